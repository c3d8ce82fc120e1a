"""On-disk store of dense label maps (Token Labeling's annotator score maps), one format for everything.

Token Labeling (the Token Labeling paper, Sec. 3.2 and 4.1) supervises every output token with the score map
of an offline *machine annotator*: the annotator sees the whole image (576 px for NFNet-F6), its
classifier is applied at every location of its last feature map (18 x 18 there), and only the top-5
classes per location are kept, in half precision. This module stores those maps for a whole dataset:

* memory-mapped ``.npy`` files (no pickle, ``np.load(..., mmap_mode='r', allow_pickle=False)``), so a
  DataLoader worker reads one image's map in O(1) without loading the arrays;
* indexed by *dataset sample*: the image path relative to the split root (what timm's
  ``ImageDataset.filename(i)`` returns for an ImageFolder), so the map follows the image whatever
  order, subset or sampler the training run uses;
* resumable: rows are marked done only after their data is flushed, so a killed generation run never
  claims a row that is not on disk, and a store is readable only once every row is done.

Layout of a store (a directory)::

    meta.json     {"format": "tokenaug-label-maps", "version": 1, "num_images": N, "num_classes": C,
                   "k": k, "grid": [h, w], "values": "probabilities", "values_dtype": "float16",
                   "indices_dtype": "uint16" | "int32", "annotator": ..., "annotator_checkpoint": ...,
                   "input_size": [H, W], "region": {"covers": "full_image", "resize": "squash"},
                   "complete": bool, "created": ISO time, ...}
    values.npy    (N, k, h, w) float16  -- annotator softmax probabilities of the top-k classes
    indices.npy   (N, k, h, w) uint16 (C <= 65536) or int32 (more classes) -- their class indices
    paths.txt     N relative image paths, '/'-separated, UTF-8, one per line, in row order
    done.npy      (N,) uint8 -- 1 once the row's values and indices are on disk
    paths.index.npy, paths.offsets.npy   the readers' path index, derived from paths.txt (:class:`PathIndex`;
                  written when the store is finalized, rebuilt by a reader when missing or stale)

Semantics of a row: ``values[r, :, i, j]`` are the annotator's softmax probabilities of classes
``indices[r, :, i, j]`` at map cell ``(i, j)``, sorted in descending order. Cell ``(i, j)`` covers the
normalised image region ``x in [j/w, (j+1)/w]``, ``y in [i/h, (i+1)/h]`` of the *whole* image
(``region.covers = full_image``: the annotator saw the image resized to ``input_size`` without crop
and without keeping the aspect ratio, ``region.resize = squash``; ``tokenaug-maps generate``). The maps released
with Token Labeling (``tokenaug-maps import``) cover the image's centre square instead (``covers = center_square``,
``resize = shorter_side``: :data:`CENTER_SQUARE`); the training registers them on the whole image all the same,
as the public code does, unless asked to register them where the annotator saw them
(:func:`shared_core.label_maps.register_center_square`). The top-k mass is at most 1; a
consumer that needs a full C-way distribution spreads the remaining mass ``1 - sum(top-k)`` uniformly
over the other ``C - k`` classes (that is the consumer's job, not this module's).

Public API: :func:`normalize_path`, :func:`index_dtype`, :class:`MapWriter` (``create``, ``resume``,
``write``, ``missing``, ``finalize``), :class:`LabelMapStore` (``open``, ``row``, ``lookup``,
``index_of``), :func:`new_meta`, :func:`store_status`, :func:`read_store_paths`, :func:`merge_stores`,
:func:`remove_store`, :func:`compatibility_diff`, and the errors
:class:`LabelMapError`, :class:`IncompleteStoreError`, :class:`MissingLabelMapError`.

Plain numpy + json: this module imports neither torch, timm nor mm*.
"""

from __future__ import annotations

import datetime
import errno
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

__all__ = [
    'FORMAT',
    'VERSION',
    'LabelMapError',
    'IncompleteStoreError',
    'MissingLabelMapError',
    'normalize_path',
    'index_dtype',
    'MapWriter',
    'LabelMapStore',
    'store_status',
    'merge_stores',
    'remove_store',
    'compatibility_diff',
    'new_meta',
    'read_store_paths',
    'PathIndex',
]

FORMAT = 'tokenaug-label-maps'
VERSION = 1
META_FILE = 'meta.json'
VALUES_FILE = 'values.npy'
INDICES_FILE = 'indices.npy'
PATHS_FILE = 'paths.txt'
DONE_FILE = 'done.npy'
STORE_FILES = (VALUES_FILE, INDICES_FILE, PATHS_FILE, DONE_FILE, META_FILE)
VALUES_DTYPE = np.dtype(np.float16)
MAX_UINT16_CLASSES = 65536  # class indices 0..65535 fit uint16
REGION = {'covers': 'full_image', 'resize': 'squash'}
#: what the maps released with Token Labeling cover: its ``generate_label.py`` ran timm 0.4.5's eval transform at
#: ``--img-size 576 --crop-pct 1.0``, i.e. the shorter side resized to 576, then the centre square cropped
CENTER_SQUARE = {'covers': 'center_square', 'resize': 'shorter_side'}
#: the regions a store may record (``meta.json``'s ``region``)
REGIONS = (REGION, CENTER_SQUARE)
# Meta keys allowed to differ between a store and a resumed run / between shards of one run.
VOLATILE_META_KEYS = frozenset({'created', 'completed', 'complete', 'shard', 'num_images', 'run', 'merged_from'})
_REQUIRED_META = {
    'format': str,
    'version': int,
    'num_images': int,
    'num_classes': int,
    'k': int,
    'grid': list,
    'values_dtype': str,
    'indices_dtype': str,
    'input_size': list,
}
_WRITE_CHUNK_ROWS = 4096
# Keys that MapWriter.create writes itself (everything else in meta.json is extra_meta).
_FORMAT_META_KEYS = frozenset(
    {
        'format',
        'version',
        'num_images',
        'num_classes',
        'k',
        'grid',
        'values',
        'values_order',
        'values_dtype',
        'indices_dtype',
        'remaining_mass',
        'annotator',
        'annotator_checkpoint',
        'input_size',
        'region',
        'complete',
        'created',
    }
)


