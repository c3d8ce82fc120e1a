"""A device-independent proxy for the launch-bound cost of each method: the number of aten ops dispatched by
one training step (forward, loss, backward; the optimizer is the same for all and left out), counted with a
``TorchDispatchMode``, for the plain step and each method on the same model and batch.

On a GPU the eager step of a small ViT is bound by kernel launches, so extra ops are extra wall time whatever
their size; on this CPU-only machine the counts show progress that step timings (which swing by ±20 % from
pair to pair here) cannot. Counts are exact and do not depend on the device's speed.

    .venv/bin/python bench/bench_ops.py [--model deit_tiny_patch16_224] [--batch 8] [--top 12]
"""

from __future__ import annotations

import argparse

import timm
import torch
import torch.nn.functional as F
from common import OpCounter
from timm.loss import SoftTargetCrossEntropy

from shared_core.token_labeling import token_labeling_loss
from timm_plugin import create_mixer
from timm_plugin.tl_align import TLAlign, TransMix
from timm_plugin.token_label_data import TokenLabelTarget
from timm_plugin.token_labeling import TokenLabeling, TokenLabelingLoss, attach_aux_head
from timm_plugin.tokenmixup import TokenMixup


def count_step(loss_fn, *models) -> OpCounter:
    """The aten ops of ``loss_fn().backward()`` (all, and the computing ones), from gradients set to None (as a
    step after ``zero_grad(set_to_none=True)``: the backward stores each gradient instead of accumulating it)."""
    for m in models:
        m.zero_grad(set_to_none=True)
    with OpCounter() as counter:
        loss_fn().backward()
    return counter


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--model', default='deit_tiny_patch16_224')
    p.add_argument('--batch', type=int, default=8)
    p.add_argument('--top', type=int, default=12, help='list the ops TL-Align adds most of (by name)')
    args = p.parse_args()
    torch.manual_seed(0)
    C = 1000
    model = timm.create_model(args.model, num_classes=C).train()
    depth = len(model.blocks)
    x = torch.randn(args.batch, 3, 224, 224)
    y = torch.randint(0, C, (args.batch,))
    mixer = create_mixer('cutmix', mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=C, patch_size=16, carry_mix=True)
    xm, target = mixer(x, y)
    soft_ce = SoftTargetCrossEntropy()

    # token labeling: an aux head on a copy of the model, sparse map rows (k = 5 of 14x14) as the store gives
    tl_model = attach_aux_head(timm.create_model(args.model, num_classes=C)).train()
    tl_model.load_state_dict(model.state_dict(), strict=False)
    k = 5
    tl_target = TokenLabelTarget.wrap(
        y,
        torch.rand(args.batch, k, 14, 14).softmax(1).half(),
        torch.randint(0, C, (args.batch, k, 14, 14)),
        torch.tensor([[0.1, 0.1, 0.9, 0.9]]).repeat(args.batch, 1),
        torch.zeros(args.batch, dtype=torch.bool),
        C,
    )
    tl_loss = TokenLabelingLoss(C)
    steps = {
        'plain (CutMix batch, area target)': lambda: soft_ce(model(xm), target),
        'TL-Align (CutMix; shared fused attention, the default on every device)': lambda w=TLAlign(model): soft_ce(
            *w(xm, target)
        ),
        'TL-Align, shared attention materialised once (fused=False)': lambda w=TLAlign(model, fused=False): soft_ce(
            *w(xm, target)
        ),
        'TL-Align, attention recomputed (shared=False)': lambda w=TLAlign(model, shared=False): soft_ce(*w(xm, target)),
        'TransMix (CutMix)': lambda w=TransMix(model): soft_ce(*w(xm, target)),
        'plain CE, aux-head model (token labeling baseline)': lambda: F.cross_entropy(
            tl_model(x), y, label_smoothing=0.1
        ),
        'token labeling + MixToken': lambda w=TokenLabeling(tl_model): tl_loss(w(x), tl_target),
        'TokenMixup HTM (block 3)': lambda w=TokenMixup(model, htm_layers=(3,), tau=100.0): (
            lambda out: soft_ce(out[0], out[1]) + out[1].aux_loss
        )(w(xm, target)),
    }
    counters = {name: count_step(fn, model, tl_model) for name, fn in steps.items()}
    plain, aux = 'plain (CutMix batch, area target)', 'plain CE, aux-head model (token labeling baseline)'
    base = {name: aux if name in ('token labeling + MixToken', aux) else plain for name in counters}
    print(
        f'# aten ops per training step (forward + loss + backward), {args.model} ({depth} blocks), '
        f'batch {args.batch}, torch {torch.__version__}'
    )
    print('| step | aten ops | extra vs its baseline | extra per block | of them kernels (not views) | per block |')
    print('|---|---|---|---|---|---|')
    for name, c in counters.items():
        ref = counters[base[name]]
        extra = sum(c.counts.values()) - sum(ref.counts.values())
        kern = sum(c.kernels.values()) - sum(ref.kernels.values())
        total = sum(c.counts.values())
        print(f'| {name} | {total} | {extra:+d} | {extra / depth:+.1f} | {kern:+d} | {kern / depth:+.1f} |')
    fused = 'TL-Align (CutMix; shared fused attention, the default on every device)'
    a, b = counters[fused].counts, counters[plain].counts
    net = sorted(((a[n] - b[n], n) for n in set(a) | set(b) if a[n] != b[n]), key=lambda t: (-abs(t[0]), t[1]))
    print(f'\n{fused} vs plain, net change per op name over the step ({depth} blocks; * a view)')
    views = {n for n in set(a) | set(b) if n not in counters[fused].kernels and n not in counters[plain].kernels}
    for n, name in net[: args.top]:
        print(f'- {name}{" *" if name in views else ""}: {n:+d}')

    token_labeling_breakdown(tl_model, x, y, tl_target, tl_loss)


