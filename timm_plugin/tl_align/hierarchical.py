"""TL-Align tracers for timm's hierarchical transformers: Swin (shifted windows, patch merging) and PVT v2
(overlapping patch embeddings, spatial-reduction attention)."""

from __future__ import annotations

from typing import List, Optional

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

from shared_core.tl_align import (
    LabelCapture,
    attention_labels,
    residual_labels,
    swin_labels,
    window_labels,
)

from ._blocks import StagedBlocks, hook_drop_path, pool_like, set_qk


class SwinTracer(StagedBlocks):
    """Label rules for timm's ``SwinTransformer``: per block, the labels take the block's cyclic shift,
    window partition, head-mean window attention (relative-position bias and shift mask included: the
    attention the token path used), window reverse and shift back, then the residual average; each
    stage's ``PatchMerging`` (timm puts it at the start of a stage) averages the 2x2 labels it merges
    (sum, then Norm); the target is the mean label (global average pooling).

    timm's ``WindowAttention`` materialises its softmax unless fused attention is switched on: the
    hook then takes the attention probabilities the token path computed; with fused attention it takes
    ``q``, ``k`` and the shift mask and recomputes the label attention (fused on accelerators)."""

    num_prefix_tokens = 0
    #: the last block mixes its tokens by a self-attention (TransMix reads it)
    attends = True
    history: Optional[list] = None  # a list to append each block's (B, H', W', K) state to (tokenaug-viz)

    def __init__(self, model: SwinTransformer):
        if model.global_pool != 'avg':
            raise ValueError(f"model: Swin with global_pool={model.global_pool!r} has no TL-Align rule; use 'avg'")
        for stage in model.layers:
            if not isinstance(stage.downsample, (nn.Identity, PatchMerging)):
                raise ValueError(f'model: Swin downsample {type(stage.downsample).__name__} has no TL-Align rule')
            for blk in stage.blocks:
                if type(blk) is not SwinTransformerBlock or type(blk.attn) is not WindowAttention:
                    raise ValueError(
                        f'model: TL-Align traces timm SwinTransformerBlock/WindowAttention, got {type(blk).__name__}'
                    )
        self.model = model

    _stages = 'layers'

    def register(self, captures: List[LabelCapture]) -> list:
        handles = []
        for blk in self._blocks():
            cap = LabelCapture()
            captures.append(cap)
            handles.append(
                blk.register_forward_pre_hook(lambda m, i, c=cap: setattr(c, 'tokens', tuple(i[0].shape[1:3])))
            )
            if blk.attn.fused_attn:
                handles.append(
                    blk.attn.register_forward_pre_hook(
                        lambda m, a, kw, c=cap: setattr(c, 'mask', kw.get('mask', a[1] if len(a) > 1 else None)),
                        with_kwargs=True,
                    )
                )
                handles.append(
                    blk.attn.qkv.register_forward_hook(
                        lambda m, i, o, c=cap, a=blk.attn: set_qk(c, o.detach(), a.num_heads)
                    )
                )
            else:
                handles.append(
                    blk.attn.softmax.register_forward_hook(lambda m, i, o, c=cap: setattr(c, 'attn', o.detach()))
                )
            hook_drop_path(blk, cap, handles)
        return handles

    def num_tokens(self, captures: List[LabelCapture]) -> int:
        H, W = captures[0].tokens
        return H * W

    def _window_labels(self, blk: SwinTransformerBlock, cap: LabelCapture, Y: torch.Tensor) -> torch.Tensor:
        if cap.attn is not None:  # the token path's own attention probabilities
            return window_labels(Y, blk.window_size, blk.shift_size, attn=cap.attn)
        a = blk.attn
        N = a.window_area
        bias = a._get_rel_pos_bias()
        if cap.mask is not None:  # the shift mask, combined as WindowAttention combines it
            nw = cap.mask.shape[0]
            mask = cap.mask.view(1, nw, 1, N, N).expand(cap.q.shape[0] // nw, -1, a.num_heads, -1, -1)
            bias = bias + mask.reshape(-1, a.num_heads, N, N)
        return window_labels(Y, blk.window_size, blk.shift_size, q=cap.q, k=cap.k, bias=bias, scale=a.scale)

    def propagate(
        self, captures: List[LabelCapture], labels: torch.Tensor, layers: Optional[set], residual: bool
    ) -> torch.Tensor:
        blocks = self._blocks()
        stages = [(len(stage.blocks), isinstance(stage.downsample, PatchMerging)) for stage in self.model.layers]
        return swin_labels(
            labels,
            captures[0].tokens,
            stages,
            lambda idx, Y: self._window_labels(blocks[idx], captures[idx], Y),
            [c.keep for c in captures],
            merge_at='start',
            layers=layers,
            residual=residual,
            history=self.history,
        )

    def readout(self, labels: torch.Tensor, output) -> torch.Tensor:
        return labels.mean(1)

    def class_attention(self, captures: List[LabelCapture]):
        return None


# ---------------------------------------------------------------------------------------------- PVT v2


class PvtV2Tracer(StagedBlocks):
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

    num_prefix_tokens = 0
    #: the last block mixes its tokens by a self-attention (TransMix reads it)
    attends = True

    def __init__(self, model: PyramidVisionTransformerV2):
        if model.global_pool != 'avg':
            raise ValueError(f"model: PVT v2 with global_pool={model.global_pool!r} has no TL-Align rule; use 'avg'")
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
        self.model = model

    def register(self, captures: List[LabelCapture]) -> list:
        """``captures[0]`` keeps the first token grid (``patch_embed``'s output), then one per block
        (its ``feat_size``, ``q``, the ``kv`` projection and the kept samples)."""
        stem = LabelCapture()
        captures.append(stem)
        handles = [
            self.model.patch_embed.register_forward_hook(
                lambda m, i, o, c=stem: setattr(c, 'tokens', tuple(o.shape[1:3]))
            )
        ]
        for blk in self._blocks():
            cap = LabelCapture()
            captures.append(cap)
            handles.append(
                blk.register_forward_pre_hook(
                    lambda m, a, kw, c=cap: setattr(c, 'tokens', tuple(kw['feat_size'] if 'feat_size' in kw else a[1])),
                    with_kwargs=True,
                )
            )
            handles.append(blk.attn.q.register_forward_hook(lambda m, i, o, c=cap: setattr(c, 'q', o.detach())))
            handles.append(blk.attn.kv.register_forward_hook(lambda m, i, o, c=cap: setattr(c, 'k', o.detach())))
            hook_drop_path(blk, cap, handles)
        return handles

    def num_tokens(self, captures: List[LabelCapture]) -> int:
        H, W = captures[0].tokens
        return H * W

    @staticmethod
    def _key_labels(a: PvtAttention, Y: torch.Tensor) -> torch.Tensor:
        """The labels of the keys, pooled as the keys were: ``(B, K, H, W)`` → ``(B, N_k, K)``."""
        if a.pool is not None:  # linear variant: AdaptiveAvgPool2d(7), then a 1x1 conv
            Y = pool_like(F.adaptive_avg_pool2d(Y, a.pool.output_size), a.sr)
        elif a.sr is not None:  # spatial reduction: conv with kernel = stride = sr_ratio
            Y = pool_like(Y, a.sr)
        return Y.flatten(2).transpose(1, 2)

    def propagate(
        self, captures: List[LabelCapture], labels: torch.Tensor, layers: Optional[set], residual: bool
    ) -> torch.Tensor:
        H, W = captures[0].tokens
        B, _, K = labels.shape
        with torch.autocast(device_type=labels.device.type, enabled=False):
            Y = labels.float().transpose(1, 2).reshape(B, K, H, W)  # channels first, for the pooling ops
            idx = 0
            for stage in self.model.stages:
                if stage.downsample is not None:
                    Y = pool_like(Y, stage.downsample.proj)
                for blk in stage.blocks:
                    cap, a = captures[1 + idx], blk.attn
                    if cap.tokens != tuple(Y.shape[-2:]):
                        raise ValueError(
                            f'model: PVT v2 block {idx} ran on a {cap.tokens} grid, the labels are '
                            f'on {tuple(Y.shape[-2:])}'
                        )
                    if layers is None or idx in layers:
                        N, Nk = Y.shape[-2] * Y.shape[-1], cap.k.shape[1]
                        q = cap.q.reshape(B, N, a.num_heads, a.head_dim).transpose(1, 2)
                        k = cap.k.reshape(B, Nk, 2, a.num_heads, a.head_dim)[:, :, 0].transpose(1, 2)
                        flat = Y.flatten(2).transpose(1, 2)
                        branch = attention_labels(q, k, self._key_labels(a, Y), scale=a.scale)
                        flat = residual_labels(flat, branch, cap.keep, residual)  # MLP residual: Y
                        Y = flat.transpose(1, 2).reshape(B, K, *Y.shape[-2:])
                    idx += 1
        return Y.flatten(2).transpose(1, 2)

    def readout(self, labels: torch.Tensor, output) -> torch.Tensor:
        return labels.mean(1)

    def class_attention(self, captures: List[LabelCapture]):
        return None
