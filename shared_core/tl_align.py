"""TL-Align's label path, framework-free (the TL-Align paper, Sec. 3.3 and Table 9 of Appendix A).

A *label state* is a tensor ``(B, T, K)`` beside the ``T`` tokens of a model:

- dense: ``K = C`` class probabilities per token (rows sum to 1), the general form;
- compact: ``K = 1``, the share of each token that belongs to the partner image. A pairwise mix has
  only two source labels per sample, every rule below is affine in the label rows and attention rows
  sum to 1, so the dense state is always ``(1 - s) · y_own + s · y_partner`` and carrying ``s`` gives
  the same target at ``1/C`` of the cost.

The rules (each a function here, used by every architecture's tracer; the driver that runs them is
:class:`shared_core.tracer.Tracer`):

- attention (Eq. 9): ``Y ← mean_h softmax(q_h k_hᵀ · scale + bias) · Y`` — computed with the same fused
  ``scaled_dot_product_attention`` call the token path uses, with the labels as values, so the
  attention matrix is never materialised; detached and in fp32 (autocast off);
- residual + Norm (Eq. 11): ``Y ← (Y + branch(Y)) / 2`` (rows stay normalised); a residual whose
  branch was dropped for a sample (stochastic depth) leaves that sample's labels unchanged
  (``drop_path='kept'``; ``'public'``, the public code, updates them as if the branch had run);
- MLP, norms, channel mixing: unchanged (Table 9);
- spatial aggregation (patch merging): sum of the merged labels, then Norm (rows back to sum 1);
- the target: the label of the token the classifier reads (class token), or the mean over the tokens
  it pools.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F

from .label_attention import sdpa_labels, separate_path
from .mix import Mix, partner_target
from .options import TRANSMIX_MODES

__all__ = [
    'abs_row_norm',
    'linear_token_mixing',
    'conv_stencil_labels',
    'compact_labels',
    'dense_labels',
    'attention_labels',
    'residual_labels',
    'merge_labels',
    'merge_2x2_labels',
    'window_labels',
    'talking_heads_labels',
    'conv_pool_labels',
    'kernel_stencil',
    'conv_labels',
    'pool_like',
    'aligned_target',
    'TRANSMIX_MODES',
    'transmix_share',
    'nearest_token_share',
]


def compact_labels(mix: Mix, num_prefix_tokens: int = 1) -> torch.Tensor:
    """Initial compact state ``(B, P + N, 1)`` (Eq. 5): prefix tokens (class, distillation, register)
    start at the area label (partner share ``1 - λ``), each patch token at its partner share
    (fractional where a pixel box cuts the patch, ``1 - λ`` everywhere for MixUp)."""
    share = mix.token_share_flat().float()
    prefix = (1.0 - mix.lam.float())[:, None].expand(-1, num_prefix_tokens)
    return torch.cat([prefix.to(share.device), share], 1).unsqueeze(-1)


def dense_labels(
    token_labels: torch.Tensor, cls_label: Optional[torch.Tensor] = None, num_prefix_tokens: int = 1
) -> torch.Tensor:
    """Initial dense state ``(B, P + N, C)`` from per-patch labels ``(B, N, C)``; prefix tokens start at
    ``cls_label`` (default: the mean of the patch labels, i.e. the area label)."""
    if token_labels.dim() != 3:
        raise ValueError(f'token_labels: expected (B, N_patches, C), got {tuple(token_labels.shape)}')
    token_labels = token_labels.float()
    if cls_label is None:
        cls_label = token_labels.mean(1)
    if cls_label.shape != (token_labels.shape[0], token_labels.shape[2]):
        raise ValueError(
            f'cls_label: expected (B, C) = {(token_labels.shape[0], token_labels.shape[2])}, '
            f'got {tuple(cls_label.shape)}'
        )
    prefix = cls_label.float()[:, None].expand(-1, num_prefix_tokens, -1)
    return torch.cat([prefix, token_labels], 1)


@torch.no_grad()
def attention_labels(
    q: torch.Tensor,
    k: torch.Tensor,
    labels: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    fused: Union[bool, str, None] = None,
) -> torch.Tensor:
    """Eq. 9: the head-mean of the attention ``softmax(q kᵀ · scale + attn_mask)`` applied to the labels.

    ``q``, ``k``: ``(B, H, T, d)`` as the token path's attention saw them (``k`` may have fewer tokens
    than ``q``, e.g. spatial-reduction keys, and then ``labels`` are the labels of the keys);
    ``labels``: ``(B, T_k, K)``; ``attn_mask``: an additive float bias or a boolean mask broadcastable
    to ``(B, H, T_q, T_k)``. Returns ``(B, T_q, K)`` in fp32.

    ``fused`` (default :func:`~shared_core.label_attention.separate_path`, which inside a wrapper's forward is the
    path its :class:`~shared_core.label_attention.LabelBackend` chose): ``'labels'`` the label-only Triton kernel
    (:func:`shared_core.label_kernel.label_only_attention`: the products of ``q`` and ``k`` in fp32 from their own
    dtype, nothing materialised); ``True`` a fused ``scaled_dot_product_attention`` call with the labels as
    values, never materialising the attention; ``False`` one transient ``softmax(q kᵀ)`` per call. Either way the
    token path is untouched.
    """
    path = separate_path(q.device) if fused is None else 'labels' if fused == 'labels' else 'sdpa' if fused else ''
    with torch.autocast(device_type=q.device.type, enabled=False):
        if path == 'labels':
            from .label_kernel import label_only_attention

            kernel_scale = q.shape[-1] ** -0.5 if scale is None else scale
            return label_only_attention(q, k, labels, kernel_scale, attn_mask).div_(q.shape[1])
        q, k = q.detach().float(), k.detach().float()
        if attn_mask is not None and attn_mask.dtype != torch.bool:
            attn_mask = attn_mask.float()
        if path == 'sdpa':
            return sdpa_labels(q, k, labels, attn_mask, scale)
        logits = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5 if scale is None else scale)
        if attn_mask is not None:
            logits = (
                logits.masked_fill(~attn_mask, float('-inf')) if attn_mask.dtype == torch.bool else logits + attn_mask
            )
        return logits.softmax(-1).mean(1) @ labels.float()


def residual_labels(
    labels: torch.Tensor, branch: torch.Tensor, keep: Optional[torch.Tensor] = None, residual: bool = True
) -> torch.Tensor:
    """Eq. 11: ``Norm(Y + branch)`` with Norm the plain average; ``keep`` (B,) bool marks the samples
    whose residual branch ran (stochastic depth drops it for the others: their labels stay), or a mask of
    the labels' shape but their last or channel dim 1 (a drop path over parts of each sample).
    ``residual=False`` (Table 8 ablation, "normalization disabled") drops the residual from the label
    path: ``Y ← branch``."""
    new = torch.lerp(labels, branch, 0.5) if residual else branch
    if keep is not None:
        new = torch.where(
            keep if keep.dim() == labels.dim() else keep.view(-1, *([1] * (labels.dim() - 1))), new, labels
        )
    return new


def merge_labels(labels: torch.Tensor) -> torch.Tensor:
    """Spatial aggregation (patch merging): ``Norm(Σ merged labels)`` over the last-but-one dim of a
    ``(..., M, K)`` group of merged tokens. For labels that already sum to 1 this is their mean."""
    return labels.mean(-2)


def talking_heads_labels(attn: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Table 9 spatial mixing for talking-heads attention (CaiT): ``attn`` the per-head attention that
    multiplies ``v`` ``(B, N, N, H)`` (after the post-softmax head mixing, before attention dropout);
    ``W = mean_h attn`` (Eq. 9), ``Y ← Norm(|W|) · Y`` with Norm the row sum. Equals ``Norm(W) · Y``
    whenever ``W ≥ 0``; the learnt head mixing is signed, and a signed row sum can vanish, so the
    magnitudes are normalised (labels stay convex combinations, the compact state stays exact)."""
    with torch.autocast(device_type=attn.device.type, enabled=False):
        return abs_row_norm(attn.detach().mean(-1, dtype=torch.float32)) @ labels.float()