def _gb(nbytes: int) -> str:
    return f'{nbytes / 1e9:.2f} GB'


def _unallocated(path: Path) -> int:
    """Bytes of a sparse preallocated file not backed by disk blocks yet (what writing its rows will take)."""
    st = path.stat()
    return max(0, st.st_size - getattr(st, 'st_blocks', 0) * 512)


def _check_space(root: Path, need: int, done: int, total: int) -> None:
    """The store's arrays are memory-mapped, sparse files: a write into a full disk is a ``SIGBUS`` that kills the
    process (no error to catch). Refuse up front where the rows still to write need more than the disk has."""
    free = shutil.disk_usage(root).free
    if need > free:
        raise LabelMapError(
            f'disk full: the store at {root} needs {_gb(need)} more, {_gb(free)} are free; {done} of {total} rows '
            f'written. Free {_gb(need - free)} and rerun with --resume'
        )


class LabelMapError(ValueError):
    """A label-map store that is corrupt, inconsistent, incompatible or misused."""


class IncompleteStoreError(LabelMapError):
    """A store whose generation has not finished (some rows are not on disk yet)."""


class MissingLabelMapError(KeyError):
    """No label map for an image in this store (a ``KeyError`` naming the image and the store)."""

    def __init__(self, rel_path: str, store: os.PathLike | str, hint: str = ''):
        self.rel_path, self.store = rel_path, str(store)
        msg = f'no label map for image {rel_path!r} in label-map store {self.store!r}'
        super().__init__(msg + (f' ({hint})' if hint else ''))

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


# ----------------------------------------------------------------------------------------- helpers
def normalize_path(path: str | os.PathLike) -> str:
    """A dataset-relative image path in store form: ``os.sep`` -> ``'/'``, no leading ``'./'``.

    Raises ``ValueError`` for an empty or absolute path and for paths containing a newline or carriage
    return (``paths.txt`` is one path per line).
    """
    s = os.fspath(path)
    if not isinstance(s, str):
        raise ValueError(f'image path must be a str, got {type(s).__name__}: {s!r}')
    for sep in (os.sep, os.altsep):
        if sep and sep != '/':
            s = s.replace(sep, '/')
    while s.startswith('./'):
        s = s[2:]
    if '\n' in s or '\r' in s:
        raise ValueError(f'image path {s!r} contains a newline; paths.txt stores one path per line')
    if not s or s.startswith('/'):
        raise ValueError(f'image path must be relative to the dataset split root and non-empty, got {s!r}')
    return s


def index_dtype(num_classes: int) -> np.dtype:
    """Class-index dtype for ``num_classes``: uint16 while every index fits (C <= 65536), else int32."""
    if num_classes < 1:
        raise ValueError(f'num_classes must be >= 1, got {num_classes}')
    return np.dtype(np.uint16) if num_classes <= MAX_UINT16_CLASSES else np.dtype(np.int32)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')


def _write_json_atomic(path: Path, obj: Mapping[str, Any]) -> None:
    tmp = path.with_name(path.name + '.tmp')
    with open(tmp, 'w', encoding='utf-8') as f:
        json.dump(obj, f, indent=1, sort_keys=False)
        f.write('\n')
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_meta(root: Path) -> dict:
    path = root / META_FILE
    if not path.is_file():
        hint = ''
        if (root / 'shards').is_dir():
            hint = f'; it has shards/ -- merge them with `tokenaug-maps merge {root}`'
        raise LabelMapError(f'{root} is not a label-map store: {META_FILE} not found{hint}')
    try:
        meta = json.loads(path.read_text(encoding='utf-8'))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LabelMapError(f'{path}: unreadable label-map meta ({e})') from e
    _check_meta(meta, path)
    return meta


