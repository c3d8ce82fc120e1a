#!/usr/bin/env python3
"""TL-Align's readings the paper leaves open, measured: how far the aligned targets move on the world when one rule
is read another way, and whether the moved targets follow the image better or worse.

Table 9 says a convolution mixes labels by ``Norm(T(K))`` but not how one label map stands for a kernel's many
channels, nor what an SE gate or PoolFormer's ``pool(x) − x`` is. We chose; each row here swaps one choice for
the alternative, on the model family where it matters, with the rest of the label path unchanged:

- depthwise stencil (ConvNeXt-Atto): ours ``mean_c |K_c|`` (each channel by its kernel's size), the alternative
  ``mean_c Norm(|K_c|)`` (every channel's stencil counts alike);
- dense-conv channel reduction (ResNet-18): ours ``mean_{o,i} |K_oi|``, the alternative
  ``mean_o Norm(Σ_i |K_oi|)`` (every output channel alike);
- PoolFormer's token mixer (PoolFormer-S12): ours the pool alone, the alternative ``Norm(|P − I|)`` (the ``− x``
  counted: half the token's own label, half its neighbours' mean);
- SE gates (SE-ResNet-18): ours channel mixing (labels unchanged), the alternative a spatial aggregation (the gate
  reads every position: after each gated branch ``Y ← Norm(Y + mean Y)``).

For each model, randomly initialised and after ``--epochs`` of CutMix training on the world: over CutMix pairs of
the world's val images (the box on the model's 4-px label grid), the mean and largest absolute difference of the
partner share between the two readings; how far our reading moves the share from the box's area (TL-Align's own
effect, for scale); and each reading's mean absolute error against the truth from the world's label maps (as
``bench/label_fidelity.py``: of the two objects' pixels on show, the partner's fraction).

    .venv/bin/python bench/tl_align_readings.py --out /tmp/readings [--epochs 6] [--pairs 400]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import timm
import torch
import torch.nn.functional as F
from timm.data import resolve_data_config

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / 'bench'))

from label_fidelity import cutmix_with_truth, load  # noqa: E402

import shared_core.tl_align as rules  # noqa: E402
import timm_plugin.tl_align.graph as graph  # noqa: E402
from shared_core.tools.world import generate_world  # noqa: E402
from timm_plugin.tl_align import TLAlign  # noqa: E402
from timm_plugin.tl_align.cnn import ResNetTracer  # noqa: E402
from timm_plugin.tl_align.metaformer import MetaFormerTracer, Pooling  # noqa: E402


def channel_normalised_stencil(weight: torch.Tensor) -> torch.Tensor:
    """``mean_o Norm(Σ_i |K_oi|)``: each output channel's stencil summed over its inputs, normalised to sum 1, then
    averaged (a depthwise conv: ``mean_c Norm(|K_c|)``)."""
    s = weight.detach().float().abs().sum(1)  # (O, k, k)
    return (s / s.sum((1, 2), keepdim=True).clamp_min(torch.finfo(s.dtype).tiny)).mean(0)


@contextlib.contextmanager
def stencil_reading(fn):
    """Every conv label rule (the family tracers' ``conv_labels``, the graph route's convs) reads ``fn``'s stencil."""
    saved = rules.kernel_stencil, graph.kernel_stencil
    rules.kernel_stencil = graph.kernel_stencil = fn
    try:
        yield
    finally:
        rules.kernel_stencil, graph.kernel_stencil = saved


class PoolMinusIdentity(MetaFormerTracer):
    """PoolFormer's ``pool(x) − x`` as ``Norm(|P − I|)``: with ``n`` in-grid cells in a window, the row of ``P − I``
    is ``1/n`` off the centre and ``1/n − 1`` at it; normalised, the token keeps half its label and takes half the
    mean of its ``n − 1`` neighbours."""

    def branch(self, blk, cap, Y):
        mixer = blk.token_mixer
        if type(mixer) is not Pooling:
            return super().branch(blk, cap, Y)
        p = mixer.pool
        pooled = rules.conv_pool_labels(Y, p.kernel_size, p.stride, p.padding)
        ones = Y.new_ones(1, 1, *Y.shape[-2:])
        k = p.kernel_size if isinstance(p.kernel_size, int) else p.kernel_size[0]
        n = F.avg_pool2d(ones, k, p.stride, p.padding, count_include_pad=True) * (k * k)  # in-grid cells
        return Y / 2 + (n * pooled - Y) / (2 * (n - 1))


class SpatialSE(ResNetTracer):
    """An SE gate read as a spatial aggregation: after each gated branch, ``Y ← Norm(Y + mean Y)`` (its mean over
    the map, which the gate reads)."""

    def branch(self, blk, cap, Y):
        Y = super().branch(blk, cap, Y)
        if getattr(blk, 'se', None) is not None and not isinstance(blk.se, torch.nn.Identity):
            Y = (Y + Y.mean((2, 3), keepdim=True)) / 2
        return Y


