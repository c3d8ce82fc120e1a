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
from common import count_ops, device_sync, median_times
from timm.data import FastCollateMixup, Mixup

from timm_plugin import create_mixer


def compare(name, ours, theirs, repeats, sync):
    b, a = median_times([theirs, ours], repeats, warmup=3, sync=sync)
    print(f'| {name} | {b * 1e3:.2f} | {a * 1e3:.2f} | {a / b:.2f} |', flush=True)


def overhead_bound(C: int, repeats: int) -> None:
    """The launch-bound regime of a GPU, on the CPU: a batch so small (8 images of 32 px, one thread) that each
    call costs its per-op dispatch and Python, not arithmetic. What a mixer adds to an eager GPU step is this
    host time (its device kernels are a few passes over the batch on either side), so these ratios stand in
    for the GPU rows where no GPU is at hand; the aten op counts (sampling included: timm samples with numpy,
    we with torch on the host) are exact."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 3, 32, 32, generator=gen), torch.randint(0, C, (8,), generator=gen)
    print()
    print(f'# overhead-bound: batch 8x3x32x32, 1 thread, median of {repeats} (µs per call)')
    print('| mixer (x, y -> x, target) | timm µs | tokenaug µs | ratio | timm aten ops | tokenaug aten ops |')
    print('|---|---|---|---|---|---|')
    cases = [
        ('mixup α=0.8, batch', dict(mixup_alpha=0.8, cutmix_alpha=0.0), 'batch'),
        ('cutmix α=1, batch', dict(mixup_alpha=0.0, cutmix_alpha=1.0), 'batch'),
        ('mixup/cutmix switch, batch (DeiT)', dict(mixup_alpha=0.8, cutmix_alpha=1.0), 'batch'),
        ('mixup α=0.8, pair', dict(mixup_alpha=0.8, cutmix_alpha=0.0), 'pair'),
        ('cutmix α=1, pair', dict(mixup_alpha=0.0, cutmix_alpha=1.0), 'pair'),
        ('mixup α=0.8, elem', dict(mixup_alpha=0.8, cutmix_alpha=0.0), 'elem'),
        ('mixup/cutmix switch, elem', dict(mixup_alpha=0.8, cutmix_alpha=1.0), 'elem'),
    ]
    for name, alphas, mode in cases:
        ours = create_mixer(mode=mode, num_classes=C, patch_size=8, **alphas)
        theirs = Mixup(mode=mode, num_classes=C, **alphas)

        def run_ours():
            return ours(x.clone(), y)

        def run_theirs():
            return theirs(x.clone(), y)

        b, a = median_times([run_theirs, run_ours], repeats, warmup=20)
        ops = [count_ops(run_theirs), count_ops(run_ours)]
        print(f'| {name} | {b * 1e6:.0f} | {a * 1e6:.0f} | {a / b:.2f} | {ops[0]} | {ops[1]} |', flush=True)
    torch.set_num_threads(threads)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--batch', type=int, default=128)
    p.add_argument('--size', type=int, default=224)
    p.add_argument('--repeats', type=int, default=30)
    p.add_argument('--device', default='cpu')
    p.add_argument('--threads', type=int, default=None)
    p.add_argument('--small-repeats', type=int, default=400, help='rounds of the overhead-bound table')
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

    overhead_bound(C, args.small_repeats)

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
