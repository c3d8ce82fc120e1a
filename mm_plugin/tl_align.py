"""TL-Align and TransMix for MMPretrain: ``TLAlignClassifier`` and ``TransMixClassifier``, ``ImageClassifier`` classes
whose training targets are re-weighted by the attention.

Config: ``model = dict(type='TLAlignClassifier', backbone=..., neck=..., head=..., train_cfg=dict(augments=[...]))``
with ``data_preprocessor = dict(type='TokenAugDataPreprocessor', ...)``, which puts the batch's mix on the
data samples. In ``loss`` the classifier runs the backbone with hooks that keep what each block's token
path computed (``q``/``k`` of mmpretrain's ``MultiheadAttention``, the softmax of ``WindowMSA``), traces
the compact label state with the driver of :mod:`shared_core.tracer` and the rules of
:mod:`shared_core.tl_align` (the same driver as the timm adapter, :mod:`timm_plugin.tl_align`; only the tracers
here are mm's), and replaces each sample's
``gt_score`` by its aligned target before the head's loss (which applies its own label smoothing, as
for the stock mixed scores). Prediction and batches without a mix are the stock ``ImageClassifier``.

``TransMixClassifier`` replaces the target by TransMix's (:func:`shared_core.tl_align.transmix_share`: the
last block's class-token attention over the pasted region, ``mode='paper'`` or the public code's
``'average'``).

Supported backbones (``MM_SUPPORTED_BACKBONES``): mmpretrain ``VisionTransformer`` (DeiT archs) and ``DeiT3``
(``out_type`` ``'cls_token'`` or ``'avg_featmap'``), ``ViTEVA02`` and ``BEiTViT`` (their attention read at its
softmax), ``SwinTransformer`` and ``SwinTransformerV2`` (the classification output: last stage, average pooled); for
TL-Align, also ``ConvNeXt`` (V1, V2) and ``PoolFormer`` with timm's rules for them, and ``TIMMBackbone`` around a
timm ConvNeXt or ResNet, or any conv net timm_plugin's graph route takes (EfficientNet, RegNet, DenseNet, ...), with
a ``GlobalAveragePooling`` neck (timm_plugin's generalised rules, TL-Align Appendix A; the data preprocessor's
``patch_size=4``, their first grid). ``MM_REFUSED_BACKBONES`` are refused with the
reason, every other backbone by name.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn as nn
from mmpretrain.models.backbones import (
    BEiTViT,
    ConvNeXt,
    DeiT3,
    HiViT,
    PoolFormer,
    RevVisionTransformer,
    SwinTransformer,
    SwinTransformerV2,
    TIMMBackbone,
    VisionTransformer,
    ViTEVA02,
)
from mmpretrain.models.backbones.convnext import ConvNeXtBlock
from mmpretrain.models.backbones.deit3 import DeiT3TransformerEncoderLayer
from mmpretrain.models.backbones.poolformer import PatchEmbed as PoolFormerEmbed
from mmpretrain.models.backbones.poolformer import PoolFormerBlock
from mmpretrain.models.backbones.swin_transformer import SwinBlock
from mmpretrain.models.backbones.swin_transformer_v2 import SwinBlockV2
from mmpretrain.models.backbones.vision_transformer import TransformerEncoderLayer
from mmpretrain.models.classifiers import ImageClassifier
from mmpretrain.models.necks import GlobalAveragePooling
from mmpretrain.models.utils import GRN
from mmpretrain.models.utils.attention import MultiheadAttention, ShiftWindowMSA, WindowMSA, WindowMSAV2
from mmpretrain.registry import MODELS

from shared_core.capture import Captures, LabelCapture, SoftmaxCapture, hook_map_grid
from shared_core.checks import check_layers
from shared_core.label_attention import LabelBackend, compute_dtype
from shared_core.tl_align import (
    TRANSMIX_MODES,
    aligned_target,
    attention_labels,
    compact_labels,
    conv_labels,
    conv_pool_labels,
    merge_2x2_labels,
    pool_like,
    transmix_share,
    window_labels,
)
from shared_core.tracer import Tracer, check_drop_path, check_transmix

from .attention import attention_scale, split_qk
from .data_preprocessor import mix_from_samples

__all__ = ['TLAlignClassifier', 'TransMixClassifier', 'MM_SUPPORTED_BACKBONES', 'MM_REFUSED_BACKBONES', 'mm_tracer']

#: why a forced ``'triton'`` does not run in an mm classifier: the kernel is timm ViTs' shared path
_NO_KERNEL = (
    "mmpretrain's backbones keep their own attention and the labels are recomputed in a call of their own (the "
    'kernel runs in the shared attention of timm ViTs only); use fused=True or False'
)


class MMViTTracer(Tracer):
    """mmpretrain ``VisionTransformer`` and ``DeiT3``: pre-norm encoder layers, SDPA attention."""

    needs = ('q', 'k')
    why_missing = 'its attention did not run its qkv projection (a replaced forward?)'

    #: the layer each backbone class is built of (DeiT3's: layer scale, its FFN with its own drop path; both per
    #: token, so the rules are the ViT's)
    layer_types = {VisionTransformer: TransformerEncoderLayer, DeiT3: DeiT3TransformerEncoderLayer}

    def __init__(self, backbone: VisionTransformer):
        layer_type = self.layer_types[type(backbone)]
        for i, layer in enumerate(backbone.layers):
            if type(layer) is not layer_type or type(layer.attn) is not MultiheadAttention:
                raise ValueError(
                    f'backbone: TL-Align traces {layer_type.__name__}/MultiheadAttention, layer {i} '
                    f'is {type(layer).__name__}'
                )
            if getattr(layer.attn, 'v_shortcut', False):
                raise ValueError('backbone: attention with v_shortcut has no TL-Align rule')
        self._classification_output(backbone)

    def _classification_output(self, backbone: nn.Module) -> None:
        """Refuse any output but the last layer's class token or mean patch token; keep the backbone."""
        if tuple(backbone.out_indices) != (len(backbone.layers) - 1,):
            raise ValueError(
                f'backbone: TL-Align needs the classification output (out_indices=({len(backbone.layers) - 1},)), '
                f'got {backbone.out_indices}'
            )
        if backbone.out_type not in ('cls_token', 'avg_featmap'):
            raise ValueError(
                f"backbone: out_type={backbone.out_type!r} has no TL-Align rule; use 'cls_token' or 'avg_featmap'"
            )
        super().__init__(backbone)
        self.num_prefix_tokens = backbone.num_extra_tokens
        self.readout = 'cls' if backbone.out_type == 'cls_token' else 'mean'

    def blocks(self):
        return self.model.layers

    def drop_path(self, layer: nn.Module) -> nn.Module:
        return layer.attn.out_drop  # mmcv's DropPath of the attention branch

    def watch(self, layer: nn.Module, cap: LabelCapture, handles: list) -> None:
        a = layer.attn
        handles.append(a.qkv.register_forward_hook(lambda m, i, o, c=cap, a=a: _set_qk(c, o.detach(), a)))

    def tokens(self, captures: Captures) -> int:
        return captures[0].q.shape[2]

    def branch(self, layer: nn.Module, cap: LabelCapture, Y: torch.Tensor) -> torch.Tensor:
        return attention_labels(cap.q, cap.k, Y, scale=attention_scale(layer.attn))  # Eq. 9

    def class_attention(self, captures: Captures):
        if self.model.out_type != 'cls_token':
            return None
        last = captures[-1]
        return last.q[:, :, :1], last.k, attention_scale(self.model.layers[-1].attn)


