"""shared_core.map_store: the on-disk dense label-map store's writer and reader (round trips, shapes, memory maps,
missing paths, incomplete stores)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared_core import map_status
from shared_core import map_store as M
from shared_core.map_format import IncompleteStoreError, LabelMapError, MissingLabelMapError
from shared_core.map_store import LabelMapStore, MapWriter

from .map_store_rows import PATHS, create_store, full_store, random_rows


def test_round_trip_values_indices_dtypes(tmp_path):
    values, indices = random_rows(len(PATHS))
    with create_store(tmp_path / 's') as w:
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


def test_write_checks_shapes_and_class_range(tmp_path):
    values, indices = random_rows(2, num_classes=10)
    with create_store(tmp_path / 's', num_classes=10) as w:
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
    full_store(tmp_path / 's', paths=paths, grid=(2, 2))
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
    with create_store(tmp_path / 's', paths=paths, grid=grid) as w:
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
    full_store(tmp_path / 's')
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
    values, indices = random_rows(len(PATHS))
    w = create_store(tmp_path / 's')
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
    create_store(tmp_path / 's').close()
    with pytest.raises(LabelMapError, match='already holds a label-map store'):
        create_store(tmp_path / 's')
    with pytest.raises(LabelMapError, match="duplicate image path 'a/1.jpg' at rows 0 and 2"):
        create_store(tmp_path / 'd', paths=['a/1.jpg', 'a/2.jpg', './a/1.jpg'])
    with pytest.raises(ValueError, match='newline'):
        create_store(tmp_path / 'n', paths=['a/1.jpg', 'a/evil\nname.jpg'])
    with pytest.raises(ValueError, match='k must be in'):
        create_store(tmp_path / 'k', num_classes=3, k=5)


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