def token_labeling_breakdown(model, x, y, target, loss_fn) -> None:
    """Where token labeling + MixToken's extra ops go (issue 12, item 2): each phase of its step against the same
    phase of the plain cross-entropy step on the aux-head model."""
    from shared_core.token_labeling import draw_mixtoken

    def ops(fn):
        with OpCounter() as c:
            out = fn()
        return out, c

    def row(name, ours, plain=None):
        a, k = sum(ours.counts.values()), sum(ours.kernels.values())
        if plain is not None:
            a, k = a - sum(plain.counts.values()), k - sum(plain.kernels.values())
        print(f'| {name} | {a:+d} | {k:+d} |')

    wrapper = TokenLabeling(model)
    model.zero_grad(set_to_none=True)
    _, draw = ops(lambda: draw_mixtoken(wrapper.sampler, x.shape[0], tuple(x.shape[-2:]), x.device, None))
    out, fwd = ops(lambda: wrapper(x))
    logits, plain_fwd = ops(lambda: model(x))
    targets, tgt = ops(lambda: loss_fn.targets(out, target))
    loss, lss = ops(lambda: token_labeling_loss(out.cls, targets[0], out.aux, targets[1], loss_fn.dense_weight))
    ce, plain_loss = ops(lambda: F.cross_entropy(logits, y, label_smoothing=0.1))
    _, bwd = ops(loss.backward)
    model.zero_grad(set_to_none=True)
    _, plain_bwd = ops(ce.backward)
    print('\ntoken labeling + MixToken, extra aten ops per step by phase (vs the plain CE step of the same model)')
    print('| phase | aten ops | kernels (not views) |')
    print('|---|---|---|')
    row('MixToken box (host; part of the forward row)', draw)
    row('forward: MixToken hook, aux head, un-mixing', fwd, plain_fwd)
    row('targets: class target, sparse token targets', tgt)
    row('loss: class CE + dense sparse soft CE, vs CE', lss, plain_loss)
    row('backward', bwd, plain_bwd)


if __name__ == '__main__':
    main()