def _set_qk(cap: LabelCapture, qkv: torch.Tensor, attn: MultiheadAttention) -> None:
    cap.q, cap.k = split_qk(attn, qkv)


class MMSwinTracer(Tracer):
    """mmpretrain ``SwinTransformer``: ``ShiftWindowMSA`` blocks (materialised ``WindowMSA`` softmax),
    ``PatchMerging`` at the *end* of a stage, average pooling of the last stage. mmpretrain keeps the
    cyclic shift when a stage's map is larger than its window and drops it when it equals the window
    (unless ``pad_small_map``), exactly as the token path does."""

    layout = 'grid'
    needs = ('attn', 'tokens')
    why_missing = 'its window attention computed no softmax'

    #: the block and window attention the backbone class is built of
    block_type, msa_type = SwinBlock, WindowMSA

    def __init__(self, backbone: SwinTransformer):
        if tuple(backbone.out_indices) != (len(backbone.stages) - 1,):
            raise ValueError(
                f'backbone: TL-Align needs the classification output (out_indices=({len(backbone.stages) - 1},)), '
                f'got {backbone.out_indices}'
            )
        for stage in backbone.stages:
            for blk in stage.blocks:
                if (
                    type(blk) is not self.block_type
                    or type(blk.attn) is not ShiftWindowMSA
                    or type(blk.attn.w_msa) is not self.msa_type
                ):
                    raise ValueError(
                        f'backbone: TL-Align traces {self.block_type.__name__}/ShiftWindowMSA/'
                        f'{self.msa_type.__name__}, got {type(blk).__name__}'
                    )
        super().__init__(backbone)

    def stages(self):
        return [(stage, stage.blocks) for stage in self.model.stages]

    def drop_path(self, blk: nn.Module) -> nn.Module:
        return blk.attn.drop

    def watch(self, blk: nn.Module, cap: LabelCapture, handles: list) -> None:
        """The grid the block runs on (``hw_shape``) and its window attention's probabilities."""
        handles.append(blk.attn.register_forward_pre_hook(lambda m, a, c=cap: setattr(c, 'tokens', tuple(a[1]))))
        softmax = blk.attn.w_msa.softmax
        handles.append(softmax.register_forward_hook(lambda m, i, o, c=cap: setattr(c, 'attn', o.detach())))

    def watch_model(self, captures: Captures, handles: list) -> None:
        """The first token grid: the first block's ``hw_shape``."""
        first = self.blocks()[0].attn
        handles.append(first.register_forward_pre_hook(lambda m, a: setattr(captures, 'grid', tuple(a[1]))))

    @staticmethod
    def _shift(attn: ShiftWindowMSA, H: int, W: int) -> int:
        ws = attn.window_size
        if min(H, W) < ws:
            raise ValueError(f'x: a {H}x{W} map is padded to the {ws}x{ws} window; TL-Align traces unpadded grids only')
        if min(H, W) == ws and not attn.pad_small_map:
            return 0
        return attn.shift_size

    def branch(self, blk: nn.Module, cap: LabelCapture, Y: torch.Tensor) -> torch.Tensor:
        s = self._shift(blk.attn, *cap.tokens)
        return window_labels(Y, (blk.attn.window_size,) * 2, (s, s), attn=cap.attn)

    def leave(self, stage, Y: torch.Tensor) -> torch.Tensor:
        return Y if stage.downsample is None else merge_2x2_labels(Y)  # mmpretrain: at a stage's end


