#!/usr/bin/env python3
"""Token labeling's data cost: what the label maps add to timm's training pipeline.

1. per-sample loader work (``dataset[i]``: decode, RandomResizedCrop, flip, RandAugment, to tensor) of the
   plain timm ``ImageDataset`` vs :class:`TokenLabelDataset` (the same plus a memory-mapped map row, the
   recorded crop and the recorded affines of RandAugment's geometric ops; and with ``geometric_aa='drop'``),
   interleaved, median over rounds; ImageNet-like JPEGs (about 500x375);
2. collate of a batch: timm's ``fast_collate`` vs :class:`TokenLabelCollate` (stacks the rows, checks them);
3. building the per-token targets of a batch on the training device, as the loss reads them (sparse:
   ``token_targets_sparse``) and as a dense ``(B, N, C)`` tensor (``token_targets_batch``): ImageNet sizes,
   ``C = 1000``, ``k = 5``, 18x18 maps to the 14x14 token grid; with the batch's recorded affines (the
   samples RandAugment rotated, sheared or translated) and without (the crop path), interleaved.

    .venv/bin/python bench/bench_token_labels.py [--images 64] [--rounds 5] [--batch 128] [--device cpu]
        [--step-model deit_small_patch16_224 [--amp] [--compile inductor] [--profile]]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from common import device_sync, median_times, optimizer_step, profile_table
from PIL import Image
from timm.data import create_dataset, create_transform
from timm.data.loader import fast_collate

from shared_core.label_maps import token_targets_batch, token_targets_sparse
from shared_core.map_store import LabelMapStore, MapWriter
from timm_plugin.timm_fixes import fix_posterize
from timm_plugin.token_label_data import TokenLabelCollate, TokenLabelDataset


def make_images(root: Path, n: int, seed: int = 0) -> list:
    """``n`` 500x375 JPEGs with smooth structure (compress like photos, unlike noise)."""
    rng = np.random.default_rng(seed)
    paths = []
    yy, xx = np.mgrid[0:375, 0:500]
    for i in range(n):
        d = root / 'train' / f'c{i % 10}'
        d.mkdir(parents=True, exist_ok=True)
        f = rng.uniform(0.005, 0.05, size=(3, 2))
        ph = rng.uniform(0, 6.3, size=3)
        img = np.stack([127 + 120 * np.sin(f[c, 0] * xx + f[c, 1] * yy + ph[c]) for c in range(3)], -1)
        img += rng.normal(0, 8, img.shape)
        Image.fromarray(img.clip(0, 255).astype(np.uint8)).save(d / f'{i:05d}.jpg', quality=90)
        paths.append(f'c{i % 10}/{i:05d}.jpg')
    return paths


def make_store(path: Path, paths: list, C=1000, k=5, grid=(18, 18), seed=0) -> LabelMapStore:
    rng = np.random.default_rng(seed)
    w = MapWriter.create(path, paths, num_classes=C, k=k, grid=grid, annotator='bench', input_size=(576, 576))
    n = len(paths)
    idx = np.stack([rng.choice(C, size=k, replace=False) for _ in range(n * grid[0] * grid[1])])
    idx = idx.reshape(n, *grid, k).transpose(0, 3, 1, 2)
    val = np.sort(rng.dirichlet(np.ones(k) * 0.5, size=(n, *grid)) * 0.9, -1)[..., ::-1].transpose(0, 3, 1, 2)
    w.write(np.arange(n), val.astype(np.float16), idx)
    w.finalize()
    w.close()
    return LabelMapStore.open(path)


def timed(fn, reps: int) -> float:
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--images', type=int, default=64)
    p.add_argument('--rounds', type=int, default=5)
    p.add_argument('--batch', type=int, default=128)
    p.add_argument('--device', default='cpu')
    p.add_argument(
        '--step-model',
        default=None,
        help='also time a training step of this timm model: plain CE vs token labeling + MixToken '
        '(aux head, un-mixing, dense targets built in the step, and built by the loader as tokenaug-train does)',
    )
    p.add_argument('--amp', action='store_true')
    p.add_argument(
        '--compile',
        default=None,
        metavar='BACKEND',
        help='the training step through torch.compile(model, backend=BACKEND), as tokenaug-train --torchcompile',
    )
    p.add_argument('--profile', action='store_true', help='with --step-model: host op time and kernel time per step')
    args = p.parse_args()
    fix_posterize()  # as tokenaug-train: timm asks Pillow for 0 posterize bits at magnitude 10
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        paths = make_images(root, args.images)
        store = make_store(root / 'maps', paths)
        tf = create_transform(
            224, is_training=True, auto_augment='rand-m9-mstd0.5-inc1', use_prefetcher=True, interpolation='bicubic'
        )
        plain = create_dataset('', root=str(root), split='train', is_training=True)
        plain.transform = tf
        same, tl = (
            TokenLabelDataset(create_dataset('', root=str(root), split='train', is_training=True), store, mode)
            for mode in ('follow', 'drop')
        )
        for d in (tl, same):
            d.transform = create_transform(
                224, is_training=True, auto_augment='rand-m9-mstd0.5-inc1', use_prefetcher=True, interpolation='bicubic'
            )
        n = len(plain)
        # 1. per-sample loader work, interleaved rounds (each round re-seeds, so the ops drawn are the same)
        t_plain, t_tl, t_same = [], [], []
        for r in range(args.rounds):
            for ds, acc in ((plain, t_plain), (same, t_same), (tl, t_tl)):
                torch.manual_seed(r)
                np.random.seed(r)
                random.seed(r)
                acc.append(timed(lambda: [ds[i] for i in range(n)], 1) / n)
        mp, mt, ms = statistics.median(t_plain), statistics.median(t_tl), statistics.median(t_same)
        # the map part alone: row read + crop record, no image work
        t_row = statistics.median(timed(lambda: [store.lookup(q) for q in paths], 1) / n for _ in range(args.rounds))
        # 2. collate
        B = min(args.batch, n)
        sp = [plain[i % n] for i in range(B)]
        st = [same[i % n] for i in range(B)]
        coll = TokenLabelCollate(1000)
        c_plain, c_tl = [], []
        for _ in range(args.rounds):
            c_plain.append(timed(lambda: fast_collate(sp), 3))
            c_tl.append(timed(lambda: coll(st), 3))
        # 3. the per-token targets of a batch on the device: sparse (what the loss reads) and dense
        _, target = coll([st[i % len(st)] for i in range(args.batch)])
        target = target.to(args.device)
        dev = target.device
        sync = device_sync(args.device)
        moved = (
            0
            if target.maps.affines is None
            else int((target.maps.affines != torch.eye(3)[:2].to(dev)).any(-1).any(-1).any(-1).sum())
        )
        t_build = {}
        geometry = {'crop only': replace(target.maps, affines=None, extent=None), 'with affines': target.maps}
        for name, fn in (('sparse', token_targets_sparse), ('dense', token_targets_batch)):
            for geo in ('crop only', 'with affines'):

                def build(fn=fn, maps=geometry[geo]):
                    fn(maps, (14, 14), 0.1)
                    sync()

                build()
                t_build[name, geo] = []
        for _ in range(args.rounds):  # interleaved
            for (name, geo), acc in t_build.items():
                fn = token_targets_sparse if name == 'sparse' else token_targets_batch
                acc.append(timed(lambda fn=fn, maps=geometry[geo]: (fn(maps, (14, 14), 0.1), sync()), 3))
        t_build = {key: statistics.median(v) for key, v in t_build.items()}

    step = training_step(args, target) if args.step_model else None
    print(
        f'token labeling data cost ({args.images} JPEGs 500x375 -> 224 px, RandAugment m9, median of '
        f'{args.rounds} interleaved rounds, {torch.get_num_threads()} threads)'
    )
    print('| stage | plain timm | with label maps | ratio |')
    print('|---|---|---|---|')
    print(
        f'| loader work per sample, same RandAugment ops (default: geometric ops followed) | {mp * 1e3:.2f} ms | '
        f'{ms * 1e3:.2f} ms | {ms / mp:.3f} |'
    )
    print(
        f"| loader work per sample, geometric_aa='drop' (RandAugment without geometric ops) | {mp * 1e3:.2f} ms | "
        f'{mt * 1e3:.2f} ms | {mt / mp:.3f} |'
    )
    print(f'| of which: map row read (memmap, k=5, 18x18) | - | {t_row * 1e6:.1f} us | {t_row / mp:.4f} of plain |')
    print(
        f'| collate per batch of {B} | {statistics.median(c_plain) * 1e3:.2f} ms | '
        f'{statistics.median(c_tl) * 1e3:.2f} ms | {statistics.median(c_tl) / statistics.median(c_plain):.2f} |'
    )
    for name in ('sparse', 'dense'):
        t0, t1 = t_build[name, 'crop only'], t_build[name, 'with affines']
        print(
            f'| {name} token targets, batch {args.batch}, C=1000, 18x18 -> 14x14 ({args.device}), crop only | - | '
            f'{t0 * 1e3:.2f} ms | {t0 / args.batch * 1e3:.4f} ms per sample |'
        )
        print(
            f'| {name} token targets, same batch with its affines ({moved} of {args.batch} samples moved) | '
            f'{t0 * 1e3:.2f} ms | {t1 * 1e3:.2f} ms | {t1 / t0:.3f} |'
        )

    if step:
        tp, tt, tb = step
        setting = f'{args.step_model}, batch {args.batch} ({args.device}, amp={args.amp}' + (
            f', torch.compile backend {args.compile})' if args.compile else ')'
        )
        print(
            f'| training step {setting}, token targets built in the step | {tp * 1e3:.1f} ms | {tt * 1e3:.1f} ms | '
            f'{tt / tp:.3f} |'
        )
        print(
            f'| training step {setting}, token targets built by the loader (tokenaug-train) | {tp * 1e3:.1f} ms | '
            f'{tb * 1e3:.1f} ms | {tb / tp:.3f} |'
        )


def training_step(args, target):
    """Median step times (plain CE on the class head, token labeling + MixToken) on one batch, warm-up rounds
    first (with ``--compile``, they compile)."""
    import timm
    import torch.nn.functional as F

    from timm_plugin.token_labeling import TokenLabeling, TokenLabelingLoss, attach_aux_head

    dev = torch.device(args.device)
    torch.manual_seed(0)
    model = attach_aux_head(timm.create_model(args.step_model, num_classes=1000)).to(dev).train()
    wrapped = TokenLabeling(model)
    lossf = TokenLabelingLoss(1000)
    # the same rows with their token targets already built, as TokenLabelCollate(label_stride=...) hands them over
    loader_built = target.with_token_targets(tuple(224 // s for s in wrapped.label_stride), lossf.smoothing)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    x = torch.randn(args.batch, 3, 224, 224, device=dev)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=args.amp)

    # compiled: the hooks sit on the bare model, the compiled module runs the forward (as tokenaug-train)
    run = torch.compile(model, backend=args.compile) if args.compile else model
    plain = optimizer_step(lambda: F.cross_entropy(run(x), target.as_tensor(), label_smoothing=0.1), opt, autocast)
    tl = optimizer_step(lambda: lossf(wrapped.outputs(x, run), target), opt, autocast)
    tl_loader = optimizer_step(lambda: lossf(wrapped.outputs(x, run), loader_built), opt, autocast)
    warmup = 3 if args.compile else 2
    times = tuple(median_times([plain, tl, tl_loader], args.rounds * 2, warmup=warmup, sync=device_sync(dev)))
    if args.profile:
        profile_table([plain, tl_loader], ['plain CE', 'token labeling, loader-built targets'], dev)
    return times


if __name__ == '__main__':
    main()