def _check_meta(meta: Any, where: Path) -> None:
    if not isinstance(meta, dict):
        raise LabelMapError(f'{where}: expected a JSON object, got {type(meta).__name__}')
    if meta.get('format') != FORMAT:
        raise LabelMapError(f'{where}: format is {meta.get("format")!r}, expected {FORMAT!r}')
    if meta.get('version') != VERSION:
        raise LabelMapError(f'{where}: version {meta.get("version")!r} is not supported (expected {VERSION})')
    for key, typ in _REQUIRED_META.items():
        if not isinstance(meta.get(key), typ) or isinstance(meta.get(key), bool):
            raise LabelMapError(f'{where}: meta key {key!r} must be a {typ.__name__}, got {meta.get(key)!r}')
    grid = meta['grid']
    if len(grid) != 2 or not all(isinstance(g, int) and g > 0 for g in grid):
        raise LabelMapError(f'{where}: grid must be [h, w] with positive ints, got {grid!r}')
    if meta['values_dtype'] != VALUES_DTYPE.name:
        raise LabelMapError(f'{where}: values_dtype {meta["values_dtype"]!r}, expected {VALUES_DTYPE.name!r}')
    expected_ix = index_dtype(meta['num_classes']).name
    if meta['indices_dtype'] != expected_ix:
        raise LabelMapError(
            f'{where}: indices_dtype {meta["indices_dtype"]!r} for {meta["num_classes"]} classes, '
            f'expected {expected_ix!r}'
        )
    if not 1 <= meta['k'] <= meta['num_classes']:
        raise LabelMapError(f'{where}: k={meta["k"]} must be in [1, num_classes={meta["num_classes"]}]')
    if meta['num_images'] < 0:
        raise LabelMapError(f'{where}: num_images must be >= 0, got {meta["num_images"]}')


def _row_shape(meta: Mapping[str, Any]) -> tuple[int, int, int]:
    return (meta['k'], *meta['grid'])


def _load_array(root: Path, name: str, shape: tuple, dtype: np.dtype, mode: str) -> np.memmap:
    path = root / name
    if not path.is_file():
        raise LabelMapError(f'label-map store {root}: {name} is missing')
    try:
        arr = np.load(path, mmap_mode=mode, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise LabelMapError(f'label-map store {root}: {name} is not a readable .npy array ({e})') from e
    if arr.shape != tuple(shape) or arr.dtype != dtype:
        raise LabelMapError(
            f'label-map store {root}: {name} has shape {arr.shape} dtype {arr.dtype}, '
            f'expected {tuple(shape)} {dtype} (from {META_FILE})'
        )
    return arr


def _read_paths(root: Path, num_images: int) -> list[str]:
    path = root / PATHS_FILE
    try:
        text = path.read_text(encoding='utf-8')
    except FileNotFoundError as e:
        raise LabelMapError(f'label-map store {root}: {PATHS_FILE} is missing') from e
    except UnicodeDecodeError as e:
        raise LabelMapError(f'{path}: not UTF-8 ({e})') from e
    # split on '\n' only: str.splitlines() would also split on characters that are legal in file names
    paths = text.split('\n')
    if paths and paths[-1] == '':
        paths.pop()
    if len(paths) != num_images:
        raise LabelMapError(f'{path}: {len(paths)} paths, expected num_images={num_images} from {META_FILE}')
    return paths


def _index_paths(paths: Sequence[str], where: os.PathLike | str) -> dict[str, int]:
    index: dict[str, int] = {}
    for row, p in enumerate(paths):
        first = index.setdefault(p, row)
        if first != row:
            raise LabelMapError(f'{where}: duplicate image path {p!r} at rows {first} and {row}')
    return index


def _write_paths(root: Path, paths: Sequence[str]) -> None:
    tmp = root / (PATHS_FILE + '.tmp')
    with open(tmp, 'w', encoding='utf-8', newline='\n') as f:
        for p in paths:
            f.write(p + '\n')
    os.replace(tmp, root / PATHS_FILE)


# ------------------------------------------------------------------------------------------ path index
#: the store's path index (derived from paths.txt; rebuilt when missing or stale): ``(N + 1, 2)`` uint64, row 0
#: ``[digest of paths.txt, N]``, then ``(hash of the path, row)`` sorted by hash
PATH_INDEX_FILE = 'paths.index.npy'
#: byte offsets of the paths in paths.txt: ``(N + 1,)`` int64, path ``r`` is ``[offsets[r], offsets[r + 1] - 1)``
PATH_OFFSETS_FILE = 'paths.offsets.npy'


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), 'little')


