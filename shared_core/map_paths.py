"""The readers' path index of a label-map store (:class:`PathIndex`): an image path's row from memory-mapped
arrays derived from ``paths.txt``, shared by every process through the page cache.

Plain numpy.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import numpy as np

from shared_core.map_format import META_FILE, PATHS_FILE, LabelMapError

__all__ = ['PathIndex', 'PATH_INDEX_FILE', 'PATH_OFFSETS_FILE']

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
