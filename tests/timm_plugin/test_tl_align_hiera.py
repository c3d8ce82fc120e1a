"""TL-Align on timm's Hiera against a reference in image coordinates: every token is followed by the spatial cell
it stands for (the model's own ``unroll`` applied to the cells' coordinates, then the block's pooling and
windowing applied to those coordinates as the block applies them to its tokens). The reference checks that a
pooled token covers a 2x2 block of cells and a mask unit a square of cells, keeps the labels in a dict keyed by
cell, and applies Eq. 9/11 by loops over windows, queries, keys and heads in float64."""

import pytest
import timm
import torch

from timm_plugin import create_mixer
from timm_plugin.tl_align import HieraTracer, TLAlign, timm_tracer

from ..timm_plugin.test_tl_align_sdpa import RecordAttention, dense_start, sharpen

C = 5


def reference(model, x, Y0):
    """The mean label after the last block, per sample, from ``Y0`` ``(B, N, K)`` on the row-major patch grid."""
    with RecordAttention() as rec, torch.no_grad():
        model(x)
    calls = iter(rec.calls)
    H, W = model.unroll.size
    cells = torch.tensor([[i, j] for i in range(H) for j in range(W)], dtype=torch.float64)
    order = model.unroll(cells[None])[0].long().tolist()  # the cell of each token, in the blocks' order
    B = Y0.shape[0]
    labels = {(i, j): Y0[:, i * W + j].double() for i in range(H) for j in range(W)}
    for blk in model.blocks:
        s = blk.attn.q_stride
        N = len(order)
        if s > 1:  # query pooling: token m of the pooled order takes tokens j * N / s + m
            pooled, pooled_labels = [], {}
            for m in range(N // s):
                group = [tuple(order[j * (N // s) + m]) for j in range(s)]
                a, b = group[0][0] // 2, group[0][1] // 2
                assert sorted(group) == [(2 * a, 2 * b), (2 * a, 2 * b + 1), (2 * a + 1, 2 * b), (2 * a + 1, 2 * b + 1)]
                pooled.append((a, b))
                pooled_labels[(a, b)] = sum(labels[c] for c in group) / s
        else:
            pooled, pooled_labels = [tuple(c) for c in order], labels
        q, k, _, scale = next(calls)
        branch = {}
        if q.dim() == 4:  # global attention: one window of every token
            q, k = q[:, :, None], k[:, :, None]
        nw = q.shape[2]
        for w in range(nw):
            keys = [tuple(order[t * nw + w]) for t in range(k.shape[3])]
            queries = [pooled[t * nw + w] for t in range(q.shape[3])]
            side = int(len(keys) ** 0.5)
            rows, cols = {c[0] for c in keys}, {c[1] for c in keys}
            assert len(rows) == len(cols) == side and max(rows) - min(rows) == side - 1  # a square of cells
            A = ((q[:, :, w].double() @ k[:, :, w].double().transpose(-1, -2)) * scale).softmax(-1)
            for qi, qc in enumerate(queries):
                acc = torch.zeros(B, Y0.shape[-1], dtype=torch.float64)
                for h in range(A.shape[1]):
                    for ki, kc in enumerate(keys):
                        acc += A[:, h, qi, ki, None] * labels[kc]
                branch[qc] = acc / A.shape[1]
        labels = {c: (pooled_labels[c] + branch[c]) / 2 for c in pooled}
        order = [list(c) for c in pooled]
    return sum(labels.values()) / len(labels)


@pytest.mark.parametrize('img', [64, 32])
def test_the_tracer_is_the_reference_in_image_coordinates(img):
    torch.manual_seed(0)
    model = sharpen(
        timm.create_model('hiera_tiny_224', img_size=(img, img), num_classes=C, stages=(1, 1, 2, 1), num_heads=2)
    )
    assert isinstance(timm_tracer(model), HieraTracer)
    assert any(b.attn.use_mask_unit_attn and b.attn.q_stride > 1 for b in model.blocks)
    assert any(not b.attn.use_mask_unit_attn for b in model.blocks)
    g = torch.Generator().manual_seed(4)
    mixer = create_mixer(
        'cutmix', mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=C, patch_size=4, mode='elem', generator=g,
        carry_mix=True, label_smoothing=0.0,
    )  # fmt: skip
    x, y = torch.randn(4, 3, img, img, generator=g), torch.randint(0, C, (4,), generator=g)
    xm, target = mixer(x, y)
    Y0 = dense_start(target.mix, y, 0)
    expected = reference(model, xm, Y0)
    out, aligned = TLAlign(model)(xm, target)
    assert (aligned.double() - expected).abs().max() < 1e-6  # measured 4.5e-8
    assert torch.equal(out, model(xm))
    # not vacuous: the labels' places matter (the same labels in reversed token order give another target)
    assert (reference(model, xm, Y0.flip(1)) - expected).abs().max() > 1e-3


def test_hiera_refusals():
    model = timm.create_model('hiera_tiny_224', img_size=(32, 32), num_classes=C, stages=(1, 1, 1, 1))
    model.blocks[0].attn.fused_attn = False
    with pytest.raises(ValueError, match=r'blocks \[0\] compute their attention without scaled_dot_product_attention'):
        TLAlign(model)
    model = timm.create_model('hiera_tiny_224', img_size=(32, 32), num_classes=C, stages=(1, 1, 1, 1))
    model.patch_drop_rate = 0.5
    with pytest.raises(ValueError, match='patch dropout removes tokens'):
        TLAlign(model)