class PathIndex:
    """Row of an image path, from memory-mapped arrays: the hash of each path sorted with its row, the paths'
    byte offsets, and ``paths.txt`` itself, so that every process and DataLoader worker shares the page cache
    instead of holding a dict of every path in each (``bench/bench_store_memory.py``). A lookup is a
    binary search on the hashes and a comparison of the path's bytes (a hash collision costs one more
    comparison). Built once from ``paths.txt`` (duplicates refused) and written beside it; where the store's
    folder cannot be written, the arrays are kept in memory (about 24 bytes a row)."""

    def __init__(self, root: Path, num_images: int, write: bool = True):
        self.root, self.n = Path(root), int(num_images)
        text = self.root / PATHS_FILE
        try:
            data = text.read_bytes()
        except FileNotFoundError as e:
            raise LabelMapError(f'label-map store {self.root}: {PATHS_FILE} is missing') from e
        digest = _hash64(data)
        index, offsets = self._load(digest)
        if index is None:
            index, offsets = _build_path_index(data, self.n, digest, self.root)
            if write:
                self._save(index, offsets)
        del data
        self._hashes, self._rows, self._offsets = index[1:, 0], index[1:, 1], offsets
        self._text = np.memmap(text, dtype=np.uint8, mode='r') if offsets[-1] else np.zeros(0, np.uint8)

    def _load(self, digest: int):
        files = self.root / PATH_INDEX_FILE, self.root / PATH_OFFSETS_FILE
        if not all(f.is_file() for f in files):
            return None, None
        try:
            index = np.load(files[0], mmap_mode='r', allow_pickle=False)
            offsets = np.load(files[1], mmap_mode='r', allow_pickle=False)
        except (OSError, ValueError):
            return None, None
        ok = (
            index.dtype == np.uint64
            and index.shape == (self.n + 1, 2)
            and offsets.dtype == np.int64
            and offsets.shape == (self.n + 1,)
            and int(index[0, 0]) == digest
            and int(index[0, 1]) == self.n
        )
        return (index, offsets) if ok else (None, None)

    def _save(self, index: np.ndarray, offsets: np.ndarray) -> None:
        for name, arr in ((PATH_OFFSETS_FILE, offsets), (PATH_INDEX_FILE, index)):  # the index last: it vouches
            tmp = None
            try:  # a temporary of this process's own, renamed whole: readers building it at once cannot collide
                fd, tmp = tempfile.mkstemp(prefix=f'.{name}.', suffix='.tmp', dir=self.root)
                with os.fdopen(fd, 'wb') as f:
                    np.save(f, arr, allow_pickle=False)
                os.replace(tmp, self.root / name)
            except OSError:  # a read-only store: the index stays in this process's memory
                if tmp is not None:
                    Path(tmp).unlink(missing_ok=True)
                return

    def row(self, key: str) -> int:
        """The row of ``key`` (a normalised path), or -1."""
        data = key.encode('utf-8')
        h = np.uint64(_hash64(data))
        i = int(np.searchsorted(self._hashes, h))
        while i < self.n and self._hashes[i] == h:
            r = int(self._rows[i])
            start, end = int(self._offsets[r]), int(self._offsets[r + 1]) - 1
            if end - start == len(data) and self._text[start:end].tobytes() == data:
                return r
            i += 1
        return -1


def _build_path_index(data: bytes, n: int, digest: int, where) -> tuple:
    """``(index, offsets)`` of :class:`PathIndex` from the bytes of paths.txt (one path per line)."""
    try:
        data.decode('utf-8')
    except UnicodeDecodeError as e:
        raise LabelMapError(f'{where / PATHS_FILE}: not UTF-8 ({e})') from e
    ends = np.flatnonzero(np.frombuffer(data, np.uint8) == ord('\n'))
    if len(ends) != n or (n and ends[-1] != len(data) - 1):
        raise LabelMapError(f'{where / PATHS_FILE}: {len(ends)} paths, expected num_images={n} from {META_FILE}')
    offsets = np.zeros(n + 1, np.int64)
    offsets[1:] = ends + 1
    hashes = np.fromiter((_hash64(data[offsets[r] : offsets[r + 1] - 1]) for r in range(n)), dtype=np.uint64, count=n)
    order = np.argsort(hashes, kind='stable')
    index = np.empty((n + 1, 2), np.uint64)
    index[0] = (digest, n)
    index[1:, 0], index[1:, 1] = hashes[order], order
    same = np.flatnonzero(index[2:, 0] == index[1:-1, 0])  # equal hashes: a duplicate path, or a collision
    for h in np.unique(index[1:, 0][same]):
        first: dict = {}
        for r in sorted(int(r) for r in order[hashes[order] == h]):
            path = data[offsets[r] : offsets[r + 1] - 1]
            if path in first:
                raise LabelMapError(
                    f'{where}: duplicate image path {path.decode("utf-8", "replace")!r} at rows {first[path]} and {r}'
                )
            first[path] = r
    return index, offsets


def compatibility_diff(
    a: Mapping[str, Any], b: Mapping[str, Any], ignore: Iterable[str] = VOLATILE_META_KEYS
) -> list[str]:
    """The meta keys (outside ``ignore``) whose values differ between ``a`` and ``b``, as readable lines."""
    ignore = set(ignore)
    keys = sorted((set(a) | set(b)) - ignore)
    return [f'{k}: {a.get(k)!r} != {b.get(k)!r}' for k in keys if a.get(k) != b.get(k)]


def new_meta(
    n: int,
    *,
    num_classes: int,
    k: int,
    grid: Sequence[int],
    annotator: str,
    input_size: Sequence[int],
    annotator_checkpoint: str | None = None,
    region: Mapping[str, str] = REGION,
) -> dict:
    """The format part of ``meta.json`` for a new store of ``n`` images (incomplete; see the module doc);
    ``region``: what of each image the annotator saw (:data:`REGIONS`)."""
    grid, input_size = [int(g) for g in grid], [int(s) for s in input_size]
    if len(grid) != 2 or min(grid) < 1:
        raise ValueError(f'grid must be (h, w) with positive ints, got {grid}')
    if len(input_size) != 2 or min(input_size) < 1:
        raise ValueError(f'input_size must be (H, W) with positive ints, got {input_size}')
    if not 1 <= k <= num_classes:
        raise ValueError(f'k must be in [1, num_classes={num_classes}], got {k}')
    if dict(region) not in REGIONS:
        raise ValueError(f'region must be one of {REGIONS}, got {region!r}')
    return {
        'format': FORMAT,
        'version': VERSION,
        'num_images': n,
        'num_classes': int(num_classes),
        'k': int(k),
        'grid': grid,
        'values': 'probabilities',
        'values_order': 'descending',
        'values_dtype': VALUES_DTYPE.name,
        'indices_dtype': index_dtype(num_classes).name,
        'remaining_mass': 'consumer spreads 1 - sum(top-k) uniformly over the other num_classes - k classes',
        'annotator': str(annotator),
        'annotator_checkpoint': None if annotator_checkpoint is None else str(annotator_checkpoint),
        'input_size': input_size,
        'region': dict(region),
        'complete': False,
        'created': _now(),
    }


