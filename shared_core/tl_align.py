"""TL-Align's label path, framework-free (the TL-Align paper, Sec. 3.3 and Table 9 of Appendix A).

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
  branch was dropped for a sample (stochastic depth) leaves that sample's labels unchanged
  (``drop_path='kept'``; ``'public'``, the public code, updates them as if the branch had run);
- MLP, norms, channel mixing: unchanged (Table 9);
- spatial aggregation (patch merging): sum of the merged labels, then Norm (rows back to sum 1);
- the target: the label of the token the classifier reads (class token), or the mean over the tokens
  it pools.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace
from typing import Any, Callable, List, Optional, Protocol, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from .checks import check_layers
from .mix import Mix, partner_target

__all__ = [
    'abs_row_norm',
    'linear_token_mixing',
    'conv_stencil_labels',
    'compact_labels',
    'dense_labels',
    'attention_labels',
    'shared_attention',
    'LabelColumns',
    'residual_labels',
    'merge_labels',
    'merge_2x2_labels',
    'window_labels',
    'self_attention_labels',
    'swin_labels',
    'talking_heads_labels',
    'conv_pool_labels',
    'aligned_target',
    'kept_samples',
    'DROP_PATH_LABELS',
    'check_drop_path',
    'LabelCapture',
    'LabelTracer',
    'capture_forward',
    'trace_labels',
    'tracer_for',
    'check_layers',
    'TRANSMIX_MODES',
    'transmix_share',
    'nearest_token_share',
    'use_fused_label_attn',
    'set_fused_label_attn',
    'fused_label_attn',
]


# ----------------------------------------------------------------------------------------------
# The one switch: the label attention as a fused SDPA call or a transient softmax
# ----------------------------------------------------------------------------------------------

#: environment override: ``TOKENAUG_FUSED_LABEL_ATTN=1`` (always fused) / ``0`` (never); unset: by device and path
FUSED_ENV = 'TOKENAUG_FUSED_LABEL_ATTN'
_FUSED: Optional[bool] = None if os.environ.get(FUSED_ENV, '') == '' else os.environ[FUSED_ENV] not in ('0', 'false')
#: the innermost :func:`fused_label_attn` scope's choice: a plain global (read inside a compiled forward, dynamo
#: guards on it; torch 2.11's dynamo breaks the graph at a ``ContextVar.get`` in every block)
_FUSED_SCOPE: Optional[bool] = None


def set_fused_label_attn(enable: Optional[bool]) -> None:
    """Process-wide choice (as timm's ``set_fused_attn``): ``True``/``False``, or ``None`` for the default."""
    global _FUSED
    _FUSED = enable


@contextlib.contextmanager
def fused_label_attn(enable: Optional[bool]):
    """The choice inside a ``with`` block (what a wrapper's ``fused=`` argument sets); ``None`` leaves it."""
    global _FUSED_SCOPE
    outer = _FUSED_SCOPE
    if enable is not None:
        _FUSED_SCOPE = enable
    try:
        yield
    finally:
        _FUSED_SCOPE = outer


def use_fused_label_attn(device: torch.device, shared: bool = False) -> bool:
    """Whether the label attention runs as a fused ``scaled_dot_product_attention`` call: the innermost
    :func:`fused_label_attn` scope, else :func:`set_fused_label_attn` / ``$TOKENAUG_FUSED_LABEL_ATTN``, else by
    device and path. ``shared``: the labels ride as extra value columns in the token path's own call
    (:class:`LabelColumns`): fused on every device (on the CPU too, PyTorch's fused CPU kernel with a few more
    columns costs less than materialising the attention once, ``bench/RESULTS.md``). A separate label-only call
    (the recomputing path): fused on accelerators, a transient softmax on the CPU (the fused CPU kernel is slower
    for the 1-wide values of the compact state)."""
    if _FUSED_SCOPE is not None:
        return _FUSED_SCOPE
    if _FUSED is not None:
        return _FUSED
    return shared or torch.device(device).type != 'cpu'


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
    fused: Optional[bool] = None,
) -> torch.Tensor:
    """Eq. 9: the head-mean of the attention ``softmax(q kᵀ · scale + attn_mask)`` applied to the labels.

    ``q``, ``k``: ``(B, H, T, d)`` as the token path's attention saw them (``k`` may have fewer tokens
    than ``q``, e.g. spatial-reduction keys, and then ``labels`` are the labels of the keys);
    ``labels``: ``(B, T_k, K)``; ``attn_mask``: an additive float bias or a boolean mask broadcastable
    to ``(B, H, T_q, T_k)``. Returns ``(B, T_q, K)`` in fp32.

    ``fused`` (default: :func:`use_fused_label_attn`) computes it with ``scaled_dot_product_attention`` and
    the labels as values, never materialising the attention; otherwise one transient ``softmax(q kᵀ)`` per
    call. Either way the token path is untouched.
    """
    if fused is None:
        fused = use_fused_label_attn(q.device)
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
            logits = (
                logits.masked_fill(~attn_mask, float('-inf')) if attn_mask.dtype == torch.bool else logits + attn_mask
            )
        return logits.softmax(-1).mean(1) @ labels.float()