class MMSwinV2Tracer(MMSwinTracer):
    """mmpretrain ``SwinTransformerV2``: ``SwinBlockV2`` (post-norm: the norm after the attention, per token) with
    ``WindowMSAV2`` (cosine attention with the log-spaced continuous position bias: read at its softmax, which holds
    both), patch merging at the *start* of every stage but the first; otherwise as :class:`MMSwinTracer`."""

    block_type, msa_type = SwinBlockV2, WindowMSAV2

    def enter(self, stage, Y: torch.Tensor) -> torch.Tensor:
        return Y if stage.downsample is None else merge_2x2_labels(Y)  # mmpretrain's V2: at a stage's start

    def leave(self, stage, Y: torch.Tensor) -> torch.Tensor:
        return Y


def _check_pooled(backbone: nn.Module, last: int, neck: Optional[nn.Module], pooled: bool = False) -> None:
    """The classification output of a conv backbone: its last stage only (``out_indices``), average-pooled inside
    it (``pooled``) or by a ``GlobalAveragePooling`` neck; the label read is the mean label of the last map."""
    if tuple(backbone.out_indices) != (last,):
        raise ValueError(
            f'backbone: TL-Align needs the classification output (out_indices=({last},)), got '
            f'{tuple(backbone.out_indices)}'
        )
    if not pooled and type(neck) is not GlobalAveragePooling:
        raise ValueError(
            "neck: TL-Align reads the mean label of the backbone's last map; use neck=dict(type='"
            f"GlobalAveragePooling'), got {type(neck).__name__}"
        )


