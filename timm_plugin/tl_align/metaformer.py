"""TL-Align tracer for timm's ``MetaFormer`` family: PoolFormer (v1, v2), ConvFormer and CAFormer (the TL-Align
paper, Eq. 9/11 and Table 9 of its appendix), the labels on the stages' token grids."""

from __future__ import annotations

import torch
import torch.nn as nn
from timm.layers import GroupNorm1, LayerNorm, LayerNorm2d, Mlp
from timm.models.metaformer import (
    Attention,
    Downsampling,
    GroupNorm1NoBias,
    LayerNorm2dNoBias,
    LayerNormNoBias,
    MetaFormer,
    MetaFormerBlock,
    MetaFormerStage,
    Pooling,
    Scale,
    SepConv,
    Stem,
)

from shared_core.capture import LabelCapture, SdpaCapture
from shared_core.tl_align import attention_labels, conv_labels, conv_pool_labels
from shared_core.tracer import check_block_parts, check_fused_sdpa, check_pool

from .cnn import _ConvLabelGrid

__all__ = ['MetaFormerTracer']

#: the norms MetaFormer blocks use: per token, or (GroupNorm with one group, as BatchNorm in a ResNet) with
#: statistics shared by all tokens of a sample, which rescale every token alike and move no content between them
_NORMS = (LayerNorm2d, LayerNorm2dNoBias, LayerNorm, LayerNormNoBias, nn.LayerNorm, GroupNorm1, GroupNorm1NoBias)

#: the token mixers with a rule, and the block's other parts: per token (the labels pass them unchanged)
_MIXERS = (Pooling, SepConv, Attention, nn.Identity)
_PARTS = {
    'norm1': _NORMS,
    'norm2': _NORMS,
    'mlp': (Mlp,),
    'layer_scale1': (Scale, nn.Identity),
    'res_scale1': (Scale, nn.Identity),
}


