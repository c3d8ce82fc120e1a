"""A device-independent proxy for the launch-bound cost of each method: the number of aten ops dispatched by
one training step (forward, loss, backward; the optimizer is the same for all and left out), counted with a
``TorchDispatchMode``, for the plain step and each method on the same model and batch.

On a GPU the eager step of a small ViT is bound by kernel launches, so extra ops are extra wall time whatever
their size; on this CPU-only machine the counts show progress that step timings (which swing by ±20 % from
pair to pair here) cannot. Counts are exact and do not depend on the device's speed.

Each method's extra ops are split into what one more block adds (the same model with 4 and 5 blocks, each step
against its baseline's) and the per-step work that does not grow with depth (building the label state, the target).

    .venv/bin/python bench/bench_ops.py [--model deit_tiny_patch16_224] [--batch 8] [--top 12]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from typing import Dict

import timm
import torch
import torch.nn.functional as F
from common import OpCounter, interleaved_times, pair_ratios
from timm.loss import SoftTargetCrossEntropy

import shared_core.label_attention as label_attention
from shared_core.label_maps import CropMaps
from shared_core.token_labeling import token_labeling_loss
from timm_plugin import create_mixer
from timm_plugin.tl_align import TLAlign, TransMix
from timm_plugin.token_grid import token_labeling_stride
from timm_plugin.token_label_data import TokenLabelTarget
from timm_plugin.token_labeling import TokenLabeling, TokenLabelingLoss, attach_aux_head
from timm_plugin.tokenmixup import TokenMixup


def count_step(loss_fn, *models) -> OpCounter:
    """The aten ops of ``loss_fn().backward()`` (all, and the computing ones), from gradients set to None (as a
    step after ``zero_grad(set_to_none=True)``: the backward stores each gradient instead of accumulating it), in
    the steady state: after one uncounted step (which builds what is made once, e.g. the targets' constants)."""
    for counted in (False, True):
        for m in models:
            m.zero_grad(set_to_none=True)
        with OpCounter() if counted else contextlib.nullcontext() as counter:
            loss_fn().backward()
    return counter


PLAIN = 'plain (CutMix batch, area target)'
AUX = 'plain CE, aux-head model (token labeling baseline)'
TL_ALIGN = 'TL-Align (CutMix; shared fused attention, the default on every device)'
TOKEN_LABELING = 'token labeling + MixToken'
TOKEN_LABELING_LOADER = 'token labeling + MixToken, its token targets built by the loader (as tokenaug-train does)'
WIDE = 'TL-Align, the same with the wide call as accelerators run it (its backward at the wider head dim)'


def baseline(name: str) -> str:
    """The step a method's step is compared with: the plain CE step of the aux-head model for token labeling, the
    plain CutMix step for the others."""
    return AUX if name in (TOKEN_LABELING, TOKEN_LABELING_LOADER, AUX) else PLAIN


def wide_call(step):
    """``step()`` with TL-Align's shared attention on the plain wide ``scaled_dot_product_attention`` call, as on
    an accelerator or in a compiled graph (on the CPU in eager, the labels ride PyTorch's CPU kernel with the
    backward at the head dim, ``shared_core.label_attention._CPUSharedAttention``)."""
    flag = label_attention._CPU_FLASH
    label_attention._CPU_FLASH = False
    try:
        return step()
    finally:
        label_attention._CPU_FLASH = flag


def step_counts(model_name: str, x, y, xm, target, num_classes: int, **kwargs) -> Dict[str, OpCounter]:
    """The op counts of each method's step (and of its baseline) on ``timm.create_model(model_name, **kwargs)``."""
    steps, models = make_steps(model_name, x, y, xm, target, num_classes, **kwargs)
    return {name: count_step(fn, *models) for name, fn in steps.items()}


def make_steps(model_name: str, x, y, xm, target, num_classes: int, **kwargs):
    """``({name: loss function}, models)``: each method's training loss (and its baseline's) on
    ``timm.create_model(model_name, **kwargs)``, and the models whose gradients a step fills."""
    torch.manual_seed(0)
    model = timm.create_model(model_name, num_classes=num_classes, **kwargs).train()
    soft_ce = SoftTargetCrossEntropy()
    # token labeling: an aux head on a copy of the model, sparse map rows (k = 5 of 14x14) as the store gives
    tl_model = attach_aux_head(timm.create_model(model_name, num_classes=num_classes, **kwargs)).train()
    tl_model.load_state_dict(model.state_dict(), strict=False)
    tl_target, tl_loss = token_label_target(y, num_classes), TokenLabelingLoss(num_classes)
    # the same rows with their token targets built once, as TokenLabelCollate(label_stride=...) does in a worker
    sh, sw = token_labeling_stride(tl_model)
    grid = (x.shape[-2] // sh, x.shape[-1] // sw)
    tl_built = tl_target.with_token_targets(grid, tl_loss.smoothing)
    steps = {
        PLAIN: lambda: soft_ce(model(xm), target),
        TL_ALIGN: lambda w=TLAlign(model): soft_ce(*w(xm, target)),
        WIDE: lambda w=TLAlign(model): wide_call(lambda: soft_ce(*w(xm, target))),
        'TL-Align, shared attention materialised once (fused=False)': lambda w=TLAlign(model, fused=False): soft_ce(
            *w(xm, target)
        ),
        'TL-Align, attention recomputed (shared=False)': lambda w=TLAlign(model, shared=False): soft_ce(*w(xm, target)),
        'TransMix (CutMix)': lambda w=TransMix(model): soft_ce(*w(xm, target)),
        AUX: lambda: F.cross_entropy(tl_model(x), y, label_smoothing=0.1),
        TOKEN_LABELING: lambda w=TokenLabeling(tl_model): tl_loss(w(x), tl_target),
        TOKEN_LABELING_LOADER: lambda w=TokenLabeling(tl_model): tl_loss(w(x), tl_built),
        'TokenMixup HTM (block 3)': lambda w=TokenMixup(model, htm_layers=(3,), tau=100.0): (
            lambda out: soft_ce(out[0], out[1]) + out[1].aux_loss
        )(w(xm, target)),
    }
    return steps, (model, tl_model)


def token_label_target(y: torch.Tensor, num_classes: int, k: int = 5) -> TokenLabelTarget:
    """Sparse token-label rows (``k`` of 14x14) as the map store gives them."""
    B = y.shape[0]
    return TokenLabelTarget.of(
        y,
        CropMaps(
            torch.rand(B, k, 14, 14).softmax(1).half(),
            torch.randint(0, num_classes, (B, k, 14, 14)),
            num_classes,
            torch.tensor([[0.1, 0.1, 0.9, 0.9]]).repeat(B, 1),
            torch.zeros(B, dtype=torch.bool),
        ),
    )


def total(counter: OpCounter, kernels: bool = False) -> int:
    return sum((counter.kernels if kernels else counter.counts).values())


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--model', default='deit_tiny_patch16_224')
    p.add_argument('--batch', type=int, default=8)
    p.add_argument('--top', type=int, default=12, help='list the ops TL-Align adds most of (by name)')
    p.add_argument(
        '--host-rounds', type=int, default=100, help='rounds of the micro-model host-time table (0: skip it)'
    )
    args = p.parse_args()
    torch.manual_seed(0)
    C = 1000
    depth = len(timm.create_model(args.model, num_classes=C).blocks)
    x = torch.randn(args.batch, 3, 224, 224)
    y = torch.randint(0, C, (args.batch,))
    mixer = create_mixer('cutmix', mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=C, patch_size=16, carry_mix=True)
    xm, target = mixer(x, y)
    counters = step_counts(args.model, x, y, xm, target, C)
    # the same model with 4 and 5 blocks: what one more block adds (the per-block cost, without the per-step work)
    shallow, deeper = (step_counts(args.model, x, y, xm, target, C, depth=n) for n in (4, 5))
    base = {name: baseline(name) for name in counters}
    print(
        f'# aten ops per training step (forward + loss + backward), {args.model} ({depth} blocks), '
        f'batch {args.batch}, torch {torch.__version__}'
    )
    print(
        '| step | aten ops | extra vs its baseline | extra / blocks | of them kernels (not views) | kernels / blocks '
        '| one more block adds (ops, kernels) | per-step work (ops, kernels) |'
    )
    print('|---|---|---|---|---|---|---|---|')
    for name, c in counters.items():
        ref = counters[base[name]]
        extra, kern = total(c) - total(ref), total(c, True) - total(ref, True)
        block, block_k = (
            (total(deeper[name], k) - total(shallow[name], k))
            - (total(deeper[base[name]], k) - total(shallow[base[name]], k))
            for k in (False, True)
        )
        print(
            f'| {name} | {total(c)} | {extra:+d} | {extra / depth:+.1f} | {kern:+d} | {kern / depth:+.1f} '
            f'| {block:+d}, {block_k:+d} | {extra - depth * block:+d}, {kern - depth * block_k:+d} |'
        )
    a, b = counters[TL_ALIGN].counts, counters[PLAIN].counts
    net = sorted(((a[n] - b[n], n) for n in set(a) | set(b) if a[n] != b[n]), key=lambda t: (-abs(t[0]), t[1]))
    print(f'\n{TL_ALIGN} vs plain, net change per op name over the step ({depth} blocks; * a view)')
    views = {n for n in set(a) | set(b) if n not in counters[TL_ALIGN].kernels and n not in counters[PLAIN].kernels}
    for n, name in net[: args.top]:
        print(f'- {name}{" *" if name in views else ""}: {n:+d}')

    tl_model = attach_aux_head(timm.create_model(args.model, num_classes=C)).train()
    token_labeling_breakdown(tl_model, x, y, token_label_target(y, C), TokenLabelingLoss(C))
    if args.host_rounds:
        host_times(args.model, args.host_rounds)


#: the micro ViT of :func:`host_times`: the model's blocks at width 32, 4x4 tokens, 10 classes
MICRO = dict(embed_dim=32, num_heads=2, img_size=64)


def host_times(model_name: str, rounds: int, batch: int = 4, num_classes: int = 10) -> None:
    """Wall time per training step of each method vs its baseline on a micro version of ``model_name``
    (:data:`MICRO`, batch 4, one thread). Its compute is negligible, so the step time is what every op and
    Python call costs on the host: the part of the step a launch-bound accelerator pays in wall time (the H200's
    eager DeiT-S step at batch 128 is bound by the CPU launching kernels, RESULTS.md), measured rather than
    counted. Rounds interleaved, order rotated, after warm-up rounds."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(batch, 3, MICRO['img_size'], MICRO['img_size'])
    y = torch.randint(0, num_classes, (batch,))
    mixer = create_mixer(
        'cutmix', mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=num_classes, patch_size=16, carry_mix=True
    )
    xm, target = mixer(x, y)
    steps, models = make_steps(model_name, x, y, xm, target, num_classes, **MICRO)

    def step(fn):
        def run():
            for m in models:
                m.zero_grad(set_to_none=True)
            fn().backward()

        return run

    names = list(steps)
    times = interleaved_times([step(steps[n]) for n in names], rounds, warmup=10)
    med = {n: statistics.median(t) for n, t in zip(names, times)}
    print(
        f'\n# host time per training step, micro {model_name} ({MICRO}), batch {batch}, {num_classes} classes, '
        f'1 thread, median of {rounds} interleaved rounds'
    )
    print('| step | ms | baseline ms | ratio of medians | per-round ratio median [q1, q3] |')
    print('|---|---|---|---|---|')
    base = {n: baseline(n) for n in names}
    for n, t in zip(names, times):
        b = base[n]
        print(
            f'| {n} | {med[n] * 1e3:.2f} | {med[b] * 1e3:.2f} | {med[n] / med[b]:.3f} '
            f'| {pair_ratios(t, times[names.index(b)])} |'
        )


def token_labeling_breakdown(model, x, y, target, loss_fn) -> None:
    """Where token labeling + MixToken's extra ops go: each phase of its step against the same
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
