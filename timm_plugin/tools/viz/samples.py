"""The helpers of the ``tokenaug-viz`` commands: the training split and a mixed batch as ``tokenaug-train``
builds them, class names, the branch of the MixUp/CutMix switch a sample took."""

from __future__ import annotations

import argparse
import random

import numpy as np
import torch

__all__ = [
    'seed_all',
    'check_count',
    'training_split',
    'mixed_batch',
    'class_names_of',
    'top_classes',
    'branch',
    'pin_branch',
    'drawn',
]


def seed_all(seed: int) -> None:
    """Every random stream the training transforms draw from: Python's (crops, RandAugment magnitudes), numpy's
    (timm's RandAugment picks its ops with ``np.random.choice``) and torch's (flips, erasing, mixing)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def check_count(count: int) -> int:
    if count < 2 or count % 2:
        raise ValueError(f'--count: expected an even number >= 2 (mixing pairs samples), got {count}')
    return count


def training_split(args, data_config: dict, use_prefetcher: bool = False):
    """The training split with ``tokenaug-train``'s training transform (uint8 images with ``use_prefetcher``, as
    its prefetcher loader; else normalised tensors)."""
    from timm.data import create_dataset

    from timm_plugin.train_data import training_transform

    data_dir = args.data_dir or args.data
    if not data_dir:
        raise ValueError('--data-dir is required (the training split is drawn from)')
    dataset = create_dataset(
        args.dataset,
        root=data_dir,
        split=args.train_split,
        is_training=True,
        class_map=args.class_map,
        input_img_mode=args.input_img_mode or ('RGB' if data_config['input_size'][0] == 3 else 'L'),
        download=args.dataset_download,
    )
    return dataset, training_transform(args, data_config, use_prefetcher)


def mixed_batch(args, count: int):
    """What ``tokenaug-train`` would mix from these flags: ``(model, data_config, dataset, indices, x, y, xm,
    target, method, mix_kind, mixer kwargs)`` for ``count`` samples of the training split."""
    from timm.data import resolve_data_config

    from timm_plugin.recipe import build_training, uses_token_labeling
    from timm_plugin.train_data import map_dataset
    from tokenaug.train_args import check_supported

    check_supported(args)
    if uses_token_labeling(args):
        raise ValueError('--mixup-type mixtoken / --token-label-dir: token labeling mixes inside the model')
    seed_all(args.viz_seed)
    recipe = build_training(args)  # what tokenaug-train builds from the same flags
    if recipe.mixing is None:
        raise ValueError('nothing mixes: set --mixup and/or --cutmix > 0 (as for tokenaug-train)')
    model, method, mix_kind, kwargs = recipe.model, recipe.method, recipe.mix_kind, recipe.mixing
    data_config = resolve_data_config(vars(args), model=model)
    dataset, transform = training_split(args, data_config)
    base = dataset
    dataset, store = map_dataset(args, dataset)  # as tokenaug-train: the samples carry their teacher map rows
    dataset.transform = transform
    if len(dataset) < count:
        raise ValueError(f'--count: {count} samples asked, the training split has {len(dataset)}')
    indices = sorted(random.Random(args.viz_seed).sample(range(len(dataset)), count))
    samples = [dataset[i] for i in indices]
    if store is not None:
        from timm_plugin.token_label_data import TokenLabelCollate

        x, y = TokenLabelCollate(args.num_classes)(samples)
        dataset = base
    else:
        x = torch.stack([s[0] for s in samples])
        y = torch.as_tensor([int(s[1]) for s in samples])
    mixer = recipe.mixer(carry_mix=True, generator=torch.Generator().manual_seed(args.viz_seed))
    xm, target = mixer(x, y)
    return model, data_config, dataset, indices, x, y, xm, target, method, mix_kind, kwargs


def class_names_of(dataset, num_classes):
    from timm_plugin.image_data import class_names

    return class_names(dataset) or [str(i) for i in range(num_classes)]


def top_classes(soft, names, k=2):
    top = soft.topk(min(k, soft.shape[-1]))
    return ', '.join(f'{names[int(c)]} {float(v):.2f}' for v, c in zip(top.values, top.indices))


def branch(m, i: int, mix_kind: str) -> str:
    """What the sampler drew for sample ``i``: ``'unmixed'`` (λ = 1), ``'mixup'`` (a blend: no box, the same partner
    share on every token: the MixUp branch of a MixUp/CutMix switch), else the mixing kind asked for."""
    lam = float(m.lam[i])
    if lam >= 1.0:
        return 'unmixed'
    boxed = m.boxes is not None and (m.box_valid is None or bool(m.box_valid[i]))
    share = m.token_share[i]
    if not boxed and mix_kind != 'mixup' and bool(torch.allclose(share, torch.full_like(share, 1.0 - lam))):
        return 'mixup'
    return mix_kind


#: label states per row of ``tl_align_blocks.png`` (``--per-block``)


def pin_branch(args: argparse.Namespace) -> None:
    """Make the mixer draw ``args.branch`` of the MixUp/CutMix switch (``'switch'``: as configured)."""
    cut = args.cutmix > 0 or args.cutmix_minmax is not None
    if args.branch == 'cut':
        if not cut or args.mixup_type == 'mixup':
            raise ValueError(
                f'--branch cut: --mixup-type {args.mixup_type} with --cutmix {args.cutmix} has no cut branch; '
                'set --cutmix > 0 (and a kind with boxes or masks) or pass --branch mixup'
            )
        args.mixup_switch_prob = 1.0
    elif args.branch == 'mixup':
        if args.mixup <= 0:
            raise ValueError(f'--branch mixup: --mixup {args.mixup} draws no blend; set --mixup > 0')
        args.mixup_switch_prob = 0.0


def drawn(branches: list[str]) -> str:
    """``'cutmix for 8 of 8'``, ``'mixup for 3, cutmix for 5 of 8'``: the branches a draw took."""
    counts = ', '.join(f'{b} for {branches.count(b)}' for b in sorted(set(branches)))
    return f'{counts} of {len(branches)}'
