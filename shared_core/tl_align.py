"""TL-Align's label path, framework-free (``tl-align.md`` Sec. 3.3 and Table 9 of Appendix A).

A *label state* is a tensor ``(B, T, K)`` beside the ``T`` tokens of a model:

- dense: ``K = C`` class probabilities per token (rows sum to 1), the general form;
- compact: ``K = 1``, the share of each token that belongs to the partner image. A pairwise mix has
  only two source labels per sample, every rule below is affine in the label rows and attention rows
  sum to 1, so the dense state is always ``(1 - s) · y_own + s · y_partner`` and carrying ``s`` gives
  the same target at ``1/C`` of the cost.

The rules (each a function here, used by every architecture's tracer):

- attention (Eq. 9): ``Y ← mean_h softmax(q_h k_hᵀ · scale + bias) · Y`` — computed with the same fused
  ``scaled_dot_product_attention`` call the token path uses, with the labels as values, so the
  attention matrix is never materialised; detached and in fp32 (autocast off);
- residual + Norm (Eq. 11): ``Y ← (Y + branch(Y)) / 2`` (rows stay normalised); a residual whose
  branch was dropped for a sample (stochastic depth) leaves that sample's labels unchanged;
- MLP, norms, channel mixing: unchanged (Table 9);
- spatial aggregation (patch merging): sum of the merged labels, then Norm (rows back to sum 1);
- the target: the label of the token the classifier reads (class token), or the mean over the tokens
  it pools.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .mixing import Mix, pair_target

__all__ = ['compact_labels', 'dense_labels', 'attention_labels', 'residual_labels', 'merge_labels',
           'merge_2x2_labels', 'window_labels', 'self_attention_labels', 'aligned_target']


def compact_labels(mix: Mix, num_prefix_tokens: int = 1) -> torch.Tensor:
    """Initial compact state ``(B, P + N, 1)`` (Eq. 5): prefix tokens (class, distillation, register)
    start at the area label (partner share ``1 - λ``), each patch token at its partner share
    (fractional where a pixel box cuts the patch, ``1 - λ`` everywhere for MixUp)."""
    share = mix.token_share_flat().float()
    prefix = (1. - mix.lam.float())[:, None].expand(-1, num_prefix_tokens)
    return torch.cat([prefix.to(share.device), share], 1).unsqueeze(-1)


def dense_labels(token_labels: torch.Tensor, cls_label: Optional[torch.Tensor] = None,
                 num_prefix_tokens: int = 1) -> torch.Tensor:
    """Initial dense state ``(B, P + N, C)`` from per-patch labels ``(B, N, C)``; prefix tokens start at
    ``cls_label`` (default: the mean of the patch labels, i.e. the area label)."""
    if token_labels.dim() != 3:
        raise ValueError(f'token_labels: expected (B, N_patches, C), got {tuple(token_labels.shape)}')
    token_labels = token_labels.float()
    if cls_label is None:
        cls_label = token_labels.mean(1)
    if cls_label.shape != (token_labels.shape[0], token_labels.shape[2]):
        raise ValueError(f'cls_label: expected (B, C) = {(token_labels.shape[0], token_labels.shape[2])}, '
                         f'got {tuple(cls_label.shape)}')
    prefix = cls_label.float()[:, None].expand(-1, num_prefix_tokens, -1)
    return torch.cat([prefix, token_labels], 1)


@torch.no_grad()
def attention_labels(q: torch.Tensor, k: torch.Tensor, labels: torch.Tensor,
                     attn_mask: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                     fused: Optional[bool] = None) -> torch.Tensor:
    """Eq. 9: the head-mean of the attention ``softmax(q kᵀ · scale + attn_mask)`` applied to the labels.

    ``q``, ``k``: ``(B, H, T, d)`` as the token path's attention saw them (``k`` may have fewer tokens
    than ``q``, e.g. spatial-reduction keys, and then ``labels`` are the labels of the keys);
    ``labels``: ``(B, T_k, K)``; ``attn_mask``: an additive float bias or a boolean mask broadcastable
    to ``(B, H, T_q, T_k)``. Returns ``(B, T_q, K)`` in fp32.

    ``fused`` (default: on accelerators) computes it with ``scaled_dot_product_attention`` and the labels
    as values, never materialising the attention. On the CPU the default is one transient
    ``softmax(q kᵀ)`` per call instead: PyTorch's fused CPU kernel is 2-3x slower than that for the
    1-wide values of the compact state (``bench/RESULTS.md``). Either way the token path is untouched.
    """
    if fused is None:
        fused = q.device.type != 'cpu'
    with torch.autocast(device_type=q.device.type, enabled=False):
        q, k, v = q.detach().float(), k.detach().float(), labels.float().unsqueeze(1)
        if attn_mask is not None and attn_mask.dtype != torch.bool:
            attn_mask = attn_mask.float()
        if fused:
            # pad the (1- or 2-wide) label values to 8 columns: fp32 memory-efficient kernels need aligned
            # head dims, and a misaligned call falls back to the materialising math kernel
            width = v.shape[-1]
            v = F.pad(v, (0, -width % 8)).expand(-1, q.shape[1], -1, -1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
            return out[..., :width].mean(1)
        logits = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5 if scale is None else scale)
        if attn_mask is not None:
            logits = logits.masked_fill(~attn_mask, float('-inf')) if attn_mask.dtype == torch.bool \
                else logits + attn_mask
        return (logits.softmax(-1).mean(1) @ labels.float())


def residual_labels(labels: torch.Tensor, branch: torch.Tensor, keep: Optional[torch.Tensor] = None,
                    normalise: bool = True) -> torch.Tensor:
    """Eq. 11: ``Norm(Y + branch)`` with Norm the plain average; ``keep`` (B,) bool marks the samples
    whose residual branch ran (stochastic depth drops it for the others: their labels stay).
    ``normalise=False`` (Table 8 ablation) drops the residual from the label path: ``Y ← branch``."""
    new = (labels + branch) * 0.5 if normalise else branch
    if keep is not None:
        new = torch.where(keep.view(-1, *([1] * (labels.dim() - 1))), new, labels)
    return new


def merge_labels(labels: torch.Tensor) -> torch.Tensor:
    """Spatial aggregation (patch merging): ``Norm(Σ merged labels)`` over the last-but-one dim of a
    ``(..., M, K)`` group of merged tokens. For labels that already sum to 1 this is their mean."""
    return labels.mean(-2)


def self_attention_labels(blocks, labels: torch.Tensor, layers: Optional[set] = None, normalise: bool = True,
                          fused: Optional[bool] = None) -> torch.Tensor:
    """A stack of pre-norm transformer blocks (attention residual, then MLP residual, which leaves labels
    as they are): ``blocks`` yields ``(q, k, scale, keep)`` per block, ``keep`` the samples whose
    attention branch stochastic depth kept (``None``: all). ``layers``: align only at these indices."""
    for idx, (q, k, scale, keep) in enumerate(blocks):
        if layers is not None and idx not in layers:
            continue  # not aligned here: the labels pass unchanged
        labels = residual_labels(labels, attention_labels(q, k, labels, scale=scale, fused=fused), keep, normalise)
    return labels


def merge_2x2_labels(labels: torch.Tensor) -> torch.Tensor:
    """Swin patch merging on a ``(B, H, W, K)`` label map: each 2x2 group (in whatever channel order the
    framework concatenates it) becomes the Norm of its sum, ``(B, H/2, W/2, K)``."""
    B, H, W, K = labels.shape
    if H % 2 or W % 2:
        raise ValueError(f'x: patch merging pads a {H}x{W} token grid; TL-Align traces even grids only')
    return merge_labels(labels.view(B, H // 2, 2, W // 2, 2, K).permute(0, 1, 3, 2, 4, 5).reshape(
        B, H // 2, W // 2, 4, K))


def _window_partition(x: torch.Tensor, ws) -> torch.Tensor:
    """``(B, H, W, K)`` -> ``(B · nW, wh · ww, K)``, windows in (batch, row, column) order, as Swin does."""
    B, H, W, K = x.shape
    x = x.view(B, H // ws[0], ws[0], W // ws[1], ws[1], K).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, ws[0] * ws[1], K)


def _window_reverse(w: torch.Tensor, ws, B: int, H: int, W: int) -> torch.Tensor:
    K = w.shape[-1]
    x = w.view(B, H // ws[0], W // ws[1], ws[0], ws[1], K).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(B, H, W, K)


def window_labels(labels: torch.Tensor, window, shift, attn: Optional[torch.Tensor] = None,
                  q: Optional[torch.Tensor] = None, k: Optional[torch.Tensor] = None,
                  bias: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                  fused: Optional[bool] = None) -> torch.Tensor:
    """Eq. 9 for (shifted-)window attention on a ``(B, H, W, K)`` label map: cyclic shift by ``-shift``,
    window partition, the head-mean window attention, window reverse, shift back.

    The attention is either the token path's own probabilities ``attn`` ``(B · nW, heads, N, N)``
    (frameworks that materialise it), or recomputed from ``q``, ``k`` and the additive ``bias``
    (relative position bias + shift mask, ``(B · nW, heads, N, N)``) by :func:`attention_labels`.
    The grid must be a whole number of windows (padding is not traced)."""
    B, H, W, K = labels.shape
    window, shift = tuple(window), tuple(shift)
    if H % window[0] or W % window[1]:
        raise ValueError(f'x: a {H}x{W} token grid is padded to {window[0]}x{window[1]} windows; TL-Align '
                         f'traces unpadded grids only (choose the image size accordingly)')
    shifted = any(shift)
    Y = torch.roll(labels, shifts=(-shift[0], -shift[1]), dims=(1, 2)) if shifted else labels
    Yw = _window_partition(Y, window)
    if attn is not None:
        with torch.autocast(device_type=attn.device.type, enabled=False):
            out = attn.float().mean(1) @ Yw.float()
    else:
        out = attention_labels(q, k, Yw, attn_mask=bias, scale=scale, fused=fused)
    out = _window_reverse(out, window, B, H, W)
    return torch.roll(out, shifts=tuple(shift), dims=(1, 2)) if shifted else out


def aligned_target(share: torch.Tensor, labels: torch.Tensor, mix: Mix, num_classes: int,
                   smoothing: float = 0.) -> torch.Tensor:
    """The training target from the compact label of what the classifier reads: ``(B,)`` partner
    shares → ``(1 - s) · y_own + s · y_partner`` with label smoothing (rows sum to 1), detached (Eq. 12)."""
    return pair_target(labels.to(share.device), mix.partner, 1. - share.detach().float(), num_classes, smoothing)
