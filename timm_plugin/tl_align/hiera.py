"""TL-Align tracer for timm's ``Hiera``: pooled attention over unrolled tokens (the TL-Align paper, Eq. 9/11;
Table 9 for the pooling)."""

from __future__ import annotations

import torch
import torch.nn as nn
from timm.layers import Mlp
from timm.models.hiera import Hiera, HieraBlock, MaskUnitAttention

from shared_core.capture import Captures, LabelCapture, SdpaCapture
from shared_core.tl_align import attention_labels
from shared_core.tracer import Tracer, check_block_parts, check_fused_sdpa, check_pool, check_types

from ._blocks import NORMS

__all__ = ['HieraTracer']


class HieraTracer(Tracer):
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

    capture_mode = SdpaCapture
    needs = ('q', 'k')
    why_missing = 'its attention made no scaled_dot_product_attention call'

    def __init__(self, model: Hiera):
        check_types(model.blocks, (HieraBlock,), (MaskUnitAttention,), 'Hiera')
        check_block_parts(model.blocks, {'norm1': NORMS, 'norm2': NORMS, 'mlp': (Mlp,)})
        check_fused_sdpa(model.blocks)
        check_pool(getattr(model.head, 'pool_type', None), ('avg',), 'Hiera', 'head pooling ')
        if model.patch_drop_rate > 0:
            raise ValueError('model: mask-unit patch dropout removes tokens; TL-Align does not trace it')
        super().__init__(model)

    def blocks(self):
        return self.model.blocks

    def watch_model(self, captures: Captures, handles: list) -> None:
        """The patch count (``captures.grid``): the tokens are unrolled, no grid."""
        embed = self.model.patch_embed
        handles.append(embed.register_forward_hook(lambda m, i, o: setattr(captures, 'grid', o.shape[1])))

    def to_layout(self, labels: torch.Tensor, captures: Captures) -> torch.Tensor:
        """The rows in the order of the model's own ``unroll`` (a permutation of the tokens: no grid)."""
        return self.model.unroll(labels)

    def grid_of(self, Y: torch.Tensor, captures: Captures):
        return None

    def shortcut(self, blk: nn.Module, cap: LabelCapture, Y: torch.Tensor) -> torch.Tensor:
        s = blk.attn.q_stride
        return Y.view(Y.shape[0], s, -1, Y.shape[-1]).mean(1) if s > 1 else Y  # the pooled shortcut

    def branch(self, blk: nn.Module, cap: LabelCapture, Y: torch.Tensor) -> torch.Tensor:
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
