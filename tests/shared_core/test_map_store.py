"""Tests for shared_core.map_store: the on-disk dense label-map store (format, writer, reader, merge)."""

from __future__ import annotations

import json
import os
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared_core import map_format as F
from shared_core import map_paths, map_status
from shared_core import map_store as M
from shared_core.map_format import IncompleteStoreError, LabelMapError, MissingLabelMapError, normalize_path
from shared_core.map_store import LabelMapStore, MapWriter

PATHS = [f'{c:02d}_class/{i:06d}.jpg' for c in range(3) for i in range(4)]  # 12 images


def _random_rows(n, k=5, grid=(3, 4), num_classes=1000, seed=0):
    """Plausible top-k rows: descending float16 probabilities, distinct class indices per cell."""
    rng = np.random.default_rng(seed)
    v = np.sort(rng.dirichlet(np.ones(k + 2), size=(n, *grid))[..., :k], axis=-1)[..., ::-1]
    values = np.ascontiguousarray(np.moveaxis(v, -1, 1)).astype(np.float16)
    idx = (
        np.argsort(rng.random((n, *grid, num_classes)), axis=-1)[..., :k]
        if num_classes <= 2000
        else rng.choice(num_classes, size=(n, *grid, k), replace=True)
    )
    return values, np.ascontiguousarray(np.moveaxis(idx, -1, 1))


def _create(path, paths=PATHS, num_classes=1000, k=5, grid=(3, 4), **kw):
    return MapWriter.create(
        path, paths, num_classes=num_classes, k=k, grid=grid, annotator='resnet18', input_size=(96, 128), **kw
    )


def _full_store(path, paths=PATHS, num_classes=1000, k=5, grid=(3, 4)):
    values, indices = _random_rows(len(paths), k, grid, num_classes)
    with _create(path, paths, num_classes, k, grid) as w:
        w.write(np.arange(len(paths)), values, indices)
        w.finalize()
    return values, indices


# ------------------------------------------------------------------------------------- round trip
def test_round_trip_values_indices_dtypes(tmp_path):
    values, indices = _random_rows(len(PATHS))
    with _create(tmp_path / 's') as w:
        w.write([5, 1, 9], values[[5, 1, 9]], indices[[5, 1, 9]])  # scattered rows
        rest = np.setdiff1d(np.arange(len(PATHS)), [5, 1, 9])
        w.write(rest, values[rest], indices[rest])
        w.finalize()
    store = LabelMapStore.open(tmp_path / 's')
    assert len(store) == len(PATHS) and store.num_classes == 1000 and store.k == 5 and store.grid == (3, 4)
    assert store.paths == PATHS
    meta = store.meta
    assert meta['format'] == 'tokenaug-label-maps' and meta['version'] == 1 and meta['complete'] is True
    assert meta['values'] == 'probabilities' and meta['values_dtype'] == 'float16'
    assert meta['indices_dtype'] == 'uint16' and meta['input_size'] == [96, 128]
    assert meta['region'] == {'covers': 'full_image', 'resize': 'squash'}
    assert store.values.dtype == np.float16 and store.indices.dtype == np.uint16
    for r, p in enumerate(PATHS):
        v, i = store.lookup(p)
        assert v.dtype == np.float16 and i.dtype == np.int64 and v.shape == i.shape == (5, 3, 4)
        np.testing.assert_array_equal(v, values[r])
        np.testing.assert_array_equal(i, indices[r])
        assert store.index_of(p) == r
    v, _ = store.row(0)
    assert type(v) is np.ndarray and v.flags.owndata and v.flags.writeable  # a copy, not a memmap view


def test_more_than_65535_classes_use_int32(tmp_path):
    c = 70_000
    assert F.index_dtype(65536) == np.uint16 and F.index_dtype(65537) == np.int32
    values, indices = _random_rows(len(PATHS), num_classes=c)
    indices[0, 0, 0, 0] = c - 1  # the largest class survives
    with _create(tmp_path / 's', num_classes=c) as w:
        w.write(np.arange(len(PATHS)), values, indices)
        w.finalize()
    store = LabelMapStore.open(tmp_path / 's')
    assert store.meta['indices_dtype'] == 'int32' and store.indices.dtype == np.int32
    np.testing.assert_array_equal(store.row(0)[1], indices[0])
    assert store.row(0)[1][0, 0, 0] == c - 1


