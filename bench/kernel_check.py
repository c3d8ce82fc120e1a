"""TL-Align's label kernels (``shared_core.label_kernel``) on a GPU at DeiT's shapes: are they right here, and what
does each label path add to one block's attention.

1. The checks: the fused kernel's output, log-sum-exp and labels against ``scaled_dot_product_attention`` and the
   materialised rule, its gradients against SDPA's; the label-only kernel's labels against the rule; fp32 and bf16;
   and the self-check each wrapper runs before it trains (``self_check``).
2. The backend plain SDPA runs here (the aten op it dispatches to: cuDNN, flash, efficient or math), and whether
   the fused kernel's backward ran PyTorch's flash backward or fell back to the recomputed one.
3. The times, bf16, forward and backward apart: CUDA events over ``--iters`` back-to-back calls, ``--rounds``
   rounds interleaved across the paths, medians: plain SDPA (no labels), the fused kernel (``'triton'``), plain
   SDPA plus the label-only kernel (``'labels'``), SDPA with label columns (``True``, ``[v | labels]``).

    python3 bench/kernel_check.py [--batch 128] [--heads 6] [--tokens 197] [--head-dim 64] [--rounds 7] [--iters 20]

On the CPU (no GPU) it runs under Triton's interpreter at a small size (``TRITON_INTERPRET=1`` is set here before
Triton is imported) with host timers: a check of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault('TRITON_INTERPRET', '1')

import torch.nn.functional as F  # noqa: E402

from shared_core import label_kernel  # noqa: E402
from shared_core.label_attention import LabelColumns  # noqa: E402
from shared_core.label_kernel import label_attention, label_only_attention, self_check  # noqa: E402


def check(B, H, T, D, dtype, dev) -> str:
    g = torch.Generator().manual_seed(0)
    qkv = (torch.randn(B, T, 3, H, D, generator=g) * 1.5).permute(2, 0, 3, 1, 4).to(dev, dtype).requires_grad_()
    labels = torch.rand(B, T, 1, generator=g).to(dev)
    grad = torch.randn(B, H, T, D, generator=g).to(dev, dtype)
    scale = D**-0.5
    out, lse, heads = label_attention(*qkv.unbind(0), labels, scale)
    (mine,) = torch.autograd.grad(out, qkv, grad)
    sdpa = F.scaled_dot_product_attention(*qkv.unbind(0), scale=scale)
    (theirs,) = torch.autograd.grad(sdpa, qkv, grad)
    only = label_only_attention(*qkv.detach().unbind(0)[:2], labels, scale)
    with torch.no_grad():
        q, k, v = (t.float() for t in qkv.unbind(0))
        logits = q @ k.transpose(-1, -2) * scale
        ref_heads = (logits.softmax(-1) @ labels[:, None]).sum(1)
        ref_lse = logits.logsumexp(-1)
        ref_out = logits.softmax(-1) @ v
    rel = (mine.float() - theirs.float()).abs().max() / theirs.float().abs().max()
    diffs = [out.float() - sdpa.float(), out.float() - ref_out, lse - ref_lse, heads - ref_heads, only - ref_heads]
    checks = ', '.join(f'{kind} {self_check(kind, dev, dtype, D) or "passes"}' for kind in ('fused', 'labels'))
    return f'| {str(dtype)[6:]} | ' + ' | '.join(f'{d.abs().max():.2e}' for d in diffs) + f' | {rel:.2e} | {checks} |'


def sdpa_backend(qkv, scale) -> str:
    """The aten attention op plain SDPA dispatched to, forward and backward, read from the profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = F.scaled_dot_product_attention(*qkv.unbind(0), scale=scale)
        out.backward(torch.ones_like(out))
    qkv.grad = None
    names = sorted({e.key for e in prof.key_averages() if 'scaled_dot_product' in e.key or 'attention' in e.key})
    return ', '.join(n.removeprefix('aten::') for n in names if n != 'aten::scaled_dot_product_attention')


