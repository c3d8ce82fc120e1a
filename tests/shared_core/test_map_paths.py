"""shared_core.map_paths: the path index (memory-mapped, written once, rebuilt when stale, hash collisions, readers
building it at once)."""

from __future__ import annotations

import numpy as np
import pytest

from shared_core import map_paths
from shared_core import map_store as M
from shared_core.map_format import LabelMapError
from shared_core.map_store import LabelMapStore

from .map_store_rows import PATHS, full_store


def test_the_path_index_is_memory_mapped_written_once_and_rebuilt_when_stale(tmp_path):
    """The readers' path index: written when the store is finalized, memory-mapped by every reader (nothing per
    process but the maps), equal to a dict of the paths, and rebuilt from paths.txt when that changed."""
    root = tmp_path / 's'
    full_store(root)
    index_file = root / M.PATH_INDEX_FILE
    assert index_file.is_file() and (root / M.PATH_OFFSETS_FILE).is_file()
    written = index_file.stat().st_mtime_ns
    store = LabelMapStore.open(root)
    assert isinstance(store._index._hashes, np.memmap) and isinstance(store._index._text, np.memmap)
    assert index_file.stat().st_mtime_ns == written  # opening reads it, does not rewrite it
    assert [store.index_of(p) for p in PATHS] == list(range(len(PATHS)))
    for missing in ('00_class/000000.jp', '00_class/000000.jpgx', 'x/00_class/000000.jpg', '99_class/1.jpg'):
        assert missing not in store
    assert store._paths is None  # lookups need no list of the paths
    # paths.txt edited (same count, other names): the stale index is rebuilt, not trusted
    renamed = [p.replace('class', 'klasse') for p in PATHS]
    (root / M.PATHS_FILE).write_text('\n'.join(renamed) + '\n')
    store = LabelMapStore.open(root)
    assert [store.index_of(p) for p in renamed] == list(range(len(PATHS))) and PATHS[0] not in store
    # a garbled index file is rebuilt too
    index_file.write_bytes(b'garbage')
    assert LabelMapStore.open(root).index_of(renamed[5]) == 5


def test_the_path_index_of_a_read_only_store_stays_in_memory(tmp_path, monkeypatch):
    """A store on a read-only file system (the index cannot be written): the reader keeps it in memory."""
    import errno

    root = tmp_path / 's'
    full_store(root)
    for name in (M.PATH_INDEX_FILE, M.PATH_OFFSETS_FILE):
        (root / name).unlink()

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, 'Read-only file system')

    monkeypatch.setattr(M.np, 'save', read_only)
    store = LabelMapStore.open(root)
    assert [store.index_of(p) for p in PATHS] == list(range(len(PATHS)))
    assert not isinstance(store._index._hashes, np.memmap)
    assert sorted(p.name for p in root.iterdir()) == sorted(M.STORE_FILES)  # nothing half-written left


def test_hash_collisions_cost_a_comparison_and_hide_no_duplicate(tmp_path, monkeypatch):
    """With a hash of 3 values every path collides with others: lookups still find the right row by comparing
    the path's bytes, and a duplicate among colliding paths is still refused."""
    monkeypatch.setattr(map_paths, '_hash64', lambda data: len(data) % 3)
    root = tmp_path / 's'
    paths = PATHS + ['a.jpg', 'bb.jpg', 'ccc.jpg']
    full_store(root, paths)
    store = LabelMapStore.open(root)
    assert [store.index_of(p) for p in paths] == list(range(len(paths)))
    assert 'dd.jpg' not in store and 'a.jpg' in store
    dup = paths[:-1] + ['bb.jpg']
    (root / M.PATHS_FILE).write_text('\n'.join(dup) + '\n')
    with pytest.raises(LabelMapError, match=r"duplicate image path 'bb.jpg' at rows 13 and 14"):
        LabelMapStore.open(root)


def _open_and_look_up(root):
    store = LabelMapStore.open(root)
    return [store.index_of(p) for p in PATHS]


def test_readers_building_the_path_index_at_once_do_not_collide(tmp_path):
    """An older store without the index, opened by several processes at once (loader workers): each writes its
    own temporary and renames it whole, so every reader and the files left are right; remove_store takes an
    unfinished temporary too."""
    import multiprocessing as mp

    root = tmp_path / 's'
    full_store(root)
    for name in (M.PATH_INDEX_FILE, M.PATH_OFFSETS_FILE):
        (root / name).unlink()
    with mp.get_context('spawn').Pool(4) as pool:
        rows = pool.map(_open_and_look_up, [root] * 8)
    assert all(r == list(range(len(PATHS))) for r in rows)
    assert sorted(p.name for p in root.iterdir()) == sorted(M.STORE_FILES + (M.PATH_INDEX_FILE, M.PATH_OFFSETS_FILE))
    (root / f'.{M.PATH_INDEX_FILE}.abcd1234.tmp').write_bytes(b'half')
    M.remove_store(root)
    assert not root.exists()
