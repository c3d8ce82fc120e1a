"""TL-Align tracer for timm's ``MultiScaleVit`` (MViTv2): pooled attention with relative positions and residual
pooling (the TL-Align paper, Eq. 9/11; Table 9 for the pooling convs and the pooled shortcut)."""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn as nn
from timm.layers import Mlp
from timm.models.mvitv2 import MultiScaleAttention, MultiScaleBlock, MultiScaleVit, MultiScaleVitStage

from shared_core.capture import SoftmaxCapture
from shared_core.tl_align import LabelCapture, conv_pool_labels, conv_stencil_labels, residual_labels

from ._blocks import NORMS, check_captured, watch_blocks

__all__ = ['MViTv2Tracer']


def _stencil(conv: nn.Conv2d) -> torch.Tensor:
    return conv.weight.detach().float().abs().mean((0, 1))


class MViTv2Tracer:
    """Label rules for timm's ``MultiScaleVit`` (``mvitv2_*``, with or without a class token):

    - Initial labels: one per patch of the patch embedding (stride 4; its overlapping 7x7 windows are not traced,
      as ResNet's stem); a class token carries the area label and is never pooled (as in the model).
    - Pooling of ``q``, ``k``, ``v`` (depthwise convs, strided at the stage starts): the labels of the pooled
      queries, keys and values are the convs' fixed stencils ``Norm(T(mean_c |K_c|))`` read at their strides
      (Table 9's mixing and aggregation at once; ``avg``/``max`` pooling modes: the window mean).
    - Attention (with the decomposed relative position term, which the token path adds before its softmax): Eq. 9
      with the probabilities of that softmax applied to the values' labels; residual pooling (``x = A v + q``)
      joins the pooled queries' labels: ``Norm(A Y_v + Y_q)``.
    - The shortcut max-pooled at the stage starts: the mean label of each pooling window (Table 9's aggregation).
      Eq. 11 at each residual for the samples whose branch stochastic depth kept; norms, MLPs and projections are
      per token; the head reads the class token or the mean patch label.

    Refused: ``pool_first`` attention (``MultiScaleAttentionPoolFirst``), head pooling other than ``avg`` or
    ``token``.
    """

    #: the last block mixes its tokens by a self-attention (TransMix reads it)
    attends = True

    def __init__(self, model: MultiScaleVit):
        if model.global_pool not in ('avg', 'token'):
            raise ValueError(f'model: MViTv2 with global_pool={model.global_pool!r} has no TL-Align rule')
        for i, stage in enumerate(model.stages):
            if type(stage) is not MultiScaleVitStage:
                raise ValueError(
                    f'model: TL-Align traces MultiScaleVitStage stages; stage {i} is {type(stage).__name__}'
                )
            for j, b in enumerate(stage.blocks):
                if type(b) is not MultiScaleBlock or type(b.attn) is not MultiScaleAttention:
                    raise ValueError(
                        f'model: TL-Align traces MultiScaleBlock with MultiScaleAttention (pool_first off); stage {i} '
                        f'block {j} is {type(b).__name__} with {type(b.attn).__name__}'
                    )
                if type(b.mlp) is not Mlp or type(b.norm1) not in NORMS or type(b.norm2) not in NORMS:
                    raise ValueError(f'model: MViTv2 stage {i} block {j} has parts without a TL-Align rule')
                for name in ('pool_q', 'pool_k', 'pool_v'):
                    pool = getattr(b.attn, name)
                    ok = pool is None or isinstance(pool, (nn.MaxPool2d, nn.AvgPool2d))
                    ok = ok or (type(pool) is nn.Conv2d and pool.groups == pool.in_channels and pool.dilation == (1, 1))
                    if not ok:
                        raise ValueError(f'model: MViTv2 stage {i} block {j} {name} {pool} has no TL-Align rule')
        self.model = model
        self.num_prefix_tokens = int(model.num_prefix_tokens)

    def _blocks(self):
        return [b for stage in self.model.stages for b in stage.blocks]

    @property
    def depth(self) -> int:
        return len(self._blocks())

    def register(self, captures: List[LabelCapture]) -> list:
        """``captures[0]`` keeps the first grid, then one per block (its attention probabilities, kept samples)."""
        embed = LabelCapture()
        captures.append(embed)
        handle = self.model.patch_embed.register_forward_hook(lambda m, i, o: setattr(embed, 'tokens', tuple(o[1])))
        return [handle] + watch_blocks(self._blocks(), captures, SoftmaxCapture())

    def num_tokens(self, captures: List[LabelCapture]) -> int:
        check_captured(captures[:1], ('tokens',), 'the patch embedding did not run')
        check_captured(captures[1:], ('attn',), 'its attention computed no softmax')
        H, W = captures[0].tokens
        return self.num_prefix_tokens + H * W

    @staticmethod
    def _pool(pool: Optional[nn.Module], Y: torch.Tensor) -> torch.Tensor:
        """A pooling of ``q``/``k``/``v`` (or the shortcut) applied to the ``(B, K, H, W)`` label map."""
        if pool is None:
            return Y
        if type(pool) is nn.Conv2d:
            return conv_stencil_labels(Y, _stencil(pool), pool.padding, pool.stride)
        return conv_pool_labels(Y, pool.kernel_size, pool.stride, pool.padding)

    def propagate(
        self, captures: List[LabelCapture], labels: torch.Tensor, layers: Optional[set], residual: bool
    ) -> torch.Tensor:
        P = self.num_prefix_tokens
        H, W = captures[0].tokens
        B, _, K = labels.shape
        cls = labels[:, :P]
        grid = labels[:, P:].transpose(1, 2).reshape(B, K, H, W)

        def tokens(cls_labels, grid_labels):
            return torch.cat([cls_labels, grid_labels.flatten(2).transpose(1, 2)], 1)

        for idx, (blk, cap) in enumerate(zip(self._blocks(), captures[1:])):
            attn = blk.attn
            short = self._pool(blk.shortcut_pool_attn, grid)
            if layers is not None and idx not in layers:
                grid = short
                continue
            q_grid, v_grid = self._pool(attn.pool_q, grid), self._pool(attn.pool_v, grid)
            A = cap.attn.float().mean(1)  # (B, T_q, T_kv), the head mean
            branch = A @ tokens(cls, v_grid)  # Eq. 9 on the values' labels
            if attn.residual_pooling:
                branch = (branch + tokens(cls, q_grid)) / 2
            new = residual_labels(tokens(cls, short), branch, cap.keep, residual)
            cls = new[:, :P]
            grid = new[:, P:].transpose(1, 2).reshape(B, K, *short.shape[-2:])
        return tokens(cls, grid)

    def readout(self, labels: torch.Tensor, output) -> torch.Tensor:
        if self.model.global_pool == 'token':
            return labels[:, 0]
        return labels[:, self.num_prefix_tokens :].mean(1)

    def class_attention(self, captures: List[LabelCapture]):
        return None
