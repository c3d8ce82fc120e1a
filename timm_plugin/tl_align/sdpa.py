"""TL-Align tracers that read each block's attention where the token path computes it: at its
``F.scaled_dot_product_attention`` call, with ``q`` and ``k`` as the kernel saw them (after RoPE, after q/k norms),
the additive bias or mask it was given (BEiT's relative position bias) and its scale. A torch function mode,
active only while a block's attention module runs, records that one call; the label rule is then Eq. 9 and 11
with the attention ``softmax(q kᵀ · scale + mask)`` (:func:`shared_core.tl_align.attention_labels`).

- :class:`EvaTracer`: timm's ``Eva`` (EVA-02, the ``vit_*_rope_*`` ViTs, PE): RoPE on q/k, SwiGLU or GLU MLPs,
  sub-LN, layer scale, pre- or post-norm blocks, with or without a class token, ``'avg'`` or ``'token'`` pooling,
  grouped-query attention (keys repeated per head group);
- :class:`BeitTracer`: timm's ``Beit`` (BEiT, BEiT v2): relative position bias as an additive bias;
- :class:`RelPosViTTracer`: timm's ``VisionTransformerRelPos`` (``vit_relpos_*``, ``vit_srelpos_*``): the relative
  position bias (MLP-generated or a table, per block or shared) as the additive bias of the call; pre-norm and
  residual post-norm blocks.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from timm.layers import AttentionRope
from timm.models.beit import Attention as BeitAttention
from timm.models.beit import Block as BeitBlock
from timm.models.eva import EvaAttention, EvaBlock, EvaBlockPostNorm
from timm.models.vision_transformer_relpos import RelPosAttention, RelPosBlock, ResPostRelPosBlock

from shared_core.capture import Captures, LabelCapture, SdpaCapture
from shared_core.tl_align import attention_labels
from shared_core.tracer import Tracer, check_block_parts, check_fused_sdpa, check_pool, check_types

from ._blocks import VIT_BLOCK_PARTS

__all__ = ['EvaTracer', 'BeitTracer', 'RelPosViTTracer']


class _SdpaBlocksTracer(Tracer):
    """Pre-norm (or post-norm) residual attention blocks whose attention calls ``scaled_dot_product_attention``
    once: the labels follow Eq. 9 and 11 with the captured call's attention; MLP, norms, layer scale are per token
    (the TL-Align paper, Table 9)."""

    family = ''
    block_types: tuple = ()
    attn_types: tuple = ()
    parts: dict = {}

    capture_mode = SdpaCapture
    needs = ('q', 'k')
    why_missing = 'its attention made no scaled_dot_product_attention call'

    def __init__(self, model: nn.Module):
        check_types(model.blocks, self.block_types, self.attn_types, self.family)
        check_block_parts(model.blocks, self.parts)
        check_fused_sdpa(model.blocks)
        pool = getattr(model, 'global_pool', None)
        if getattr(model, 'attn_pool', None) is not None:
            pool = 'map'
        check_pool(pool, ('token', 'avg'), self.family)
        if pool == 'token' and model.num_prefix_tokens < 1:
            raise ValueError("model: global_pool='token' reads a class token this model does not have")
        if getattr(getattr(model, 'patch_drop', None), 'prob', 0.0) > 0:
            raise ValueError('model: patch dropout changes the token set; TL-Align does not trace it')
        super().__init__(model)
        self.num_prefix_tokens = int(model.num_prefix_tokens)
        self.readout = 'cls' if pool == 'token' else 'mean'

    def blocks(self):
        return self.model.blocks

    def tokens(self, captures: Captures) -> int:
        return captures[0].q.shape[2]

    def branch(self, blk: nn.Module, cap: LabelCapture, Y: torch.Tensor) -> torch.Tensor:
        return attention_labels(cap.q, cap.k, Y, cap.mask, scale=cap.scale)  # Eq. 9

    def class_attention(self, captures: Captures):
        if self.model.global_pool != 'token':
            return None
        last = captures[-1]
        bias = None if last.mask is None else last.mask[..., :1, :] if last.mask.shape[-2] > 1 else last.mask
        return last.q[:, :, :1], last.k, last.scale, bias


class EvaTracer(_SdpaBlocksTracer):
    """Label rules for timm's ``Eva`` (EVA-02, RoPE ViTs): see the module docstring."""

    family = 'Eva'
    block_types = (EvaBlock, EvaBlockPostNorm)
    attn_types = (EvaAttention, AttentionRope)
    parts = VIT_BLOCK_PARTS  # the ViT block's parts (its layer scale is a parameter here; q/k norms, sub-LN)


class BeitTracer(_SdpaBlocksTracer):
    """Label rules for timm's ``Beit``: the relative position bias is the additive bias of the captured call."""

    family = 'Beit'
    block_types = (BeitBlock,)
    attn_types = (BeitAttention,)
    parts = VIT_BLOCK_PARTS  # (no q/k norms: parts a block lacks are skipped)


class RelPosViTTracer(_SdpaBlocksTracer):
    """Label rules for timm's ``VisionTransformerRelPos``: the relative position bias, the block's own or the
    model's shared one, is the additive bias of the captured call; residual post-norm blocks are per token."""

    family = 'VisionTransformerRelPos'
    block_types = (RelPosBlock, ResPostRelPosBlock)
    attn_types = (RelPosAttention,)
    parts = VIT_BLOCK_PARTS
