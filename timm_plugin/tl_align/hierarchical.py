"""TL-Align tracers for timm's hierarchical transformers: Swin and Swin V2 (shifted windows, patch merging) and PVT
v2 (overlapping patch embeddings, spatial-reduction attention)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.models.pvt_v2 import (
    Attention as PvtAttention,
)
from timm.models.pvt_v2 import (
    Block as PvtBlock,
)
from timm.models.pvt_v2 import (
    OverlapPatchEmbed,
    PyramidVisionTransformerStage,
    PyramidVisionTransformerV2,
)
from timm.models.swin_transformer import (
    PatchMerging,
    SwinTransformer,
    SwinTransformerBlock,
    WindowAttention,
)
from timm.models.swin_transformer_v2 import PatchMerging as V2PatchMerging
from timm.models.swin_transformer_v2 import SwinTransformerV2Block
from timm.models.swin_transformer_v2 import WindowAttention as V2WindowAttention
from timm.models.swin_transformer_v2_cr import PatchMerging as CrPatchMerging
from timm.models.swin_transformer_v2_cr import (
    SwinTransformerV2Cr,
    SwinTransformerV2CrBlock,
    WindowMultiHeadAttention,
)

from shared_core.capture import Captures, LabelCapture
from shared_core.tl_align import attention_labels, merge_2x2_labels, pool_like, window_labels
from shared_core.tracer import Tracer, check_pool

from ._blocks import set_qk


class _ShiftedWindows(Tracer):
    """What the Swin tracers share: the ``(B, H, W, K)`` label map on the first block's grid, each stage's 2x2 patch
    merging at its start (``merging``, the framework's class) as the Norm of the 2x2 sum, and the hooks of a
    window attention: its softmax's probabilities, or its ``q``, ``k`` and shift mask (combined with a position
    bias as the attention combines them: :meth:`window_bias`)."""

    layout = 'grid'
    merging: type = type(None)

    def watch_model(self, captures: Captures, handles: list) -> None:
        """The first token grid: the first block's ``(B, H, W, C)`` input."""
        first = self.blocks()[0]
        handles.append(first.register_forward_pre_hook(lambda m, i: setattr(captures, 'grid', tuple(i[0].shape[1:3]))))

    @staticmethod
    def watch_softmax(attn: nn.Module, cap: LabelCapture, handles: list) -> None:
        handles.append(attn.softmax.register_forward_hook(lambda m, i, o, c=cap: setattr(c, 'attn', o.detach())))

    @staticmethod
    def watch_qk_mask(attn: nn.Module, cap: LabelCapture, handles: list) -> None:
        handles.append(
            attn.register_forward_pre_hook(
                lambda m, a, kw, c=cap: setattr(c, 'mask', kw.get('mask', a[1] if len(a) > 1 else None)),
                with_kwargs=True,
            )
        )
        handles.append(attn.qkv.register_forward_hook(lambda m, i, o, c=cap: set_qk(c, o.detach(), attn.num_heads)))

    @staticmethod
    def window_bias(cap: LabelCapture, bias: torch.Tensor, heads: int) -> torch.Tensor:
        """The position ``bias`` ``(1 or B · nW, heads, N, N)`` plus the captured shift mask ``(nW, N, N)`` per
        window, as timm's window attentions add it: ``(B · nW, heads, N, N)``."""
        Bw, N = cap.q.shape[0], cap.q.shape[2]
        bias = bias.expand(Bw, -1, -1, -1)
        if cap.mask is None:
            return bias
        nw = cap.mask.shape[0]
        mask = cap.mask.view(1, nw, 1, N, N).expand(Bw // nw, -1, heads, -1, -1)
        return bias + mask.reshape(Bw, heads, N, N)

    def enter(self, stage, Y: torch.Tensor) -> torch.Tensor:
        return merge_2x2_labels(Y) if isinstance(stage.downsample, self.merging) else Y  # timm: at a stage's start


class SwinTracer(_ShiftedWindows):
    """Label rules for timm's ``SwinTransformer``: per block, the labels take the block's cyclic shift,
    window partition, head-mean window attention (relative-position bias and shift mask included: the
    attention the token path used), window reverse and shift back, then the residual average; each
    stage's ``PatchMerging`` (timm puts it at the start of a stage) averages the 2x2 labels it merges
    (sum, then Norm); the target is the mean label (global average pooling).

    timm's ``WindowAttention`` materialises its softmax unless fused attention is switched on: the
    hook then takes the attention probabilities the token path computed; with fused attention it takes
    ``q``, ``k`` and the shift mask and recomputes the label attention (fused on accelerators)."""

    merging = PatchMerging

    def __init__(self, model: SwinTransformer):
        check_pool(model.global_pool, ('avg',), 'Swin')
        for stage in model.layers:
            if not isinstance(stage.downsample, (nn.Identity, PatchMerging)):
                raise ValueError(f'model: Swin downsample {type(stage.downsample).__name__} has no TL-Align rule')
            for blk in stage.blocks:
                if type(blk) is not SwinTransformerBlock or type(blk.attn) is not WindowAttention:
                    raise ValueError(
                        f'model: TL-Align traces timm SwinTransformerBlock/WindowAttention, got {type(blk).__name__}'
                    )
        super().__init__(model)

    def stages(self):
        return [(stage, stage.blocks) for stage in self.model.layers]

    def watch(self, blk: nn.Module, cap: LabelCapture, handles: list) -> None:
        """Its attention's ``q``, ``k`` and shift mask (fused attention), else the attention probabilities of its
        softmax."""
        if blk.attn.fused_attn:
            self.watch_qk_mask(blk.attn, cap, handles)
        else:
            self.watch_softmax(blk.attn, cap, handles)

    def branch(self, blk: SwinTransformerBlock, cap: LabelCapture, Y: torch.Tensor) -> torch.Tensor:
        """Eq. 9 for the block's (shifted) window attention on the ``(B, H, W, K)`` labels."""
        if cap.attn is not None:  # the token path's own attention probabilities
            return window_labels(Y, blk.window_size, blk.shift_size, attn=cap.attn)
        a = blk.attn
        bias = self.window_bias(cap, a._get_rel_pos_bias(), a.num_heads)
        return window_labels(Y, blk.window_size, blk.shift_size, q=cap.q, k=cap.k, bias=bias, scale=a.scale)


class SwinV2Tracer(_ShiftedWindows):
    """Label rules for timm's Swin V2, both variants: ``SwinTransformerV2`` and ``SwinTransformerV2Cr``. The geometry
    is Swin's (:class:`SwinTracer`: cyclic shift, windows, patch merging at a stage's start as the Norm of the 2x2
    sum, the residual average, the mean label): the rules differ in the attention and the norms only.

    - Scaled cosine attention with the log-spaced continuous position bias (the paper's Eq. 9 on its softmax):
      ``softmax(cos(q, k) · τ_h + 16 σ(CPB) + mask)`` (``SwinTransformerV2``), ``cos(q, k) · τ_h + meta-MLP bias +
      mask`` (``V2Cr``), head-averaged. The rule reads the attention where the block normalises it, whatever the
      logits are made of: ``SwinTransformerV2`` materialises its softmax in a module, whose output the hook takes;
      ``V2Cr`` calls ``softmax`` inline, so the hooks take its ``q``, ``k``, shift mask and the meta-MLP's output
      (the position bias the token path computed) and the label path forms the same logits, the cosine of the
      normalised ``q`` and ``k`` times the clamped logit scale plus that bias (fused on accelerators).
    - Residual post-norm (``x + norm(attn(x))``) and V2Cr's extra main-branch norms: point-wise, labels unchanged.
    """

    def __init__(self, model):
        cr = isinstance(model, SwinTransformerV2Cr)
        pool = model.head.global_pool.pool_type if cr else model.global_pool
        check_pool(pool, ('avg',), 'Swin V2')
        block, attention, merging = (
            (SwinTransformerV2CrBlock, WindowMultiHeadAttention, CrPatchMerging)
            if cr
            else (SwinTransformerV2Block, V2WindowAttention, V2PatchMerging)
        )
        self.cr, self.merging = cr, merging
        for stage in self.stage_modules(model):
            if not isinstance(stage.downsample, (nn.Identity, merging)):
                raise ValueError(f'model: Swin V2 downsample {type(stage.downsample).__name__} has no TL-Align rule')
            for blk in stage.blocks:
                if type(blk) is not block or type(blk.attn) is not attention:
                    raise ValueError(
                        f'model: TL-Align traces timm {block.__name__}/{attention.__name__}, got {type(blk).__name__}'
                    )
        super().__init__(model)

    @staticmethod
    def stage_modules(model) -> list:
        return list(model.stages if isinstance(model, SwinTransformerV2Cr) else model.layers)

    def stages(self):
        return [(stage, stage.blocks) for stage in self.stage_modules(self.model)]

    def watch(self, blk: nn.Module, cap: LabelCapture, handles: list) -> None:
        """The attention probabilities of its softmax (``SwinTransformerV2``), or its ``q``, ``k``, shift mask and
        position bias (``V2Cr``: the meta-MLP's ``(N², heads)`` output)."""
        if not self.cr:
            self.watch_softmax(blk.attn, cap, handles)
            return
        self.watch_qk_mask(blk.attn, cap, handles)
        handles.append(blk.attn.meta_mlp.register_forward_hook(lambda m, i, o, c=cap: setattr(c, 'bias', o.detach())))

    def branch(self, blk: nn.Module, cap: LabelCapture, Y: torch.Tensor) -> torch.Tensor:
        """Eq. 9 for the block's (shifted) window attention on the ``(B, H, W, K)`` labels."""
        if not self.cr:
            return window_labels(Y, blk.window_size, blk.shift_size, attn=cap.attn)
        a = blk.attn
        heads, N = a.num_heads, cap.q.shape[2]
        tau = torch.clamp(a.logit_scale.detach().float().reshape(1, heads, 1, 1), max=math.log(1.0 / 0.01)).exp()
        q = F.normalize(cap.q.float(), dim=-1) * tau  # the cosine's logit scale, per head
        k = F.normalize(cap.k.float(), dim=-1)
        position = cap.bias.float().transpose(1, 0).reshape(1, heads, N, N)  # as _relative_positional_encodings
        bias = self.window_bias(cap, position, heads)
        return window_labels(Y, blk.window_size, blk.shift_size, q=q, k=k, bias=bias, scale=1.0)


# ---------------------------------------------------------------------------------------------- PVT v2


class PvtV2Tracer(Tracer):
    """Label rules for timm's ``PyramidVisionTransformerV2`` (the TL-Align paper, Eq. 9/11 and Table 9).

    - Initial labels: one per token of the first (overlapping, 7x7 stride-4) patch embedding, from the
      partner share of its 4x4 stride cell: give the mixer ``patch_size=4`` (the stride), so the token
      grid is the mix grid. The 7x7 receptive field overlaps the neighbouring cells; that is not traced.
    - Overlapping patch embedding between stages (3x3 conv, stride 2, padding 1): spatial aggregation,
      Table 9's ``Norm(Σ Y_i)`` over the tokens each output token concatenates, i.e. average pooling of
      the labels with the conv's own window geometry (kernel 3, stride 2, padding 1, padded positions
      not counted): each output label is the mean of the in-grid labels of its (overlapping) 3x3 window.
      This is exact for the conv's geometry, where an area (adaptive) pooling would ignore the overlap.
    - Attention with spatial-reduction keys: queries are all tokens; the keys' labels are the labels
      pooled the way the keys were: ``sr`` conv (kernel = stride = sr_ratio) → average pooling with
      that geometry; the ``linear`` variant (``AdaptiveAvgPool2d(7)`` then a 1x1 conv) → adaptive
      average pooling to 7x7. ``Y ← Norm(Y + mean_h softmax(q kᵀ · scale) · Y_keys)`` (Eq. 9/11) with the
      captured ``q`` (hook on ``attn.q``) and ``k`` (hook on ``attn.kv``), fused on accelerators.
    - MLP: left unchanged, as the paper's Eq. 11 does for the (channel) MLP. Simplification: PVT v2's
      MLP has a 3x3 depthwise conv, a static spatial mixing for which Table 9 would give
      ``Y ← Norm(W^s) · Y``; it is not traced (it would blur labels by at most one token per block).
    - Stage norms are point-wise; the target is the mean label of the last stage (global average pooling).
    """

    layout = 'map'

    def __init__(self, model: PyramidVisionTransformerV2):
        check_pool(model.global_pool, ('avg',), 'PVT v2')
        for stage in model.stages:
            if type(stage) is not PyramidVisionTransformerStage:
                raise ValueError(
                    f'model: TL-Align traces PVT v2 PyramidVisionTransformerStage, got {type(stage).__name__}'
                )
            if stage.downsample is not None and type(stage.downsample) is not OverlapPatchEmbed:
                raise ValueError(f'model: PVT v2 downsample {type(stage.downsample).__name__} has no TL-Align rule')
            for b in stage.blocks:
                if type(b) is not PvtBlock or type(b.attn) is not PvtAttention:
                    raise ValueError(f'model: TL-Align traces PVT v2 Block/Attention, got {type(b).__name__}')
        super().__init__(model)

    def stages(self):
        return [(stage, stage.blocks) for stage in self.model.stages]

    def watch_model(self, captures: Captures, handles: list) -> None:
        """The first token grid: ``patch_embed``'s output."""
        embed = self.model.patch_embed
        handles.append(embed.register_forward_hook(lambda m, i, o: setattr(captures, 'grid', tuple(o.shape[1:3]))))

    def watch(self, blk: nn.Module, cap: LabelCapture, handles: list) -> None:
        """The block's grid (``feat_size``), ``q`` and the ``kv`` projection."""
        handles.append(
            blk.register_forward_pre_hook(
                lambda m, a, kw, c=cap: setattr(c, 'tokens', tuple(kw['feat_size'] if 'feat_size' in kw else a[1])),
                with_kwargs=True,
            )
        )
        handles.append(blk.attn.q.register_forward_hook(lambda m, i, o, c=cap: setattr(c, 'q', o.detach())))
        handles.append(blk.attn.kv.register_forward_hook(lambda m, i, o, c=cap: setattr(c, 'k', o.detach())))

    @staticmethod
    def _key_labels(a: PvtAttention, Y: torch.Tensor) -> torch.Tensor:
        """The labels of the keys, pooled as the keys were: ``(B, K, H, W)`` → ``(B, N_k, K)``."""
        if a.pool is not None:  # linear variant: AdaptiveAvgPool2d(7), then a 1x1 conv
            Y = pool_like(F.adaptive_avg_pool2d(Y, a.pool.output_size), a.sr)
        elif a.sr is not None:  # spatial reduction: conv with kernel = stride = sr_ratio
            Y = pool_like(Y, a.sr)
        return Y.flatten(2).transpose(1, 2)

    def enter(self, stage, Y: torch.Tensor) -> torch.Tensor:
        return Y if stage.downsample is None else pool_like(Y, stage.downsample.proj)

    def branch(self, blk: nn.Module, cap: LabelCapture, Y: torch.Tensor) -> torch.Tensor:
        """Eq. 9 with spatial-reduction keys on the ``(B, K, H, W)`` labels."""
        if cap.tokens != tuple(Y.shape[-2:]):
            raise ValueError(
                f'model: a PVT v2 block ran on a {cap.tokens} grid, the labels are on {tuple(Y.shape[-2:])}'
            )
        a = blk.attn
        B, K = Y.shape[:2]
        N, Nk = Y.shape[-2] * Y.shape[-1], cap.k.shape[1]
        q = cap.q.reshape(B, N, a.num_heads, a.head_dim).transpose(1, 2)
        k = cap.k.reshape(B, Nk, 2, a.num_heads, a.head_dim)[:, :, 0].transpose(1, 2)
        branch = attention_labels(q, k, self._key_labels(a, Y), scale=a.scale)  # (B, N, K); MLP residual: Y
        return branch.transpose(1, 2).reshape(B, K, *Y.shape[-2:])
