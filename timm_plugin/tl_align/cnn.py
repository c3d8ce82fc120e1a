"""TL-Align tracers for timm CNNs (TL-Align Appendix A's rules beyond ViTs): ConvNeXt and ResNet, the labels on
the convolutions' grid."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import CecaModule, EcaModule, EffectiveSEModule, GlobalResponseNormMlp, Mlp, SEModule
from timm.models.convnext import ConvNeXt, ConvNeXtBlock, ConvNeXtStage
from timm.models.resnet import BasicBlock, Bottleneck, ResNet

from shared_core.capture import Captures, LabelCapture, hook_map_grid
from shared_core.tl_align import conv_labels, pool_like
from shared_core.tracer import Tracer, check_pool

# ---------------------------------------------------------------------------------------------- ConvNeXt


class _ConvLabelGrid(Tracer):
    """What the CNN tracers share: the label state is a ``(B, K, H, W)`` map on the grid one module reports
    (:meth:`watch_model`, default the output grid of ``model.stem``), each block's samples its (first) drop path
    kept, convs mix labels by their fixed stencil ``mean |K|`` over the channel dims (:func:`._blocks.stencil`),
    and global average pooling reads the mean label. ``pooled_outside``: the model's own head pooling is off and
    its final map is average-pooled outside it (mmpretrain's ``TIMMBackbone`` with a ``GlobalAveragePooling``
    neck): the head's pooling is not checked, the readout is the same mean."""

    layout = 'map'
    grid_module = 'the stem'
    #: convolutions mix the tokens (TransMix has no attention to read)
    attends = False
    why_no_attention = 'its blocks mix tokens by convolutions'

    def watch_model(self, captures: Captures, handles: list) -> None:
        hook_map_grid(self.model.stem, captures, handles)

    def drop_path(self, blk: nn.Module):
        return getattr(blk, 'drop_path', None)  # (ResNet's: None without stochastic depth)


class ConvNeXtTracer(_ConvLabelGrid):
    """Label rules for timm's ``ConvNeXt`` (TL-Align Appendix A, Table 9; ConvNeXt is the appendix's example of
    spatial mixing by a convolution, ``W^s = T(K)``):

    - Initial labels: one per token of the patchify stem (``Conv2d`` with kernel = stride, 4 for ConvNeXt): give
      the mixer ``patch_size`` = that stride (``tokenaug-train`` does), so the stem's grid is the mix grid.
    - Block (``conv_dw``, norm, MLP, layer scale, residual): the depthwise ``k x k`` conv is the block's only
      spatial mixing, but each channel has its own signed kernel ``K_c`` while the labels are shared by the
      channels. We use one fixed stencil per layer, ``S = mean_c |K_c|``, and mix the labels with
      ``Norm(T(S))`` (:func:`~shared_core.tl_align.conv_stencil_labels`: the conv's equivalent matrix with
      rows normalised, padding positions not counted): magnitudes because the signed kernels' sums can vanish
      (as for CaiT and the MLP family), the channel mean because one label map has to stand for all channels
      and each channel's kernel moves its information by that kernel's weights. The norm, MLP and layer scale
      are point-wise or channel mixing (labels unchanged); the residual is Eq. 11, ``Y ← Norm(Y + g(Y))``, for
      the samples whose branch stochastic depth kept.
    - Downsampling between stages (norm, then a 2x2 stride-2 conv): spatial aggregation, ``Norm(Σ Y_i)`` over
      each output's window (average pooling with the conv's geometry).
    - Global average pooling (the head): the mean label.

    - ConvNeXt V2's global response norm (``GlobalResponseNormMlp``): ``x + β + γ · x · N(x)``, each channel of
      each position scaled by one scalar of its sample (its channel's spatial norm over their mean), a channel
      gate as SE is (:data:`CHANNEL_GATES`): channel mixing, labels unchanged.

    Refused (a clear error): overlapping stems, dilated or strided depthwise convs, a head pooling other than
    ``avg``.
    """

    why_no_attention = 'its blocks mix tokens by depthwise convolutions'

    def __init__(self, model: ConvNeXt, pooled_outside: bool = False):
        if not pooled_outside:
            pool = getattr(getattr(model.head, 'global_pool', None), 'pool_type', None)
            check_pool(pool, ('avg',), 'ConvNeXt', 'head pooling ')
        stem = model.stem[0] if isinstance(model.stem, nn.Sequential) and len(model.stem) == 2 else None
        if type(stem) is not nn.Conv2d or stem.kernel_size != stem.stride or stem.padding != (0, 0):
            raise ValueError(
                "model: TL-Align traces ConvNeXt's patchify stem (stem_type='patch'); an overlapping stem has no "
                'token grid of its own'
            )
        for i, stage in enumerate(model.stages):
            if type(stage) is not ConvNeXtStage:
                raise ValueError(f'model: TL-Align traces ConvNeXtStage stages, stage {i} is {type(stage).__name__}')
            if not isinstance(stage.downsample, nn.Identity):
                conv = stage.downsample[-1]
                if type(conv) is not nn.Conv2d or conv.kernel_size != conv.stride:
                    raise ValueError(f'model: ConvNeXt stage {i} downsample {conv} has no TL-Align rule')
            for j, b in enumerate(stage.blocks):
                dw = b.conv_dw
                ok = type(b) is ConvNeXtBlock and type(dw) is nn.Conv2d and dw.groups == dw.in_channels
                if not ok or dw.stride != (1, 1) or dw.dilation != (1, 1) or isinstance(dw.padding, str):
                    raise ValueError(
                        f'model: TL-Align traces ConvNeXtBlock with an undilated stride-1 depthwise conv_dw; stage '
                        f'{i} block {j} is {type(b).__name__} with {dw}'
                    )
                if type(b.mlp) not in (Mlp, GlobalResponseNormMlp) or not isinstance(b.shortcut, nn.Identity):
                    raise ValueError(
                        f'model: ConvNeXt stage {i} block {j}: mlp {type(b.mlp).__name__} / shortcut '
                        f'{type(b.shortcut).__name__} has no TL-Align rule'
                    )
        super().__init__(model)

    def stages(self):
        return [(stage, stage.blocks) for stage in self.model.stages]

    def enter(self, stage, Y: torch.Tensor) -> torch.Tensor:
        return Y if isinstance(stage.downsample, nn.Identity) else pool_like(Y, stage.downsample[-1])

    def branch(self, blk: nn.Module, cap: LabelCapture, Y: torch.Tensor) -> torch.Tensor:
        dw = blk.conv_dw
        return conv_labels(Y, dw)