def test_write_checks_shapes_and_class_range(tmp_path):
    values, indices = _random_rows(2, num_classes=10)
    with _create(tmp_path / 's', num_classes=10) as w:
        with pytest.raises(ValueError, match='shape'):
            w.write([0, 1], values[:, :3], indices[:, :3])
        bad = indices.copy()
        bad[0, 0, 0, 0] = 10
        with pytest.raises(ValueError, match=r'\[0, num_classes=10\)'):
            w.write([0, 1], values, bad)
        with pytest.raises(IndexError, match='rows must be in'):
            w.write([0, 12], values, indices)
        with pytest.raises(ValueError, match='duplicates'):
            w.write([3, 3], values, indices)
        assert w.num_done() == 0  # nothing was marked done by the failed writes


# ----------------------------------------------------------------------------- memmap and pickling
def test_reader_is_memory_mapped_and_pickles_small(tmp_path):
    paths = [f'some/rather/long/class_folder_name_{i % 50:03d}/image_{i:08d}.JPEG' for i in range(5000)]
    _full_store(tmp_path / 's', paths=paths, grid=(2, 2))
    store = LabelMapStore.open(tmp_path / 's')
    assert isinstance(store.values, np.memmap) and store.values.mode == 'r'
    assert isinstance(store.indices, np.memmap)
    blob = pickle.dumps(store)
    assert len(blob) < 4000, len(blob)  # no arrays, no path list, no index dict
    clone = pickle.loads(blob)
    assert clone._values is None and clone._index is None  # reopened lazily, per process
    np.testing.assert_array_equal(clone.lookup(paths[4321])[0], store.row(4321)[0])
    assert isinstance(clone.values, np.memmap)


def _rss_bytes() -> int:
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith('VmRSS:'):
                return int(line.split()[1]) * 1024
    raise RuntimeError('no VmRSS')


def test_reading_rows_does_not_load_the_arrays(tmp_path):  # reads VmRSS from /proc: Linux, as the project
    n, grid = 20_000, (18, 18)  # 2 x 65 MB of arrays (sparse on disk: nothing written but the done flags)
    paths = [f'c/{i:06d}.jpg' for i in range(n)]
    with _create(tmp_path / 's', paths=paths, grid=grid) as w:
        done = np.load(tmp_path / 's' / M.DONE_FILE, mmap_mode='r+')
        done[:] = 1  # stands in for 20k writes; the arrays stay zero
        done.flush()
        del done
        w.finalize()
    before = _rss_bytes()
    store = LabelMapStore.open(tmp_path / 's')
    rng = np.random.default_rng(0)
    for r in rng.integers(0, n, 200):
        store.row(int(r))
    grown = _rss_bytes() - before
    assert store.values.nbytes + store.indices.nbytes > 120e6
    assert grown < 30e6, f'RSS grew by {grown / 1e6:.1f} MB reading 200 rows'


# --------------------------------------------------------------------------------- errors, checks
def test_missing_path_raises_keyerror_naming_image_and_store(tmp_path):
    _full_store(tmp_path / 's')
    store = LabelMapStore.open(tmp_path / 's')
    with pytest.raises(KeyError) as info:
        store.lookup('99_class/000042.jpg')
    err = info.value
    assert isinstance(err, MissingLabelMapError)
    assert '99_class/000042.jpg' in str(err) and str(tmp_path / 's') in str(err)
    assert '99_class/000042.jpg' not in store and PATHS[3] in store
    assert store.index_of('./' + PATHS[3]) == 3  # normalised lookups
    with pytest.raises(IndexError, match=r'\[0, 12\)'):
        store.row(12)


def test_incomplete_store_is_refused(tmp_path):
    values, indices = _random_rows(len(PATHS))
    w = _create(tmp_path / 's')
    w.write(np.arange(9), values[:9], indices[:9])
    assert w.missing().tolist() == [9, 10, 11]
    with pytest.raises(IncompleteStoreError, match='3 of 12 rows missing'):
        w.finalize()
    w.close()
    with pytest.raises(IncompleteStoreError) as info:
        LabelMapStore.open(tmp_path / 's')
    assert str(tmp_path / 's') in str(info.value) and '3 of 12 rows missing' in str(info.value)
    assert '--resume' in str(info.value)
    status = map_status.store_status(tmp_path / 's')
    assert status['rows_missing'] == 3 and not status['complete']
    # resume: the done rows stay, the rest is written, then it opens
    w = MapWriter.resume(tmp_path / 's')
    assert w.missing().tolist() == [9, 10, 11]
    w.write([9, 10, 11], values[9:], indices[9:])
    w.finalize()
    w.close()
    np.testing.assert_array_equal(LabelMapStore.open(tmp_path / 's').values, values)
    with pytest.raises(LabelMapError, match='already complete'):
        MapWriter.resume(tmp_path / 's')


