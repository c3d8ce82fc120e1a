"""TL-Align tracer for timm's ``DaVit`` (dual attention: spatial window attention and channel attention)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.models.davit import (
    ChannelAttention,
    ChannelAttentionV2,
    ChannelBlock,
    ConvPosEnc,
    DaVit,
    DaVitStage,
    Downsample,
    SpatialBlock,
    WindowAttention,
)

from shared_core.capture import Captures, LabelCapture, SdpaCapture, hook_map_grid
from shared_core.tl_align import conv_labels, residual_labels, window_labels
from shared_core.tracer import Tracer, check_fused_sdpa, check_pool

__all__ = ['DaViTTracer']


def _cpe(cpe: ConvPosEnc, Y: torch.Tensor) -> torch.Tensor:
    """The conv position encoding ``x + act(dwconv(x))`` on a ``(B, K, H, W)`` map: Table 9's stencil of the
    depthwise conv with its residual, ``Norm(Y + T(mean |K|) Y)``."""
    return residual_labels(Y, conv_labels(Y, cpe.proj), None, True)


class DaViTTracer(Tracer):
    """Label rules for timm's ``DaVit``, on the ``(B, K, H, W)`` grid of the stem (a 7x7 stride-4 conv, whose
    overlapping windows are not traced, as ResNet's stem; give the mixer ``patch_size=4``):

    - every block's two conv position encodings (``x + dwconv(x)``, before the attention and before the MLP): the
      depthwise conv's stencil with its residual;
    - a spatial block's window attention: Eq. 9 within each window from its ``scaled_dot_product_attention`` call,
      then Eq. 11 (a grid the windows do not tile is refused: DaViT pads it with zero tokens, keys without a label);
    - a channel block's channel attention (``softmax(kᵀ v)`` over channels, a ``d x d`` mixing of each token's
      channels with weights from all tokens): channel mixing, data-dependent, which Table 9 leaves the labels
      through; its residual then averages equal labels;
    - a stage's downsampling (a norm, then a ``k x k`` stride-2 conv): the mean of each output's window (Table 9's
      aggregation; on an odd grid, which the model pads, of its in-grid cells); MLP and norms per position; the
      mean label is the readout.
    """

    layout = 'map'
    capture_mode = SdpaCapture
    grid_module = 'stem'

    def __init__(self, model: DaVit):
        check_pool(getattr(model.head.global_pool, 'pool_type', None), ('avg',), 'DaVit', 'head pooling ')
        for i, stage in enumerate(model.stages):
            if type(stage) is not DaVitStage or not isinstance(stage.downsample, (nn.Identity, Downsample)):
                raise ValueError(f'model: DaVit stage {i} ({type(stage).__name__}) has no TL-Align rule')
        super().__init__(model)
        for i, blk in enumerate(self.blocks()):
            spatial = type(blk) is SpatialBlock and type(blk.attn) is WindowAttention
            channel = type(blk) is ChannelBlock and type(blk.attn) in (ChannelAttention, ChannelAttentionV2)
            if not (spatial or channel) or type(blk.cpe1) is not ConvPosEnc or type(blk.cpe2) is not ConvPosEnc:
                raise ValueError(f'model: DaVit block {i} ({type(blk).__name__}) has no TL-Align rule')
        check_fused_sdpa(self.blocks(), self.attention)

    def stages(self):
        """``((stage, blocks), blocks)``: :meth:`after` reads a block's second position encoding by its index."""
        staged = [(stage, [b for pair in stage.blocks for b in pair]) for stage in self.model.stages]
        return [(pair, pair[1]) for pair in staged]

    def attention(self, blk: nn.Module):
        """A spatial block's window attention (its SDPA call is recorded); a channel block attends over none."""
        return blk.attn if type(blk) is SpatialBlock else None

    @property
    def attends(self) -> bool:
        return type(self.blocks()[-1]) is SpatialBlock

    why_no_attention = "its last block is a channel block: its attention mixes each token's channels, not tokens"

    def watch_model(self, captures: Captures, handles: list) -> None:
        hook_map_grid(self.model.stem, captures, handles)

    def enter(self, stage, Y: torch.Tensor) -> torch.Tensor:
        downsample = stage[0].downsample
        if isinstance(downsample, nn.Identity):
            return Y
        conv = downsample.conv
        if conv.kernel_size != conv.stride:
            raise ValueError(f'model: DaVit downsample {conv} is not a k x k stride-k conv; it has no TL-Align rule')
        # an odd grid is zero-padded on the right and bottom: the last windows' means over their in-grid cells
        return F.avg_pool2d(Y, conv.kernel_size, conv.stride, 0, ceil_mode=True, count_include_pad=False)

    def shortcut(self, blk: nn.Module, cap: LabelCapture, Y: torch.Tensor) -> torch.Tensor:
        return _cpe(blk.cpe1, Y)  # the attention's residual adds to the position-encoded tokens

    def branch(self, blk: nn.Module, cap: LabelCapture, Y: torch.Tensor) -> torch.Tensor:
        Y = _cpe(blk.cpe1, Y)
        if type(blk) is ChannelBlock:
            return Y  # channel mixing: the labels pass
        B, K, H, W = Y.shape
        grid = Y.permute(0, 2, 3, 1)
        out = window_labels(grid, blk.window_size, (0, 0), q=cap.q, k=cap.k, scale=cap.scale)
        return out.permute(0, 3, 1, 2)

    def after(self, stage, j: int, Y: torch.Tensor) -> torch.Tensor:
        return _cpe(stage[1][j].cpe2, Y)
