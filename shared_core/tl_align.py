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

from dataclasses import replace
from typing import Any, Callable, List, Optional, Protocol, Sequence, Tuple

import torch
import torch.nn.functional as F

from .checks import check_layers
from .label_attention import (
    use_fused_label_attn,
)
from .mix import Mix, partner_target
from .options import DROP_PATH_LABELS, TRANSMIX_MODES

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
    'self_attention_labels',
    'swin_labels',
    'talking_heads_labels',
    'conv_pool_labels',
    'aligned_target',
    'kept_samples',
    'DROP_PATH_LABELS',
    'check_drop_path',
    'LabelCapture',
    'check_captured',
    'LabelTracer',
    'capture_forward',
    'check_transmix',
    'trace_labels',
    'tracer_for',
    'check_layers',
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
    labels = labels.to(share.device)
    return partner_target(labels, mix.partner, share, num_classes, smoothing, reversed_pairs=mix.reversed_pairs)


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
    ``tokens`` the token grid or count the block saw, ``scale`` the attention's scale."""

    __slots__ = ('q', 'k', 'keep', 'attn', 'mask', 'tokens', 'scale')

    def __init__(self):
        self.q = self.k = self.keep = self.attn = self.mask = self.tokens = self.scale = None


def check_captured(captures: List[LabelCapture], fields, why: str) -> None:
    """Refuse a forward after which a block's capture lacks a field the rule reads (``why``: the likely cause)."""
    for i, c in enumerate(captures):
        if any(getattr(c, f) is None for f in fields):
            raise ValueError(f'model: block {i} left no {"/".join(fields)} for the label path: {why}')


class LabelTracer(Protocol):
    """The rules of one architecture (one per framework and model family; see the adapters).

    - ``num_prefix_tokens``: leading non-patch tokens of the label state (class, distillation, register);
    - ``depth``: the number of blocks that ``layers`` indexes;
    - ``register(captures)``: forward hooks that append/fill :class:`LabelCapture` records; returns handles;
    - ``num_tokens(captures)``: tokens of the label state for the captured forward (prefix + patches);
    - ``propagate(captures, labels, layers, residual)``: the label state through every block (no grad);
    - ``readout(labels, output)``: ``(B, K)`` the label of what the classifier reads;
    - ``class_attention(captures)``: ``(q_cls (B, H, 1, d), k (B, H, T, d), scale[, mask])`` of the last block (or
      the class token's attention probabilities ``(B, H, 1, T)`` themselves) for
      TransMix's class-token rule, or ``None`` where the classifier reads no class token;
    - ``attends``: whether the last block, the one TransMix reads, mixes its tokens by a self-attention
      (:func:`check_transmix`); where not, ``why_no_attention`` says what mixes them there.
    """

    num_prefix_tokens: int
    attends: bool
    why_no_attention: str

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


def check_transmix(tracer: LabelTracer, model, name: str = 'model') -> None:
    """TransMix reads the last block's self-attention: refuse, naming the family and what mixes its tokens there,
    a model whose tracer does not attend there (``tracer.attends``)."""
    if not tracer.attends:
        raise ValueError(
            f"{name}: TransMix reads the last block's self-attention, and {type(model).__name__} has none there: "
            f'{tracer.why_no_attention}; TL-Align traces it (TLAlign, --mixup-type tl_align)'
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
            share = trace_labels(tracer, captures, output, labels.to(dev), {tracer.depth - 1}, False)[:, 0]
    if mode == 'average':
        share = 0.5 * share + 0.5 * (1.0 - mix.lam.to(share.device))
    return share
