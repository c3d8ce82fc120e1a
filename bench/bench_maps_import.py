"""``tokenaug-maps import --from tokenlabeling`` at scale, and what a training loader pays per sample.

1. Writes ``--images`` label files in the public format (``(2, 5, 18, 18)`` float16, NFNet-F6's grid, one
   ``torch.save`` per image at ``<root>/<class>/<stem>.pt``, 1000 classes) for an ImageFolder of as many empty
   image files (the import lists the images, it does not decode them), then imports them with ``--workers``
   and reports files per second and the projected time for ImageNet-1k's 1,281,167 files on this machine.
2. The per-sample map read of a training loader, interleaved, medians over ``--reads`` random images: a store
   row (``LabelMapStore.lookup``) against the public per-image ``torch.load`` of its ``.pt`` file; the ratio is
   public / store.

    python bench/bench_maps_import.py [--images 20000] [--workers 2] [--reads 2000] [--out /tmp/imp]
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared_core.map_store import LabelMapStore  # noqa: E402
from timm_plugin.tools import maps_cli  # noqa: E402

IMAGENET = 1_281_167


def write_public(root: Path, n: int, classes: int = 1000) -> tuple[list, float]:
    """An ImageFolder of ``n`` empty images and their public label files; returns (relative paths, seconds)."""
    g = torch.Generator().manual_seed(0)
    t = time.perf_counter()
    rels = []
    for i in range(n):
        cls = f'n{i % classes:08d}'
        (root / 'data' / 'train' / cls).mkdir(parents=True, exist_ok=True)
        (root / 'labels' / cls).mkdir(parents=True, exist_ok=True)
        rel = f'{cls}/{cls}_{i}.JPEG'
        (root / 'data' / 'train' / rel).touch()
        logits = torch.randn(18, 18, classes, generator=g) if i < 8 else None  # a few real top-5s, then copies
        if logits is not None:
            value, indices = logits.topk(5)
            blob = torch.stack([value.half(), indices.half()]).permute(0, 3, 1, 2).contiguous()
            template = blob
        torch.save(template if logits is None else blob, root / 'labels' / f'{cls}/{cls}_{i}.pt')
        rels.append(rel)
    return rels, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--images', type=int, default=20000)
    ap.add_argument('--workers', type=int, default=2)
    ap.add_argument('--reads', type=int, default=2000)
    ap.add_argument('--out', default=None)
    args = ap.parse_args()
    root = Path(args.out or tempfile.mkdtemp(prefix='import-'))
    if root.exists() and args.out:
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    rels, secs = write_public(root, args.images)
    print(f'wrote {len(rels)} public label files in {secs:.1f} s')
    argv = ['import', '--from', 'tokenlabeling', '--src', str(root / 'labels'), '--data-dir', str(root / 'data')]
    argv += ['--num-classes', '1000', '--out', str(root / 'store'), '-j', str(args.workers), '--no-progress']
    t = time.perf_counter()
    assert maps_cli.main(argv) == 0
    secs = time.perf_counter() - t
    rate = len(rels) / secs
    print(
        f'| import | files | workers | seconds | files/s | projected for {IMAGENET:,} files |\n'
        '|---|---|---|---|---|---|\n'
        f'| tokenlabeling -> store | {len(rels)} | {args.workers} | {secs:.1f} | {rate:.0f} | '
        f'{IMAGENET / rate / 60:.0f} min |'
    )
    store = LabelMapStore.open(root / 'store')
    sample = random.Random(0).sample(rels, min(args.reads, len(rels)))
    store_t, public_t = [], []
    for i, rel in enumerate(sample):  # alternate the order each read
        pt = root / 'labels' / (rel.split('.')[0] + '.pt')
        for kind in ('store', 'public') if i % 2 else ('public', 'store'):
            t = time.perf_counter()
            if kind == 'store':
                store.lookup(rel)
                store_t.append(time.perf_counter() - t)
            else:
                torch.load(pt, weights_only=True)
                public_t.append(time.perf_counter() - t)
    s, p = statistics.median(store_t), statistics.median(public_t)
    print(
        f'\n| per-sample map read | median µs |\n|---|---|\n| store row (LabelMapStore.lookup) | {s * 1e6:.1f} |\n'
        f'| public .pt file (torch.load) | {p * 1e6:.1f} |\n| ratio public / store | {p / s:.1f} |'
    )


if __name__ == '__main__':
    main()
