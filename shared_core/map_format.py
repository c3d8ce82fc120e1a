"""The label-map store's format (:mod:`shared_core.map_store` describes it): file names, ``meta.json`` and its
checks, the errors, image paths in store form, and the low-level reads and writes the writer, the readers and the
tools share.

Plain numpy + json.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

__all__ = [
    'FORMAT',
    'VERSION',
    'META_FILE',
    'VALUES_FILE',
    'INDICES_FILE',
    'PATHS_FILE',
    'DONE_FILE',
    'STORE_FILES',
    'VALUES_DTYPE',
    'REGION',
    'CENTER_SQUARE',
    'REGIONS',
    'VOLATILE_META_KEYS',
    'DISK_ERRNOS',
    'LabelMapError',
    'IncompleteStoreError',
    'MissingLabelMapError',
    'normalize_path',
    'index_dtype',
    'compatibility_diff',
    'new_meta',
    'store_bytes',
    'disk_writes',
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


def _size(nbytes: int) -> str:
    """``nbytes`` in the unit that shows it: ``512 B``, ``12.3 kB``, ``4.56 MB``, ``8.30 GB``."""
    for unit, scale in (('GB', 1e9), ('MB', 1e6), ('kB', 1e3)):
        if nbytes >= scale:
            return f'{nbytes / scale:.3g} {unit}' if scale == 1e3 else f'{nbytes / scale:.2f} {unit}'
    return f'{nbytes} B'


def _unallocated(path: Path) -> int:
    """Bytes of a sparse preallocated file not backed by disk blocks yet (what writing its rows will take)."""
    st = path.stat()
    return max(0, st.st_size - getattr(st, 'st_blocks', 0) * 512)


#: the errors of a write that the disk (full, over quota) or a file-size limit refused
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})


def _npy_bytes(shape: Sequence[int], dtype: np.dtype) -> int:
    """The size of the ``.npy`` file of an array: its header (as ``open_memmap`` writes it) and its data."""
    import io

    header = io.BytesIO()
    d = {'descr': np.lib.format.dtype_to_descr(np.dtype(dtype)), 'fortran_order': False, 'shape': tuple(shape)}
    np.lib.format.write_array_header_1_0(header, d)
    return len(header.getvalue()) + int(np.prod(shape)) * np.dtype(dtype).itemsize


def store_bytes(
    num_images: int, row_shape: Sequence[int], indices_itemsize: int, paths: Sequence[str], meta: Mapping
) -> dict[str, int]:
    """Every file a store of ``num_images`` rows writes, and its size in bytes: the three arrays, ``paths.txt``,
    ``meta.json`` (twice: a temporary is written beside it each time it is replaced) and the readers' path
    index (``paths.index.npy``, ``paths.offsets.npy``, written when the store is finalized)."""
    rows = (num_images, *row_shape)
    meta_size = len(json.dumps(meta, indent=1).encode('utf-8')) + 256  # finalize adds 'completed'
    return {
        VALUES_FILE: _npy_bytes(rows, VALUES_DTYPE),
        INDICES_FILE: _npy_bytes(rows, np.dtype(f'u{indices_itemsize}')),
        DONE_FILE: _npy_bytes((num_images,), np.uint8),
        PATHS_FILE: sum(len(p.encode('utf-8')) + 1 for p in paths),
        META_FILE: 2 * meta_size,
        'paths.index.npy': _npy_bytes((num_images + 1, 2), np.uint64),
        'paths.offsets.npy': _npy_bytes((num_images + 1,), np.int64),
    }


def _on_disk(root: Path, nbytes: int) -> int:
    """``nbytes`` rounded up to the file system's blocks (a small file still takes a whole one)."""
    try:
        block = os.statvfs(root).f_frsize or 4096
    except (OSError, AttributeError):
        block = 4096
    return -(-nbytes // block) * block


def _file_size_limit() -> int | None:
    """This process's file-size limit in bytes (``ulimit -f``), or ``None`` where there is none."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return None
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if limit in (resource.RLIM_INFINITY, -1) else int(limit)


def _check_space(root: Path, sizes: Mapping[str, int], done: int, total: int) -> None:
    """Refuse up front where the files still to write (``sizes``: name -> bytes) need more than the disk has or
    than the process may write into one file (``ulimit -f``)."""
    limit = _file_size_limit()
    if limit is not None:
        name, size = max(sizes.items(), key=lambda kv: kv[1])
        if size > limit:
            raise LabelMapError(
                f'file-size limit: the store at {root} writes {name} of {_size(size)}, the limit of this process is '
                f'{_size(limit)} (ulimit -f); {done} of {total} rows written. Raise the limit and rerun with --resume'
            )
    need = sum(_on_disk(root, n) for n in sizes.values())
    free = shutil.disk_usage(root).free
    if need > free:
        raise LabelMapError(
            f'disk full: the store at {root} needs {_size(need)} more, {_size(free)} are free; {done} of {total} rows '
            f'written. Free {_size(need - free)} and rerun with --resume'
        )


def _allocate(path: Path) -> None:
    """Back every byte of ``path`` (a sparse preallocated array) by disk blocks now: its rows are written through
    a memory map, where a full disk is a ``SIGBUS`` that kills the process (no error to catch); allocated up
    front, a full disk is an ``OSError`` here, and a disk that fills later (another writer) cannot take the
    store's blocks. A file system without ``fallocate`` keeps the file sparse (the up-front check still holds)."""
    if not hasattr(os, 'posix_fallocate'):
        return
    with open(path, 'r+b') as f:
        size = os.fstat(f.fileno()).st_size
        try:
            os.posix_fallocate(f.fileno(), 0, size)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                return
            raise


@contextlib.contextmanager
def disk_writes(root: Path, done: int | Callable[[], int], total: int, then: str = 'rerun with --resume'):
    """A write of the store at ``root`` that the disk or a file-size limit refuses (:data:`DISK_ERRNOS`) ends in
    one :class:`LabelMapError` naming the file, the cause, the rows on disk (``done``, or a function that counts
    them, called only then) and what to do (``then``)."""
    try:
        yield
    except OSError as e:
        if e.errno not in DISK_ERRNOS:
            raise
        done = done() if callable(done) else done
        where = f' {e.filename}' if e.filename else f' the store at {root}'
        if e.errno == errno.EFBIG:
            cause, fix = 'file-size limit', 'Raise the limit of this process (ulimit -f)'
        else:
            cause, fix = 'disk full', f'Free space on the disk of {root}'
        raise LabelMapError(
            f'{cause}: writing{where} failed ({e.strerror}); {done} of {total} rows written. {fix} and {then}'
        ) from None


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


@contextlib.contextmanager
def _replacing(path: Path):
    """Yields the text file ``path.tmp`` to write; it replaces ``path`` when the block succeeds. A failed write
    leaves ``path`` as it was and no temporary, and its ``OSError`` names ``path``."""
    tmp = path.with_name(path.name + '.tmp')
    try:
        with open(tmp, 'w', encoding='utf-8', newline='\n') as f:
            yield f
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.filename is None:
            e.filename = str(path)
        raise


def _write_json_atomic(path: Path, obj: Mapping[str, Any]) -> None:
    with _replacing(path) as f:
        json.dump(obj, f, indent=1, sort_keys=False)
        f.write('\n')
        f.flush()
        os.fsync(f.fileno())


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
    with _replacing(root / PATHS_FILE) as f:
        for p in paths:
            f.write(p + '\n')


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
