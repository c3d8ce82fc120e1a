"""TL-Align tracer for timm's ``EfficientFormer`` (v1: PoolFormer-style 4D stages, attention in the last stage)."""

from __future__ import annotations

import torch
import torch.nn as nn
from timm.models.efficientformer import (
    Attention,
    ConvMlpWithNorm,
    Downsample,
    EfficientFormer,
    EfficientFormerStage,
    Flat,
    MetaBlock1d,
    MetaBlock2d,
    Pooling,
)

from shared_core.capture import Captures, LabelCapture, SoftmaxCapture, hook_map_grid
from shared_core.tl_align import conv_labels, conv_pool_labels
from shared_core.tracer import Tracer, check_pool

__all__ = ['EfficientFormerTracer']


class EfficientFormerTracer(Tracer):
    """Label rules for timm's ``EfficientFormer``, on the ``(B, K, H, W)`` grid the first stage runs on (stride 4:
    the stem's two 3x3 stride-2 convs, whose overlapping windows are not traced, as ResNet's stem; give the mixer
    ``patch_size=4``):

    - a stage's downsampling (a 3x3 stride-2 conv, then a norm): a fixed stencil ``Norm(T(mean |K|))`` read at
      stride 2, as ResNet's strided 3x3 convs and the MetaFormers' downsampling;
    - the 4D blocks' pooling mixer ``pool(x) − x``: the average pool's matrix (the ``− x`` moves no content between
      tokens), as PoolFormer's; their 1x1-conv MLP with norms is per position;
    - the last stage's 3D blocks (after ``Flat``, the same tokens in row-major order): attention with its learnt
      attention biases, Eq. 9 on the probabilities of its softmax (the biases are in them);
    - layer scale per token, Eq. 11 at each residual; the mean label is the readout (both heads, distilled or not,
      read the same pooled tokens).
    """

    layout = 'map'
    capture_mode = SoftmaxCapture
    grid_module = 'stem'

    def __init__(self, model: EfficientFormer):
        check_pool(model.global_pool, ('avg',), 'EfficientFormer')
        for i, stage in enumerate(model.stages):
            if type(stage) is not EfficientFormerStage:
                raise ValueError(
                    f'model: TL-Align traces EfficientFormerStage stages, stage {i} is {type(stage).__name__}'
                )
            if not isinstance(stage.downsample, (nn.Identity, Downsample)):
                raise ValueError(f'model: EfficientFormer stage {i} downsample {stage.downsample} has no TL-Align rule')
            for j, b in enumerate(stage.blocks):
                ok = (
                    type(b) is Flat
                    or (type(b) is MetaBlock2d and type(b.token_mixer) is Pooling and type(b.mlp) is ConvMlpWithNorm)
                    or (type(b) is MetaBlock1d and type(b.token_mixer) is Attention)
                )
                if not ok:
                    raise ValueError(
                        f'model: EfficientFormer stage {i} block {j} ({type(b).__name__}) has no TL-Align rule'
                    )
        super().__init__(model)

    def stages(self):
        return [(stage, [b for b in stage.blocks if type(b) is not Flat]) for stage in self.model.stages]

    def attention(self, blk: nn.Module):
        """The 3D blocks' attention (its softmax is recorded); the pooling blocks have none."""
        return blk.token_mixer if type(blk) is MetaBlock1d else None

    def watch_model(self, captures: Captures, handles: list) -> None:
        """The first grid: the stem's output."""
        hook_map_grid(self.model.stem, captures, handles)

    def enter(self, stage, Y: torch.Tensor) -> torch.Tensor:
        if isinstance(stage.downsample, nn.Identity):
            return Y
        conv = stage.downsample.conv
        return conv_labels(Y, conv)

    def branch(self, blk: nn.Module, cap: LabelCapture, Y: torch.Tensor) -> torch.Tensor:
        """The token mixer's labels on the ``(B, K, H, W)`` label map."""
        if type(blk) is MetaBlock2d:
            p = blk.token_mixer.pool
            return conv_pool_labels(Y, p.kernel_size, p.stride, p.padding)
        B, K, H, W = Y.shape
        if cap.attn is None:
            raise ValueError('model: an EfficientFormer attention block computed no softmax')
        rows = cap.attn.float().mean(1) @ Y.flatten(2).transpose(1, 2)  # (B, N, K)
        return rows.transpose(1, 2).reshape(B, K, H, W)
