"""TokenMixup's cost: a training step (forward, loss, backward, optimizer) with HTM / VTM / HTM+VTM vs the plain
step on the same mixed batch (interleaved, medians, ratios); and the saliency of one HTM block (its attention on
the batch, tokenmixup.md Sec. 3.3) vs a gradient saliency (one backward of the loss to the input, as Co-Mixup
and PuzzleMix use; the paper's Table 3: 16 ms vs 236 ms per batch of 128 on a GPU), plus the optimal matching.

    .venv/bin/python bench/bench_tokenmixup.py [--model cct_7_3x1_32] [--batch 128] [--repeats 10] [--device cpu]
        [--amp] [--compile inductor]

``--compile BACKEND``: every step runs through ``torch.compile(model, backend=BACKEND)`` (as ``tokenaug-train
--torchcompile``: the method's hooks on the bare model; HTM's matching on the host breaks the graph there).

``--plan-only``: just HTM's plan against the bare ``linear_sum_assignment`` of its gain, side by side
(interleaved, torch on one thread, B = ``--batch`` rows all easy, N = 64 patch tokens of a peaked saliency):
what the plan costs beyond the assignment itself (the gain, the copies, Eq. 9 and λ).
"""

from __future__ import annotations

import argparse
import platform
import statistics

import timm
import torch
from common import device_sync, interleaved_times, median_times, optimizer_step, pair_ratios
from scipy.optimize import linear_sum_assignment
from timm.loss import SoftTargetCrossEntropy

