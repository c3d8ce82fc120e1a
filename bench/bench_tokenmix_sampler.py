"""TokenMix block-mask sampler time per batch, against timm's per-sample CutMix box sampling.

The block sampler (:func:`shared_core.mixing.tokenmix_masks`) draws ``--batch`` masks on a
``--grid`` token grid (14x14: 224 px, patch 16). The closest thing timm has is the per-sample CutMix box
of ``Mixup`` in ``'elem'`` mode: ``_mix_elem`` calls ``cutmix_bbox_and_lam`` (``rand_bbox`` + the λ
correction) once per sample, with numpy's global RNG; only that drawing is timed on the timm side, not
the pixel copy. Rows:

- ``λ = 0.5``: TokenMix's default (``round(0.5 · N)`` tokens from the partner) vs 128 boxes at λ = 0.5;
- ``λ ~ Beta(1, 1)``: λ drawn per sample on both sides (ours: ``sample_beta`` then the masks);
- full elem-mode draw: ``MixSampler('tokenmix_block', cutmix_alpha=1, mode='elem').sample`` (λ, masks
  and the per-token shares of a :class:`Mix`) vs timm's ``Mixup._params_per_elem`` plus the boxes as
  ``_mix_elem`` draws them.

Each row times both sides alternately (interleaved, after a warm-up) and reports medians and the
ratio ours / timm (< 1: ours is faster).

    .venv/bin/python bench/bench_tokenmix_sampler.py [--batch 128] [--grid 14] [--repeats 200] [--threads N]
"""

from __future__ import annotations

import argparse
import platform

import numpy as np
import torch
from common import median_times
from timm.data.mixup import Mixup, cutmix_bbox_and_lam

from shared_core.mixing import MixSampler, sample_beta, tokenmix_masks


def compare(name, ours, theirs, repeats):
    b, a = median_times([theirs, ours], repeats, warmup=5)
    print(f'| {name} | {b * 1e3:.3f} | {a * 1e3:.3f} | {a / b:.2f} |', flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--batch', type=int, default=128)
    p.add_argument('--grid', type=int, default=14, help='token grid side (image side = 16 x grid)')
    p.add_argument('--repeats', type=int, default=200)
    p.add_argument('--threads', type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    B, G = args.batch, args.grid
    N, S = G * G, 16 * G
    img_shape = (3, S, S)
    gen = torch.Generator().manual_seed(0)
    np.random.seed(0)
    print(
        f'# {B} masks on a {G}x{G} token grid ({S} px, patch 16) vs {B} timm CutMix boxes (elem mode), '
        f'CPU ({platform.processor() or platform.machine()}), torch {torch.__version__}, numpy {np.__version__}, '
        f'{torch.get_num_threads()} threads, median of {args.repeats}'
    )
    print('| sampler (batch of %d) | timm CutMix ms | tokenaug TokenMix block ms | ratio |' % B)
    print('|---|---|---|---|')

    k_half = torch.full((B,), round(0.5 * N), dtype=torch.long)

    def timm_boxes_half():
        for _ in range(B):
            cutmix_bbox_and_lam(img_shape, 0.5, correct_lam=True)

    compare('λ = 0.5', lambda: tokenmix_masks((G, G), k_half, gen), timm_boxes_half, args.repeats)

    def ours_beta():
        lam = sample_beta(1.0, B, gen)
        tokenmix_masks((G, G), torch.round((1.0 - lam) * N).long(), gen)

    def timm_beta():
        lam = np.random.beta(1.0, 1.0, size=B)
        for i in range(B):
            cutmix_bbox_and_lam(img_shape, lam[i], correct_lam=True)

    compare('λ ~ Beta(1, 1)', ours_beta, timm_beta, args.repeats)

    sampler = MixSampler('tokenmix_block', mixup_alpha=0.0, cutmix_alpha=1.0, mode='elem', patch_size=16)
    mixup = Mixup(mixup_alpha=0.0, cutmix_alpha=1.0, mode='elem', num_classes=1000)

    def timm_elem():  # the drawing part of Mixup._mix_elem, without the pixel copy
        lam_batch, use_cutmix = mixup._params_per_elem(B)
        for i in range(B):
            if lam_batch[i] != 1.0 and use_cutmix[i]:
                _, lam_batch[i] = cutmix_bbox_and_lam(img_shape, lam_batch[i], correct_lam=True)
        return torch.tensor(lam_batch).unsqueeze(1)

    compare(
        'full elem-mode draw, α = 1 (MixSampler.sample vs _params_per_elem + boxes)',
        lambda: sampler.sample(B, S, gen),
        timm_elem,
        args.repeats,
    )


if __name__ == '__main__':
    main()