def shared_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    labels: torch.Tensor,
    scale: float,
    attn_mask: Optional[torch.Tensor] = None,
    fused: Optional[bool] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The token path's attention and Eq. 9's label branch from one attention: ``(out, branch)`` with ``out``
    what ``scaled_dot_product_attention(q, k, v, attn_mask, scale=scale)`` gives the token path (with its
    gradients) and ``branch`` ``(B, T, K)`` fp32, without gradients: ``mean_h softmax(q kᵀ · scale + mask) ·
    labels`` (``labels`` ``(B, T, K)``, no gradients).

    ``fused`` (default :func:`use_fused_label_attn` with ``shared``: fused on every device): one fused call with
    the labels as extra value columns
    (:class:`LabelColumns`, for one call; a model's forward keeps one across its blocks). Unfused: the attention
    materialised once (its logits in fp32) for both paths. No attention dropout here (callers keep the
    recomputing path then).
    """
    if fused is None:
        fused = use_fused_label_attn(q.device, shared=True)
    if fused:
        columns = LabelColumns(labels, q.shape[1], q.shape[-1], v.dtype)
        out, heads = columns.attend(torch.stack([q, k, v]), scale, attn_mask)
        return out, heads.div_(q.shape[1])
    with torch.autocast(device_type=q.device.type, enabled=False):
        logits = (q.float() * scale) @ k.float().transpose(-2, -1)
        if attn_mask is not None:
            logits = (
                logits.masked_fill(~attn_mask, float('-inf'))
                if attn_mask.dtype == torch.bool
                else logits + attn_mask.float()
            )
        attn = logits.softmax(-1)
        with torch.no_grad():
            branch = attn.mean(1) @ labels.float()
    return attn.to(v.dtype) @ v, branch


_ATEN = torch.ops.aten
#: PyTorch's fused CPU attention and its backward (what ``scaled_dot_product_attention`` runs on the CPU)
_CPU_FLASH = all(
    hasattr(_ATEN, n)
    for n in ('_scaled_dot_product_flash_attention_for_cpu', '_scaled_dot_product_flash_attention_for_cpu_backward')
)


class _CPUSharedAttention(torch.autograd.Function):
    """The CPU's fused attention over ``[q | 0]``, ``[k | 0]``, ``[v | labels]`` whose backward is the plain
    attention's: the zero columns leave the logits, the softmax and its log-sum-exp as they are, and the label
    columns carry no gradient, so the backward runs PyTorch's own CPU attention backward on ``q, k, v`` at their
    head dim with the forward's log-sum-exp (the gradients are the plain ``scaled_dot_product_attention``'s,
    bit for bit on this machine) instead of at the wider one."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, ext: torch.Tensor, scale: float, width: int):
        q, k, v = torch.cat([qkv, ext], -1).unbind(0)
        out, lse = _ATEN._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)
        d = qkv.shape[-1]  # one op takes the token columns, the label columns and the padding (maybe 0) apart
        tokens, labels, _ = out.split_with_sizes([d, width, out.shape[-1] - d - width], -1)
        ctx.mark_non_differentiable(labels)
        ctx.set_materialize_grads(False)  # no zeros for the label columns' (absent) gradient
        ctx.save_for_backward(*qkv.unbind(0), tokens, lse)
        ctx.scale = scale
        return tokens, labels

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _):
        q, k, v, out, lse = ctx.saved_tensors
        grads = _ATEN._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, False, scale=ctx.scale
        )
        return torch.stack(grads), None, None, None


def _cpu_shared_attention(qkv: torch.Tensor, attn_mask: Optional[torch.Tensor]) -> bool:
    """Whether :class:`_CPUSharedAttention` applies: eager (a compiled graph gets the plain call, which inductor
    optimises itself), on the CPU, no mask, a dtype the CPU kernel takes."""
    return (
        _CPU_FLASH
        and attn_mask is None
        and qkv.device.type == 'cpu'
        and qkv.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and not torch.compiler.is_compiling()
    )