class _MMMapTracer(Tracer):
    """What the mm conv tracers share: a ``(B, K, H, W)`` label map on the stem's grid, each block's samples its
    drop path kept, the mean label of the last map read out (TL-Align Appendix A's rules, as timm's tracers)."""

    layout = 'map'
    grid_module = 'the stem'
    attends = False

    def drop_path(self, blk: nn.Module) -> nn.Module:
        return blk.drop_path


class MMConvNeXtTracer(_MMMapTracer):
    """mmpretrain ``ConvNeXt`` (V1, and V2 with ``use_grn``): the rules of timm's ConvNeXt
    (:class:`~timm_plugin.tl_align.cnn.ConvNeXtTracer`): the depthwise conv's fixed stencil ``mean_c |K_c|``
    (Norm of its equivalent matrix), Eq. 11 at the residual, each downsampling conv (2x2, stride 2) a spatial
    aggregation, the norms, point-wise convs and layer scale per token, GRN a channel gate (each channel of each
    position scaled by one scalar of its sample: channel mixing, labels unchanged, as SE). Refused: an overlapping
    stem, a strided or dilated depthwise conv, any output but the last stage's pooled map."""

    why_no_attention = 'its blocks mix tokens by depthwise convolutions'

    def __init__(self, backbone: ConvNeXt, neck: Optional[nn.Module] = None):
        _check_pooled(backbone, len(backbone.stages) - 1, neck, backbone.gap_before_final_norm)
        stem = backbone.downsample_layers[0][0]
        if type(stem) is not nn.Conv2d or stem.kernel_size != stem.stride or stem.padding != (0, 0):
            raise ValueError(f"backbone: TL-Align traces ConvNeXt's patchify stem (kernel = stride), got {stem}")
        for i, stage in enumerate(backbone.stages):
            down = backbone.downsample_layers[i][-1]
            if i and (type(down) is not nn.Conv2d or down.kernel_size != down.stride or down.padding != (0, 0)):
                raise ValueError(f'backbone: ConvNeXt downsampling {i} ({down}) has no TL-Align rule')
            for j, blk in enumerate(stage):
                dw = getattr(blk, 'depthwise_conv', None)
                ok = type(blk) is ConvNeXtBlock and type(dw) is nn.Conv2d and dw.groups == dw.in_channels
                if not ok or dw.stride != (1, 1) or dw.dilation != (1, 1) or isinstance(dw.padding, str):
                    raise ValueError(
                        f'backbone: TL-Align traces ConvNeXtBlock with an undilated stride-1 depthwise conv; stage '
                        f'{i} block {j} is {type(blk).__name__} with {dw}'
                    )
                if blk.grn is not None and type(blk.grn) is not GRN:
                    raise ValueError(f'backbone: ConvNeXt stage {i} block {j}: {type(blk.grn).__name__} has no rule')
        super().__init__(backbone)

    def stages(self):
        return list(zip(range(len(self.model.stages)), self.model.stages))

    def watch_model(self, captures: Captures, handles: list) -> None:
        hook_map_grid(self.model.downsample_layers[0], captures, handles)

    def enter(self, stage: int, Y: torch.Tensor) -> torch.Tensor:
        return Y if stage == 0 else pool_like(Y, self.model.downsample_layers[stage][-1])

    def branch(self, blk: nn.Module, cap: LabelCapture, Y: torch.Tensor) -> torch.Tensor:
        return conv_labels(Y, blk.depthwise_conv)