import timm_plugin  # noqa: F401  (registers cct_*)
from shared_core.tokenmixup import htm_gain, htm_plan, qk_saliency
from timm_plugin import TokenMixup, create_mixer
from timm_plugin.tokenmixup import block_qk


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--model', default='cct_7_3x1_32')
    p.add_argument('--batch', type=int, default=128)
    p.add_argument('--repeats', type=int, default=10)
    p.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    p.add_argument('--amp', action='store_true')
    p.add_argument('--compile', default=None, metavar='BACKEND', help='run every step through torch.compile')
    p.add_argument('--plan-only', action='store_true', help="HTM's plan vs its bare assignment, one thread")
    p.add_argument(
        '--tau',
        type=float,
        default=100.0,
        help="HTM's τ (default 100: every sample easy, the most work HTM can do; the public recipes' 0.2 mixes "
        'nothing while the ScoreNet is untrained, so it times the difficulty and saliency without the matching)',
    )
    args = p.parse_args()
    dev = torch.device(args.device)
    if args.plan_only:
        return plan_vs_assignment(args.batch, 64, max(args.repeats, 30), dev)
    torch.manual_seed(0)
    model = timm.create_model(args.model, num_classes=100).to(dev).train()
    size = model.pretrained_cfg['input_size'][-1]
    tau = args.tau  # default 100: every sample is easy, the most work HTM can do
    variants = {
        f'HTM (block 2, τ {tau:g})': TokenMixup(model, htm_layers=(2,), tau=tau, rho=0.005),
        'VTM (block 2, kappa 80)': TokenMixup(model, vtm_layers=(2,), kappa=80),
        f'HTM 3 + VTM 2 (kappa 3, τ {tau:g})': TokenMixup(model, htm_layers=(3,), vtm_layers=(2,), tau=tau, kappa=3),
    }
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    loss_fn = SoftTargetCrossEntropy()
    mixer = create_mixer('cutmix', mixup_alpha=0.8, cutmix_alpha=1.0, num_classes=100, patch_size=2)
    x = torch.randn(args.batch, 3, size, size, device=dev)
    y = torch.randint(0, 100, (args.batch,), device=dev)
    xm, target = mixer(x, y)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=args.amp)
    sync = device_sync(dev)

    run = torch.compile(model, backend=args.compile) if args.compile else model

    def tm_loss(tm):
        logits, t = tm(xm, target, lambda: run(xm))
        return loss_fn(logits, t) + t.aux_loss

    steps = [optimizer_step(lambda: loss_fn(run(xm), target), opt, autocast)]
    steps += [optimizer_step(lambda tm=tm: tm_loss(tm), opt, autocast) for tm in variants.values()]
    times = median_times(steps, args.repeats, warmup=2, sync=sync)
    name = torch.cuda.get_device_name(dev) if dev.type == 'cuda' else (platform.processor() or platform.machine())
    print(
        f'# {args.model}, batch {args.batch}x3x{size}x{size}, device {dev} ({name}), amp={args.amp}, '
        f'torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.repeats}'
        + (f', torch.compile backend {args.compile}' if args.compile else '')
    )
    print('| training step | ms | / plain |')
    print('|---|---|---|')
    print(f'| plain (mixed batch, area target) | {times[0] * 1e3:.1f} | 1.000 |')
    for label, t in zip(variants, times[1:]):
        print(f'| {label} | {t * 1e3:.1f} | {t / times[0]:.3f} |')
    if args.compile:  # what dynamo made of the four steps (TokenMixup: one graph each, no break)
        from torch._dynamo.utils import counters

        breaks = sum(counters['graph_break'].values())
        print(f'\ndynamo: {counters["stats"]["unique_graphs"]} graphs for the 4 steps, {breaks} graph breaks')

    # saliency of the HTM block on its input: attention (ours) vs gradient (one backward to the block input)
    blk, kept = model.blocks[2], {}
    handle = blk.register_forward_pre_hook(lambda m, a: kept.__setitem__('x', a[0].detach()))
    with torch.no_grad():
        model(xm)
    handle.remove()
    h = kept['x']
    P = model.num_prefix_tokens

    def attention_saliency():
        return qk_saliency(*block_qk(blk, h), blk.attn.scale, P, 'mean')

    def gradient_saliency():
        inp = h.clone().requires_grad_(True)
        out = inp
        for b in model.blocks[2:]:
            out = b(out)
        loss_fn(model.forward_head(model.norm(out)), target).backward()
        return inp.grad.abs().sum(-1)[:, P:]

    S = attention_saliency()
    easy = torch.ones(args.batch, dtype=torch.bool, device=dev)
    att, grad, match = median_times(
        [attention_saliency, gradient_saliency, lambda: htm_plan(S, easy, 0.005)], args.repeats, warmup=1, sync=sync
    )
    print()
    print('| saliency of one batch (HTM block 2) | ms | / attention |')
    print('|---|---|---|')
    print(f'| attention (the block on its input, no grad) | {att * 1e3:.1f} | 1.0 |')
    print(f'| gradient (backward from the loss to the block input) | {grad * 1e3:.1f} | {grad / att:.1f} |')
    print(f'| optimal matching (linear_sum_assignment, all easy) | {match * 1e3:.1f} | {match / att:.1f} |')


def plan_vs_assignment(B: int, N: int, repeats: int, dev: torch.device) -> None:
    """``htm_plan`` against ``linear_sum_assignment`` of the same gain, interleaved, torch on one thread."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    S = torch.softmax(torch.randn(B, N, generator=g) * 3, -1).to(dev)
    easy = torch.ones(B, dtype=torch.bool, device=dev)
    gain = (htm_gain(S, 0.005) * easy[:, None]).cpu().numpy()
    sync = device_sync(dev)
    fns = [lambda: htm_plan(S, easy, 0.005), lambda: linear_sum_assignment(gain, maximize=True)]
    plan, bare = interleaved_times(fns, repeats, warmup=3, sync=sync)
    name = torch.cuda.get_device_name(dev) if dev.type == 'cuda' else (platform.processor() or platform.machine())
    print(f'# htm_plan, B={B} all easy, N={N}, device {dev} ({name}), torch {torch.__version__}, 1 thread, '
          f'{repeats} interleaved rounds')  # fmt: skip
    print('| call | median ms | / linear_sum_assignment |')
    print('|---|---|---|')
    print(
        f'| htm_plan (gain, assignment, Eq. 9, λ) | {statistics.median(plan) * 1e3:.2f} | {pair_ratios(plan, bare)} |'
    )
    print(f'| linear_sum_assignment of its gain | {statistics.median(bare) * 1e3:.2f} | 1.000 |')


if __name__ == '__main__':
    main()
