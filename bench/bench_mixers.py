"""Mixer time per batch: tokenaug's mixers against timm's ``Mixup`` / ``FastCollateMixup`` on the same batch.

Each row times timm's mixer and ours alternately (interleaved, after a warm-up), reports medians and
the ratio ours / timm (< 1: ours is faster). The timm side uses the same arguments; token-mask kinds
are compared against timm's CutMix with the same α (the closest thing timm has). In the MixUp/CutMix
switch rows each side draws its own branch per call, so those medians mix both kinds of work.

    .venv/bin/python bench/bench_mixers.py [--batch 128] [--size 224] [--repeats 30] [--device cpu]
"""

from __future__ import annotations

import argparse
import platform

import numpy as np
import torch
from common import device_sync, median_times
from timm.data import FastCollateMixup, Mixup

from timm_plugin import create_mixer


def compare(name, ours, theirs, repeats, sync):
    b, a = median_times([theirs, ours], repeats, warmup=3, sync=sync)
    print(f'| {name} | {b * 1e3:.2f} | {a * 1e3:.2f} | {a / b:.2f} |', flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--batch', type=int, default=128)
    p.add_argument('--size', type=int, default=224)
    p.add_argument('--repeats', type=int, default=30)
    p.add_argument('--device', default='cpu')
    p.add_argument('--threads', type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    sync = device_sync(dev)
    B, S, C = args.batch, args.size, 1000
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(B, 3, S, S, generator=gen).to(dev)
    y = torch.randint(0, C, (B,), generator=gen).to(dev)
    print(
        f'# batch {B}x3x{S}x{S}, {C} classes, device {dev} '
        f'({torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine()}), '
        f'torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.repeats}'
    )
    print('| mixer (on-device, x, y -> x, target) | timm ms | tokenaug ms | ratio |')
    print('|---|---|---|---|')
    cases = [
        ('mixup α=0.8, batch', 'mixup', dict(mixup_alpha=0.8, cutmix_alpha=0.0), 'batch'),
        ('cutmix α=1, batch', 'cutmix', dict(mixup_alpha=0.0, cutmix_alpha=1.0), 'batch'),
        ('mixup/cutmix switch, batch (DeiT)', 'cutmix', dict(mixup_alpha=0.8, cutmix_alpha=1.0), 'batch'),
        ('mixup/cutmix switch, elem', 'cutmix', dict(mixup_alpha=0.8, cutmix_alpha=1.0), 'elem'),
        ('tokenmix_block elem vs timm cutmix elem', 'tokenmix_block', dict(mixup_alpha=0.0, cutmix_alpha=1.0), 'elem'),
        (
            'tokenmix_random elem vs timm cutmix elem',
            'tokenmix_random',
            dict(mixup_alpha=0.0, cutmix_alpha=1.0),
            'elem',
        ),
        ('token_box elem vs timm cutmix elem', 'token_box', dict(mixup_alpha=0.0, cutmix_alpha=1.0), 'elem'),
    ]
    for name, kind, alphas, mode in cases:
        ours = create_mixer(kind, mode=mode, num_classes=C, patch_size=16, **alphas)
        timm_alphas = alphas if kind in ('mixup', 'cutmix') else dict(mixup_alpha=0.0, cutmix_alpha=1.0)
        theirs = Mixup(mode=mode, num_classes=C, **timm_alphas)
        compare(name, lambda: ours(x.clone(), y), lambda: theirs(x.clone(), y), args.repeats, sync)

    print()
    print('| collate (CPU, list of (uint8 CHW array, label) -> uint8 batch, target) | timm ms | tokenaug ms | ratio |')
    print('|---|---|---|---|')
    rng = np.random.RandomState(0)
    imgs = [rng.randint(0, 256, (3, S, S), dtype=np.uint8) for _ in range(B)]
    labels = rng.randint(0, C, B).tolist()
    for name, kind, alphas, mode in cases[:4] + cases[4:5]:
        ours = create_mixer(kind, mode=mode, num_classes=C, patch_size=16, collate=True, **alphas)
        timm_alphas = alphas if kind in ('mixup', 'cutmix') else dict(mixup_alpha=0.0, cutmix_alpha=1.0)
        theirs = FastCollateMixup(mode=mode, num_classes=C, **timm_alphas)
        reps = max(5, args.repeats // 3)
        # timm's pair mode mutates the arrays in place: every call gets its own copies, made outside the timing
        copies = iter([[(im.copy(), lab) for im, lab in zip(imgs, labels)] for _ in range(2 * (reps + 3))])
        compare(name, lambda: ours(next(copies)), lambda: theirs(next(copies)), reps, None)


if __name__ == '__main__':
    main()