class MMPoolFormerTracer(_MMMapTracer):
    """mmpretrain ``PoolFormer``: the rules of timm's PoolFormer
    (:class:`~timm_plugin.tl_align.metaformer.MetaFormerTracer`): the token mixer ``pool(x) − x`` read as the
    average pool alone (its equivalent matrix over the in-grid cells, as the pool counts them; the ``− x`` is the
    token's own content), Eq. 11 at the residual, the patch embeddings between stages (strided convs) spatial
    aggregation, the norms (GroupNorm: one scalar pair per sample), MLP and layer scales per token."""

    why_no_attention = 'its blocks mix tokens by pooling'

    def __init__(self, backbone: PoolFormer, neck: Optional[nn.Module] = None):
        _check_pooled(backbone, len(backbone.network) - 1, neck)
        self._stages = []
        down = None
        for i, part in enumerate(backbone.network):
            if type(part) is PoolFormerEmbed:
                down = part.proj
                continue
            for j, blk in enumerate(part):
                pool = getattr(getattr(blk, 'token_mixer', None), 'pool', None)
                if type(blk) is not PoolFormerBlock or type(pool) is not nn.AvgPool2d or pool.count_include_pad:
                    raise ValueError(
                        f'backbone: TL-Align traces PoolFormerBlock with its average pool (padding not counted); '
                        f'network {i} block {j} is {type(blk).__name__}'
                    )
            self._stages.append((down, part))
            down = None
        super().__init__(backbone)

    def stages(self):
        return self._stages

    def watch_model(self, captures: Captures, handles: list) -> None:
        hook_map_grid(self.model.patch_embed, captures, handles)

    def enter(self, down, Y: torch.Tensor) -> torch.Tensor:
        return Y if down is None else pool_like(Y, down)

    def branch(self, blk: nn.Module, cap: LabelCapture, Y: torch.Tensor) -> torch.Tensor:
        p = blk.token_mixer.pool
        return conv_pool_labels(Y, p.kernel_size, p.stride, p.padding, p.ceil_mode)


class MMSoftmaxViTTracer(MMViTTracer):
    """mmpretrain ``ViTEVA02`` (EVA-02: RoPE on q/k, SwiGLU) and ``BEiTViT`` (relative position bias): their
    attention computes its probabilities itself, so the label rule reads them at its softmax
    (:class:`shared_core.capture.SoftmaxCapture`: RoPE and the bias are in them) and applies Eq. 9/11; the layer's
    one drop path (called for the attention branch, then the MLP's) gives the kept samples of its first call."""

    capture_mode = SoftmaxCapture
    needs = ('attn',)
    why_missing = 'its attention computed no softmax'

    def __init__(self, backbone: nn.Module):
        from mmpretrain.models.backbones.beit import BEiTAttention, BEiTTransformerEncoderLayer
        from mmpretrain.models.backbones.vit_eva02 import AttentionWithRoPE, EVA02EndcoderLayer

        types = {
            ViTEVA02: (EVA02EndcoderLayer, AttentionWithRoPE),
            BEiTViT: (BEiTTransformerEncoderLayer, BEiTAttention),
        }
        layer_type, attn_type = types[type(backbone)]
        for i, layer in enumerate(backbone.layers):
            if type(layer) is not layer_type or type(layer.attn) is not attn_type:
                raise ValueError(
                    f'backbone: TL-Align traces {layer_type.__name__}/{attn_type.__name__}, layer {i} is '
                    f'{type(layer).__name__}'
                )
        self._classification_output(backbone)

    def drop_path(self, layer: nn.Module) -> nn.Module:
        return layer.drop_path

    def watch(self, layer: nn.Module, cap: LabelCapture, handles: list) -> None:
        """Nothing beyond the softmax the capture mode records."""

    def tokens(self, captures: Captures) -> int:
        return captures[0].attn.shape[-1]

    def branch(self, layer: nn.Module, cap: LabelCapture, Y: torch.Tensor) -> torch.Tensor:
        return cap.attn.float().mean(1) @ Y.float()

    def class_attention(self, captures: Captures):
        if self.model.out_type != 'cls_token':
            return None
        return captures[-1].attn[:, :, :1]  # the class token's attention probabilities