# ------------------------------------------------------------------------------------------ writer
class MapWriter:
    """Writes rows into a preallocated store; use :meth:`create` (new) or :meth:`resume` (unfinished)."""

    def __init__(self, root: Path, meta: dict, paths: list[str]):
        self.root, self._meta, self._paths = root, meta, paths
        n, shape, ix_dtype = meta['num_images'], _row_shape(meta), np.dtype(meta['indices_dtype'])
        self._values = _load_array(root, VALUES_FILE, (n, *shape), VALUES_DTYPE, 'r+')
        self._indices = _load_array(root, INDICES_FILE, (n, *shape), ix_dtype, 'r+')
        self._done = _load_array(root, DONE_FILE, (n,), np.dtype(np.uint8), 'r+')

    # -- construction
    @classmethod
    def create(
        cls,
        path: str | os.PathLike,
        paths: Sequence[str],
        *,
        num_classes: int,
        k: int,
        grid: Sequence[int],
        annotator: str,
        input_size: Sequence[int],
        annotator_checkpoint: str | None = None,
        region: Mapping[str, str] = REGION,
        extra_meta: Mapping[str, Any] | None = None,
    ) -> 'MapWriter':
        """Preallocate a new, empty store at ``path`` (a directory; created, must not hold a store).

        ``paths`` are the images' paths relative to the split root, in row order (normalised with
        :func:`normalize_path`; duplicates are refused). ``extra_meta`` adds keys to ``meta.json``
        (it may not override the format keys).
        """
        root = Path(path)
        if root.exists() and not root.is_dir():
            raise LabelMapError(f'{root} is a file: a label-map store is a folder; give another --out')
        if (root / META_FILE).exists():
            raise LabelMapError(f'{root} already holds a label-map store; remove it or resume it')
        paths = [normalize_path(p) for p in paths]
        _index_paths(paths, root)
        meta = new_meta(
            len(paths),
            num_classes=num_classes,
            k=k,
            grid=grid,
            annotator=annotator,
            input_size=input_size,
            annotator_checkpoint=annotator_checkpoint,
            region=region,
        )
        clash = set(extra_meta or ()) & set(meta)
        if clash:
            raise ValueError(f'extra_meta may not override the format keys {sorted(clash)}')
        meta.update(extra_meta or {})
        root.mkdir(parents=True, exist_ok=True)
        n, shape = len(paths), _row_shape(meta)
        arrays = (
            (VALUES_FILE, VALUES_DTYPE, (n, *shape)),
            (INDICES_FILE, np.dtype(meta['indices_dtype']), (n, *shape)),
            (DONE_FILE, np.dtype(np.uint8), (n,)),
        )
        _check_space(root, sum(int(np.prod(full)) * dtype.itemsize for _, dtype, full in arrays), 0, n)
        for name, dtype, full in arrays:
            try:
                arr = np.lib.format.open_memmap(root / name, mode='w+', dtype=dtype, shape=full)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                    raise LabelMapError(
                        f'disk full: {root / name} ({_gb(int(np.prod(full)) * dtype.itemsize)}) cannot be '
                        f'allocated ({e.strerror}); 0 of {n} rows written. Free the space and rerun'
                    ) from None
                raise
            arr.flush()
            del arr
        _write_paths(root, paths)
        _write_json_atomic(root / META_FILE, meta)  # last: its presence marks an initialised store
        return cls(root, meta, paths)

    @classmethod
    def resume(cls, path: str | os.PathLike) -> 'MapWriter':
        """Reopen an unfinished store for writing (its rows marked done stay as they are)."""
        root = Path(path)
        meta = _read_meta(root)
        if meta.get('complete'):
            raise LabelMapError(f'label-map store {root} is already complete; nothing to resume')
        paths = _read_paths(root, meta['num_images'])
        _index_paths(paths, root)
        writer = cls(root, meta, paths)
        unallocated = sum(_unallocated(root / name) for name in (VALUES_FILE, INDICES_FILE, DONE_FILE))
        _check_space(root, unallocated, writer.num_done(), writer.num_images)
        return writer

    # -- properties
    @property
    def meta(self) -> dict:
        return dict(self._meta)

    @property
    def paths(self) -> list[str]:
        return list(self._paths)

    @property
    def num_images(self) -> int:
        return self._meta['num_images']

    def __len__(self) -> int:
        return self.num_images

    def missing(self) -> np.ndarray:
        """Rows (int64, ascending) whose data is not on disk yet."""
        return np.flatnonzero(np.asarray(self._done) == 0).astype(np.int64)

    def num_done(self) -> int:
        return int(np.count_nonzero(np.asarray(self._done)))

    # -- writing
    def write(self, rows: Sequence[int] | np.ndarray, values: np.ndarray, indices: np.ndarray) -> None:
        """Write ``values`` (n, k, h, w) and ``indices`` (n, k, h, w) into ``rows`` (n,), then mark them done.

        Values are stored as float16 (they should be probabilities sorted descending along k);
        indices must lie in ``[0, num_classes)``. Data is flushed to the files before the rows are
        flagged done, so an interrupted run never marks a row that is not on disk.
        """
        rows = self._check_rows(rows)
        values, indices = self._check_block(len(rows), values, indices)
        if len(rows) == 0:
            return
        where = self._as_slice(rows)
        self._values[where] = values
        self._indices[where] = indices
        self._values.flush()
        self._indices.flush()
        self._done[where] = 1
        self._done.flush()

    def _check_rows(self, rows) -> np.ndarray:
        rows = np.asarray(rows)
        if rows.ndim != 1 or (rows.size and not np.issubdtype(rows.dtype, np.integer)):
            raise ValueError(f'rows must be a 1-D integer array, got shape {rows.shape} dtype {rows.dtype}')
        rows = rows.astype(np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= self.num_images):
            raise IndexError(
                f'rows must be in [0, {self.num_images}) for store {self.root}, got [{rows.min()}, {rows.max()}]'
            )
        if np.unique(rows).size != rows.size:
            raise ValueError(f'rows contain duplicates: {rows.tolist()[:16]}')
        return rows

    def _check_block(self, n: int, values, indices) -> tuple[np.ndarray, np.ndarray]:
        shape = (n, *_row_shape(self._meta))
        values, indices = np.asarray(values), np.asarray(indices)
        if values.shape != shape or indices.shape != shape:
            raise ValueError(
                f'values and indices must have shape {shape} (rows, k, h, w), got {values.shape} and {indices.shape}'
            )
        if not np.issubdtype(values.dtype, np.floating):
            raise ValueError(f'values must be floating point probabilities, got dtype {values.dtype}')
        if not np.issubdtype(indices.dtype, np.integer):
            raise ValueError(f'indices must be integer class indices, got dtype {indices.dtype}')
        values = values.astype(VALUES_DTYPE, copy=False)
        if values.size and not np.isfinite(values).all():
            raise ValueError('values contain NaN or inf')
        c = self._meta['num_classes']
        if indices.size and (indices.min() < 0 or indices.max() >= c):
            raise ValueError(f'indices must be in [0, num_classes={c}), got [{indices.min()}, {indices.max()}]')
        return values, indices.astype(self._indices.dtype, copy=False)

    @staticmethod
    def _as_slice(rows: np.ndarray) -> slice | np.ndarray:
        if rows[-1] - rows[0] + 1 == rows.size and (rows.size == 1 or bool((np.diff(rows) == 1).all())):
            return slice(int(rows[0]), int(rows[-1]) + 1)
        return rows

    # -- completion
    def finalize(self) -> None:
        """Check that every row is done, then mark the store complete (readable) in ``meta.json``."""
        missing = self.missing()
        if missing.size:
            raise IncompleteStoreError(
                f'label-map store {self.root}: cannot finalize, {missing.size} of {self.num_images} rows missing '
                f'(first: row {missing[0]} = {self._paths[missing[0]]!r})'
            )
        for arr in (self._values, self._indices, self._done):
            arr.flush()
        self._meta.update(complete=True, completed=_now())
        _write_json_atomic(self.root / META_FILE, self._meta)
        PathIndex(self.root, self.num_images)  # the readers' path index, written once here

    def close(self) -> None:
        for name in ('_values', '_indices', '_done'):
            arr = getattr(self, name, None)
            if arr is not None:
                arr.flush()
                setattr(self, name, None)

    def __enter__(self) -> 'MapWriter':
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ------------------------------------------------------------------------------------------ reader
class LabelMapStore:
    """Read-only access to a complete store; cheap to pickle (arrays and path index reopen lazily).

    ``LabelMapStore.open(path)`` validates the store once. Rows are read from memory-mapped arrays
    opened on first use in each process, and ``__getstate__`` drops the memmaps and the path index,
    so a Dataset holding a store pickles to a few hundred bytes (spawn / forkserver workers). The path index
    (:class:`PathIndex`) is memory-mapped too: every process and worker shares it through the page cache.
    Writing is :class:`MapWriter` (``MapWriter.create``).
    """

    def __init__(self, root: Path, meta: dict):
        self.root, self._meta = root, meta
        self._values = self._indices = None
        self._paths: list[str] | None = None  # read when asked (tools); training looks rows up by the index
        self._index: PathIndex | None = None

    @classmethod
    def open(cls, path: str | os.PathLike) -> 'LabelMapStore':
        """Open and validate a complete store (meta, array shapes/dtypes, paths, duplicates, completeness)."""
        root = Path(path)
        meta = _read_meta(root)
        n = meta['num_images']
        done = _load_array(root, DONE_FILE, (n,), np.dtype(np.uint8), 'r')
        n_missing = int(n - np.count_nonzero(np.asarray(done)))
        del done
        if not meta.get('complete') or n_missing:
            raise IncompleteStoreError(
                f'label-map store {root} is incomplete: {n_missing} of {n} rows missing'
                f'{"" if n_missing else " (never finalized)"}; finish it with `tokenaug-maps generate ... --resume`'
                ' (or `tokenaug-maps merge` for a sharded run)'
            )
        store = cls(root, meta)
        store._open_arrays()
        store._open_index()
        return store

    # -- lazy per-process state
    def _open_arrays(self) -> None:
        shape = (self._meta['num_images'], *_row_shape(self._meta))
        self._values = _load_array(self.root, VALUES_FILE, shape, VALUES_DTYPE, 'r')
        self._indices = _load_array(self.root, INDICES_FILE, shape, np.dtype(self._meta['indices_dtype']), 'r')

    def _open_index(self) -> None:
        self._index = PathIndex(self.root, self._meta['num_images'])

    def __getstate__(self) -> dict:
        return {'root': self.root, 'meta': self._meta}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state['root'], state['meta'])

    # -- metadata
    @property
    def meta(self) -> dict:
        return dict(self._meta)

    @property
    def num_classes(self) -> int:
        return self._meta['num_classes']

    @property
    def k(self) -> int:
        return self._meta['k']

    @property
    def grid(self) -> tuple[int, int]:
        return tuple(self._meta['grid'])

    @property
    def paths(self) -> list[str]:
        """The image paths in row order (read from paths.txt on first use; lookups need no list)."""
        if self._paths is None:
            self._paths = _read_paths(self.root, self._meta['num_images'])
        return self._paths

    @property
    def values(self) -> np.memmap:
        """The (N, k, h, w) float16 memmap (read-only)."""
        if self._values is None:
            self._open_arrays()
        return self._values

    @property
    def indices(self) -> np.memmap:
        """The (N, k, h, w) uint16/int32 memmap (read-only), as stored."""
        if self._indices is None:
            self._open_arrays()
        return self._indices

    def __len__(self) -> int:
        return self._meta['num_images']

    # -- lookup
    def index_of(self, rel_path: str | os.PathLike) -> int:
        """Row of an image (path relative to the split root; normalised): a binary search of the memory-mapped
        :class:`PathIndex`, O(log N).

        Raises :class:`MissingLabelMapError` (a ``KeyError``) naming the image and the store.
        """
        if self._index is None:
            self._open_index()
        key = normalize_path(rel_path)
        row = self._index.row(key)
        if row < 0:
            raise MissingLabelMapError(key, self.root)
        return row

    def __contains__(self, rel_path: object) -> bool:
        try:
            self.index_of(rel_path)  # type: ignore[arg-type]
        except (MissingLabelMapError, ValueError, TypeError):
            return False
        return True

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Row ``i``: ``(values, indices)``, each (k, h, w); values float16, indices **int64**.

        Both are small owned copies (not views of the memmap), safe for ``torch.from_numpy`` and for
        indexing (torch cannot index with uint16).
        """
        n = len(self)
        if not isinstance(i, (int, np.integer)) or isinstance(i, bool) or not 0 <= i < n:
            raise IndexError(f'row must be an int in [0, {n}) for label-map store {self.root}, got {i!r}')
        values = np.array(self.values[i], dtype=VALUES_DTYPE, copy=True)
        indices = np.array(self.indices[i], dtype=np.int64, copy=True)
        return values, indices

    def lookup(self, rel_path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`row` of the image at ``rel_path`` (relative to the split root)."""
        return self.row(self.index_of(rel_path))

    def __repr__(self) -> str:
        m = self._meta
        return (
            f'LabelMapStore({str(self.root)!r}, num_images={m["num_images"]}, num_classes={m["num_classes"]}, '
            f'k={m["k"]}, grid={tuple(m["grid"])}, annotator={m.get("annotator")!r})'
        )