#: (row, model, our reading, the alternative, how to read the alternative)
READINGS = [
    ('depthwise stencil', 'convnext_atto', 'mean_c \\|K_c\\|', 'mean_c Norm(\\|K_c\\|)', 'stencil'),
    ('dense-conv channel reduction', 'resnet18', 'mean_oi \\|K_oi\\|', 'mean_o Norm(Σ_i \\|K_oi\\|)', 'stencil'),
    ("PoolFormer's pool(x) − x", 'poolformer_s12', 'the pool alone', 'Norm(\\|P − I\\|)', PoolMinusIdentity),
    ('SE gate', 'seresnet18', 'channel mixing (Y ← Y)', 'spatial aggregation (Y ← Norm(Y + mean Y))', SpatialSE),
]


def shares(model, alt, inp, target, partner_labels):
    """The partner share of the aligned target under our reading and under the alternative."""
    ours = TLAlign(model).eval()
    other = TLAlign(model).eval()
    if alt == 'stencil':
        context = stencil_reading(channel_normalised_stencil)
    else:
        other.tracer = alt(model)
        context = contextlib.nullcontext()
    with torch.no_grad():
        a = ours(inp, target)[1].gather(1, partner_labels[:, None])[:, 0]
        with context:
            b = other(inp, target)[1].gather(1, partner_labels[:, None])[:, 0]
    return a, b


def train(world: Path, out: Path, model: str, epochs: int) -> Path:
    """``tokenaug-train`` with CutMix on the world (the world ViT config's schedule); the last checkpoint."""
    from timm_plugin.train import run

    run(
        ['-c', str(REPO / 'configs' / 'timm' / 'world_vit-tiny.yaml'), '--data-dir', str(world / 'imagenet')]
        + ['--model', model, '--model-kwargs', '--mixup', '0', '--cutmix', '1.0', '--epochs', str(epochs)]
        + ['--warmup-epochs', '0', '--workers', '0', '--output', str(out), '--experiment', model]
    )
    return out / model / 'last.pth.tar'


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--out', type=Path, required=True, help='the world and the trainings go here')
    p.add_argument('--epochs', type=int, default=6)
    p.add_argument('--pairs', type=int, default=400)
    p.add_argument('--train-per-class', type=int, default=40)
    p.add_argument('--seed', type=int, default=0)
    args = p.parse_args()
    world = args.out / 'world'
    generate_world(
        world, seed=args.seed, num_classes=10, image_size=112, train_per_class=args.train_per_class,
        val_per_class=args.pairs // 10, formats=('imagenet', 'ade20k'),
    )  # fmt: skip
    classes = sorted(d.name for d in (world / 'imagenet' / 'val').iterdir() if d.is_dir())
    x, y, maps = load(world, 'val', classes)
    g = torch.Generator().manual_seed(args.seed)
    n = 2 * (len(x) // 2)
    x, y, maps = x[:n], y[:n], maps[:n]
    xm, target, truth, area, valid = cutmix_with_truth(x, y, maps, len(classes), 4, g)
    mix = target.mix
    truth, area = truth[valid], area[valid]
    print(
        f'# {int(valid.sum())} CutMix pairs of val images with two classes and an object on show (world at {world}, '
        f'4-px label grid); models randomly initialised (seed 0) and after {args.epochs} epochs of CutMix training; '
        f"the box's area (CutMix's share) is {float((area - truth).abs().mean()):.4f} from the truth"
    )
    print(
        '| reading | model | weights | ours | alternative | mean abs. change of the share (max) | ours: mean abs. '
        'move from the area | abs. error vs truth: ours / alternative |'
    )
    print('|---|---|---|---|---|---|---|---|')
    for row, name, ours_text, alt_text, alt in READINGS:
        for weights in ('random init', f'{args.epochs} epochs'):
            torch.manual_seed(0)
            model = timm.create_model(name, num_classes=len(classes))
            if weights != 'random init':
                state = torch.load(train(world, args.out / 'runs', name, args.epochs), weights_only=True)
                model.load_state_dict(state.get('state_dict', state))
            cfg = resolve_data_config({}, model=model)
            mean, std = torch.tensor(cfg['mean'])[:, None, None], torch.tensor(cfg['std'])[:, None, None]
            a, b = shares(model.eval(), alt, (xm - mean) / std, target, y[mix.partner])
            a, b = a[valid], b[valid]
            d = (a - b).abs()
            moved, err_a, err_b = ((v - w).abs().mean() for v, w in ((a, area), (a, truth), (b, truth)))
            print(
                f'| {row} | {name} | {weights} | {ours_text} | {alt_text} | {float(d.mean()):.4f} '
                f'({float(d.max()):.4f}) | {float(moved):.4f} | {float(err_a):.4f} / {float(err_b):.4f} |',
                flush=True,
            )


if __name__ == '__main__':
    main()
