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

Layout of a store (a directory):

=================================== =================================================================
file                                what it holds
=================================== =================================================================
``meta.json``                       the store's description (below)
``values.npy``                      ``(N, k, h, w)`` float16: the annotator's softmax probabilities of
                                    the top-k classes
``indices.npy``                     ``(N, k, h, w)`` uint16 (C <= 65536) or int32 (more classes):
                                    their class indices
``paths.txt``                       N relative image paths, '/'-separated, UTF-8, one per line, in row
                                    order
``done.npy``                        ``(N,)`` uint8: 1 once the row's values and indices are on disk
``paths.index.npy``,                the readers' path index, derived from paths.txt
``paths.offsets.npy``               (:class:`PathIndex`; written when the store is finalized, rebuilt
                                    by a reader when missing or stale)
=================================== =================================================================

``meta.json``::

    {"format": "tokenaug-label-maps", "version": 1, "num_images": N,
     "num_classes": C, "k": k, "grid": [h, w], "values": "probabilities",
     "values_dtype": "float16", "indices_dtype": "uint16" | "int32",
     "annotator": ..., "annotator_checkpoint": ..., "input_size": [H, W],
     "region": {"covers": "full_image", "resize": "squash"},
     "complete": bool, "created": ISO time, ...}

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

Public API: :class:`MapWriter` (``create``, ``resume``, ``write``, ``missing``, ``finalize``),
:class:`LabelMapStore` (``open``, ``row``, ``lookup``, ``index_of``), :func:`read_store_paths`,
:func:`remove_store`. The format's names live in :mod:`shared_core.map_format` (import them from there):
:func:`~shared_core.map_format.normalize_path`, :func:`~shared_core.map_format.index_dtype`,
:func:`~shared_core.map_format.new_meta`, :func:`~shared_core.map_format.compatibility_diff`, the errors
:class:`~shared_core.map_format.LabelMapError`, :class:`~shared_core.map_format.IncompleteStoreError`,
:class:`~shared_core.map_format.MissingLabelMapError` and the format's constants; the path index
:class:`~shared_core.map_paths.PathIndex`; a store's status and the merge of shards:
:mod:`shared_core.map_status` (:func:`~shared_core.map_status.store_status`,
:func:`~shared_core.map_status.merge_stores`).

Plain numpy + json: this module imports neither torch, timm nor mm*.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from shared_core.map_format import (
    DONE_FILE,
    INDICES_FILE,
    META_FILE,
    PATHS_FILE,
    REGION,
    STORE_FILES,
    VALUES_DTYPE,
    VALUES_FILE,
    IncompleteStoreError,
    LabelMapError,
    MissingLabelMapError,
    _allocate,
    _check_space,
    _index_paths,
    _load_array,
    _now,
    _read_meta,
    _read_paths,
    _row_shape,
    _unallocated,
    _write_json_atomic,
    _write_paths,
    disk_writes,
    new_meta,
    normalize_path,
    store_bytes,
)
from shared_core.map_paths import PATH_INDEX_FILE, PATH_OFFSETS_FILE, PathIndex

__all__ = ['MapWriter', 'LabelMapStore', 'read_store_paths', 'remove_store']


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
        made_root = not root.exists()
        root.mkdir(parents=True, exist_ok=True)
        n, shape = len(paths), _row_shape(meta)
        arrays = (
            (VALUES_FILE, VALUES_DTYPE, (n, *shape)),
            (INDICES_FILE, np.dtype(meta['indices_dtype']), (n, *shape)),
            (DONE_FILE, np.dtype(np.uint8), (n,)),
        )
        written = [root / name for name, _, _ in arrays] + [root / PATHS_FILE]
        try:  # a failed creation leaves nothing (a rerun creates the store afresh)
            _check_space(root, store_bytes(n, shape, np.dtype(meta['indices_dtype']).itemsize, paths, meta), 0, n)
            with disk_writes(root, 0, n, then='rerun'):
                for name, dtype, full in arrays:
                    arr = np.lib.format.open_memmap(root / name, mode='w+', dtype=dtype, shape=full)
                    arr.flush()
                    del arr
                    _allocate(root / name)
                _write_paths(root, paths)
                _write_json_atomic(root / META_FILE, meta)  # last: its presence marks an initialised store
        except BaseException:
            for path in written:
                path.unlink(missing_ok=True)
            if made_root:
                with contextlib.suppress(OSError):
                    root.rmdir()
            raise
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
        n, done = writer.num_images, writer.num_done()
        left = store_bytes(n, _row_shape(meta), np.dtype(meta['indices_dtype']).itemsize, [], meta)
        for name in (VALUES_FILE, INDICES_FILE, DONE_FILE):  # what of the arrays is not on disk yet
            left[name] = _unallocated(root / name)
        _check_space(root, left, done, n)
        with disk_writes(root, done, n):
            for name in (VALUES_FILE, INDICES_FILE, DONE_FILE):  # a store created sparse: its blocks now
                _allocate(root / name)
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
        with disk_writes(self.root, self.num_done, self.num_images):  # counted only if a write fails
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
        n = self.num_images
        with disk_writes(self.root, n, n, then='rerun with --resume (nothing is recomputed)'):
            for arr in (self._values, self._indices, self._done):
                arr.flush()
            meta = {**self._meta, 'complete': True, 'completed': _now()}
            _write_json_atomic(self.root / META_FILE, meta)
        self._meta = meta
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