def abs_row_norm(W: torch.Tensor) -> torch.Tensor:
    """``Norm(|W|)``: the magnitudes of a (signed) token-mixing matrix ``(..., N_out, N_in)`` with each row scaled to
    sum 1 (a zero row stays zero). For ``W ≥ 0`` this is Table 9's ``Norm(W)``; a signed row sum can vanish, so the
    magnitudes are normalised: labels stay convex combinations, the compact state stays exact."""
    W = W.abs()
    return W / W.sum(-1, keepdim=True).clamp_min(torch.finfo(W.dtype).tiny)


def linear_token_mixing(*weights: torch.Tensor) -> torch.Tensor:
    """Table 9 for learnt linear maps over the tokens (MLP-Mixer's token MLP, ResMLP's and gMLP's token
    projections), applied in the order given (``weights[0]`` first, each ``(N_out, N_in)`` as ``nn.Linear``
    stores it), with only point-wise ops between them (bias, activation, norm: labels unchanged): each map is a
    spatial mixing ``Y ← Norm(|W|) · Y``, so the stack is the ``(N, N)`` product ``Norm(|W_L|) ··· Norm(|W_1|)``
    (rows sum to 1). Static: the same matrix for every sample."""
    with torch.no_grad(), torch.autocast(device_type=weights[0].device.type, enabled=False):
        A = abs_row_norm(weights[0].detach().float())
        for W in weights[1:]:
            A = abs_row_norm(W.detach().float()) @ A
        return A


