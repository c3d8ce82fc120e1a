"""A label-map store's status (completeness, problems, size: ``tokenaug-maps info``) and the merge of the shard
stores of one sharded run into one store.

Plain numpy + json.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from shared_core.map_format import (
    _FORMAT_META_KEYS,
    DONE_FILE,
    INDICES_FILE,
    REGION,
    STORE_FILES,
    VALUES_DTYPE,
    VALUES_FILE,
    LabelMapError,
    _load_array,
    _read_meta,
    _row_shape,
    compatibility_diff,
)
from shared_core.map_paths import PathIndex
from shared_core.map_store import LabelMapStore, MapWriter

__all__ = ['store_status', 'merge_stores']

#: rows copied at once by :func:`merge_stores`
_WRITE_CHUNK_ROWS = 4096


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