class MetaFormerTracer(_ConvLabelGrid):
    """Label rules for timm's ``MetaFormer`` (``poolformer_*``, ``poolformerv2_*``, ``convformer_*``,
    ``caformer_*``):

    - Initial labels: one per cell of the stem's output grid (stride 4): give the mixer ``patch_size=4``
      (``tokenaug-train`` does). The stem's overlapping 7x7 windows reach into neighbouring cells; that is not
      traced (as ResNet's and PVT v2's stems).
    - Downsampling between stages (norm, 3x3 stride-2 conv): the conv as one fixed stencil
      ``Norm(T(mean_{o,i} |K|))`` read at stride 2 (mixing and aggregation at once, as ResNet's strided 3x3).
    - Token mixers (the block's only spatial mixing; Eq. 11 around each, ``Y ← Norm(Y + g(Y))``, for the samples
      whose branch stochastic depth kept):

      - ``Pooling`` (PoolFormer, ``pool(x) − x``): the average pool's equivalent matrix (in-grid cells, as the
        pool counts them). The ``− x`` is the token's own content, point-wise; we take the pool alone as the
        branch's label (the branch moves content from the window; subtracting the token's own does not move any),
        so a PoolFormer block gives ``Norm(Y + pool(Y))``;
      - ``SepConv`` (ConvFormer, CAFormer's first stages): the depthwise ``k x k`` conv as the stencil
        ``Norm(T(mean_c |K_c|))``, as ConvNeXt's; its 1x1 convs and activations are per token;
      - ``Attention`` (CAFormer's last stages): Eq. 9 with the attention of its ``scaled_dot_product_attention``
        call over the stage's tokens (row-major).

    - MLPs, norms (per token, or GroupNorm with one group: sample statistics shared by all tokens, as a ResNet's
      BatchNorm), layer and residual scales: labels unchanged. The head's global average pool reads the mean label.

    Refused: head pooling other than ``avg``, a stem or downsampling other than MetaFormer's own, any other token
    mixer.
    """

    def __init__(self, model: MetaFormer, pooled_outside: bool = False):
        if not pooled_outside:
            pool = getattr(getattr(model.head, 'global_pool', None), 'pool_type', None)
            check_pool(pool, ('avg',), 'MetaFormer', 'head pooling ')
        if type(model.stem) is not Stem:
            raise ValueError(f"model: TL-Align traces MetaFormer's Stem; the stem is {type(model.stem).__name__}")
        for i, stage in enumerate(model.stages):
            if type(stage) is not MetaFormerStage:
                raise ValueError(f'model: TL-Align traces MetaFormerStage stages; stage {i} is {type(stage).__name__}')
            ds = stage.downsample
            if not isinstance(ds, nn.Identity) and (type(ds) is not Downsampling or type(ds.conv) is not nn.Conv2d):
                raise ValueError(f'model: MetaFormer stage {i} downsample {ds} has no TL-Align rule')
            for j, b in enumerate(stage.blocks):
                for name, types in (('block', (MetaFormerBlock,)), ('token_mixer', _MIXERS)):
                    obj = b if name == 'block' else b.token_mixer
                    if type(obj) not in types:
                        raise ValueError(
                            f'model: MetaFormer stage {i} block {j}: {name} is a {type(obj).__name__}; TL-Align '
                            f'traces {", ".join(t.__name__ for t in types)} there'
                        )
                mixer = b.token_mixer
                if type(mixer) is SepConv:
                    dw = mixer.dwconv
                    if dw.groups != dw.in_channels or dw.stride != (1, 1) or dw.dilation != (1, 1):
                        raise ValueError(f'model: MetaFormer stage {i} block {j}: {dw} is not a plain depthwise conv')
        super().__init__(model)
        blocks = self.blocks()
        check_block_parts(blocks, _PARTS)
        check_fused_sdpa(blocks, self.attention)

    capture_mode = SdpaCapture

    def stages(self):
        return [(stage, stage.blocks) for stage in self.model.stages]

    def attention(self, blk: nn.Module):
        """An attention token mixer (CAFormer's last stages); pooling and convolution mixers have none."""
        return blk.token_mixer if type(blk.token_mixer) is Attention else None

    def drop_path(self, blk: nn.Module) -> nn.Module:
        return blk.drop_path1

    @property
    def _last_mixer(self) -> nn.Module:
        return self.blocks()[-1].token_mixer

    @property
    def attends(self) -> bool:
        """CAFormer's last stages attend; PoolFormer's and ConvFormer's blocks pool or convolve."""
        return type(self._last_mixer) is Attention

    @property
    def why_no_attention(self) -> str:
        what = {Pooling: 'pooling', SepConv: 'a depthwise convolution'}.get(type(self._last_mixer), 'an identity')
        return f'its last block mixes tokens by {what} ({type(self._last_mixer).__name__})'

    def branch(self, blk: nn.Module, cap: LabelCapture, Y: torch.Tensor) -> torch.Tensor:
        """The token mixer's labels on the ``(B, K, H, W)`` label map."""
        mixer = blk.token_mixer
        if type(mixer) is Pooling:
            p = mixer.pool
            return conv_pool_labels(Y, p.kernel_size, p.stride, p.padding)
        if type(mixer) is SepConv:
            dw = mixer.dwconv
            return conv_labels(Y, dw)
        if type(mixer) is Attention:
            if cap.q is None:
                raise ValueError('model: a MetaFormer attention block made no scaled_dot_product_attention call')
            B, K, H, W = Y.shape
            flat = Y.flatten(2).transpose(1, 2)
            return attention_labels(cap.q, cap.k, flat, scale=cap.scale).transpose(1, 2).reshape(B, K, H, W)
        return Y  # an identity mixer

    def enter(self, stage, Y: torch.Tensor) -> torch.Tensor:
        if isinstance(stage.downsample, nn.Identity):
            return Y
        conv = stage.downsample.conv
        return conv_labels(Y, conv)
