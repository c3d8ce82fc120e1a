#!/usr/bin/env python3
"""Do the mixed targets follow the image? CutMix pairs of the world's val images, each pair's partner share
measured three ways against the truth the world knows (its ADE20K label maps), and (``--htm-layer``) TokenMixup
HTM's token swaps and labels on the same images:

- truth: of the pixels of the two labelled objects that the mixed image shows (the sample's own object outside
  the box, the partner's object inside it), the partner's fraction;
- area: the box's area (CutMix's target);
- TL-Align and TransMix: the share in the target each method builds from a model (a study checkpoint, or a
  randomly initialised model).

Prints the mean absolute error of each against the truth and their correlation with it. The multi-seed study
(``bench/study.py``) uses it to check, beside accuracy, that the aligned targets follow their images.

    .venv/bin/python bench/label_fidelity.py --world study_out/world \
        --checkpoint study_out/runs/tl_align/seed0/last.pth.tar
        [--model-kwargs img_size=112 depth=6 embed_dim=96 num_heads=3] [--pairs 500]

The world needs its ``ade20k`` layout (``tokenaug-data --formats imagenet,ade20k`` with the study's arguments;
the same scenes and ids as its ``imagenet`` layout).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import timm
import torch
from PIL import Image
from timm.data import resolve_data_config

from timm_plugin import create_mixer
from timm_plugin.tl_align import TLAlign, TransMix


def load(world: Path, split: str, classes: list[str]):
    """Val images (float, 0..1, CHW), their labels and their label maps (0 background, k + 1 class k)."""
    ade = {'val': 'validation', 'train': 'training'}[split]
    xs, ys, maps = [], [], []
    for k, name in enumerate(classes):
        for path in sorted((world / 'imagenet' / split / name).glob('*.jpg')):
            xs.append(np.asarray(Image.open(path).convert('RGB'), np.float32) / 255)
            maps.append(np.asarray(Image.open(world / 'ade20k' / 'annotations' / ade / f'{path.stem}.png')))
            ys.append(k)
    x = torch.from_numpy(np.stack(xs)).permute(0, 3, 1, 2)
    return x, torch.tensor(ys), torch.from_numpy(np.stack(maps).astype(np.int64))


def cutmix_with_truth(x, y, maps, num_classes: int, patch_size: int, generator):
    """CutMix on ``x`` (the box on a ``patch_size`` grid) and what the label maps say of each pair: ``(mixed
    images, target, truth, area, valid)``. Truth: of the two labelled objects' pixels the mixed image shows (the
    sample's own outside the box, the partner's inside it), the partner's fraction; area: the box's; valid: the
    pairs with two classes and some object on show."""
    mixer = create_mixer(
        'cutmix', mixup_alpha=0.0, cutmix_alpha=1.0, mode='elem', label_smoothing=0.0, num_classes=num_classes,
        patch_size=patch_size, carry_mix=True, generator=generator,
    )  # fmt: skip
    xm, target = mixer(x, y)
    mix = target.mix
    inside = mix.pixel_share()[:, 0] > 0.5  # (B, H, W) partner pixels
    own = (maps == (y + 1)[:, None, None]) & ~inside
    partner = (maps[mix.partner] == (y[mix.partner] + 1)[:, None, None]) & inside
    shown = own.sum((1, 2)) + partner.sum((1, 2))
    valid = (shown > 0) & (y != y[mix.partner])  # two classes, some object on show
    truth = partner.sum((1, 2)).float() / shown.clamp_min(1)
    return xm, target, truth, inside.float().mean((1, 2)), valid


def load_model(args, kwargs: dict, num_classes: int, ckpt):
    """The model, randomly initialised (seed 0) or from a timm checkpoint; an HTM run's ScoreNet is left out."""
    torch.manual_seed(0)
    model = timm.create_model(args.model, num_classes=num_classes, **kwargs)
    if ckpt is not None:
        state = torch.load(ckpt, map_location='cpu', weights_only=True)
        state = state.get('state_dict', state)
        model.load_state_dict({k: v for k, v in state.items() if not k.startswith('tokenmixup_scorenet.')})
    return model


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--world', type=Path, required=True)
    p.add_argument('--split', default='val', choices=['val', 'train'])
    p.add_argument('--checkpoint', type=Path, nargs='*', default=[], help='timm checkpoints (state_dict)')
    p.add_argument('--model', default='vit_tiny_patch16_224')
    p.add_argument('--model-kwargs', nargs='*', default=['img_size=112', 'depth=6', 'embed_dim=96', 'num_heads=3'])
    p.add_argument('--pairs', type=int, default=500)
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--htm-layer', type=int, default=None, help='also score HTM at this block (TokenMixup)')
    p.add_argument('--htm-rho', type=float, default=0.005, help="HTM's ρ")
    args = p.parse_args()
    classes = sorted(d.name for d in (args.world / 'imagenet' / args.split).iterdir() if d.is_dir())
    x, y, maps = load(args.world, args.split, classes)
    g = torch.Generator().manual_seed(args.seed)
    idx = torch.randperm(len(x), generator=g)[: 2 * (min(args.pairs, len(x)) // 2)]
    x, y, maps = x[idx], y[idx], maps[idx]
    kwargs = dict(kv.split('=', 1) for kv in args.model_kwargs)
    kwargs = {k: int(v) if v.lstrip('-').isdigit() else v for k, v in kwargs.items()}
    xm, target, truth, area, valid = cutmix_with_truth(x, y, maps, len(classes), 16, g)
    mix = target.mix
    rows = [('area (CutMix)', area)]
    models = [('random init', None)] + [(str(c), c) for c in args.checkpoint]
    for name, ckpt in models:
        model = load_model(args, kwargs, len(classes), ckpt)
        model.eval()
        cfg = resolve_data_config({}, model=model)
        mean, std = torch.tensor(cfg['mean'])[:, None, None], torch.tensor(cfg['std'])[:, None, None]
        inp = (xm - mean) / std
        with torch.no_grad():
            for method, cls in (('TL-Align', TLAlign), ('TransMix', TransMix)):
                _, t = cls(model).eval()(inp, target)
                share = t.gather(1, y[mix.partner][:, None])[:, 0]  # smoothing 0: the partner's mass
                rows.append((f'{method}, {name}', share))
    print(
        f'# {int(valid.sum())} CutMix pairs of {args.split} images with two classes and an object on show '
        f'({args.world}); partner share vs the truth from the label maps'
    )
    print('| partner share from | mean abs. error vs truth | correlation with truth | mean share |')
    print('|---|---|---|---|')
    t = truth[valid]
    for name, s in rows:
        s = s[valid].float()
        corr = float(torch.corrcoef(torch.stack([s, t]))[0, 1])
        print(f'| {name} | {float((s - t).abs().mean()):.3f} | {corr:.3f} | {float(s.mean()):.3f} |')
    print(f'| (truth) | 0 | 1 | {float(t.mean()):.3f} |')
    if args.htm_layer is not None:
        htm_fidelity(args, x, y, maps, kwargs, len(classes))


def htm_fidelity(args, x, y, maps, kwargs, num_classes):
    """TokenMixup's HTM on the clean val images (every sample easy: τ = inf, so the plan alone is scored): its
    swap decides which 16x16 patches of sample i show the partner's object at block ``--htm-layer``. Truth: of
    the object pixels on show (i's own in the kept patches, the partner's in the swapped ones), the partner's
    fraction; against it HTM's label (1 - λ, from saliency, Eq. 11) and the swapped-token count (the paper's
    Table 4 ablation). Also where the saliency looks: its mean on a sample's object patches over its mean on the
    others (1: blind to the object)."""
    from timm_plugin import TokenMixup

    ps = 16
    own_obj = (maps == (y + 1)[:, None, None]).float()  # (B, H, W)
    obj_tokens = torch.nn.functional.avg_pool2d(own_obj[:, None], ps).flatten(1)  # (B, N) object share per patch
    print()
    print(
        f'# HTM at block {args.htm_layer} (ρ {args.htm_rho:g}, every sample easy) on {len(y)} clean {args.split} '
        'images: partner share vs the truth from the label maps, over the mixed pairs with two classes'
    )
    print(
        '| checkpoint | pairs | truth mean | 1 - λ (saliency): abs. error / corr. | swapped count: abs. error / corr. '
        '| saliency on object / elsewhere |'
    )
    print('|---|---|---|---|---|---|')
    for ckpt in [None] + list(args.checkpoint):
        model = load_model(args, kwargs, num_classes, ckpt)
        tm = TokenMixup(model, htm_layers=(args.htm_layer,), tau=float('inf'), rho=args.htm_rho)
        cfg = resolve_data_config({}, model=model)
        mean, std = torch.tensor(cfg['mean'])[:, None, None], torch.tensor(cfg['std'])[:, None, None]
        tm.hooks.record = {}
        tm.train()
        with torch.no_grad():
            _, target = tm((x - mean) / std, torch.nn.functional.one_hot(y, num_classes).float())
        mix = target.mixes[0]
        S = tm.hooks.record[args.htm_layer]['saliency']  # (B, N)
        swap = mix.token_share.flatten(1) > 0.5
        partner = mix.partner
        n_pix = ps * ps
        kept_own = (obj_tokens * ~swap).sum(1) * n_pix
        given = (obj_tokens[partner] * swap).sum(1) * n_pix
        shown = kept_own + given
        valid = swap.any(1) & (shown > 0) & (y != y[partner])
        name = 'random init' if ckpt is None else str(ckpt)
        if not bool(valid.any()):  # an untrained model's saliency is flat: no token clears the margin ρ
            print(f'| {name} | 0 | - | - | - | - |')
            continue
        truth = (given / shown.clamp_min(1))[valid]
        cells = []
        for share in (1 - mix.lam, swap.float().mean(1)):
            s = share[valid].float()
            corr = float(torch.corrcoef(torch.stack([s, truth]))[0, 1])
            cells.append(f'{float((s - truth).abs().mean()):.3f} / {corr:.3f}')
        on = obj_tokens > 0.5
        ratio = (S * on).sum(1) / on.sum(1).clamp_min(1) / ((S * ~on).sum(1) / (~on).sum(1).clamp_min(1))
        ratio = float(ratio[on.any(1) & (~on).any(1)].mean())
        print(f'| {name} | {int(valid.sum())} | {float(truth.mean()):.3f} | {cells[0]} | {cells[1]} | {ratio:.2f} |')


if __name__ == '__main__':
    main()
