"""TL-Align tracer for timm's ``Twins`` (Twins-PCPVT and Twins-SVT): locally grouped and global sub-sampled
attention, the conditional position encoding, and patch merging (the TL-Align paper, Eq. 9/11 and Table 9)."""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn as nn
from timm.layers import Mlp
from timm.models.twins import Block, GlobalSubSampleAttn, LocallyGroupedAttn, PatchEmbed, PosConv, Twins

from shared_core.capture import SdpaCapture
from shared_core.tl_align import (
    LabelCapture,
    attention_labels,
    conv_pool_labels,
    conv_stencil_labels,
    residual_labels,
)

from ._blocks import NORMS, check_captured, watch_blocks

__all__ = ['TwinsTracer']


class TwinsTracer:
    """Label rules for timm's ``Twins`` (``twins_pcpvt_*``, ``twins_svt_*``):

    - Initial labels: one per patch of the first patch embedding (stride 4, non-overlapping).
    - Patch embedding of the later stages (a ``k x k`` stride-``k`` conv): each new token's label is the mean of its
      window's (Table 9's aggregation).
    - Locally grouped attention (LSA, windows of ``ws x ws`` tokens): Eq. 9 within each window, from the block's
      ``scaled_dot_product_attention`` call. A grid the windows do not tile is refused (the token path pads it
      with zero tokens that would take part in the attention as keys with no label).
    - Global sub-sampled attention (GSA, PCPVT's attention): the keys come from an ``sr x sr`` stride-``sr`` conv
      of the tokens, so a key's label is the mean of its window's; then Eq. 9 over all queries (as PVT v2's
      spatial reduction).
    - The conditional position encoding after each stage's first block (``x + dwconv3x3(x)``): the depthwise conv
      as the stencil ``Norm(T(mean_c |K_c|))`` with its residual, ``Y ← Norm(Y + S(Y))`` (as ConvNeXt's).
    - Eq. 11 at the attention residual, for the samples whose branch stochastic depth kept; norms and MLPs are per
      token; the head's mean pool reads the mean label.
    """

    num_prefix_tokens = 0
    #: the last block mixes its tokens by a self-attention (TransMix reads it)
    attends = True

    def __init__(self, model: Twins):
        if model.global_pool != 'avg':
            raise ValueError(f"model: Twins with global_pool={model.global_pool!r} has no TL-Align rule; use 'avg'")
        for i, embed in enumerate(model.patch_embeds):
            conv = embed.proj
            if type(embed) is not PatchEmbed or conv.kernel_size != conv.stride or conv.padding != (0, 0):
                raise ValueError(f'model: Twins stage {i} patch embedding {embed} has no TL-Align rule')
        for i, pos in enumerate(model.pos_block):
            dw = pos.proj[0] if type(pos) is PosConv and len(pos.proj) == 1 else None
            if dw is None or dw.groups != dw.in_channels or pos.stride != 1:
                raise ValueError(f'model: Twins stage {i} position encoding {pos} has no TL-Align rule')
        for i, stage in enumerate(model.blocks):
            for j, b in enumerate(stage):
                attn_ok = type(b.attn) in (LocallyGroupedAttn, GlobalSubSampleAttn)
                if type(b) is not Block or not attn_ok or type(b.mlp) is not Mlp or type(b.norm1) not in NORMS:
                    raise ValueError(
                        f'model: TL-Align traces Twins Blocks with LocallyGroupedAttn or GlobalSubSampleAttn; stage '
                        f'{i} block {j} is {type(b).__name__} with {type(b.attn).__name__}'
                    )
                if not b.attn.fused_attn:
                    raise ValueError(
                        f'model: Twins stage {i} block {j} computes its attention without '
                        'scaled_dot_product_attention (fused_attn off); TL-Align reads the attention at that call'
                    )
                sr = getattr(b.attn, 'sr', None)
                if sr is not None and (sr.kernel_size != sr.stride or sr.padding != (0, 0)):
                    raise ValueError(f'model: Twins stage {i} block {j} sub-sampling {sr} has no TL-Align rule')
        self.model = model

    @property
    def depth(self) -> int:
        return sum(len(stage) for stage in self.model.blocks)

    def _blocks(self):
        return [b for stage in self.model.blocks for b in stage]

    def register(self, captures: List[LabelCapture]) -> list:
        """``captures[0]`` keeps the first grid, then one per block (its attention call, the kept samples)."""
        embed = LabelCapture()
        captures.append(embed)
        handle = self.model.patch_embeds[0].register_forward_hook(lambda m, i, o: setattr(embed, 'tokens', tuple(o[1])))
        return [handle] + watch_blocks(self._blocks(), captures, SdpaCapture())

    def num_tokens(self, captures: List[LabelCapture]) -> int:
        check_captured(captures[:1], ('tokens',), 'the first patch embedding did not run')
        check_captured(captures[1:], ('q', 'k'), 'its attention made no scaled_dot_product_attention call')
        H, W = captures[0].tokens
        return H * W

    @staticmethod
    def _branch(attn: nn.Module, cap: LabelCapture, Y: torch.Tensor) -> torch.Tensor:
        """Eq. 9 on the ``(B, K, H, W)`` label map -> ``(B, K, H, W)``."""
        B, K, H, W = Y.shape
        if type(attn) is LocallyGroupedAttn:
            ws = attn.ws
            if H % ws or W % ws:
                raise ValueError(
                    f'x: the {H}x{W} token grid is not tiled by {ws}x{ws} windows (the model pads it); TL-Align '
                    'traces tiled grids only'
                )
            h, w = H // ws, W // ws
            Yw = Y.permute(0, 2, 3, 1).reshape(B, h, ws, w, ws, K).transpose(2, 3).reshape(B * h * w, ws * ws, K)
            q, k = cap.q.flatten(0, 1), cap.k.flatten(0, 1)  # (B, windows, heads, ws², d) -> (B * windows, ...)
            out = attention_labels(q, k, Yw, scale=cap.scale)
            out = out.view(B, h, w, ws, ws, K).transpose(2, 3).reshape(B, H, W, K)
            return out.permute(0, 3, 1, 2)
        keys = Y
        if attn.sr is not None:
            keys = conv_pool_labels(Y, attn.sr.kernel_size, attn.sr.stride, 0)
        out = attention_labels(cap.q, cap.k, keys.flatten(2).transpose(1, 2), scale=cap.scale)  # (B, H*W, K)
        return out.transpose(1, 2).reshape(B, K, H, W)

    def propagate(
        self, captures: List[LabelCapture], labels: torch.Tensor, layers: Optional[set], residual: bool
    ) -> torch.Tensor:
        H, W = captures[0].tokens
        Y = labels.transpose(1, 2).reshape(labels.shape[0], labels.shape[2], H, W)
        caps = iter(captures[1:])
        idx = 0
        for i, (embed, stage, pos) in enumerate(zip(self.model.patch_embeds, self.model.blocks, self.model.pos_block)):
            if i > 0:
                Y = conv_pool_labels(Y, embed.proj.kernel_size, embed.proj.stride, 0)
            for j, blk in enumerate(stage):
                cap = next(caps)
                if layers is None or idx in layers:
                    Y = residual_labels(Y, self._branch(blk.attn, cap, Y), cap.keep, residual)
                if j == 0:  # the position encoding (PEG) after the stage's first block
                    dw = pos.proj[0]
                    Y = residual_labels(Y, conv_stencil_labels(Y, dw.weight.detach().float().abs().mean((0, 1)),
                                                               dw.padding), None, True)  # fmt: skip
                idx += 1
        return Y.flatten(2).transpose(1, 2)

    def readout(self, labels: torch.Tensor, output) -> torch.Tensor:
        return labels.mean(1)

    def class_attention(self, captures: List[LabelCapture]):
        return None
