"""The Triton label-attention kernel (``shared_core.label_kernel``) on a GPU, at DeiT's shapes: its forward output,
log-sum-exp and labels against ``scaled_dot_product_attention`` and the materialised rule, its gradients against
SDPA's, in fp32 and bf16; then the attention's forward + backward with the labels (the kernel) against the plain
SDPA forward + backward and against the SDPA call with label columns (``[v | labels]``), interleaved, medians.

    python3 bench/kernel_check.py [--batch 128] [--heads 6] [--tokens 197] [--head-dim 64] [--repeats 50]

On the CPU (no GPU) it runs under Triton's interpreter at a small size (``TRITON_INTERPRET=1`` is set here before
Triton is imported): a check of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

if not torch.cuda.is_available():
    os.environ.setdefault('TRITON_INTERPRET', '1')

import torch.nn.functional as F  # noqa: E402
from common import device_sync, interleaved_times, pair_ratios  # noqa: E402

from shared_core.label_attention import LabelColumns  # noqa: E402
from shared_core.label_kernel import label_attention  # noqa: E402


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
    with torch.no_grad():
        q, k, v = (t.float() for t in qkv.unbind(0))
        logits = q @ k.transpose(-1, -2) * scale
        ref_heads = (logits.softmax(-1) @ labels[:, None]).sum(1)
        ref_lse = logits.logsumexp(-1)
        ref_out = logits.softmax(-1) @ v
    rel = (mine.float() - theirs.float()).abs().max() / theirs.float().abs().max()
    diffs = [out.float() - sdpa.float(), out.float() - ref_out, lse - ref_lse, heads - ref_heads]
    return f'| {str(dtype)[6:]} | ' + ' | '.join(f'{d.abs().max():.2e}' for d in diffs) + f' | {rel:.2e} |'


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--batch', type=int, default=128)
    p.add_argument('--heads', type=int, default=6)
    p.add_argument('--tokens', type=int, default=197)
    p.add_argument('--head-dim', type=int, default=64)
    p.add_argument('--repeats', type=int, default=50)
    args = p.parse_args()
    dev = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    B, H, T, D = args.batch, args.heads, args.tokens, args.head_dim
    if dev.type == 'cpu':
        B, H, args.repeats = 2, 2, 3
    name = torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'CPU, Triton interpreter'
    print(f'# label kernel, (B, H, T, d) = ({B}, {H}, {T}, {D}), {name}, torch {torch.__version__}')
    print('| dtype | max abs out - SDPA | out - exact | lse - exact | labels - exact | grad - SDPA grad / max |')
    print('|---|---|---|---|---|---|')
    for dtype in (torch.float32, torch.bfloat16):
        print(check(B, H, T, D, dtype, dev), flush=True)

    # forward + backward of one block's attention, bf16: plain SDPA, the kernel, SDPA with label columns
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(B, T, 3, H, D, generator=g).permute(2, 0, 3, 1, 4).to(dev, torch.bfloat16).requires_grad_()
    labels = torch.rand(B, T, 1, generator=g).to(dev)
    grad = torch.randn(B, H, T, D, generator=g).to(dev, torch.bfloat16)
    scale = D**-0.5

    def plain():
        torch.autograd.grad(F.scaled_dot_product_attention(*qkv.unbind(0), scale=scale), qkv, grad)

    def kernel():
        out, _, _ = label_attention(*qkv.unbind(0), labels, scale)
        torch.autograd.grad(out, qkv, grad)

    def columns():
        out, _ = LabelColumns(labels, H, D, torch.bfloat16).attend(qkv, scale)
        torch.autograd.grad(out, qkv, grad)

    times = interleaved_times([plain, kernel, columns], args.repeats, warmup=3, sync=device_sync(dev))
    base = statistics.median(times[0])
    print()
    print('| bf16 attention, forward + backward | median ms | / plain SDPA, per-round median [q1, q3] |')
    print('|---|---|---|')
    print(f'| plain SDPA (no labels) | {base * 1e3:.3f} | 1.000 |')
    for row, t in (('Triton kernel with the labels', times[1]), ('SDPA with label columns', times[2])):
        print(f'| {row} | {statistics.median(t) * 1e3:.3f} | {pair_ratios(t, times[0])} |')


if __name__ == '__main__':
    main()