def conv_stencil_labels(labels: torch.Tensor, stencil: torch.Tensor, padding, stride=1, dilation=1) -> torch.Tensor:
    """Table 9 spatial mixing for a convolution used as one fixed non-negative stencil ``S`` ``(kh, kw)`` on a
    ``(B, K, H, W)`` label map: ``Y'[p] = Σ_q S[q - s·p + pad] Y[q] / Σ_q S[q - s·p + pad]`` over the in-grid
    positions ``q`` of the window (the conv's zero padding is no token), i.e. the conv's equivalent ``(N_out, N)``
    matrix with rows normalised to sum 1 (the same cross-correlation as the token path). A ``stride`` > 1 (a
    strided conv: mixing and spatial aggregation at once) reads every ``stride``-th window, as the conv does;
    ``dilation`` spaces the stencil's taps as the conv's. ``padding``: a pair (both sides), or
    ``(left, right, top, bottom)`` for an asymmetric padding (TF's "same")."""
    K, H, W = labels.shape[1:]
    S = stencil.to(labels.dtype)[None, None]
    ones = labels.new_ones(1, 1, H, W)
    if isinstance(padding, (tuple, list)) and len(padding) == 4:
        labels, ones, padding = F.pad(labels, tuple(padding)), F.pad(ones, tuple(padding)), 0
    num = F.conv2d(labels, S.expand(K, 1, *S.shape[-2:]), stride=stride, padding=padding, dilation=dilation, groups=K)
    den = F.conv2d(ones, S, stride=stride, padding=padding, dilation=dilation)
    return num / den.clamp_min(torch.finfo(labels.dtype).tiny)


def conv_pool_labels(labels: torch.Tensor, kernel_size, stride, padding, ceil_mode: bool = False) -> torch.Tensor:
    """Table 9 spatial aggregation for a strided conv or a pooling on a ``(B, K, H, W)`` label map: every output
    token's label is the Norm of the sum (the mean) of the labels in its window, with the conv's kernel, stride and
    padding (``ceil_mode`` as the pooling's); padding positions are not tokens (``count_include_pad=False``).
    ``padding``: a pair (both sides), or ``(left, right, top, bottom)`` for an asymmetric padding (TF's "same")."""
    if isinstance(padding, (tuple, list)) and len(padding) == 4:  # pad, and count the in-grid positions apart
        ones = F.pad(labels.new_ones(1, 1, *labels.shape[-2:]), tuple(padding))
        num = F.avg_pool2d(F.pad(labels, tuple(padding)), kernel_size, stride, 0, ceil_mode)
        return num / F.avg_pool2d(ones, kernel_size, stride, 0, ceil_mode)
    return F.avg_pool2d(labels, kernel_size, stride, padding, ceil_mode, count_include_pad=False)


