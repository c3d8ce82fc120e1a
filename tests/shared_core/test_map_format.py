"""shared_core.map_format: the store's on-disk format (index dtypes, meta checks, no pickles, path normalisation and
the paths file)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from shared_core import map_format as F
from shared_core.map_format import LabelMapError, normalize_path
from shared_core.map_store import LabelMapStore

from .map_store_rows import PATHS, create_store, full_store, random_rows


def test_more_than_65535_classes_use_int32(tmp_path):
    c = 70_000
    assert F.index_dtype(65536) == np.uint16 and F.index_dtype(65537) == np.int32
    values, indices = random_rows(len(PATHS), num_classes=c)
    indices[0, 0, 0, 0] = c - 1  # the largest class survives
    with create_store(tmp_path / 's', num_classes=c) as w:
        w.write(np.arange(len(PATHS)), values, indices)
        w.finalize()
    store = LabelMapStore.open(tmp_path / 's')
    assert store.meta['indices_dtype'] == 'int32' and store.indices.dtype == np.int32
    np.testing.assert_array_equal(store.row(0)[1], indices[0])
    assert store.row(0)[1][0, 0, 0] == c - 1


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
    full_store(root)
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
    full_store(root)
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
    full_store(tmp_path / 's', paths=paths, num_classes=10)
    store = LabelMapStore.open(tmp_path / 's')
    assert store.paths == paths and [store.index_of(p) for p in paths] == [0, 1, 2, 3]
