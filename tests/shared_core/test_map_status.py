"""shared_core.map_status: merging shards into one store (equal to the single store; gaps, overlaps and
incompatible shards refused)."""

from __future__ import annotations

import numpy as np
import pytest

from shared_core import map_status
from shared_core.map_format import LabelMapError
from shared_core.map_store import LabelMapStore, MapWriter

from .map_store_rows import PATHS, create_store, random_rows


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
    with create_store(root, paths=paths, extra_meta=extra) as w:
        w.write(np.arange(len(paths)), values[start : start + len(paths)], indices[start : start + len(paths)])
        w.finalize()


def test_merge_stores_equals_single_store(tmp_path):
    values, indices = random_rows(len(PATHS))
    _shard(tmp_path / 'a', PATHS[:8], 0, 0, 3, 12, values, indices)
    _shard(tmp_path / 'b', PATHS[8:], 8, 1, 3, 12, values, indices)
    _shard(tmp_path / 'c', [], 12, 2, 3, 12, values, indices)  # an empty last shard is fine
    map_status.merge_stores([tmp_path / 'c', tmp_path / 'a', tmp_path / 'b'], tmp_path / 'out')
    out = LabelMapStore.open(tmp_path / 'out')
    assert out.paths == PATHS and 'shard' not in out.meta and out.meta['merged_from']['num_shards'] == 3
    np.testing.assert_array_equal(out.values, values)
    np.testing.assert_array_equal(out.indices, indices)


def test_merge_refuses_gaps_overlaps_and_incompatible_shards(tmp_path):
    values, indices = random_rows(len(PATHS))
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
