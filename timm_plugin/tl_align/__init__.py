"""TL-Align for timm models: a wrapper that traces token labels beside the token path.

``TLAlign(model)`` wraps a supported timm model. In training, ``logits, target = wrapped(x, mix_target)``
with ``mix_target`` the :class:`timm_plugin.MixTarget` from a token-aware mixer: the logits are the model's
(exactly on the recomputing path; on timm ViTs' shared attention up to another kernel's float rounding), and
``target`` is the aligned ``(B, C)`` soft target (TL-Align paper Eq. 12). In eval mode (or without a target)
it is the plain model call: same logits, no extra work.

How the labels are traced: forward hooks on each attention's ``q_norm`` / ``k_norm`` (identity modules
unless qk-norm is on) keep the detached ``q``, ``k`` the token path fed to its fused attention (autograd
holds them anyway), and a hook on ``drop_path1`` notes which samples' attention branch stochastic
depth dropped. After the forward, the label state (compact ``(B, T, 1)`` partner shares, or dense
``(B, T, C)`` for :meth:`TLAlign.trace`) goes through the blocks with the rules of
:mod:`shared_core.tl_align`; the attention is recomputed for the labels by a fused
``scaled_dot_product_attention`` call with the labels as values (on accelerators; on the CPU a
transient softmax is faster), and the token path is untouched: still the model's fused attention.

On timm ``VisionTransformer`` / DeiT the default is :class:`SharedAttentionViT`: the labels travel through
the token path's own attention call as extra value columns (one fused attention per block for both, on every
device; ``fused=False`` materialises the attention once for both; ``TLAlign(model, shared=False)`` keeps the
recomputing path described above).

Supported: the model classes of :data:`SUPPORTED_MODELS`, each with its tracer, whose docstring gives its rules;
``docs/methods/tl_align_zoo.md`` lists every timm family with its status. Families whose token mixer no rule
covers are refused with the reason (``NO_RULE``); other models raise an error listing the supported classes.

This package: the wrappers and the model -> tracer table here; the tracers by model family in :mod:`.vit` (ViT,
DeiT, CaiT, CCT), :mod:`.hierarchical` (Swin, PVT v2), :mod:`.sdpa` (EVA, BEiT), :mod:`.metaformer`
(PoolFormer, ConvFormer, CAFormer), :mod:`.hiera`, :mod:`.twins`, :mod:`.mvitv2`, :mod:`.mlp_mixer` and
:mod:`.cnn` (ConvNeXt, ResNet), the parts they share in :mod:`._blocks`.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence, Union

import torch
import torch.nn as nn
from timm.models.beit import Beit
from timm.models.cait import Cait
from timm.models.convit import ConVit
from timm.models.convnext import ConvNeXt
from timm.models.davit import DaVit
from timm.models.deit import VisionTransformerDistilled
from timm.models.efficientformer import EfficientFormer
from timm.models.eva import Eva
from timm.models.hiera import Hiera
from timm.models.metaformer import MetaFormer
from timm.models.mlp_mixer import MlpMixer
from timm.models.mvitv2 import MultiScaleVit
from timm.models.naflexvit import NaFlexVit
from timm.models.pvt_v2 import PyramidVisionTransformerV2
from timm.models.resnet import ResNet
from timm.models.swin_transformer import SwinTransformer
from timm.models.swin_transformer_v2 import SwinTransformerV2
from timm.models.swin_transformer_v2_cr import SwinTransformerV2Cr
from timm.models.twins import Twins
from timm.models.vision_transformer import VisionTransformer
from timm.models.vision_transformer_relpos import VisionTransformerRelPos
from timm.models.vision_transformer_sam import VisionTransformerSAM

from shared_core.checks import check_layers
from shared_core.compiling import guard_module_hooks
from shared_core.label_attention import LabelBackend, check_choice, compute_dtype
from shared_core.mix import Mix
from shared_core.tl_align import TRANSMIX_MODES, aligned_target, compact_labels, dense_labels, transmix_share
from shared_core.tracer import check_drop_path, check_transmix, tracer_for

from ..carrier import MixTarget
from ..cct import CCT
from .cnn import ConvNeXtTracer, ResNetTracer
from .convit import ConViTTracer
from .davit import DaViTTracer
from .efficientformer import EfficientFormerTracer
from .graph import GraphRouteError, GraphTracer
from .hiera import HieraTracer
from .hierarchical import PvtV2Tracer, SwinTracer, SwinV2Tracer
from .metaformer import MetaFormerTracer
from .mlp_mixer import MlpMixerTracer
from .mvitv2 import MViTv2Tracer
from .sam import SamViTTracer
from .sdpa import BeitTracer, EvaTracer, RelPosViTTracer
from .twins import TwinsTracer
from .vit import CaitTracer, CCTTracer, DistilledViTTracer, NaFlexViTTracer, SharedAttentionViT, ViTTracer

__all__ = [
    'TLAlign',
    'TransMix',
    'SUPPORTED_MODELS',
    'timm_tracer',
    'ViTTracer',
    'SharedAttentionViT',
    'DistilledViTTracer',
    'NaFlexViTTracer',
    'CaitTracer',
    'CCTTracer',
    'SwinTracer',
    'SwinV2Tracer',
    'PvtV2Tracer',
    'MlpMixerTracer',
    'EvaTracer',
    'MetaFormerTracer',
    'HieraTracer',
    'TwinsTracer',
    'MViTv2Tracer',
    'BeitTracer',
    'RelPosViTTracer',
    'SamViTTracer',
    'ConViTTracer',
    'EfficientFormerTracer',
    'DaViTTracer',
    'ConvNeXtTracer',
    'ResNetTracer',
    'GraphTracer',
]


#: the timm model classes TL-Align traces, each with its tracer (most specific class first)
SUPPORTED_MODELS = {
    CCT: CCTTracer,
    VisionTransformerDistilled: DistilledViTTracer,
    VisionTransformer: ViTTracer,
    NaFlexVit: NaFlexViTTracer,
    SwinTransformer: SwinTracer,
    SwinTransformerV2: SwinV2Tracer,
    SwinTransformerV2Cr: SwinV2Tracer,
    Cait: CaitTracer,
    PyramidVisionTransformerV2: PvtV2Tracer,
    MlpMixer: MlpMixerTracer,
    Eva: EvaTracer,
    Beit: BeitTracer,
    VisionTransformerRelPos: RelPosViTTracer,
    VisionTransformerSAM: SamViTTracer,
    ConVit: ConViTTracer,
    EfficientFormer: EfficientFormerTracer,
    DaVit: DaViTTracer,
    MetaFormer: MetaFormerTracer,
    Hiera: HieraTracer,
    Twins: TwinsTracer,
    MultiScaleVit: MViTv2Tracer,
    ConvNeXt: ConvNeXtTracer,
    ResNet: ResNetTracer,
}


#: the timm CNNs whose unpooled feature map another framework may pool (``TIMMBackbone`` + a global average neck)
POOLED_OUTSIDE = {ConvNeXt: ConvNeXtTracer, ResNet: ResNetTracer}


#: timm families whose token mixer no TL-Align rule covers (the paper's Eq. 9 needs token-to-token attention
#: weights; its Table 9 covers linear, convolutional and pooling mixers whose weights do not depend on the data):
#: the block type and why
NO_RULE = {
    ('timm.models.xcit', 'Xcit'): (
        'XCA (cross-covariance attention)',
        'its attention is channel-to-channel (a d x d matrix per head); it forms no token-to-token weights to '
        'apply to the labels',
    ),
    ('timm.models.efficientvit_mit', 'EfficientVit'): (
        'LiteMLA (ReLU linear attention)',
        'the token weights relu(q)·relu(k) / Σ are never formed (it computes relu(q) (relu(k)ᵀ v)); a rule would '
        'have to materialise them, which the model avoids by design',
    ),
    ('timm.models.focalnet', 'FocalNet'): (
        'FocalModulation',
        'the query multiplies a context gathered by gated depthwise convolutions: a data-dependent elementwise '
        'product, neither an attention (Eq. 9) nor a fixed linear mixer (Table 9)',
    ),
    ('timm.models.levit', 'Levit'): (
        'AttentionSubsample with convolutional stem and attention biases',
        'LeViT mixes hard-swish attention outputs with subsampled queries and BatchNorm-folded projections; no '
        'tracer is written for it',
    ),
    ('timm.models.coat', 'CoaT'): (
        'FactorAttnConvRelPosEnc (factorized attention)',
        'it computes q (softmax(k)ᵀ v): softmax over tokens of the keys alone, not a row-stochastic token-to-token '
        'attention, plus a convolutional relative position term multiplied by q',
    ),
    ('timm.models.sequencer', 'Sequencer2d'): (
        'LSTM2d (bidirectional LSTMs along rows and columns)',
        "each position's output is a recurrence over its whole row and column, gated by the data at every step: "
        'it forms no token-to-token weights (Eq. 9) and is no fixed mixer (Table 9)',
    ),
    ('timm.models.fastvit', 'FastVit'): (
        'RepMixer / RepConditionalPosEnc (reparameterised depthwise convolutions with BatchNorm)',
        'its train-time branches (several convolutions and BatchNorms summed) have no tracer; attention stages '
        'would follow Eq. 9, the convolutional ones Table 9 once written',
    ),
}


def _no_rule(model: nn.Module, name: str) -> None:
    """A :data:`NO_RULE` family: its own refusal, naming the block type and why."""
    for cls in type(model).__mro__:
        found = NO_RULE.get((cls.__module__, cls.__name__))
        if found:
            block, why = found
            raise ValueError(f"{name}: TL-Align has no rule for {type(model).__name__}'s {block}: {why}")


def timm_tracer(
    model: nn.Module, pooled_outside: bool = False, name: str = 'model', input_size: Optional[Sequence[int]] = None
):
    """The TL-Align tracer of a timm model: its family's tracer (:data:`SUPPORTED_MODELS`), else the graph route for
    conv nets (:class:`~.graph.GraphTracer`, Table 9 read off the model's fx graph), which names the op it has no
    rule for where it cannot take the model: its refusal where Table 9 gives the op no reading, else "no tracer" with
    the supported classes and the node where the route stops. ``pooled_outside``: the model's own head pooling is
    off (mmpretrain's ``TIMMBackbone`` resets it) and its final map is average-pooled outside it (a
    ``GlobalAveragePooling`` neck): the timm CNNs of :data:`POOLED_OUTSIDE` and the graph route's conv nets, read
    out by the mean label of the final map. ``input_size`` ``(C, H, W)``: the size the model trains at, which the
    graph route compiles its first label program for (default the model's ``pretrained_cfg`` size; a model built
    for another size, as GCViT or EfficientFormer v2 with ``img_size``, needs its own)."""
    _no_rule(model, name)
    supported = POOLED_OUTSIDE if pooled_outside else SUPPORTED_MODELS
    if pooled_outside:
        family = next((t for cls, t in POOLED_OUTSIDE.items() if isinstance(model, cls)), None)
        if family is not None:
            return family(model, pooled_outside=True)
    elif hasattr(model, '_orig_mod') or any(isinstance(model, cls) for cls in supported):
        return tracer_for(model, SUPPORTED_MODELS, name)
    try:
        return GraphTracer(model, input_size=input_size, pooled_outside=pooled_outside)
    except GraphRouteError as e:
        if e.decided:  # an op Table 9 gives no reading: the route's refusal, as a family's
            raise GraphRouteError(f'{name}: {str(e).removeprefix("model: ")}', True) from e
        names = ', '.join(f'{c.__module__}.{c.__name__}' for c in supported)
        raise ValueError(
            f'{name}: TL-Align has no tracer for {type(model).__module__}.{type(model).__name__} (supported: '
            f'{names}), and {str(e).removeprefix("model: ")}'
        ) from e


class _MixTargetWrapper(nn.Module):
    """What TL-Align and TransMix share around a timm model: its tracer, the label attention's path (``fused``),
    ``forward`` (the model without a target, the subclass's ``align`` with one) and the checks of a mixed batch."""

    method = ''

    def __init__(
        self, model: nn.Module, fused: Union[bool, str, None] = None, input_size: Optional[Sequence[int]] = None
    ):
        super().__init__()
        check_choice('fused', fused)
        self.tracer = timm_tracer(model, input_size=input_size)
        # the label attention's path, chosen once per device and dtype (a kernel once it passed its self-check)
        backend = LabelBackend(fused, head_dims=self.tracer.head_dims())
        #: (heads, head dim) of the model's first attention, at which 'auto' times the label paths (fixed with it)
        self._attention_shape = self.tracer.attention_shape()
        guard_module_hooks()  # per-call hooks under torch.compile
        self.model = model
        self.backend = backend

    @property
    def fused(self) -> Union[bool, str, None]:
        """The wrapper's choice of label attention (``None``: the process's)."""
        return self.backend.choice

    @property
    def num_prefix_tokens(self) -> int:
        return self.tracer.num_prefix_tokens

    @property
    def depth(self) -> int:
        return self.tracer.depth

    def forward(self, x: torch.Tensor, target: Optional[torch.Tensor] = None):
        """``model(x)`` without a target; with one, :meth:`align`'s ``(output, aligned target)`` in train and eval
        mode alike (in eval mode stochastic depth and dropout are off, so every block counts)."""
        if target is None:
            return self.model(x)
        return self.align(x, target)

    def _check_target(self, x: torch.Tensor, target) -> Mix:
        """The :class:`Mix` of ``target``, checked against the batch and the model's classes."""
        mix = check_mix_target(target, self.method, type(self).__name__)
        if not torch.is_tensor(x) or x.dim() != 4:
            raise ValueError(f'x: expected a (B, C, H, W) image batch, got {getattr(x, "shape", type(x).__name__)}')
        if x.shape[0] != mix.batch_size:
            raise ValueError(
                f'x: a batch of {x.shape[0]} images for a target (mix) of {mix.batch_size}; '
                'pass the images the mixer returned with its target'
            )
        classes = getattr(self.model, 'num_classes', None)
        if isinstance(classes, int) and classes > 0 and target.num_classes != classes:
            raise ValueError(
                f'target: the mixer made {target.num_classes}-class targets for a model with {classes} classes '
                "(create_mixer(num_classes=...) must be the model's)"
            )
        return mix


class TLAlign(_MixTargetWrapper):
    """Token-label alignment around a timm model (see the module docstring); the label path is
    :meth:`shared_core.tracer.Tracer.label_path` of this model's tracer. :class:`timm_plugin.TLAlignTask` is
    the same as a timm ``TrainingTask``.

    Args:
        model: a supported timm model.
        layers: align only at these block indices (Table 8 ablation); ``None``: every block.
        residual: ``False`` drops the residual from the label path (Table 8, "normalization disabled").
        fused: the label attention as a fused SDPA call (``True``), a transient softmax (``False``), for the
            shared path the Triton kernel (``'triton'``, :mod:`shared_core.label_kernel`), or the model's own
            attention left as it is with the labels from the label-only kernel beside it (``'labels'``, every
            family whose rule recomputes an attention) for this wrapper;
            default the process's choice (``$TOKENAUG_FUSED_LABEL_ATTN``,
            :func:`~shared_core.label_attention.set_fused_label_attn`), else the shared path fused on every device,
            through the Triton kernel on CUDA, the recomputing path fused on accelerators. The wrapper's
            :class:`~shared_core.label_attention.LabelBackend` (``backend``) resolves it once per device and dtype.
            With ``shared=False`` the token path is the model's own either way.
        drop_path: ``'kept'`` (a sample whose attention branch stochastic depth dropped keeps its labels) or
            ``'public'`` (the public code: they update anyway).
        shared: timm ViTs: one attention per block for tokens and labels (:class:`SharedAttentionViT`);
            ``False`` keeps the model's own attention and recomputes it for the labels (the reference path).
        input_size: ``(C, H, W)`` the model trains at, for the graph route's first label program
            (:func:`timm_tracer`); default the model's ``pretrained_cfg`` size.
    """

    method = 'tl_align'

    def __init__(
        self,
        model: nn.Module,
        layers: Optional[Iterable[int]] = None,
        residual: bool = True,
        fused: Union[bool, str, None] = None,
        drop_path: str = 'kept',
        shared: bool = True,
        input_size: Optional[Sequence[int]] = None,
    ):
        for name, value in (('residual', residual), ('shared', shared)):
            if not isinstance(value, bool):
                raise ValueError(f'{name}: expected True or False, got {value!r}')
        super().__init__(model, fused, input_size)
        if self.tracer.whole_graph and (layers is not None or not residual):
            raise ValueError(
                f"layers / residual: TL-Align's graph route runs {type(model).__name__}'s whole graph as one label "
                'program; it has no blocks to pick or residuals to drop (leave layers=None, residual=True)'
            )
        self.shared = shared
        self.layers = check_layers(layers, self.tracer.depth)
        self.residual = residual
        self.drop_path = check_drop_path(drop_path)

    def _run(self, x: torch.Tensor, labels: torch.Tensor, forward=None, observe=None):
        labels = labels.to(x.device)
        tracer = self.tracer
        if self.shared:
            why_not = SharedAttentionViT.why_not(tracer, labels, self.layers)
        else:
            why_not = "shared=False keeps the model's own attention and recomputes the labels in a call of their own"
        self.backend.refuse_unrun_kernel(why_not)  # the kernel runs in the shared path only
        geometry = self._attention_shape  # 'auto' times the label paths at this block attention's shape
        shape = None if geometry is None else (x.shape[0], geometry[0], labels.shape[1], geometry[1])
        # (a kernel: once it passed its self-check here; 'labels' or auto's choice may leave the attention apart)
        path = self.backend.path(x.device, compute_dtype(x), shape, shared_ok=why_not is None)
        shared = None
        if why_not is None and path.shared != 'apart':
            args = (labels, self.layers, self.residual, self.drop_path, path, self.backend, observe)
            shared = SharedAttentionViT(tracer, *args)
        with self.backend.applied(path):
            output, captures = tracer.capture(forward or (lambda: self.model(x)), shared)
            state = None if shared is None else shared.state(captures)
            share = tracer.label_path(
                captures, output, labels, self.layers, self.residual, self.drop_path, observe, state
            )
        return output, share

    def align(self, x: torch.Tensor, target: torch.Tensor, forward=None):
        """``(output, aligned (B, C) target)``; ``forward`` (default ``self.model(x)``) runs the token path."""
        mix = self._check_target(x, target)
        output, share = self._run(x, compact_labels(mix, self.num_prefix_tokens), forward)
        return output, aligned_target(share[:, 0], target.labels, mix, target.num_classes, target.smoothing)

    def label_states(self, x: torch.Tensor, target: torch.Tensor) -> tuple:
        """What :meth:`align` computes, and the label state after each block: ``(output, share, states)`` with
        ``share`` the ``(B, K)`` aligned label of what the classifier reads (column 0: the partner's share) and
        ``states`` one ``(labels, grid)`` per block: the ``(B, T, K)`` label rows after it (prefix tokens first)
        and the ``(H', W')`` grid its patch tokens lie on, or ``None`` where the tracer knows of none (a ViT's are
        on the mix's patch grid; Hiera's are unrolled). ``tokenaug-viz tl-align`` draws them."""
        mix = self._check_target(x, target)
        states: list = []
        output, share = self._run(
            x,
            compact_labels(mix, self.num_prefix_tokens),
            observe=lambda i, labels, grid: states.append((labels, grid)),
        )
        return output, share, states

    def trace(self, x: torch.Tensor, token_labels: torch.Tensor, cls_label: Optional[torch.Tensor] = None):
        """Reference entry point: dense per-patch labels ``(B, N_patches, C)`` (rows sum to 1, row-major
        over the patch grid of ``x``) through the model; returns ``(output, label)`` with ``label`` the
        aligned ``(B, C)`` label of what the classifier reads. ``cls_label`` (default: the mean of
        ``token_labels``) starts every prefix token."""
        return self._run(x, dense_labels(token_labels, cls_label, self.num_prefix_tokens))


def check_mix_target(target, method: str, who: str) -> Mix:
    """The :class:`Mix` a :class:`MixTarget` carries; a clear error for a plain target."""
    if not isinstance(target, MixTarget):
        raise ValueError(
            f'target: {who} needs the MixTarget of a mixer with carry_mix '
            f'(create_mixer(..., carry_mix=True) / --mixup-type {method}), got a plain tensor'
        )
    return target.mix


class TransMix(_MixTargetWrapper):
    """TransMix (Chen et al., "TransMix: Attend to Mix for Vision Transformers"), the baseline TL-Align
    compares with: the partner share of the target is read from the last block's attention over the
    mixed region instead of the area (:func:`shared_core.tl_align.transmix_share`).

    ``mode='paper'``: the attention share alone, each patch weighted by its fractional share of a pixel box;
    ``'average'``: the public TransMix code, the mean of the attention share over its nearest-neighbour patch
    mask (top-left pixel inside the box) and the area share. Default ``'paper'``: the papers are this project's
    specification.
    DeiT distilled: the class token's attention. Models without a class token (``global_pool='avg'`` ViTs,
    Swin, PVT v2; our extension): the pooled compact label after the last block's attention alone.
    """

    method = 'transmix'
    MODES = TRANSMIX_MODES

    def __init__(
        self,
        model: nn.Module,
        mode: str = 'paper',
        fused: Union[bool, str, None] = None,
        input_size: Optional[Sequence[int]] = None,
    ):
        super().__init__(model, fused=fused, input_size=input_size)
        if mode not in self.MODES:
            raise ValueError(f'mode must be one of {self.MODES}, got {mode!r}')
        check_transmix(self.tracer, model)
        self.mode = mode

    def align(self, x: torch.Tensor, target: torch.Tensor, forward=None):
        mix = self._check_target(x, target)
        self.backend.refuse_unrun_kernel("TransMix reads the last block's attention in a call of its own")
        output, captures = self.tracer.capture(forward or (lambda: self.model(x)))
        with self.backend.applied(self.backend.path(x.device, compute_dtype(x))):
            share = transmix_share(self.tracer, captures, output, mix.to(x.device), self.mode)
        return output, aligned_target(share, target.labels, mix, target.num_classes, target.smoothing)