# ---------------------------------------------------------------------------------------------- ResNet

#: the channel gates a ResNet block may carry (``attn_layer`` 'se', 'ese', 'eca', 'ceca'): each multiplies every
#: channel of every position by one scalar of its sample, computed from the channels' global means. Table 9 reads
#: that as channel mixing ``W^c(Z)``, data-dependent: the labels are unchanged (Y ← Y), as for a 1x1 conv
CHANNEL_GATES = (SEModule, EffectiveSEModule, EcaModule, CecaModule)


class ResNetTracer(_ConvLabelGrid):
    """Label rules for timm's ``ResNet`` with ``BasicBlock`` / ``Bottleneck`` blocks (ResNet, ResNet-D, ResNeXt, wide
    ResNets; TL-Align Appendix A, Table 9 applied to a plain CNN):

    - Initial labels: one per cell of the grid the first stage runs on (stride 4: the stem's stride-2 conv and
      stride-2 max pool), from the partner share of that 4x4 cell: give the mixer ``patch_size=4``
      (``tokenaug-train`` does for TL-Align on a ResNet). The stem's overlapping 7x7 / 3x3 windows reach into
      the neighbouring cells; that is not traced (as PVT v2's overlapping patch embedding).
    - 3x3 convolutions (``Bottleneck.conv2``; ``BasicBlock.conv1`` and ``conv2``): spatial mixing with one fixed
      stencil per layer, ``S = mean_{o,i} |K_{o,i}|`` over the output and input channels (grouped convs: over the
      groups' kernels), mixed as ``Norm(T(S))`` (:func:`~shared_core.tl_align.conv_stencil_labels`, in-grid
      positions only). A stride-2 3x3 conv mixes and aggregates at once: the same stencil read at stride 2.
      Why the channel mean of magnitudes: as ConvNeXt's depthwise kernels, one label map stands for every
      channel, and a signed kernel's sum can vanish.
    - 1x1 convolutions, batch norms, activations: channel mixing / point-wise, labels unchanged. So are the
      channel gates (:data:`CHANNEL_GATES`: SE, effective SE, ECA, circular ECA): a gate multiplies each channel
      of each position by one scalar of its sample (from the channels' global means), a data-dependent channel
      mixing that Table 9 leaves the labels through (``seresnet*``, ``ecaresnet*``, ``seresnext*``).
    - Shortcut: identity, or the downsample's geometry: a strided 1x1 conv reads one position of each 2x2 cell
      (:func:`~shared_core.tl_align.conv_pool_labels` with its window), ResNet-D's 2x2 average pool (ceil mode) is
      the mean of its window.
    - Residual (Eq. 11): ``Y ← Norm(Y_shortcut + Y_branch)``; a sample whose branch stochastic depth dropped keeps
      its shortcut labels. Global average pooling reads the mean label.

    Refused with a clear error: the other ``attn_layer`` kinds (CBAM's and coordinate attention's gates differ per
    position, global context adds a pooled vector to every position, gather-excite gathers from a neighbourhood:
    no Table 9 reading), anti-aliased downsampling (``aa_layer``), ResNeSt's split attention, dilated convs, and
    pooling other than ``avg``.
    """

    def __init__(self, model: ResNet, pooled_outside: bool = False):
        if not pooled_outside:
            check_pool(model.global_pool.pool_type, ('avg',), 'ResNet')
        super().__init__(model)
        for i, blk in enumerate(self.blocks()):
            convs = self._spatial_convs(blk)
            if type(blk) not in (BasicBlock, Bottleneck) or convs is None:
                raise ValueError(
                    f'model: TL-Align traces ResNet BasicBlock / Bottleneck blocks; block {i} is {type(blk).__name__} '
                    '(ResNeSt split attention has no rule)'
                )
            if not isinstance(blk.se, (type(None), nn.Identity, *CHANNEL_GATES)):
                raise ValueError(
                    f'model: ResNet block {i}: its attention layer {type(blk.se).__name__} has no TL-Align rule (the '
                    'channel gates SE, ESE, ECA and CECA leave the labels; a gate that differs per position or adds '
                    'a pooled context has no Table 9 reading)'
                )
            aa = [] if isinstance(getattr(blk, 'aa', None), (type(None), nn.Identity)) else ['aa']
            bad = [c for c in convs if type(c) is not nn.Conv2d or c.dilation != (1, 1) or isinstance(c.padding, str)]
            if aa or bad:
                raise ValueError(
                    f'model: ResNet block {i}: {", ".join(aa + [str(c) for c in bad])} has no TL-Align rule '
                    '(dilated or anti-aliased convs are not traced)'
                )
            self._shortcut(blk)  # checks the downsample

    grid_module = 'layer1'

    def blocks(self) -> list:
        m = self.model
        return [b for layer in (m.layer1, m.layer2, m.layer3, m.layer4) for b in layer]

    @staticmethod
    def _spatial_convs(blk):
        """The block's k x k convs in order (``None`` for a block type without a rule)."""
        if type(blk) is Bottleneck:
            return [blk.conv2]
        if type(blk) is BasicBlock:
            return [blk.conv1, blk.conv2]
        return None

    @staticmethod
    def _shortcut(blk):
        """The shortcut's label op: ``None`` (identity), or a function of the ``(B, K, H, W)`` labels."""
        ds = blk.downsample
        if ds is None or isinstance(ds, nn.Identity):
            return None
        parts = (
            [m for m in ds if not isinstance(m, (nn.BatchNorm2d, nn.Identity))] if isinstance(ds, nn.Sequential) else []
        )
        if len(parts) == 1 and type(parts[0]) is nn.Conv2d:
            conv = parts[0]
            return lambda Y: pool_like(Y, conv)
        if len(parts) == 2 and type(parts[0]) is nn.AvgPool2d and type(parts[1]) is nn.Conv2d:
            pool, conv = parts
            if conv.kernel_size != (1, 1) or conv.stride != (1, 1):
                raise ValueError(f'model: ResNet downsample {ds} has no TL-Align rule')
            return lambda Y: F.avg_pool2d(
                Y, pool.kernel_size, pool.stride, pool.padding, pool.ceil_mode, count_include_pad=False
            )
        raise ValueError(f'model: ResNet downsample {ds} has no TL-Align rule')

    def watch_model(self, captures: Captures, handles: list) -> None:
        """The grid the first stage runs on (``layer1``'s input)."""
        layer1 = self.model.layer1
        handles.append(layer1.register_forward_pre_hook(lambda m, a: setattr(captures, 'grid', tuple(a[0].shape[-2:]))))

    def shortcut(self, blk: nn.Module, cap: LabelCapture, Y: torch.Tensor) -> torch.Tensor:
        op = self._shortcut(blk)
        return Y if op is None else op(Y)

    def branch(self, blk: nn.Module, cap: LabelCapture, Y: torch.Tensor) -> torch.Tensor:
        for conv in self._spatial_convs(blk):
            Y = conv_labels(Y, conv)
        return Y
