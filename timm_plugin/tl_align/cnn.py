"""TL-Align tracers for timm CNNs (TL-Align Appendix A's rules beyond ViTs): ConvNeXt and ResNet, the labels on
the convolutions' grid."""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import Mlp
from timm.models.convnext import ConvNeXt, ConvNeXtBlock, ConvNeXtStage
from timm.models.resnet import BasicBlock, Bottleneck, ResNet

from shared_core.tl_align import (
    LabelCapture,
    conv_stencil_labels,
    residual_labels,
)

from ._blocks import StagedBlocks, check_captured, hook_first_drop_path, pool_like

# ---------------------------------------------------------------------------------------------- ConvNeXt


class _ConvLabelGrid(StagedBlocks):
    """What the CNN tracers share: the label state starts on the grid one module reports (:meth:`_grid_hook`), one
    capture per block keeps the samples its (first) drop path kept, convs mix labels by their fixed stencil
    ``mean |K|`` over the channel dims, and global average pooling reads the mean label."""

    num_prefix_tokens = 0
    _grid_module = 'the stem'
    #: convolutions mix the tokens (TransMix has no attention to read)
    attends = False
    why_no_attention = 'its blocks mix tokens by convolutions'

    def _grid_hook(self, cap: LabelCapture):
        """A hook that sets ``cap.tokens`` to the ``(H, W)`` grid the label state starts on (default: the output
        grid of ``model.stem``); returns its handle."""
        return self.model.stem.register_forward_hook(lambda m, i, o, c=cap: setattr(c, 'tokens', tuple(o.shape[-2:])))

    def register(self, captures: List[LabelCapture]) -> list:
        """``captures[0]`` keeps the first grid, then one per block (the samples its drop_path kept)."""
        stem = LabelCapture()
        captures.append(stem)
        handles = [self._grid_hook(stem)]
        for blk in self._blocks():
            cap = LabelCapture()
            captures.append(cap)
            hook_first_drop_path(blk, cap, handles)
        return handles

    def num_tokens(self, captures: List[LabelCapture]) -> int:
        check_captured(captures[:1], ('tokens',), f'{self._grid_module} did not run (a replaced forward?)')
        H, W = captures[0].tokens
        return H * W

    @staticmethod
    def _label_map(captures: List[LabelCapture], labels: torch.Tensor) -> torch.Tensor:
        """The ``(B, N, K)`` labels as a channels-first ``(B, K, H, W)`` map on the first grid, for the conv ops."""
        H, W = captures[0].tokens
        return labels.transpose(1, 2).reshape(labels.shape[0], labels.shape[2], H, W)

    @staticmethod
    def stencil(conv: nn.Conv2d) -> torch.Tensor:
        """``S = mean |K|`` ``(k, k)`` fp32 over a conv's output and input channel dims (a depthwise conv: over its
        channels' kernels)."""
        return conv.weight.detach().float().abs().mean((0, 1))

    def readout(self, labels: torch.Tensor, output) -> torch.Tensor:
        return labels.mean(1)

    def class_attention(self, captures: List[LabelCapture]):
        return None


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

    Refused (a clear error): overlapping stems, ConvNeXt V2's global response norm (it rescales every token by
    statistics of all tokens), dilated or strided depthwise convs, a head pooling other than ``avg``.
    """

    why_no_attention = 'its blocks mix tokens by depthwise convolutions'

    def __init__(self, model: ConvNeXt, pooled_outside: bool = False):
        pool = getattr(getattr(model.head, 'global_pool', None), 'pool_type', None)
        if pool != 'avg' and not pooled_outside:
            raise ValueError(f"model: ConvNeXt with head pooling {pool!r} has no TL-Align rule; use 'avg'")
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
                if type(b.mlp) is not Mlp or not isinstance(b.shortcut, nn.Identity):
                    raise ValueError(
                        f'model: ConvNeXt stage {i} block {j}: mlp {type(b.mlp).__name__} / shortcut '
                        f'{type(b.shortcut).__name__} has no TL-Align rule (ConvNeXt V2 global response norm '
                        'mixes all tokens)'
                    )
        self.model = model

    def propagate(
        self, captures: List[LabelCapture], labels: torch.Tensor, layers: Optional[set], residual: bool
    ) -> torch.Tensor:
        Y = self._label_map(captures, labels)
        caps = iter(captures[1:])
        idx = 0
        for stage in self.model.stages:
            if not isinstance(stage.downsample, nn.Identity):
                Y = pool_like(Y, stage.downsample[-1])
            for blk in stage.blocks:
                keep = next(caps).keep
                if layers is None or idx in layers:
                    dw = blk.conv_dw
                    branch = conv_stencil_labels(Y, self.stencil(dw), dw.padding)
                    Y = residual_labels(Y, branch, keep, residual)
                idx += 1
        return Y.flatten(2).transpose(1, 2)


# ---------------------------------------------------------------------------------------------- ResNet


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
    - 1x1 convolutions, batch norms, activations: channel mixing / point-wise, labels unchanged.
    - Shortcut: identity, or the downsample's geometry: a strided 1x1 conv reads one position of each 2x2 cell
      (:func:`~shared_core.tl_align.conv_pool_labels` with its window), ResNet-D's 2x2 average pool (ceil mode) is
      the mean of its window.
    - Residual (Eq. 11): ``Y ← Norm(Y_shortcut + Y_branch)``; a sample whose branch stochastic depth dropped keeps
      its shortcut labels. Global average pooling reads the mean label.

    Refused with a clear error: attention / SE layers and anti-aliased downsampling (``attn_layer``, ``aa_layer``:
    the SE gate comes from every position, like ConvNeXt V2's GRN), ResNeSt's split attention, dilated convs,
    and pooling other than ``avg``.
    """

    def __init__(self, model: ResNet, pooled_outside: bool = False):
        if model.global_pool.pool_type != 'avg' and not pooled_outside:
            raise ValueError(
                f"model: ResNet with global_pool={model.global_pool.pool_type!r} has no TL-Align rule; use 'avg'"
            )
        self.model = model
        for i, blk in enumerate(self._blocks()):
            convs = self._spatial_convs(blk)
            if type(blk) not in (BasicBlock, Bottleneck) or convs is None:
                raise ValueError(
                    f'model: TL-Align traces ResNet BasicBlock / Bottleneck blocks; block {i} is {type(blk).__name__} '
                    '(ResNeSt split attention has no rule)'
                )
            extras = [n for n in ('se', 'aa') if not isinstance(getattr(blk, n), (type(None), nn.Identity))]
            bad = [c for c in convs if type(c) is not nn.Conv2d or c.dilation != (1, 1) or isinstance(c.padding, str)]
            if extras or bad:
                raise ValueError(
                    f'model: ResNet block {i}: {", ".join(extras + [str(c) for c in bad])} has no TL-Align rule '
                    '(attention/SE gates read every position; dilated or anti-aliased convs are not traced)'
                )
            self._shortcut(blk)  # checks the downsample

    _grid_module = 'layer1'

    def _blocks(self) -> list:
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

    def _grid_hook(self, cap: LabelCapture):
        return self.model.layer1.register_forward_pre_hook(
            lambda m, a, c=cap: setattr(c, 'tokens', tuple(a[0].shape[-2:]))
        )

    def propagate(
        self, captures: List[LabelCapture], labels: torch.Tensor, layers: Optional[set], residual: bool
    ) -> torch.Tensor:
        Y = self._label_map(captures, labels)
        for idx, (blk, cap) in enumerate(zip(self._blocks(), captures[1:])):
            shortcut = self._shortcut(blk)
            short = Y if shortcut is None else shortcut(Y)
            if layers is None or idx in layers:
                branch = Y
                for conv in self._spatial_convs(blk):
                    branch = conv_stencil_labels(branch, self.stencil(conv), conv.padding, conv.stride)
                Y = residual_labels(short, branch, cap.keep, residual)
            else:
                Y = short
        return Y.flatten(2).transpose(1, 2)