# ------------------------------------------------------------------------------ status, merge, remove
def store_status(path: str | os.PathLike) -> dict:
    """Meta plus completeness and on-disk size of a store, complete or not. The arrays and the paths are opened
    as training opens them (shape, dtype, no pickled objects, readable paths, no duplicates); what fails is
    listed in ``problems`` and the store is then not ``complete``."""
    root = Path(path)
    meta = _read_meta(root)
    n = meta['num_images']
    done = _load_array(root, DONE_FILE, (n,), np.dtype(np.uint8), 'r')
    n_done = int(np.count_nonzero(np.asarray(done)))
    del done
    problems = []
    shape = (n, *_row_shape(meta))
    for name, dtype in ((VALUES_FILE, VALUES_DTYPE), (INDICES_FILE, np.dtype(meta['indices_dtype']))):
        try:
            _load_array(root, name, shape, dtype, 'r')  # opened as training opens it, then dropped
        except LabelMapError as e:
            problems.append(str(e))
    try:
        PathIndex(root, n, write=False)  # readable, no duplicates (a status writes nothing)
    except LabelMapError as e:
        problems.append(str(e))
    files = {name: (root / name).stat().st_size for name in STORE_FILES if (root / name).is_file()}
    allocated = {name: (root / name).stat().st_blocks * 512 for name in files}
    k, h, w = _row_shape(meta)
    payload = k * h * w * (VALUES_DTYPE.itemsize + np.dtype(meta['indices_dtype']).itemsize)
    return {
        'meta': meta,
        'rows_done': n_done,
        'rows_missing': n - n_done,
        'complete': bool(meta.get('complete')) and n_done == n and not problems,
        'problems': problems,
        'file_bytes': files,
        'allocated_bytes': allocated,
        'payload_bytes_per_image': payload,
        'file_bytes_per_image': (sum(files.values()) / n) if n else float('nan'),
    }


