"""``tokenaug-maps info``: the status of a label-map store, with numpy and json only (no torch, no timm), so that
printing a store's JSON costs a few MB, not the 870 MB of the annotation tools (the command:
:func:`tokenaug.commands.maps`)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np

from shared_core.map_format import LabelMapError
from shared_core.map_status import store_status

__all__ = ['SHARD_DIR_RE', 'shard_dirs', 'info', 'format_status', 'print_info']

SHARD_DIR_RE = re.compile(r'^shard-(\d+)-of-(\d+)$')


def shard_dirs(out: Path) -> list[Path]:
    found = [(d, SHARD_DIR_RE.match(d.name)) for d in sorted((out / 'shards').glob('shard-*-of-*')) if d.is_dir()]
    found = [(int(m.group(1)), int(m.group(2)), d) for d, m in found if m]
    counts = sorted({s for _, s, _ in found})
    if not found:
        raise LabelMapError(f'{out / "shards"}: no shard stores (shard-I-of-S) to merge')
    if len(counts) > 1:
        raise LabelMapError(
            f'{out / "shards"} holds shards of runs with different --num-shards {counts}; remove the stale ones'
        )
    return [d for _, _, d in sorted(found)]


def info(path: str | os.PathLike) -> dict:
    """Status of a store (meta, completeness, bytes per image) or of the shards of an unmerged run."""
    root = Path(path)
    if (root / 'meta.json').is_file():
        return store_status(root)
    if (root / 'shards').is_dir():
        return {'shards': {d.name: store_status(d) for d in shard_dirs(root)}}
    raise LabelMapError(f'{root} is neither a label-map store (no meta.json) nor a sharded run (no shards/)')


def format_status(status: dict) -> str:
    meta = status['meta']
    n = meta['num_images']
    lines = [
        json.dumps(meta, indent=1),
        '',
        f'rows: {status["rows_done"]} of {n} done, {status["rows_missing"]} missing; complete: {status["complete"]}',
        *(f'problem: {p}' for p in status.get('problems', ())),
        f'payload bytes per image: {status["payload_bytes_per_image"]} '
        f'(k {meta["k"]} x grid {meta["grid"][0]}x{meta["grid"][1]} x (2 B float16 + '
        f'{np.dtype(meta["indices_dtype"]).itemsize} B {meta["indices_dtype"]}))',
        f'file bytes per image: {status["file_bytes_per_image"]:.1f} '
        f'(all files: {sum(status["file_bytes"].values())} B; allocated on disk: '
        f'{sum(status["allocated_bytes"].values())} B)',
    ]
    return '\n'.join(lines)


def print_info(path, as_json: bool = False) -> None:
    status = info(path)
    if as_json:
        print(json.dumps(status, indent=1))
    elif 'shards' in status:
        for name, st in status['shards'].items():
            print(f'== {name}\n{format_status(st)}\n')
    else:
        print(format_status(status))
