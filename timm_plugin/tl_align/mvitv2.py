"""TL-Align tracer for timm's ``MultiScaleVit`` (MViTv2): pooled attention with relative positions and residual
pooling (the TL-Align paper, Eq. 9/11; Table 9 for the pooling convs and the pooled shortcut)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from timm.layers import Mlp
from timm.models.mvitv2 import MultiScaleAttention, MultiScaleBlock, MultiScaleVit, MultiScaleVitStage

from shared_core.capture import Captures, LabelCapture, SoftmaxCapture
from shared_core.tl_align import conv_labels, conv_pool_labels
from shared_core.tracer import Tracer, check_block_parts, check_pool

from ._blocks import NORMS

__all__ = ['MViTv2Tracer']


class MViTv2Tracer(Tracer):
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

    capture_mode = SoftmaxCapture
    needs = ('attn',)
    why_missing = 'its attention computed no softmax'

    def __init__(self, model: MultiScaleVit):
        check_pool(model.global_pool, ('avg', 'token'), 'MViTv2')
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
                for name in ('pool_q', 'pool_k', 'pool_v'):
                    pool = getattr(b.attn, name)
                    ok = pool is None or isinstance(pool, (nn.MaxPool2d, nn.AvgPool2d))
                    ok = ok or (type(pool) is nn.Conv2d and pool.groups == pool.in_channels and pool.dilation == (1, 1))
                    if not ok:
                        raise ValueError(f'model: MViTv2 stage {i} block {j} {name} {pool} has no TL-Align rule')
        super().__init__(model)
        check_block_parts(self.blocks(), {'norm1': NORMS, 'norm2': NORMS, 'mlp': (Mlp,)})
        self.num_prefix_tokens = int(model.num_prefix_tokens)
        self.readout = 'cls' if model.global_pool == 'token' else 'mean'

    def stages(self):
        return [(stage, stage.blocks) for stage in self.model.stages]

    def watch_model(self, captures: Captures, handles: list) -> None:
        embed = self.model.patch_embed  # returns (tokens, feat_size)
        handles.append(embed.register_forward_hook(lambda m, i, o: setattr(captures, 'grid', tuple(o[1]))))

    def watch(self, blk: nn.Module, cap: LabelCapture, handles: list) -> None:
        """The grid the block runs on (its ``feat_size``)."""
        handles.append(blk.register_forward_pre_hook(lambda m, a, c=cap: setattr(c, 'tokens', tuple(a[1]))))

    @staticmethod
    def _pool(pool: Optional[nn.Module], Y: torch.Tensor) -> torch.Tensor:
        """A pooling of ``q``/``k``/``v`` (or the shortcut) applied to the ``(B, K, H, W)`` label map."""
        if pool is None:
            return Y
        if type(pool) is nn.Conv2d:
            return conv_labels(Y, pool)
        return conv_pool_labels(Y, pool.kernel_size, pool.stride, pool.padding)

    def _pooled(self, pool: Optional[nn.Module], cap: LabelCapture, Y: torch.Tensor) -> torch.Tensor:
        """The ``(B, P + N, K)`` rows (prefix tokens, then the block's grid) with the grid pooled by ``pool``; the
        prefix tokens are never pooled."""
        P = self.num_prefix_tokens
        grid = Y[:, P:].transpose(1, 2).reshape(Y.shape[0], Y.shape[2], *cap.tokens)
        return torch.cat([Y[:, :P], self._pool(pool, grid).flatten(2).transpose(1, 2)], 1)

    def shortcut(self, blk: nn.Module, cap: LabelCapture, Y: torch.Tensor) -> torch.Tensor:
        return self._pooled(blk.shortcut_pool_attn, cap, Y)  # max-pooled at the stage starts

    def branch(self, blk: nn.Module, cap: LabelCapture, Y: torch.Tensor) -> torch.Tensor:
        attn = blk.attn
        A = cap.attn.float().mean(1)  # (B, T_q, T_kv), the head mean
        branch = A @ self._pooled(attn.pool_v, cap, Y)  # Eq. 9 on the values' labels
        if attn.residual_pooling:  # x = A v + q
            branch = (branch + self._pooled(attn.pool_q, cap, Y)) / 2
        return branch