def merge_stores(
    shard_paths: Sequence[str | os.PathLike], out: str | os.PathLike, meta_update: Mapping[str, Any] | None = None
) -> Path:
    """Merge complete shard stores into one store at ``out``; returns ``out``.

    Every shard's meta must carry ``shard = {"index", "num_shards", "row_start", "row_stop",
    "num_images_total"}``; the shards must be the ``num_shards`` indices exactly once, their row
    ranges must tile ``[0, num_images_total)`` and all other non-volatile meta must agree. Rows are
    copied in shard order, so row ``r`` of the result is global row ``r``; the merged store is then
    finalized and reopened (which re-checks that no image path occurs twice). Shards are left as they are.
    """
    shards = [LabelMapStore.open(p) for p in shard_paths]
    if not shards:
        raise LabelMapError('merge: no shard stores given')
    shards.sort(key=lambda s: _shard_info(s)['index'])
    _check_shards(shards)
    meta0 = shards[0].meta
    total = _shard_info(shards[0])['num_images_total']
    paths = [p for s in shards for p in s.paths]
    if len(paths) != total:
        raise LabelMapError(f'merge: shards hold {len(paths)} rows, expected {total}')
    extra = {key: v for key, v in meta0.items() if key not in _FORMAT_META_KEYS | {'shard', 'completed'}}
    extra['merged_from'] = {'num_shards': len(shards), 'shards': [str(s.root) for s in shards]}
    extra.update(meta_update or {})
    writer = MapWriter.create(
        out,
        paths,
        num_classes=meta0['num_classes'],
        k=meta0['k'],
        grid=meta0['grid'],
        annotator=meta0['annotator'],
        input_size=meta0['input_size'],
        annotator_checkpoint=meta0['annotator_checkpoint'],
        region=meta0.get('region', REGION),
        extra_meta=extra,
    )
    with writer:
        for s in shards:
            start = _shard_info(s)['row_start']
            for a in range(0, len(s), _WRITE_CHUNK_ROWS):
                b = min(len(s), a + _WRITE_CHUNK_ROWS)
                writer.write(np.arange(start + a, start + b), s.values[a:b], s.indices[a:b])
        writer.finalize()
    LabelMapStore.open(out)  # full validation of the result (duplicates across shards included)
    return Path(out)


