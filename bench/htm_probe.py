#!/usr/bin/env python3
"""What HTM does on a trained model: which samples its difficulty test marks easy, and how much it mixes them.

Loads a checkpoint of ``bench/study.py`` (a run with ``--tokenmixup-htm-layers``, whose ScoreNet is in the
checkpoint; or any run of the same ViT, whose ScoreNet is then untrained) and, on one batch of training images
(centre crop, no augmentation), clean and MixUp/CutMix-mixed as the study trains (elem mode, so each row draws its
own mix):

- the quantiles of the ScoreNet's difficulty ``0.1 · CE`` at the HTM block, and of the final head's, against the
  (mixed, smoothed) target;
- the share of samples that each τ marks easy (easy: ``0.1 · CE <= τ``);
- for each (τ, ρ): the samples HTM mixes, the patch tokens swapped per mixed sample and its mean λ.

    .venv/bin/python bench/htm_probe.py --study study_out --run htm --seed 1
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--study', type=Path, required=True, help="bench/study.py's --out")
    p.add_argument('--run', default='htm', help='the run name (its checkpoint holds the ScoreNet)')
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--layer', type=int, default=2, help='the HTM block')
    p.add_argument('--images', type=int, default=300)
    p.add_argument('--taus', type=float, nargs='+', default=[0.1, 0.12, 0.15, 0.18, 0.2])
    p.add_argument('--settings', nargs='+', default=['0.2,0.005', '0.1,0.003'], help='τ,ρ pairs to plan with')
    args = p.parse_args(argv)

    import timm
    from timm.data import Mixup, create_dataset, create_loader

    from shared_core.tokenmixup import difficulty
    from timm_plugin import TokenMixup

    run_dir = args.study / 'runs' / args.run / f'seed{args.seed}'
    run_args = json.loads((run_dir / 'study_step.json').read_text())['cmd']
    kwargs = run_args[run_args.index('--model-kwargs') + 1 :]
    kwargs = dict(kv.split('=') for kv in kwargs[: next(i for i, a in enumerate(kwargs) if a.startswith('--'))])
    model_kwargs = {k: int(v) for k, v in kwargs.items()}
    size = model_kwargs['img_size']
    world = Path(run_args[run_args.index('--data-dir') + 1])

    torch.manual_seed(0)
    ds = create_dataset('', root=str(world), split='train')
    loader = create_loader(
        ds,
        input_size=(3, size, size),
        batch_size=args.images,
        is_training=False,
        mean=(0.5,) * 3,
        std=(0.5,) * 3,
        crop_pct=0.9,
        num_workers=0,
        use_prefetcher=False,
    )
    x, y = next(iter(loader))
    C = len(ds.reader.class_to_idx)
    mixer = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, mode='elem', label_smoothing=0.1, num_classes=C)
    batches = {'clean': (x, torch.nn.functional.one_hot(y, C).float() * 0.9 + 0.1 / C), 'mixed': mixer(x.clone(), y)}

    model = timm.create_model('vit_tiny_patch16_224', num_classes=C, **model_kwargs)
    tm = TokenMixup(model, htm_layers=(args.layer,))
    state = torch.load(run_dir / 'last.pth.tar', map_location='cpu', weights_only=True)['state_dict']
    missing = model.load_state_dict(state, strict=False).missing_keys
    print(f'# {run_dir}: {len(y)} training images at {size} px, HTM block {args.layer}', end='')
    print(' (ScoreNet untrained: not in the checkpoint)' if missing else '')
    q = torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9])
    feats = {}
    handle = model.blocks[args.layer].register_forward_pre_hook(lambda m, a: feats.__setitem__('x', a[0]))
    model.eval()
    print(
        '| batch | ScoreNet 0.1·CE quantiles 10/25/50/75/90 % | final head 0.1·CE quantiles | '
        + ' | '.join(f'easy at τ {t:g}' for t in args.taus)
        + ' |'
    )
    print('|---|---|---|' + '---|' * len(args.taus))
    for name, (xb, yb) in batches.items():
        with torch.no_grad():
            out = model(xb)
            d = difficulty(model.tokenmixup_scorenet[str(args.layer)](feats['x']), yb)
            final = difficulty(out, yb)
        cells = [' / '.join(f'{v:.3f}' for v in t.quantile(q).tolist()) for t in (d, final)]
        easy = [f'{float((d <= t).float().mean()):.2f}' for t in args.taus]
        print(f'| {name} | ' + ' | '.join(cells + easy) + ' |')
    handle.remove()

    print()
    print('| batch | τ | ρ | samples mixed | tokens swapped per mixed sample | mean λ of the mixed |')
    print('|---|---|---|---|---|---|')
    tm.train()
    for setting in args.settings:
        tau, rho = map(float, setting.split(','))
        tm.hooks.tau, tm.hooks.rho = tau, rho
        for name, (xb, yb) in batches.items():
            with torch.no_grad():
                _, target = tm(xb, yb)
            stats, mix = target.stats[f'htm{args.layer}'], target.mixes[0]
            mixed = mix.token_share.flatten(1).sum(1) > 0
            lam = f'{float(mix.lam[mixed].mean()):.3f}' if bool(mixed.any()) else '-'
            share = stats['mixed'] / len(yb)
            print(f'| {name} | {tau:g} | {rho:g} | {share:.2f} | {stats["swapped"]:.1f} of {mix.num_tokens} | {lam} |')


if __name__ == '__main__':
    main()
