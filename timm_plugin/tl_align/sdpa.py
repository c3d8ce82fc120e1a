"""TL-Align tracers that read each block's attention where the token path computes it: at its
``F.scaled_dot_product_attention`` call, with ``q`` and ``k`` as the kernel saw them (after RoPE, after q/k norms),
the additive bias or mask it was given (BEiT's relative position bias) and its scale. A torch function mode,
active only while a block's attention module runs, records that one call; the label rule is then Eq. 9 and 11
with the attention ``softmax(q kᵀ · scale + mask)`` (:func:`shared_core.tl_align.attention_labels`).

- :class:`EvaTracer`: timm's ``Eva`` (EVA-02, the ``vit_*_rope_*`` ViTs, PE): RoPE on q/k, SwiGLU or GLU MLPs,
  sub-LN, layer scale, pre- or post-norm blocks, with or without a class token, ``'avg'`` or ``'token'`` pooling,
  grouped-query attention (keys repeated per head group);
- :class:`BeitTracer`: timm's ``Beit`` (BEiT, BEiT v2): relative position bias as an additive bias.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn as nn
from timm.layers import AttentionRope
from timm.models.beit import Attention as BeitAttention
from timm.models.beit import Block as BeitBlock
from timm.models.eva import EvaAttention, EvaBlock, EvaBlockPostNorm

from shared_core.capture import SdpaCapture
from shared_core.tl_align import LabelCapture, attention_labels, residual_labels

from ._blocks import VIT_BLOCK_PARTS, check_block_parts, check_captured, watch_blocks

__all__ = ['EvaTracer', 'BeitTracer']


class _SdpaBlocksTracer:
    """Pre-norm (or post-norm) residual attention blocks whose attention calls ``scaled_dot_product_attention``
    once: the labels follow Eq. 9 and 11 with the captured call's attention; MLP, norms, layer scale are per token
    (the TL-Align paper, Table 9)."""

    family = ''
    block_types: tuple = ()
    attn_types: tuple = ()
    parts: dict = {}

    attends = True

    def __init__(self, model: nn.Module):
        bad = [
            i
            for i, b in enumerate(model.blocks)
            if type(b) not in self.block_types or type(b.attn) not in self.attn_types
        ]
        if bad:
            blk = model.blocks[bad[0]]
            raise ValueError(
                f'model: TL-Align traces {self.family} blocks of type '
                f'{"/".join(t.__name__ for t in self.block_types)} with '
                f'{"/".join(t.__name__ for t in self.attn_types)}; block {bad[0]} is a {type(blk).__name__} with '
                f'{type(getattr(blk, "attn", None)).__name__}'
            )
        check_block_parts(model.blocks, self.parts)
        unfused = [i for i, b in enumerate(model.blocks) if not getattr(b.attn, 'fused_attn', True)]
        if unfused:
            raise ValueError(
                f'model: blocks {unfused} compute their attention without scaled_dot_product_attention '
                '(fused_attn off, e.g. TIMM_FUSED_ATTN=0); TL-Align reads the attention at that call'
            )
        pool = getattr(model, 'global_pool', None)
        if getattr(model, 'attn_pool', None) is not None or pool not in ('token', 'avg'):
            raise ValueError(f"model: global_pool={pool!r} has no TL-Align rule; use 'token' or 'avg'")
        if pool == 'token' and model.num_prefix_tokens < 1:
            raise ValueError("model: global_pool='token' reads a class token this model does not have")
        if getattr(getattr(model, 'patch_drop', None), 'prob', 0.0) > 0:
            raise ValueError('model: patch dropout changes the token set; TL-Align does not trace it')
        self.model = model
        self.num_prefix_tokens = int(model.num_prefix_tokens)

    @property
    def depth(self) -> int:
        return len(self.model.blocks)

    def register(self, captures: List[LabelCapture]) -> list:
        return watch_blocks(self.model.blocks, captures, SdpaCapture())

    def num_tokens(self, captures: List[LabelCapture]) -> int:
        check_captured(captures, ('q', 'k'), 'its attention made no scaled_dot_product_attention call')
        return captures[0].q.shape[2]

    def propagate(
        self, captures: List[LabelCapture], labels: torch.Tensor, layers: Optional[set], residual: bool
    ) -> torch.Tensor:
        for idx, c in enumerate(captures):
            if layers is not None and idx not in layers:
                continue
            branch = attention_labels(c.q, c.k, labels, c.mask, scale=c.scale)  # Eq. 9
            labels = residual_labels(labels, branch, c.keep, residual)  # Eq. 11
        return labels

    def class_attention(self, captures: List[LabelCapture]):
        if self.model.global_pool != 'token':
            return None
        last = captures[-1]
        bias = None if last.mask is None else last.mask[..., :1, :] if last.mask.shape[-2] > 1 else last.mask
        return last.q[:, :, :1], last.k, last.scale, bias

    def readout(self, labels: torch.Tensor, output) -> torch.Tensor:
        """The label of what the classifier reads: the class token, or the mean of the patch tokens."""
        if self.model.global_pool == 'token':
            return labels[:, 0]
        return labels[:, self.num_prefix_tokens :].mean(1)


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