def kernel_stencil(weight: torch.Tensor) -> torch.Tensor:
    """``S = mean |K|`` ``(k, k)`` fp32 over a kernel's output and input channel dims (a depthwise conv: over its
    channels' kernels): the fixed stencil by which Table 9 mixes labels for a convolution."""
    return weight.detach().float().abs().mean((0, 1))


def conv_labels(labels: torch.Tensor, conv: torch.nn.Conv2d) -> torch.Tensor:
    """Table 9 for a convolution module on a ``(B, K, H, W)`` label map: its fixed :func:`kernel_stencil`, at its
    padding and stride (:func:`conv_stencil_labels`)."""
    return conv_stencil_labels(labels, kernel_stencil(conv.weight), conv.padding, conv.stride)


def pool_like(labels: torch.Tensor, conv: torch.nn.Conv2d) -> torch.Tensor:
    """:func:`conv_pool_labels` with the geometry of ``conv`` (a strided conv: spatial aggregation)."""
    if tuple(conv.dilation) != (1, 1) or isinstance(conv.padding, str):
        raise ValueError(f'model: TL-Align pools labels for undilated, explicitly padded convs, got {conv}')
    return conv_pool_labels(labels, conv.kernel_size, conv.stride, conv.padding)


def merge_2x2_labels(labels: torch.Tensor) -> torch.Tensor:
    """Swin patch merging on a ``(B, H, W, K)`` label map: each 2x2 group (in whatever channel order the
    framework concatenates it) becomes the Norm of its sum, ``(B, H/2, W/2, K)``."""
    B, H, W, K = labels.shape
    if H % 2 or W % 2:
        raise ValueError(f'x: patch merging pads a {H}x{W} token grid; TL-Align traces even grids only')
    return merge_labels(
        labels.view(B, H // 2, 2, W // 2, 2, K).permute(0, 1, 3, 2, 4, 5).reshape(B, H // 2, W // 2, 4, K)
    )


def _window_partition(x: torch.Tensor, ws) -> torch.Tensor:
    """``(B, H, W, K)`` -> ``(B · nW, wh · ww, K)``, windows in (batch, row, column) order, as Swin does."""
    B, H, W, K = x.shape
    x = x.view(B, H // ws[0], ws[0], W // ws[1], ws[1], K).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, ws[0] * ws[1], K)


def _window_reverse(w: torch.Tensor, ws, B: int, H: int, W: int) -> torch.Tensor:
    K = w.shape[-1]
    x = w.view(B, H // ws[0], W // ws[1], ws[0], ws[1], K).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(B, H, W, K)


def window_labels(
    labels: torch.Tensor,
    window,
    shift,
    attn: Optional[torch.Tensor] = None,
    q: Optional[torch.Tensor] = None,
    k: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Eq. 9 for (shifted-)window attention on a ``(B, H, W, K)`` label map: cyclic shift by ``-shift``,
    window partition, the head-mean window attention, window reverse, shift back.

    The attention is either the token path's own probabilities ``attn`` ``(B · nW, heads, N, N)``
    (frameworks that materialise it), or recomputed from ``q``, ``k`` and the additive ``bias``
    (relative position bias + shift mask, ``(B · nW, heads, N, N)``) by :func:`attention_labels`.
    The grid must be a whole number of windows (padding is not traced)."""
    B, H, W, K = labels.shape
    window, shift = tuple(window), tuple(shift)
    if H % window[0] or W % window[1]:
        raise ValueError(
            f'x: a {H}x{W} token grid is padded to {window[0]}x{window[1]} windows; TL-Align '
            f'traces unpadded grids only (choose the image size accordingly)'
        )
    shifted = any(shift)
    Y = torch.roll(labels, shifts=(-shift[0], -shift[1]), dims=(1, 2)) if shifted else labels
    Yw = _window_partition(Y, window)
    if attn is not None:
        with torch.autocast(device_type=attn.device.type, enabled=False):
            out = attn.float().mean(1) @ Yw.float()
    else:
        out = attention_labels(q, k, Yw, attn_mask=bias, scale=scale)
    out = _window_reverse(out, window, B, H, W)
    return torch.roll(out, shifts=tuple(shift), dims=(1, 2)) if shifted else out


def aligned_target(
    share: torch.Tensor, labels: torch.Tensor, mix: Mix, num_classes: int, smoothing: float = 0.0
) -> torch.Tensor:
    """The training target from the compact label of what the classifier reads: ``(B,)`` partner
    shares → ``(1 - s) · y_own + s · y_partner`` with label smoothing (rows sum to 1), detached (Eq. 12)."""
    share = share.float()
    if share.requires_grad:
        share = share.detach()
    labels = labels.to(share.device)
    return partner_target(labels, mix.partner, share, num_classes, smoothing, reversed_pairs=mix.reversed_pairs)


def nearest_token_share(mix: Mix) -> torch.Tensor:
    """``(B, gh, gw)`` the partner share of each patch's top-left pixel: the nearest-neighbour downsampling of
    the pixel mask that the public TransMix code uses (``nn.Upsample(mode='nearest')`` to the patch grid). Equal
    to the token shares for token masks and blends; 0/1 per patch for pixel CutMix boxes."""
    ph, pw = mix.patch_size
    return mix.pixel_share()[:, 0, ::ph, ::pw]


def transmix_share(tracer, captures: list, output: Any, mix: Mix, mode: str = 'paper') -> torch.Tensor:
    """TransMix's ``(B,)`` partner share of the target from the last block's attention, after a forward captured
    by ``tracer`` (a :class:`shared_core.tracer.Tracer` whose last block attends: ``tracer.attends``).

    Class-token models (``tracer.class_attention``): ``λ_partner = A · M``, ``A`` the head-mean attention of
    the class token to the patch tokens in the last block, renormalised over the patches, ``M`` the partner
    share of each patch token (both sums from one call with two value columns). Models without a class token
    (our extension): the pooled compact label after the last block's attention alone. ``mode='average'``:
    the mean of that and the area share ``1 - λ``."""
    if mode not in TRANSMIX_MODES:
        raise ValueError(f'mode: expected one of {TRANSMIX_MODES}, got {mode!r}')
    if mode == 'average':  # the public code's patch mask: "inside" when the patch's top-left pixel is
        mix = replace(mix, token_share=nearest_token_share(mix))
    qk = tracer.class_attention(captures)
    with torch.no_grad():
        if qk is not None:
            probs = qk if isinstance(qk, torch.Tensor) else None  # (B, H, 1, T): the probabilities themselves
            q_cls = probs if probs is not None else qk[0]
            with torch.autocast(device_type=q_cls.device.type, enabled=False):
                P = tracer.num_prefix_tokens
                s = mix.token_share_flat().float().to(q_cls.device)
                v = torch.zeros(s.shape[0], P + s.shape[1], 2, device=s.device)
                v[:, P:, 0], v[:, P:, 1] = s, 1.0
                if probs is not None:
                    num_den = (probs.float().mean(1) @ v)[:, 0]
                else:
                    q_cls, k, scale, *bias = qk  # an optional 4th: the class row of an additive bias or mask
                    num_den = attention_labels(q_cls, k, v, bias[0] if bias else None, scale=scale)[:, 0]
                share = num_den[:, 0] / num_den[:, 1]
        else:
            labels = compact_labels(mix, tracer.num_prefix_tokens)
            dev = next(t for c in captures[::-1] for t in (c.q, c.k, c.attn) if t is not None).device
            share = tracer.label_path(captures, output, labels.to(dev), {tracer.depth - 1}, False)[:, 0]
    if mode == 'average':
        share = 0.5 * share + 0.5 * (1.0 - mix.lam.to(share.device))
    return share
