"""TL-Align tracer for timm's ``Twins`` (Twins-PCPVT and Twins-SVT): locally grouped and global sub-sampled
attention, the conditional position encoding, and patch merging (the TL-Align paper, Eq. 9/11 and Table 9)."""

from __future__ import annotations

import torch
import torch.nn as nn
from timm.layers import Mlp
from timm.models.twins import Block, GlobalSubSampleAttn, LocallyGroupedAttn, PatchEmbed, PosConv, Twins

from shared_core.capture import Captures, LabelCapture, SdpaCapture
from shared_core.tl_align import attention_labels, conv_labels, conv_pool_labels, residual_labels
from shared_core.tracer import Tracer, check_block_parts, check_fused_sdpa, check_pool, check_types

from ._blocks import NORMS

__all__ = ['TwinsTracer']


class TwinsTracer(Tracer):
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

    capture_mode = SdpaCapture
    needs = ('q', 'k')
    why_missing = 'its attention made no scaled_dot_product_attention call'
    layout = 'map'
    grid_module = 'the first patch embedding'

    def __init__(self, model: Twins):
        check_pool(model.global_pool, ('avg',), 'Twins')
        for i, embed in enumerate(model.patch_embeds):
            conv = embed.proj
            if type(embed) is not PatchEmbed or conv.kernel_size != conv.stride or conv.padding != (0, 0):
                raise ValueError(f'model: Twins stage {i} patch embedding {embed} has no TL-Align rule')
        for i, pos in enumerate(model.pos_block):
            dw = pos.proj[0] if type(pos) is PosConv and len(pos.proj) == 1 else None
            if dw is None or dw.groups != dw.in_channels or pos.stride != 1:
                raise ValueError(f'model: Twins stage {i} position encoding {pos} has no TL-Align rule')
        super().__init__(model)
        blocks = self.blocks()
        check_types(blocks, (Block,), (LocallyGroupedAttn, GlobalSubSampleAttn), 'Twins')
        check_block_parts(blocks, {'norm1': NORMS, 'norm2': NORMS, 'mlp': (Mlp,)})
        check_fused_sdpa(blocks)
        for i, b in enumerate(blocks):
            sr = getattr(b.attn, 'sr', None)
            if sr is not None and (sr.kernel_size != sr.stride or sr.padding != (0, 0)):
                raise ValueError(f'model: Twins block {i} sub-sampling {sr} has no TL-Align rule')

    def stages(self):
        m = self.model
        return [
            ((i, embed, pos), stage) for i, (embed, stage, pos) in enumerate(zip(m.patch_embeds, m.blocks, m.pos_block))
        ]

    def watch_model(self, captures: Captures, handles: list) -> None:
        embed = self.model.patch_embeds[0]
        handles.append(embed.register_forward_hook(lambda m, i, o: setattr(captures, 'grid', tuple(o[1]))))

    def enter(self, stage, Y: torch.Tensor) -> torch.Tensor:
        i, embed, _ = stage  # the later stages' patch embeddings: a k x k stride-k conv
        return Y if i == 0 else conv_pool_labels(Y, embed.proj.kernel_size, embed.proj.stride, 0)

    def after(self, stage, j: int, Y: torch.Tensor) -> torch.Tensor:
        if j:
            return Y
        dw = stage[2].proj[0]  # the position encoding (PEG) after the stage's first block: x + dwconv(x)
        return residual_labels(Y, conv_labels(Y, dw), None, True)

    def branch(self, blk: nn.Module, cap: LabelCapture, Y: torch.Tensor) -> torch.Tensor:
        """Eq. 9 on the ``(B, K, H, W)`` label map -> ``(B, K, H, W)``."""
        attn = blk.attn
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