class LabelColumns:
    """TL-Align's label state as extra value columns of the token path's own fused attention, for one forward
    (issue 12): a buffer ``(3, B, 1, T, W)`` holds zeros for ``q`` and ``k`` and the label columns for ``v``, so one
    concatenation with a block's stacked ``qkv`` ``(3, B, H, T, d)`` gives ``[q | 0]``, ``[k | 0]`` and ``[v |
    labels]`` (kernels want equal head dims; ``d + W`` a multiple of 8), and the state is updated in place after
    each block (Eq. 11).

    The columns hold ``Z = c · Y``, the state scaled by a power of two ``c`` per sample (exact in floating point):
    Eq. 11's ``Y ← (Y + Σ_h A_h Y / H) / 2`` is then one in-place ``Z ← Z + Σ_h A_h Z / H`` with ``c`` doubled (a
    sample whose branch stochastic depth dropped keeps ``Z`` and ``c``), and :attr:`state` is ``Z / c``.

    fp32: ``Z`` is the buffer's value columns themselves. A lower precision (``dtype``, the dtype ``qkv`` has
    under autocast): ``Z`` stays fp32 and travels as two columns per label, ``hi`` (rounded) and ``lo`` (its
    rounding error), whose sum keeps fp32-like precision; the heads are summed in fp32. The label columns carry
    no gradient (the buffer does not require one), so the gradients of ``qkv`` are the plain attention's.
    """

    def __init__(self, labels: torch.Tensor, num_heads: int, head_dim: int, dtype: torch.dtype):
        labels = labels.float()
        if labels.requires_grad:
            labels = labels.detach()
        B, T, K = labels.shape
        self.num_heads, self.head_dim, self.split = num_heads, head_dim, dtype != torch.float32
        self.width = 2 * K if self.split else K
        self.buf = labels.new_zeros(3, B, 1, T, self.width + (-(head_dim + self.width) % 8), dtype=dtype)
        self.ext = self.buf.expand(3, B, num_heads, T, self.buf.shape[-1])
        self.scale: Union[float, torch.Tensor] = 1.0  # c: a float while every sample doubles, else (B, 1, 1)
        cols = self.buf[2, :, 0]
        if self.split:
            self.z = labels.clone()
            self._hi, self._lo = cols[..., :K], cols[..., K : 2 * K]
            self._write()
        else:
            self.z = cols[..., :K]
            self.z.copy_(labels)

    @property
    def state(self) -> torch.Tensor:
        """The label state ``Y = Z / c`` ``(B, T, K)`` fp32."""
        return self.z / self.scale

    def _write(self) -> None:
        self._hi.copy_(self.z)
        # in fp32, rounded once as it is written; compiled: a copy (dynamo breaks the graph at an ``out=`` view,
        # and inductor fuses the two), eager: one op
        if torch.compiler.is_compiling():
            self._lo.copy_(self.z - self._hi)
        else:
            torch.sub(self.z, self._hi, out=self._lo)

    def attend(
        self, qkv: torch.Tensor, scale: float, attn_mask: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(out, heads)``: the token path's ``scaled_dot_product_attention(q, k, v, attn_mask, scale=scale)``
        ``(B, H, T, d)`` for ``q, k, v = qkv.unbind(0)``, and ``Σ_h softmax(q kᵀ · scale + mask) · Z`` ``(B, T, K)``
        fp32 without gradient (for :meth:`update`)."""
        d = self.head_dim
        if _cpu_shared_attention(qkv, attn_mask):  # the backward at the head dim (the plain one)
            out, lab = _CPUSharedAttention.apply(qkv, self.ext, scale, self.width)
        else:
            q, k, v = torch.cat([qkv, self.ext], -1).unbind(0)
            wide = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
            # two slices, not one split: the token slice's backward is one op (a split's: two zeros and a cat)
            out, lab = wide[..., :d], wide[..., d : d + self.width]
        with torch.no_grad():
            if self.split:  # the heads and the hi + lo pair summed in fp32
                heads = lab.unflatten(-1, (2, self.width // 2)).sum((1, 3), dtype=torch.float32)
            else:
                heads = lab.sum(1)
        return out, heads

    def update(self, heads: torch.Tensor, keep: Optional[torch.Tensor] = None, residual: bool = True) -> None:
        """Eq. 11 with the head mean, ``Y ← Norm(Y + Σ_h A_h Y / H)`` (``residual=False``: ``Y ← Σ_h A_h Y / H``),
        for the samples whose branch ran (``keep`` (B,) bool; the others keep their labels exactly)."""
        H = self.num_heads
        with torch.no_grad():
            if not residual:  # Z ← Σ_h A_h Z / H, c unchanged
                new = heads.div_(H)
                self.z.copy_(torch.where(keep.view(-1, 1, 1), new, self.z) if keep is not None else new)
            elif keep is None:
                self.z.add_(heads, alpha=1.0 / H)
                self.scale = self.scale * 2.0
            else:
                kept = keep.view(-1, 1, 1).float()
                self.z.addcmul_(heads, kept, value=1.0 / H)
                self.scale = self.scale * (kept + 1.0)
            if self.split:
                self._write()


def residual_labels(
    labels: torch.Tensor, branch: torch.Tensor, keep: Optional[torch.Tensor] = None, residual: bool = True
) -> torch.Tensor:
    """Eq. 11: ``Norm(Y + branch)`` with Norm the plain average; ``keep`` (B,) bool marks the samples
    whose residual branch ran (stochastic depth drops it for the others: their labels stay).
    ``residual=False`` (Table 8 ablation, "normalization disabled") drops the residual from the label
    path: ``Y ← branch``."""
    new = torch.lerp(labels, branch, 0.5) if residual else branch
    if keep is not None:
        new = torch.where(keep.view(-1, *([1] * (labels.dim() - 1))), new, labels)
    return new


def merge_labels(labels: torch.Tensor) -> torch.Tensor:
    """Spatial aggregation (patch merging): ``Norm(Σ merged labels)`` over the last-but-one dim of a
    ``(..., M, K)`` group of merged tokens. For labels that already sum to 1 this is their mean."""
    return labels.mean(-2)


def self_attention_labels(
    blocks, labels: torch.Tensor, layers: Optional[set] = None, residual: bool = True
) -> torch.Tensor:
    """A stack of pre-norm transformer blocks (attention residual, then MLP residual, which leaves labels
    as they are): ``blocks`` yields ``(q, k, scale, keep)`` per block, ``keep`` the samples whose
    attention branch stochastic depth kept (``None``: all). ``layers``: align only at these indices."""
    for idx, (q, k, scale, keep) in enumerate(blocks):
        if layers is not None and idx not in layers:
            continue  # not aligned here: the labels pass unchanged
        labels = residual_labels(labels, attention_labels(q, k, labels, scale=scale), keep, residual)
    return labels


def swin_labels(
    labels: torch.Tensor,
    grid: Tuple[int, int],
    stages: Sequence[Tuple[int, bool]],
    block_branch: Callable[[int, torch.Tensor], torch.Tensor],
    keeps: Sequence[Optional[torch.Tensor]],
    merge_at: str,
    layers: Optional[set] = None,
    residual: bool = True,
    history: Optional[list] = None,
) -> torch.Tensor:
    """Swin's stage rule on the ``(B, H·W, K)`` labels of the first token grid ``grid``: per stage of
    ``(num_blocks, merges)``, a 2x2 patch merging (:func:`merge_2x2_labels`) at the ``'start'`` of the
    stage (timm) or its ``'end'`` (mmpretrain), and per block ``Y ← Norm(Y + block_branch(idx, Y))``
    (Eq. 9/11; ``block_branch`` the block's window-attention labels, :func:`window_labels`) for the
    samples whose branch ``keeps[idx]`` kept. Returns the last grid's labels ``(B, H'·W', K)``; ``history``
    (a list) gets each block's state on its grid, ``(B, H', W', K)``, after the block (tokenaug-viz)."""
    if merge_at not in ('start', 'end'):
        raise ValueError(f"merge_at: expected 'start' or 'end', got {merge_at!r}")
    Y = labels.view(labels.shape[0], grid[0], grid[1], labels.shape[-1])
    idx = 0
    for num_blocks, merges in stages:
        if merges and merge_at == 'start':
            Y = merge_2x2_labels(Y)
        for _ in range(num_blocks):
            if layers is None or idx in layers:
                Y = residual_labels(Y, block_branch(idx, Y), keeps[idx], residual)
            if history is not None:
                history.append(Y.clone())
            idx += 1
        if merges and merge_at == 'end':
            Y = merge_2x2_labels(Y)
    return Y.flatten(1, 2)


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


def conv_stencil_labels(labels: torch.Tensor, stencil: torch.Tensor, padding, stride=1) -> torch.Tensor:
    """Table 9 spatial mixing for a convolution used as one fixed non-negative stencil ``S`` ``(kh, kw)`` on a
    ``(B, K, H, W)`` label map: ``Y'[p] = Σ_q S[q - s·p + pad] Y[q] / Σ_q S[q - s·p + pad]`` over the in-grid
    positions ``q`` of the window (the conv's zero padding is no token), i.e. the conv's equivalent ``(N_out, N)``
    matrix with rows normalised to sum 1 (the same cross-correlation as the token path). A ``stride`` > 1 (a
    strided conv: mixing and spatial aggregation at once) reads every ``stride``-th window, as the conv does."""
    K, H, W = labels.shape[1:]
    S = stencil.to(labels.dtype)[None, None]
    num = F.conv2d(labels, S.expand(K, 1, *S.shape[-2:]), stride=stride, padding=padding, groups=K)
    den = F.conv2d(labels.new_ones(1, 1, H, W), S, stride=stride, padding=padding)
    return num / den.clamp_min(torch.finfo(labels.dtype).tiny)


def conv_pool_labels(labels: torch.Tensor, kernel_size, stride, padding) -> torch.Tensor:
    """Table 9 spatial aggregation for a strided conv on a ``(B, K, H, W)`` label map: every output token's
    label is the Norm of the sum (the mean) of the labels in its window, with the conv's kernel, stride and
    padding; padding positions are not tokens (``count_include_pad=False``)."""
    return F.avg_pool2d(labels, kernel_size, stride, padding, count_include_pad=False)


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
    return partner_target(labels.to(share.device), mix.partner, share, num_classes, smoothing, flip=mix.flip)


# ----------------------------------------------------------------------------------------------
# The driver: what every adapter runs (hooks -> forward -> label path -> readout)
# ----------------------------------------------------------------------------------------------


def kept_samples(inp: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``(B,)`` bool: the samples whose residual branch survived DropPath (it zeroes whole samples; a
    branch input that is all zero counts as kept), from a drop-path module's input and output."""
    return (out.flatten(1) != 0).any(1) | (inp.flatten(1) == 0).all(1)


class LabelCapture:
    """What one block's token path left for the label path (each tracer fills the fields it needs):
    ``q``/``k`` ``(B, H, T, d)`` (or the projections they are split from), ``keep`` the samples whose
    attention branch ran, ``attn`` materialised attention probabilities, ``mask`` an attention mask,
    ``tokens`` the token grid or count the block saw."""

    __slots__ = ('q', 'k', 'keep', 'attn', 'mask', 'tokens')

    def __init__(self):
        self.q = self.k = self.keep = self.attn = self.mask = self.tokens = None


class LabelTracer(Protocol):
    """The rules of one architecture (one per framework and model family; see the adapters).

    - ``num_prefix_tokens``: leading non-patch tokens of the label state (class, distillation, register);
    - ``depth``: the number of blocks that ``layers`` indexes;
    - ``register(captures)``: forward hooks that append/fill :class:`LabelCapture` records; returns handles;
    - ``num_tokens(captures)``: tokens of the label state for the captured forward (prefix + patches);
    - ``propagate(captures, labels, layers, residual)``: the label state through every block (no grad);
    - ``readout(labels, output)``: ``(B, K)`` the label of what the classifier reads;
    - ``class_attention(captures)``: ``(q_cls (B, H, 1, d), k (B, H, T, d), scale)`` of the last block for
      TransMix's class-token rule, or ``None`` where the classifier reads no class token.
    """

    num_prefix_tokens: int

    @property
    def depth(self) -> int: ...

    def register(self, captures: List[LabelCapture]) -> list: ...

    def num_tokens(self, captures: List[LabelCapture]) -> int: ...

    def propagate(
        self, captures: List[LabelCapture], labels: torch.Tensor, layers: Optional[set], residual: bool
    ) -> torch.Tensor: ...

    def readout(self, labels: torch.Tensor, output: Any) -> torch.Tensor: ...

    def class_attention(self, captures: List[LabelCapture]) -> Optional[tuple]: ...


def tracer_for(model, supported: dict, name: str = 'model') -> LabelTracer:
    """The tracer of ``model`` from ``{model class: tracer class}`` (most specific first); an error
    listing the supported classes otherwise."""
    if hasattr(model, '_orig_mod'):  # torch.compile's OptimizedModule: its hooks would not see the graph
        raise ValueError(
            f"{name}: a torch.compile'd model; wrap the plain model first and compile the wrapper "
            '(torch.compile(TLAlign(model)))'
        )
    for cls, tracer in supported.items():
        if isinstance(model, cls):
            return tracer(model)
    names = ', '.join(f'{c.__module__}.{c.__name__}' for c in supported)
    raise ValueError(
        f'{name}: TL-Align has no tracer for {type(model).__module__}.{type(model).__name__}; supported: {names}'
    )


def capture_forward(tracer: LabelTracer, forward: Callable[[], Any]) -> Tuple[Any, List[LabelCapture]]:
    """Run ``forward()`` (the token path, unchanged) with the tracer's hooks; returns its output and the
    captures. The hooks are removed whatever happens."""
    captures: List[LabelCapture] = []
    handles = tracer.register(captures)
    try:
        output = forward()
    finally:
        for h in handles:
            h.remove()
    return output, captures


#: what the label path does where stochastic depth dropped a sample's attention branch: ``'kept'`` (ours: the
#: branch did not run, the labels stay) or ``'public'`` (the public code: the labels update regardless)
DROP_PATH_LABELS = ('kept', 'public')


def check_drop_path(drop_path: str, name: str = 'drop_path') -> str:
    if drop_path not in DROP_PATH_LABELS:
        raise ValueError(f'{name}: expected one of {DROP_PATH_LABELS}, got {drop_path!r}')
    return drop_path


def trace_labels(
    tracer: LabelTracer,
    captures: List[LabelCapture],
    output: Any,
    labels: torch.Tensor,
    layers: Optional[set] = None,
    residual: bool = True,
    drop_path: str = 'kept',
) -> torch.Tensor:
    """The label path after a captured forward: the initial state ``labels`` ``(B, T, K)`` through every
    block (no gradients, fp32 whatever autocast the token path ran under), read out as ``(B, K)``.
    ``drop_path`` (:data:`DROP_PATH_LABELS`): ``'public'`` ignores which samples stochastic depth dropped."""
    if check_drop_path(drop_path) == 'public':
        for c in captures:
            c.keep = None
    if tracer.num_tokens(captures) != labels.shape[1]:
        raise ValueError(
            f'labels: {labels.shape[1]} token labels for {tracer.num_tokens(captures)} tokens '
            f'(prefix {tracer.num_prefix_tokens} + patches): the patch grid of x does not match'
        )
    with torch.no_grad(), torch.autocast(device_type=labels.device.type, enabled=False):
        state = tracer.propagate(captures, labels.float(), layers, residual)
        return tracer.readout(state, output)


#: TransMix's rules: ``'paper'`` (the attention share alone) and ``'average'`` (its mean with the area share)
TRANSMIX_MODES = ('paper', 'average')


def nearest_token_share(mix: Mix) -> torch.Tensor:
    """``(B, gh, gw)`` the partner share of each patch's top-left pixel: the nearest-neighbour downsampling of
    the pixel mask that the public TransMix code uses (``nn.Upsample(mode='nearest')`` to the patch grid). Equal
    to the token shares for token masks and blends; 0/1 per patch for pixel CutMix boxes."""
    ph, pw = mix.patch_size
    return mix.pixel_share()[:, 0, ::ph, ::pw]


def transmix_share(
    tracer: LabelTracer, captures: List[LabelCapture], output: Any, mix: Mix, mode: str = 'paper'
) -> torch.Tensor:
    """TransMix's ``(B,)`` partner share of the target from the last block's attention.

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
            q_cls, k, scale = qk
            with torch.autocast(device_type=q_cls.device.type, enabled=False):
                P = tracer.num_prefix_tokens
                s = mix.token_share_flat().float().to(q_cls.device)
                v = torch.zeros(s.shape[0], P + s.shape[1], 2, device=s.device)
                v[:, P:, 0], v[:, P:, 1] = s, 1.0
                num_den = attention_labels(q_cls, k, v, scale=scale)[:, 0]
                share = num_den[:, 0] / num_den[:, 1]
        else:
            labels = compact_labels(mix, tracer.num_prefix_tokens)
            dev = next(t for c in captures[::-1] for t in (c.q, c.k, c.attn) if t is not None).device
            share = trace_labels(tracer, captures, output, labels.to(dev), {tracer.depth - 1}, False)[:, 0]
    if mode == 'average':
        share = 0.5 * share + 0.5 * (1.0 - mix.lam.to(share.device))
    return share
