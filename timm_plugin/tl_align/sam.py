"""TL-Align tracer for timm's ``VisionTransformerSAM`` (SAM's image encoder as a classifier: ``samvit_*``)."""

from __future__ import annotations

import torch
import torch.nn as nn
from timm.layers import LayerNorm2d
from timm.models.vision_transformer_sam import Attention as SamAttention
from timm.models.vision_transformer_sam import Block as SamBlock
from timm.models.vision_transformer_sam import VisionTransformerSAM

from shared_core.capture import Captures, LabelCapture, SdpaCapture
from shared_core.tl_align import attention_labels, conv_labels, window_labels
from shared_core.tracer import Tracer, check_block_parts, check_fused_sdpa, check_pool, check_types

from ._blocks import VIT_BLOCK_PARTS

__all__ = ['SamViTTracer']


class SamViTTracer(Tracer):
    """Label rules for timm's ``VisionTransformerSAM``, on the ``(B, H, W, K)`` patch grid:

    - attention, windowed (``window_size > 0``) or global, with the decomposed relative position bias or RoPE: read
      at the block's ``scaled_dot_product_attention`` call (``q``, ``k`` after RoPE and the q/k norms, the bias it
      was given), Eq. 9 within each window or over the grid, then Eq. 11. A grid the windows do not tile is
      refused: SAM pads it with zero tokens, which are keys without a label;
    - the neck (``neck_chans``: a 1x1 conv, LayerNorm2d, a 3x3 conv, LayerNorm2d): the 1x1 conv and the norms leave
      the labels, the 3x3 conv mixes them as its stencil ``Norm(T(mean |K|))`` (Table 9, as ResNet's 3x3 convs);
    - MLP, norms and layer scale per token; the mean label is the readout (global average pooling).
    """

    layout = 'grid'
    capture_mode = SdpaCapture
    needs = ('q', 'k')
    why_missing = 'its attention made no scaled_dot_product_attention call'
    grid_module = 'patch_embed'

    def __init__(self, model: VisionTransformerSAM):
        check_types(model.blocks, (SamBlock,), (SamAttention,), 'VisionTransformerSAM')
        check_block_parts(model.blocks, VIT_BLOCK_PARTS)
        check_fused_sdpa(model.blocks)
        check_pool(model.global_pool, ('avg',), 'VisionTransformerSAM')
        if getattr(model.patch_drop, 'prob', 0.0) > 0:
            raise ValueError('model: patch dropout changes the token set; TL-Align does not trace it')
        self.neck_convs = self._neck(model.neck)
        super().__init__(model)

    @staticmethod
    def _neck(neck: nn.Module) -> list:
        """The neck's spatial convs (its k x k convs; 1x1 convs and norms leave the labels)."""
        parts = list(neck) if isinstance(neck, nn.Sequential) else [neck]
        convs = []
        for part in parts:
            if isinstance(part, (nn.Identity, LayerNorm2d)):
                continue
            if type(part) is not nn.Conv2d or part.stride != (1, 1) or part.dilation != (1, 1):
                raise ValueError(f'model: the SAM neck part {part} has no TL-Align rule')
            if part.kernel_size != (1, 1):
                convs.append(part)
        return convs

    def blocks(self):
        return list(self.model.blocks)

    def watch_model(self, captures: Captures, handles: list) -> None:
        """The patch grid: ``patch_embed``'s ``(B, H, W, C)`` output."""
        embed = self.model.patch_embed
        handles.append(embed.register_forward_hook(lambda m, i, o: setattr(captures, 'grid', tuple(o.shape[1:3]))))

    def branch(self, blk: nn.Module, cap: LabelCapture, Y: torch.Tensor) -> torch.Tensor:
        """Eq. 9 on the ``(B, H, W, K)`` labels, the captured call's heads unfolded from its batch."""
        heads = blk.attn.num_heads
        q, k = cap.q.unflatten(0, (-1, heads)), cap.k.unflatten(0, (-1, heads))  # (B · nW, heads, N, d)
        mask = None if cap.mask is None else cap.mask.unflatten(0, (-1, heads))
        if blk.window_size > 0:
            ws = (blk.window_size, blk.window_size)
            return window_labels(Y, ws, (0, 0), q=q, k=k, bias=mask, scale=cap.scale)
        B, H, W, K = Y.shape
        return attention_labels(q, k, Y.reshape(B, H * W, K), mask, scale=cap.scale).reshape(B, H, W, K)

    def leave(self, stage, Y: torch.Tensor) -> torch.Tensor:
        """The neck's k x k convs, as fixed stencils on the ``(B, K, H, W)`` map."""
        if not self.neck_convs:
            return Y
        Y = Y.permute(0, 3, 1, 2)
        for conv in self.neck_convs:
            Y = conv_labels(Y, conv)
        return Y.permute(0, 2, 3, 1)