MM_SUPPORTED_BACKBONES = {
    VisionTransformer: MMViTTracer,
    DeiT3: MMViTTracer,
    SwinTransformer: MMSwinTracer,
    SwinTransformerV2: MMSwinV2Tracer,
    ViTEVA02: MMSoftmaxViTTracer,
    BEiTViT: MMSoftmaxViTTracer,
    ConvNeXt: MMConvNeXtTracer,
    PoolFormer: MMPoolFormerTracer,
}

#: the tracers that read the neck (a conv backbone's map pooled by it)
_WITH_NECK = (MMConvNeXtTracer, MMPoolFormerTracer)

#: mmpretrain backbones TL-Align refuses by name, and why
MM_REFUSED_BACKBONES = {
    RevVisionTransformer: (
        "its reversible layers split each token's channels into two streams (y1 = x1 + F(x2), y2 = x2 + G(y1)), "
        'each with its own labels, and build their drop path anew inside every forward, so no hook sees which '
        'samples it dropped: one label state per token does not describe it'
    ),
    HiViT: (
        'its first stages run MLP blocks on the 4x4 sub-patches nested inside each patch and merge them before the '
        'attention stage: a nested token layout the mm tracers do not follow (timm has no HiViT to share a rule)'
    ),
}


def mm_tracer(backbone: nn.Module, neck: Optional[nn.Module] = None):
    """The TL-Align tracer of a supported mmpretrain backbone (exact classes: a subclass may change the rules), or of
    the timm CNN inside a ``TIMMBackbone`` (ConvNeXt, ResNet: timm_plugin's generalised rules; any other conv net
    its graph route takes) whose map ``neck`` average-pools (``GlobalAveragePooling``)."""
    if type(backbone) is TIMMBackbone:
        if type(neck) is not GlobalAveragePooling:
            raise ValueError(
                "neck: TL-Align on a TIMMBackbone reads the mean label of the final map; use neck=dict(type='"
                f"GlobalAveragePooling'), got {type(neck).__name__}"
            )
        from timm_plugin.tl_align import timm_tracer  # here: `import mm_plugin` does not load timm_plugin

        return timm_tracer(backbone.timm_model, pooled_outside=True, name='backbone')
    refused = MM_REFUSED_BACKBONES.get(type(backbone))
    if refused is not None:
        raise ValueError(f'backbone: TL-Align has no rule for {type(backbone).__name__}: {refused}')
    tracer = next((t for cls, t in MM_SUPPORTED_BACKBONES.items() if type(backbone) is cls), None)
    if tracer is not None:
        return tracer(backbone, neck) if tracer in _WITH_NECK else tracer(backbone)
    names = ', '.join(f'{c.__module__}.{c.__name__}' for c in MM_SUPPORTED_BACKBONES)
    raise ValueError(
        f'backbone: TL-Align has no tracer for {type(backbone).__module__}.{type(backbone).__name__}; '
        f'supported: {names}, TIMMBackbone around a timm conv net'
    )