def _shard_info(store: LabelMapStore) -> dict:
    info = store.meta.get('shard')
    keys = ('index', 'num_shards', 'row_start', 'row_stop', 'num_images_total')
    if not isinstance(info, dict) or not all(isinstance(info.get(k), int) for k in keys):
        raise LabelMapError(f'{store.root} is not a shard store: meta "shard" must hold {list(keys)}')
    return info


def _check_shards(shards: Sequence[LabelMapStore]) -> None:
    infos = [_shard_info(s) for s in shards]
    num_shards, total = infos[0]['num_shards'], infos[0]['num_images_total']
    indices = [i['index'] for i in infos]
    if indices != list(range(num_shards)) or any(i['num_shards'] != num_shards for i in infos):
        raise LabelMapError(
            f'merge: expected shards 0..{num_shards - 1} of {num_shards} exactly once, '
            f'got indices {indices} (num_shards {sorted({i["num_shards"] for i in infos})})'
        )
    expect = 0
    for s, info in zip(shards, infos):
        if info['num_images_total'] != total:
            raise LabelMapError(
                f'merge: {s.root} belongs to a run of {info["num_images_total"]} images, shard 0 to one of {total}'
            )
        if info['row_start'] != expect or info['row_stop'] - info['row_start'] != len(s):
            raise LabelMapError(
                f'merge: {s.root} holds rows [{info["row_start"]}, {info["row_stop"]}) with '
                f'{len(s)} images; expected to start at row {expect}'
            )
        expect = info['row_stop']
        diff = compatibility_diff(shards[0].meta, s.meta)
        if diff:
            raise LabelMapError(f'merge: {s.root} is incompatible with {shards[0].root}: ' + '; '.join(diff))
    if expect != total:
        raise LabelMapError(f'merge: shards cover rows [0, {expect}), expected [0, {total})')


def read_store_paths(path: str | os.PathLike) -> list[str]:
    """The image paths of a store (complete or not), in row order."""
    root = Path(path)
    return _read_paths(root, _read_meta(root)['num_images'])


def remove_store(path: str | os.PathLike) -> None:
    """Delete a store's own files (and its directory if that leaves it empty); nothing else is touched."""
    root = Path(path)
    for name in STORE_FILES + (META_FILE + '.tmp', PATHS_FILE + '.tmp', PATH_INDEX_FILE, PATH_OFFSETS_FILE):
        (root / name).unlink(missing_ok=True)
    for name in (PATH_INDEX_FILE, PATH_OFFSETS_FILE):  # a path index's write that never finished
        for tmp in root.glob(f'.{name}.*.tmp'):
            tmp.unlink(missing_ok=True)
    try:
        root.rmdir()
    except OSError:
        pass
