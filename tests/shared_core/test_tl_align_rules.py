"""The core TL-Align rules of :mod:`shared_core.tl_align` (Eq. 9, Eq. 11, Table 9), each against an explicit loop in
float64 written from the paper's formula (one sample, one head, one token at a time), on random inputs; and the
property every rule keeps: labels that sum to 1 per token still do. The tracers' tests (tests/timm_plugin,
tests/mm_plugin) hold whole models to their references; these hold the rules they are built of."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared_core.tl_align import (
    abs_row_norm,
    attention_labels,
    conv_pool_labels,
    conv_stencil_labels,
    linear_token_mixing,
    merge_2x2_labels,
    residual_labels,
    talking_heads_labels,
    window_labels,
)

from ..timm_plugin.tl_align_checks import stencil_loops


def _labels(B, N, K, g):
    return torch.softmax(torch.randn(B, N, K, generator=g) * 2, -1)


def _eq9_loop(q, k, Y, scale, bias=None):
    """Eq. 9 by loops: ``Y'_i = (1/H) Σ_h Σ_j softmax_j(q_hi · k_hj · scale + bias_hij) Y_j``."""
    B, H, Tq, _ = q.shape
    Tk, K = k.shape[2], Y.shape[-1]
    out = torch.zeros(B, Tq, K, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(Tq):
                logits = [float(q[b, h, i].double() @ k[b, h, j].double()) * scale for j in range(Tk)]
                if bias is not None:
                    logits = [x + float(bias[b, h, i, j]) for j, x in enumerate(logits)]
                top = max(logits)
                w = [math.exp(x - top) if x != -math.inf else 0.0 for x in logits]
                s = sum(w)
                for j in range(Tk):
                    out[b, i] += w[j] / s * Y[b, j].double() / H
    return out


@pytest.mark.parametrize('fused', [True, False])
@pytest.mark.parametrize('Tq, Tk', [(7, 7), (9, 4)])  # keys of their own (spatial-reduction attention)
def test_eq9_attention_labels_are_the_head_mean_attention_applied_to_the_labels(fused, Tq, Tk):
    g = torch.Generator().manual_seed(Tq * 10 + Tk)
    q, k = torch.randn(2, 3, Tq, 8, generator=g), torch.randn(2, 3, Tk, 8, generator=g)
    Y = _labels(2, Tk, 3, g)
    got = attention_labels(q, k, Y, scale=0.4, fused=fused)
    assert got.dtype == torch.float32 and got.shape == (2, Tq, 3)
    assert (got.double() - _eq9_loop(q, k, Y, 0.4)).abs().max() < 1e-5
    bias = torch.randn(2, 3, Tq, Tk, generator=g)  # an additive bias (relative position terms)
    assert (
        attention_labels(q, k, Y, bias, scale=0.4, fused=fused).double() - _eq9_loop(q, k, Y, 0.4, bias)
    ).abs().max() < 1e-5
    mask = torch.rand(Tq, Tk, generator=g) > 0.3
    mask[:, 0] = True  # every row keeps a key
    want = _eq9_loop(q, k, Y, 0.4, torch.zeros(Tq, Tk).masked_fill(~mask, -math.inf).expand(2, 3, Tq, Tk))
    assert (attention_labels(q, k, Y, mask, scale=0.4, fused=fused).double() - want).abs().max() < 1e-5
    default = attention_labels(q, k, Y, fused=fused)  # the default scale: head dim ** -0.5
    assert (default.double() - _eq9_loop(q, k, Y, 8**-0.5)).abs().max() < 1e-5


def test_eq11_residual_labels_average_with_the_branch_for_the_kept_samples_only():
    g = torch.Generator().manual_seed(1)
    Y, branch = _labels(4, 5, 3, g), _labels(4, 5, 3, g)
    keep = torch.tensor([True, False, True, False])
    got = residual_labels(Y, branch, keep)
    for b in range(4):
        want = (Y[b] + branch[b]) / 2 if keep[b] else Y[b]  # Norm(Y + branch), Norm the plain average
        assert torch.allclose(got[b], want, atol=1e-7)
    assert torch.equal(residual_labels(Y, branch, None, residual=False), branch)  # Table 8: no residual
    assert torch.equal(residual_labels(Y, branch, keep, residual=False)[1], Y[1])  # a dropped branch: kept


def test_table9_linear_token_mixing_is_the_product_of_the_normalised_magnitudes():
    """``Y ← Norm(|W|) · Y`` per map, the maps in order: ``Norm(|W_2|) Norm(|W_1|)``."""
    g = torch.Generator().manual_seed(3)
    W1, W2 = torch.randn(6, 5, generator=g), torch.randn(4, 6, generator=g)
    A = linear_token_mixing(W1, W2)
    loops = []
    for W in (W1, W2):
        M = torch.zeros(W.shape, dtype=torch.float64)
        for i in range(W.shape[0]):
            s = sum(abs(float(w)) for w in W[i])
            for j in range(W.shape[1]):
                M[i, j] = abs(float(W[i, j])) / s
        loops.append(M)
    assert (A.double() - loops[1] @ loops[0]).abs().max() < 1e-6
    assert torch.equal(abs_row_norm(torch.zeros(2, 3)), torch.zeros(2, 3))  # a zero row stays zero


def _stencil_loop(Y, S, pad, stride):
    """Table 9 for a conv as a fixed stencil on ``(B, K, H, W)`` labels: each output cell the ``S``-weighted mean of
    the in-grid cells of its window (the zero padding is no token), by loops."""
    return stencil_loops(Y.permute(0, 2, 3, 1), S, (pad,) * 4, stride).permute(0, 3, 1, 2)


@pytest.mark.parametrize('k, pad, stride', [(3, 1, 1), (3, 1, 2), (7, 3, 1), (2, 0, 2)])
def test_table9_conv_stencil_and_pool_labels_are_window_means_over_in_grid_cells(k, pad, stride):
    g = torch.Generator().manual_seed(k * 10 + stride)
    Y = _labels(2, 6 * 5, 3, g).transpose(1, 2).reshape(2, 3, 6, 5)
    S = torch.rand(k, k, generator=g) + 0.05
    got = conv_stencil_labels(Y, S, pad, stride)
    assert (got.double() - _stencil_loop(Y, S, pad, stride)).abs().max() < 1e-6
    pooled = conv_pool_labels(Y, k, stride, pad)  # aggregation: the plain mean of the window's in-grid cells
    assert (pooled.double() - _stencil_loop(Y, torch.ones(k, k), pad, stride)).abs().max() < 1e-6


def test_table9_patch_merging_is_the_mean_of_each_2x2_group():
    g = torch.Generator().manual_seed(4)
    Y = _labels(2, 4 * 6, 3, g).view(2, 4, 6, 3)
    got = merge_2x2_labels(Y)
    for i in range(2):
        for j in range(3):
            want = (
                Y[:, 2 * i, 2 * j] + Y[:, 2 * i + 1, 2 * j] + Y[:, 2 * i, 2 * j + 1] + Y[:, 2 * i + 1, 2 * j + 1]
            ) / 4
            assert torch.allclose(got[:, i, j], want, atol=1e-7)
    with pytest.raises(ValueError, match='pads a 3x6 token grid'):
        merge_2x2_labels(Y[:, :3])


def test_talking_heads_labels_normalise_the_head_mean_magnitudes():
    g = torch.Generator().manual_seed(5)
    attn = torch.randn(2, 5, 5, 3, generator=g)  # signed: after the learnt head mixing
    Y = _labels(2, 5, 2, g)
    got = talking_heads_labels(attn, Y)
    for b in range(2):
        W = attn[b].double().mean(-1).abs()
        assert (got[b].double() - (W / W.sum(-1, keepdim=True)) @ Y[b].double()).abs().max() < 1e-6


def test_shifted_window_labels_are_eq9_inside_each_window_of_the_rolled_grid():
    """Swin: roll by ``-shift``, Eq. 9 inside each window (here the window attention itself is given), roll
    back: a cell's label mixes only the cells of its window on the rolled grid."""
    g = torch.Generator().manual_seed(6)
    B, H, W, K, ws, shift = 1, 4, 6, 2, (2, 3), (1, 1)
    Y = _labels(B, H * W, K, g).view(B, H, W, K)
    nW = (H // ws[0]) * (W // ws[1])
    attn = torch.softmax(torch.randn(B * nW, 2, 6, 6, generator=g), -1)
    got = window_labels(Y, ws, shift, attn=attn)
    rolled = torch.roll(Y, (-shift[0], -shift[1]), (1, 2)).double()
    want = torch.zeros_like(rolled)
    for wi in range(H // ws[0]):
        for wj in range(W // ws[1]):
            cells = [(wi * ws[0] + a, wj * ws[1] + c) for a in range(ws[0]) for c in range(ws[1])]
            A = attn[wi * (W // ws[1]) + wj].double().mean(0)
            for p, (u, v) in enumerate(cells):
                for r, (s, t) in enumerate(cells):
                    want[0, u, v] += A[p, r] * rolled[0, s, t]
    want = torch.roll(want, shift, (1, 2))
    assert (got.double() - want).abs().max() < 1e-6


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), tokens=st.integers(2, 9), classes=st.integers(1, 4))
def test_every_rule_keeps_labels_that_sum_to_one(seed, tokens, classes):
    g = torch.Generator().manual_seed(seed)
    Y = _labels(2, tokens, classes, g)
    q, k = torch.randn(2, 2, tokens, 4, generator=g), torch.randn(2, 2, tokens, 4, generator=g)
    ones = torch.ones(2, tokens)
    for fused in (True, False):
        assert torch.allclose(attention_labels(q, k, Y, scale=1.0, fused=fused).sum(-1), ones, atol=1e-5)
    assert torch.allclose(residual_labels(Y, attention_labels(q, k, Y, fused=False)).sum(-1), ones, atol=1e-5)
    A = linear_token_mixing(torch.randn(tokens, tokens, generator=g))
    assert torch.allclose((A @ Y).sum(-1), ones, atol=1e-5)
    grid = Y.transpose(1, 2).reshape(2, classes, 1, tokens)
    stencil = conv_stencil_labels(grid, torch.rand(1, 3, generator=g) + 0.01, (0, 1))
    assert torch.allclose(stencil.sum(1), torch.ones(2, 1, tokens), atol=1e-5)