class AlignedTargetClassifier(ImageClassifier):
    """The part TL-Align's and TransMix's classifiers share: an ``ImageClassifier`` whose mixed training targets are
    re-weighted by the partner share its subclass computes from the backbone's captured attention (``_share``).
    Not registered: use :class:`TLAlignClassifier` or :class:`TransMixClassifier`.

    The other arguments: as ``ImageClassifier``.
    """

    config_key, config_keys = '', ()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tracer = mm_tracer(self.backbone, self.neck)
        self._check_tracer()

    def _check_tracer(self) -> None:
        """A method's own refusal of a backbone TL-Align traces."""

    def _configure(self, cfg: dict) -> None:
        unknown = sorted(set(cfg) - set(self.config_keys))
        if unknown:
            raise ValueError(f'{self.config_key}: unknown keys {unknown} (expected {", ".join(self.config_keys)})')
        self.align_layers = check_layers(cfg.get('layers'), self.tracer.depth, f'{self.config_key}.layers')
        self.align_residual = bool(cfg.get('residual', True))
        self.align_backend = LabelBackend(cfg.get('fused', None), f'{self.config_key}.fused', self.tracer.head_dims())
        self.align_backend.refuse_unrun_kernel(_NO_KERNEL)
        self.align_drop_path = check_drop_path(cfg.get('drop_path', 'kept'), f'{self.config_key}.drop_path')

    def _share(self, feats, captures, mix) -> torch.Tensor:
        """The ``(B,)`` partner share of what the classifier reads."""
        raise NotImplementedError

    def extract_feat_aligned(self, inputs: torch.Tensor, data_samples: List):
        """Features and, if the batch carries a mix, the re-weighted ``(B, C)`` targets (else ``None``)."""
        mix = mix_from_samples(data_samples)
        if mix is None:
            return self.extract_feat(inputs), None
        self.align_backend.refuse_unrun_kernel(_NO_KERNEL)
        feats, captures = self.tracer.capture(lambda: self.extract_feat(inputs))
        with self.align_backend.applied(self.align_backend.path(inputs.device, compute_dtype(inputs))):
            share = self._share(feats, captures, mix.to(inputs.device))
        labels = torch.cat([s.gt_label for s in data_samples]).to(share.device)
        # the preprocessor's num_classes sized the stock scores; label smoothing stays with the head's loss
        num_classes = data_samples[0].gt_score.numel() if 'gt_score' in data_samples[0] else self.head.num_classes
        return feats, aligned_target(share, labels, mix, num_classes, 0.0)

    def loss(self, inputs: torch.Tensor, data_samples: List) -> dict:
        feats, targets = self.extract_feat_aligned(inputs, data_samples)
        if targets is not None:
            for sample, t in zip(data_samples, targets):
                sample.set_gt_score(t)
        return self.head.loss(feats, data_samples)


@MODELS.register_module()
class TLAlignClassifier(AlignedTargetClassifier):
    """``ImageClassifier`` trained on TL-Align's aligned targets (see the module docstring).

    Args:
        tl_align: ``dict(layers=None, residual=True, fused=None, drop_path='kept')``: align only at these
            block indices (Table 8), keep the residual in the label path (``False``: Table 8's "normalization
            disabled"), the label attention fused or not (default
            :func:`shared_core.label_attention.use_fused_label_attn`), labels of samples whose attention branch
            stochastic depth dropped kept (``'public'``: updated anyway, as the public code).

    The other arguments: as ``ImageClassifier``.
    """

    config_key, config_keys = 'tl_align', ('layers', 'residual', 'fused', 'drop_path')

    def __init__(self, *args, tl_align: Optional[dict] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._configure(dict(tl_align or {}))

    def _share(self, feats, captures, mix) -> torch.Tensor:
        labels0 = compact_labels(mix, self.tracer.num_prefix_tokens)
        return self.tracer.label_path(
            captures, feats, labels0, self.align_layers, self.align_residual, self.align_drop_path
        )[:, 0]


@MODELS.register_module()
class TransMixClassifier(AlignedTargetClassifier):
    """``ImageClassifier`` trained on TransMix's targets (Chen et al., the baseline TL-Align compares with):
    the partner share is the last block's head-mean class-token attention over the pasted patches
    (:func:`shared_core.tl_align.transmix_share`; without a class token, our extension: the pooled label
    after the last block's attention alone).

    Args:
        transmix: ``dict(mode='paper', fused=None)``; ``mode='average'`` is the public code's mean of the
            attention share (over its nearest-neighbour patch mask) and the area share.

    The other arguments: as ``ImageClassifier``.
    """

    config_key, config_keys = 'transmix', ('mode', 'fused')

    def __init__(self, *args, transmix: Optional[dict] = None, **kwargs):
        super().__init__(*args, **kwargs)
        cfg = dict(transmix or {})
        self.transmix_mode = cfg.pop('mode', 'paper')
        if self.transmix_mode not in TRANSMIX_MODES:
            raise ValueError(f'transmix.mode: expected one of {TRANSMIX_MODES}, got {self.transmix_mode!r}')
        self._configure(cfg)

    def _check_tracer(self) -> None:
        check_transmix(self.tracer, getattr(self.backbone, 'timm_model', self.backbone), 'backbone')

    def _share(self, feats, captures, mix) -> torch.Tensor:
        return transmix_share(self.tracer, captures, feats, mix, self.transmix_mode)