def test_create_refuses_existing_store_duplicates_and_newlines(tmp_path):
    _create(tmp_path / 's').close()
    with pytest.raises(LabelMapError, match='already holds a label-map store'):
        _create(tmp_path / 's')
    with pytest.raises(LabelMapError, match="duplicate image path 'a/1.jpg' at rows 0 and 2"):
        _create(tmp_path / 'd', paths=['a/1.jpg', 'a/2.jpg', './a/1.jpg'])
    with pytest.raises(ValueError, match='newline'):
        _create(tmp_path / 'n', paths=['a/1.jpg', 'a/evil\nname.jpg'])
    with pytest.raises(ValueError, match='k must be in'):
        _create(tmp_path / 'k', num_classes=3, k=5)


@pytest.mark.parametrize(
    'corrupt, match',
    [
        ('format', "format is 'other', expected 'tokenaug-label-maps'"),
        ('version', 'version 7 is not supported'),
        ('shape', r'values.npy has shape \(12, 5, 3, 3\) dtype float16, expected \(12, 5, 3, 4\) float16'),
        ('dtype', r'indices.npy has shape .* dtype int64, expected .* uint16'),
        ('count', 'paths.txt: 11 paths, expected num_images=12'),
        ('duplicate', "duplicate image path '00_class/000000.jpg' at rows 0 and 1"),
        ('missing', 'indices.npy is missing'),
    ],
)
def test_open_validates(tmp_path, corrupt, match):
    root = tmp_path / 's'
    _full_store(root)
    if corrupt in ('format', 'version'):
        meta = json.loads((root / 'meta.json').read_text())
        meta[corrupt] = 'other' if corrupt == 'format' else 7
        (root / 'meta.json').write_text(json.dumps(meta))
    elif corrupt == 'shape':
        np.save(root / 'values.npy', np.zeros((12, 5, 3, 3), np.float16))
    elif corrupt == 'dtype':
        np.save(root / 'indices.npy', np.zeros((12, 5, 3, 4), np.int64))
    elif corrupt == 'count':
        (root / 'paths.txt').write_text('\n'.join(PATHS[:11]) + '\n')
    elif corrupt == 'duplicate':
        (root / 'paths.txt').write_text('\n'.join([PATHS[0]] + PATHS[:11]) + '\n')
    else:
        (root / 'indices.npy').unlink()
    with pytest.raises(LabelMapError, match=match):
        LabelMapStore.open(root)


def test_pickled_arrays_are_refused(tmp_path):
    root = tmp_path / 's'
    _full_store(root)
    np.save(root / 'values.npy', np.array([{'evil': 1}], dtype=object), allow_pickle=True)
    with pytest.raises(LabelMapError, match='values.npy'):
        LabelMapStore.open(root)


def test_normalize_path():
    assert normalize_path('./a/b.jpg') == 'a/b.jpg'
    assert normalize_path(os.path.join('a', 'b.jpg')) == 'a/b.jpg'
    assert normalize_path('a\\b.jpg') == ('a/b.jpg' if os.sep == '\\' else 'a\\b.jpg')
    for bad in ('', '/abs/x.jpg', 'a\nb.jpg', 'a\rb.jpg'):
        with pytest.raises(ValueError):
            normalize_path(bad)


def test_paths_with_odd_characters_round_trip(tmp_path):
    # str.splitlines() would also split at \u2028 and \x0c
    paths = ['ünï/cödé.jpg', 'a/b\u2028c.jpg', 'a/tab\there.jpg', 'a/form\x0cfeed.jpg']
    _full_store(tmp_path / 's', paths=paths, num_classes=10)
    store = LabelMapStore.open(tmp_path / 's')
    assert store.paths == paths and [store.index_of(p) for p in paths] == [0, 1, 2, 3]


# ------------------------------------------------------------------------------------------- merge
def _shard(root, paths, start, index, num_shards, total, values, indices):
    extra = {
        'shard': {
            'index': index,
            'num_shards': num_shards,
            'row_start': start,
            'row_stop': start + len(paths),
            'num_images_total': total,
        }
    }
    with _create(root, paths=paths, extra_meta=extra) as w:
        w.write(np.arange(len(paths)), values[start : start + len(paths)], indices[start : start + len(paths)])
        w.finalize()


def test_merge_stores_equals_single_store(tmp_path):
    values, indices = _random_rows(len(PATHS))
    _shard(tmp_path / 'a', PATHS[:8], 0, 0, 3, 12, values, indices)
    _shard(tmp_path / 'b', PATHS[8:], 8, 1, 3, 12, values, indices)
    _shard(tmp_path / 'c', [], 12, 2, 3, 12, values, indices)  # an empty last shard is fine
    map_status.merge_stores([tmp_path / 'c', tmp_path / 'a', tmp_path / 'b'], tmp_path / 'out')
    out = LabelMapStore.open(tmp_path / 'out')
    assert out.paths == PATHS and 'shard' not in out.meta and out.meta['merged_from']['num_shards'] == 3
    np.testing.assert_array_equal(out.values, values)
    np.testing.assert_array_equal(out.indices, indices)


