"""TL-Align tracer for timm's ``Hiera``: pooled attention over unrolled tokens (the TL-Align paper, Eq. 9/11;
Table 9 for the pooling)."""

from __future__ import annotations

from typing import List, Optional

import torch
from timm.layers import Mlp
from timm.models.hiera import Hiera, HieraBlock, MaskUnitAttention

from shared_core.capture import SdpaCapture
from shared_core.tl_align import LabelCapture, attention_labels, residual_labels

from ._blocks import NORMS, check_captured, watch_blocks

__all__ = ['HieraTracer']


class HieraTracer:
    """Label rules for timm's ``Hiera`` (``hiera_*``):

    - Initial labels: one per patch of the patch embedding (stride 4; its overlapping 7x7 windows are not
      traced, as ResNet's stem), in the row-major order the mixer draws them; the model's own ``unroll``
      (a permutation that puts each pooling window's tokens ``N / s`` apart) reorders them as it reorders the
      tokens.
    - Query pooling (a block that starts a stage: ``q`` and the shortcut max-pooled over the ``s = q_stride``
      tokens of each window): the pooled token's label is the mean of its window's labels (Table 9's
      aggregation, ``Norm(Σ Y)``).
    - Attention (mask-unit attention within windows, or global): Eq. 9 with the attention of the block's
      ``scaled_dot_product_attention`` call, the keys' labels arranged as the keys are (window ``w`` holds the
      tokens ``t · num_windows + w``), the pooled queries' labels out in the order the block writes them.
    - Eq. 11 at each residual (the pooled shortcut's labels with the attention branch's), for the samples whose
      branch stochastic depth kept; norms, MLP and layer scale are per token; the head's mean pool reads the mean
      label.

    Refused: mask-unit patch dropout in training (it removes tokens), head pooling other than ``avg``, blocks
    without SDPA (``fused_attn`` off).
    """

    num_prefix_tokens = 0
    #: the last block mixes its tokens by a self-attention (TransMix reads it)
    attends = True

    def __init__(self, model: Hiera):
        for i, b in enumerate(model.blocks):
            if type(b) is not HieraBlock or type(b.attn) is not MaskUnitAttention:
                raise ValueError(f'model: TL-Align traces HieraBlock with MaskUnitAttention; block {i} is {b}')
            for name, obj, types in (
                ('norm1', b.norm1, NORMS),
                ('norm2', b.norm2, NORMS),
                ('mlp', b.mlp, (Mlp,)),
            ):
                if type(obj) not in types:
                    raise ValueError(f'model: Hiera block {i}: {name} is a {type(obj).__name__}; no TL-Align rule')
            if not b.attn.fused_attn:
                raise ValueError(
                    f'model: Hiera block {i} computes its attention without scaled_dot_product_attention (fused_attn '
                    'off); TL-Align reads the attention at that call'
                )
        if getattr(model.head, 'pool_type', None) != 'avg':
            raise ValueError(
                f'model: Hiera with head pooling {getattr(model.head, "pool_type", None)!r} has no TL-Align rule; '
                "use 'avg'"
            )
        if model.patch_drop_rate > 0:
            raise ValueError('model: mask-unit patch dropout removes tokens; TL-Align does not trace it')
        self.model = model

    @property
    def depth(self) -> int:
        return len(self.model.blocks)

    def register(self, captures: List[LabelCapture]) -> list:
        """``captures[0]`` keeps the patch count, then one per block (its attention call, the kept samples)."""
        embed = LabelCapture()
        captures.append(embed)
        handle = self.model.patch_embed.register_forward_hook(lambda m, i, o: setattr(embed, 'tokens', o.shape[1]))
        return [handle] + watch_blocks(self.model.blocks, captures, SdpaCapture())

    def num_tokens(self, captures: List[LabelCapture]) -> int:
        check_captured(captures[:1], ('tokens',), 'the patch embedding did not run')
        check_captured(captures[1:], ('q', 'k'), 'its attention made no scaled_dot_product_attention call')
        return captures[0].tokens

    @staticmethod
    def _branch(attn: MaskUnitAttention, cap: LabelCapture, Y: torch.Tensor) -> torch.Tensor:
        """Eq. 9 for one block: ``Y`` ``(B, N, K)`` in the block's token order -> ``(B, N / s, K)``."""
        B, N, K = Y.shape
        if cap.q.dim() == 4:  # global attention over every token
            return attention_labels(cap.q, cap.k, Y, scale=cap.scale)
        nw = cap.q.shape[2]  # mask units: token t * nw + w is window w's t-th token
        Yw = Y.view(B, N // nw, nw, K).transpose(1, 2)  # (B, nw, T_k, K)
        q = cap.q.transpose(1, 2).flatten(0, 1)  # (B * nw, heads, T_q, d)
        k = cap.k.transpose(1, 2).flatten(0, 1)
        out = attention_labels(q, k, Yw.flatten(0, 1), scale=cap.scale)  # (B * nw, T_q, K)
        return out.view(B, nw, -1, K).transpose(1, 2).reshape(B, -1, K)  # token tq * nw + w

    def propagate(
        self, captures: List[LabelCapture], labels: torch.Tensor, layers: Optional[set], residual: bool
    ) -> torch.Tensor:
        Y = self.model.unroll(labels)
        for idx, (blk, cap) in enumerate(zip(self.model.blocks, captures[1:])):
            s = blk.attn.q_stride
            short = Y.view(Y.shape[0], s, -1, Y.shape[-1]).mean(1) if s > 1 else Y  # the pooled shortcut
            if layers is None or idx in layers:
                Y = residual_labels(short, self._branch(blk.attn, cap, Y), cap.keep, residual)
            else:
                Y = short
        return Y

    def readout(self, labels: torch.Tensor, output) -> torch.Tensor:
        return labels.mean(1)

    def class_attention(self, captures: List[LabelCapture]):
        return None