def timer(dev):
    """``time(fn, iters)``: seconds per call over ``iters`` back-to-back calls (CUDA events on a GPU)."""
    if dev.type == 'cuda':

        def cuda_time(fn, iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / iters

        return cuda_time

    def host_time(fn, iters):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters

    return host_time


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--batch', type=int, default=128)
    p.add_argument('--heads', type=int, default=6)
    p.add_argument('--tokens', type=int, default=197)
    p.add_argument('--head-dim', type=int, default=64)
    p.add_argument('--rounds', type=int, default=7)
    p.add_argument('--iters', type=int, default=20)
    args = p.parse_args()
    dev = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    B, H, T, D = args.batch, args.heads, args.tokens, args.head_dim
    if dev.type == 'cpu':
        B, H, args.rounds, args.iters = 2, 2, 3, 1
    name = torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'CPU, Triton interpreter'
    print(f'# label kernels, (B, H, T, d) = ({B}, {H}, {T}, {D}), {name}, torch {torch.__version__}')
    print('| dtype | fused out - SDPA | out - exact | lse - exact | labels - exact | label-only - exact '
          '| grad - SDPA grad / max | self-check |')  # fmt: skip
    print('|---|---|---|---|---|---|---|---|')
    for dtype in (torch.float32, torch.bfloat16):
        print(check(B, H, T, D, dtype, dev), flush=True)

    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(B, T, 3, H, D, generator=g).permute(2, 0, 3, 1, 4).to(dev, torch.bfloat16).requires_grad_()
    labels = torch.rand(B, T, 1, generator=g).to(dev)
    grad = torch.randn(B, H, T, D, generator=g).to(dev, torch.bfloat16)
    scale = D**-0.5
    print(f'\nplain SDPA runs: {sdpa_backend(qkv, scale)}')
    label_kernel._FLASH_BACKWARD_WARNED = False
    out, _, _ = label_attention(*qkv.unbind(0), labels, scale)
    torch.autograd.grad(out, qkv, grad)
    applies = label_kernel._flash_backward_applies(qkv)
    if label_kernel._FLASH_BACKWARD_WARNED:
        ran = 'recomputed (the flash backward refused)'
    elif applies:
        ran = "PyTorch's flash backward"
    else:
        ran = "the CPU's fused backward" if dev.type == 'cpu' else 'recomputed (fp32 or a head dim flash does not take)'
    print(f"the fused kernel's backward: {ran}")

    q, k, v = qkv.unbind(0)
    forwards = {
        'plain SDPA (no labels)': lambda: F.scaled_dot_product_attention(q, k, v, scale=scale),
        "fused kernel ('triton')": lambda: label_attention(q, k, v, labels, scale)[0],
        "SDPA + label-only kernel ('labels')": lambda: (
            F.scaled_dot_product_attention(q, k, v, scale=scale),
            label_only_attention(q.detach(), k.detach(), labels, scale),
        )[0],
        'SDPA with label columns (True)': lambda: LabelColumns(labels, H, D, torch.bfloat16).attend(qkv, scale)[0],
    }
    outs = {name: fn() for name, fn in forwards.items()}  # a graph each, for the backward alone
    backwards = {name: (lambda o=o: torch.autograd.grad(o, qkv, grad, retain_graph=True)) for name, o in outs.items()}
    time_of = timer(dev)
    for fns in (forwards, backwards):
        for fn in fns.values():  # warm-up (compiles the kernels)
            time_of(fn, 1)
    fwd = {n: [] for n in forwards}
    bwd = {n: [] for n in forwards}
    for _ in range(args.rounds):
        for n in forwards:
            fwd[n].append(time_of(forwards[n], args.iters))
            bwd[n].append(time_of(backwards[n], args.iters))
    base = statistics.median(fwd['plain SDPA (no labels)']) + statistics.median(bwd['plain SDPA (no labels)'])
    print('\n| bf16, one block | forward ms | backward ms | total / plain |')
    print('|---|---|---|---|')
    for n in forwards:
        f, b = statistics.median(fwd[n]), statistics.median(bwd[n])
        print(f'| {n} | {f * 1e3:.3f} | {b * 1e3:.3f} | {(f + b) / base:.3f} |')


if __name__ == '__main__':
    main()