def test_merge_refuses_gaps_overlaps_and_incompatible_shards(tmp_path):
    values, indices = _random_rows(len(PATHS))
    _shard(tmp_path / 'a', PATHS[:6], 0, 0, 2, 12, values, indices)
    _shard(tmp_path / 'b', PATHS[7:], 7, 1, 2, 12, values, indices)  # row 6 missing
    with pytest.raises(LabelMapError, match='expected to start at row 6'):
        map_status.merge_stores([tmp_path / 'a', tmp_path / 'b'], tmp_path / 'out')
    with pytest.raises(LabelMapError, match=r'expected shards 0..1 of 2 exactly once'):
        map_status.merge_stores([tmp_path / 'a'], tmp_path / 'out')
    v13, i13 = np.concatenate([values, values[:1]]), np.concatenate([indices, indices[:1]])
    _shard(tmp_path / 'a13', PATHS[:6], 0, 0, 2, 13, v13, i13)
    _shard(tmp_path / 'dup', PATHS[6:] + [PATHS[0]], 6, 1, 2, 13, v13, i13)  # image 0 in both shards
    with pytest.raises(LabelMapError, match="duplicate image path '00_class/000000.jpg' at rows 0 and 12"):
        map_status.merge_stores([tmp_path / 'a13', tmp_path / 'dup'], tmp_path / 'out2')
    extra = {'shard': {'index': 1, 'num_shards': 2, 'row_start': 6, 'row_stop': 12, 'num_images_total': 12}}
    with MapWriter.create(
        tmp_path / 'other',
        PATHS[6:],
        num_classes=1000,
        k=5,
        grid=(3, 4),
        annotator='resnet50',
        input_size=(96, 128),
        extra_meta=extra,
    ) as w:
        w.write(np.arange(6), values[6:], indices[6:])
        w.finalize()
    with pytest.raises(LabelMapError, match="annotator: 'resnet18' != 'resnet50'"):
        map_status.merge_stores([tmp_path / 'a', tmp_path / 'other'], tmp_path / 'out3')


# -------------------------------------------------------------------------------------- properties
@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 6),
    k=st.integers(1, 4),
    h=st.integers(1, 4),
    w=st.integers(1, 4),
    num_classes=st.sampled_from([4, 1000, 65536, 65537, 200_000]),
    seed=st.integers(0, 2**16),
)
def test_round_trip_is_bit_exact(tmp_path_factory, n, k, h, w, num_classes, seed):
    rng = np.random.default_rng(seed)
    values = rng.random((n, k, h, w)).astype(np.float16)
    indices = rng.integers(0, num_classes, (n, k, h, w))
    root = tmp_path_factory.mktemp('prop') / 's'
    paths = [f'x/{i}.png' for i in range(n)]
    with MapWriter.create(
        root, paths, num_classes=num_classes, k=k, grid=(h, w), annotator='m', input_size=(32, 32)
    ) as wr:
        order = rng.permutation(n)
        wr.write(order, values[order], indices[order])
        wr.finalize()
    store = LabelMapStore.open(root)
    for r in range(n):
        v, i = store.lookup(paths[r])
        assert v.tobytes() == values[r].tobytes()
        np.testing.assert_array_equal(i, indices[r])


# ------------------------------------------------------------------------------------- path index
def test_the_path_index_is_memory_mapped_written_once_and_rebuilt_when_stale(tmp_path):
    """The readers' path index: written when the store is finalized, memory-mapped by every reader (nothing per
    process but the maps), equal to a dict of the paths, and rebuilt from paths.txt when that changed."""
    root = tmp_path / 's'
    _full_store(root)
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
    _full_store(root)
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
    _full_store(root, paths)
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
    _full_store(root)
    for name in (M.PATH_INDEX_FILE, M.PATH_OFFSETS_FILE):
        (root / name).unlink()
    with mp.get_context('spawn').Pool(4) as pool:
        rows = pool.map(_open_and_look_up, [root] * 8)
    assert all(r == list(range(len(PATHS))) for r in rows)
    assert sorted(p.name for p in root.iterdir()) == sorted(M.STORE_FILES + (M.PATH_INDEX_FILE, M.PATH_OFFSETS_FILE))
    (root / f'.{M.PATH_INDEX_FILE}.abcd1234.tmp').write_bytes(b'half')
    M.remove_store(root)
    assert not root.exists()
