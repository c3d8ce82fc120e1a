"""TL-Align for MMPretrain: ``TLAlignClassifier``, an ``ImageClassifier`` whose training targets are aligned.

Config: ``model = dict(type='TLAlignClassifier', backbone=..., neck=..., head=..., train_cfg=dict(augments=[...]))``
with ``data_preprocessor = dict(type='TokenAugDataPreprocessor', ...)``, which puts the batch's mix on the
data samples. In ``loss`` the classifier runs the backbone with hooks that keep what each block's token
path computed (``q``/``k`` of mmpretrain's ``MultiheadAttention``, the softmax of ``WindowMSA``), traces
the compact label state with the rules of :mod:`shared_core.tl_align`, and replaces each sample's
``gt_score`` by its aligned target before the head's loss (which applies its own label smoothing, as
for the stock mixed scores). Prediction and batches without a mix are the stock ``ImageClassifier``.

Supported backbones: mmpretrain ``VisionTransformer`` (DeiT archs; ``out_type`` ``'cls_token'`` or
``'avg_featmap'``) and ``SwinTransformer`` (the classification output: last stage, average pooled).
"""
from __future__ import annotations

from typing import Iterable, List, Optional

import torch
import torch.nn as nn
from mmpretrain.models.backbones import SwinTransformer, VisionTransformer
from mmpretrain.models.backbones.swin_transformer import SwinBlock
from mmpretrain.models.backbones.vision_transformer import TransformerEncoderLayer
from mmpretrain.models.classifiers import ImageClassifier
from mmpretrain.models.utils.attention import MultiheadAttention, ShiftWindowMSA, WindowMSA
from mmpretrain.registry import MODELS

from shared_core.tl_align import (
    aligned_target, compact_labels, merge_2x2_labels, residual_labels, self_attention_labels, window_labels,
)
from .data_preprocessor import mix_from_samples

__all__ = ['TLAlignClassifier', 'MM_SUPPORTED_BACKBONES']


class _Capture:
    __slots__ = ('q', 'k', 'keep', 'attn', 'hw')

    def __init__(self):
        self.q = self.k = self.keep = self.attn = self.hw = None


def _kept(inp: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return (out.flatten(1) != 0).any(1) | (inp.flatten(1) == 0).all(1)


def _hook_drop(module: nn.Module, cap: _Capture, handles: list) -> None:
    """mmcv's DropPath (``drop_prob``) zeroes whole samples of a residual branch."""
    if getattr(module, 'drop_prob', 0.) > 0 and module.training:
        handles.append(module.register_forward_hook(lambda m, i, o, c=cap: setattr(c, 'keep', _kept(i[0], o))))


class MMViTTracer:
    """mmpretrain ``VisionTransformer``: pre-norm ``TransformerEncoderLayer`` blocks, SDPA attention."""

    def __init__(self, backbone: VisionTransformer):
        for i, layer in enumerate(backbone.layers):
            if type(layer) is not TransformerEncoderLayer or type(layer.attn) is not MultiheadAttention:
                raise ValueError(f'backbone: TL-Align traces TransformerEncoderLayer/MultiheadAttention, layer {i} '
                                 f'is {type(layer).__name__}')
            if getattr(layer.attn, 'v_shortcut', False):
                raise ValueError('backbone: attention with v_shortcut has no TL-Align rule')
        if tuple(backbone.out_indices) != (len(backbone.layers) - 1,):
            raise ValueError(f'backbone: TL-Align needs the classification output (out_indices=({len(backbone.layers) - 1},)), '
                             f'got {backbone.out_indices}')
        if backbone.out_type not in ('cls_token', 'avg_featmap'):
            raise ValueError(f"backbone: out_type={backbone.out_type!r} has no TL-Align rule; use 'cls_token' "
                             f"or 'avg_featmap'")
        self.backbone = backbone
        self.num_prefix_tokens = backbone.num_extra_tokens

    def register(self, captures: List[_Capture]) -> list:
        handles = []
        for layer in self.backbone.layers:
            cap = _Capture()
            captures.append(cap)
            a = layer.attn
            handles.append(a.qkv.register_forward_hook(lambda m, i, o, c=cap, a=a: _set_qk(c, o.detach(), a)))
            _hook_drop(a.out_drop, cap, handles)
        return handles

    def propagate(self, captures, labels, layers, normalise, fused):
        blocks = ((c.q, c.k, _scale(layer.attn), c.keep) for c, layer in zip(captures, self.backbone.layers))
        return self_attention_labels(blocks, labels, layers, normalise, fused)

    def readout(self, labels: torch.Tensor) -> torch.Tensor:
        if self.backbone.out_type == 'cls_token':
            return labels[:, 0]
        return labels[:, self.num_prefix_tokens:].mean(1)

    @property
    def depth(self) -> int:
        return len(self.backbone.layers)


def _set_qk(cap: _Capture, qkv: torch.Tensor, attn: MultiheadAttention) -> None:
    B, N, _ = qkv.shape
    q, k, _ = qkv.reshape(B, N, 3, attn.num_heads, attn.head_dims).permute(2, 0, 3, 1, 4).unbind(0)
    cap.q, cap.k = q, k


def _scale(attn: MultiheadAttention) -> Optional[float]:
    """mmpretrain's ``qk_scale`` binds ``scale`` into its SDPA partial; default ``head_dims ** -0.5``."""
    fn = attn.scaled_dot_product_attention
    return getattr(fn, 'keywords', {}).get('scale', attn.head_dims ** -0.5)


class MMSwinTracer:
    """mmpretrain ``SwinTransformer``: ``ShiftWindowMSA`` blocks (materialised ``WindowMSA`` softmax),
    ``PatchMerging`` at the *end* of a stage, average pooling of the last stage. mmpretrain keeps the
    cyclic shift when a stage's map is larger than its window and drops it when it equals the window
    (unless ``pad_small_map``), exactly as the token path does."""

    num_prefix_tokens = 0

    def __init__(self, backbone: SwinTransformer):
        if tuple(backbone.out_indices) != (len(backbone.stages) - 1,):
            raise ValueError(f'backbone: TL-Align needs the classification output (out_indices=({len(backbone.stages) - 1},)), '
                             f'got {backbone.out_indices}')
        for stage in backbone.stages:
            for blk in stage.blocks:
                if type(blk) is not SwinBlock or type(blk.attn) is not ShiftWindowMSA or \
                        type(blk.attn.w_msa) is not WindowMSA:
                    raise ValueError(f'backbone: TL-Align traces SwinBlock/ShiftWindowMSA/WindowMSA, got '
                                     f'{type(blk).__name__}')
        self.backbone = backbone

    def register(self, captures: List[_Capture]) -> list:
        handles = []
        for stage in self.backbone.stages:
            for blk in stage.blocks:
                cap = _Capture()
                captures.append(cap)
                handles.append(blk.attn.register_forward_pre_hook(lambda m, a, c=cap: setattr(c, 'hw', tuple(a[1]))))
                handles.append(blk.attn.w_msa.softmax.register_forward_hook(
                    lambda m, i, o, c=cap: setattr(c, 'attn', o.detach())))
                _hook_drop(blk.attn.drop, cap, handles)
        return handles

    @staticmethod
    def _shift(attn: ShiftWindowMSA, H: int, W: int) -> int:
        ws = attn.window_size
        if min(H, W) < ws:
            raise ValueError(f'x: a {H}x{W} map is padded to the {ws}x{ws} window; TL-Align traces unpadded grids only')
        if min(H, W) == ws and not attn.pad_small_map:
            return 0
        return attn.shift_size

    def propagate(self, captures, labels, layers, normalise, fused):
        H, W = captures[0].hw
        Y = labels.view(labels.shape[0], H, W, labels.shape[-1])
        idx = 0
        for stage in self.backbone.stages:
            for blk in stage.blocks:
                cap = captures[idx]
                if layers is None or idx in layers:
                    a = blk.attn
                    s = self._shift(a, *cap.hw)
                    branch = window_labels(Y, (a.window_size,) * 2, (s, s), attn=cap.attn)
                    Y = residual_labels(Y, branch, cap.keep, normalise)
                idx += 1
            if stage.downsample is not None:
                Y = merge_2x2_labels(Y)
        return Y.flatten(1, 2)

    def readout(self, labels: torch.Tensor) -> torch.Tensor:
        return labels.mean(1)

    @property
    def depth(self) -> int:
        return sum(len(s.blocks) for s in self.backbone.stages)


MM_SUPPORTED_BACKBONES = {VisionTransformer: MMViTTracer, SwinTransformer: MMSwinTracer}


def _tracer_for(backbone: nn.Module):
    for cls, tracer in MM_SUPPORTED_BACKBONES.items():
        if type(backbone) is cls:
            return tracer(backbone)
    names = ', '.join(f'{c.__module__}.{c.__name__}' for c in MM_SUPPORTED_BACKBONES)
    raise ValueError(f'backbone: TL-Align has no tracer for {type(backbone).__module__}.{type(backbone).__name__}; '
                     f'supported: {names}')


@MODELS.register_module()
class TLAlignClassifier(ImageClassifier):
    """``ImageClassifier`` trained on TL-Align's aligned targets (see the module docstring).

    Args:
        tl_align: ``dict(layers=None, normalise=True, fused=None)`` as :class:`timm_plugin.TLAlign`.
        Other args: as ``ImageClassifier``.
    """

    def __init__(self, *args, tl_align: Optional[dict] = None, **kwargs):
        super().__init__(*args, **kwargs)
        cfg = dict(tl_align or {})
        self.tracer = _tracer_for(self.backbone)
        layers: Optional[Iterable[int]] = cfg.pop('layers', None)
        self.align_layers = None if layers is None else set(int(i) for i in layers)
        if self.align_layers is not None and not self.align_layers <= set(range(self.tracer.depth)):
            raise ValueError(f'tl_align.layers: block indices must be in [0, {self.tracer.depth}), '
                             f'got {sorted(self.align_layers)}')
        self.align_normalise = bool(cfg.pop('normalise', True))
        self.align_fused = cfg.pop('fused', None)
        if cfg:
            raise ValueError(f'tl_align: unknown keys {sorted(cfg)} (expected layers, normalise, fused)')

    def extract_feat_aligned(self, inputs: torch.Tensor, data_samples: List):
        """Features and, if the batch carries a mix, the aligned ``(B, C)`` targets (else ``None``)."""
        mix = mix_from_samples(data_samples)
        if mix is None:
            return self.extract_feat(inputs), None
        captures: List[_Capture] = []
        handles = self.tracer.register(captures)
        try:
            feats = self.extract_feat(inputs)
        finally:
            for h in handles:
                h.remove()
        with torch.no_grad(), torch.autocast(device_type=inputs.device.type, enabled=False):
            labels0 = compact_labels(mix.to(inputs.device), self.tracer.num_prefix_tokens)
            state = self.tracer.propagate(captures, labels0, self.align_layers, self.align_normalise,
                                          self.align_fused)
        share = self.tracer.readout(state)[:, 0]
        labels = torch.cat([s.gt_label for s in data_samples]).to(share.device)
        # the preprocessor's num_classes sized the stock scores; label smoothing stays with the head's loss
        num_classes = data_samples[0].gt_score.numel() if 'gt_score' in data_samples[0] else self.head.num_classes
        return feats, aligned_target(share, labels, mix, num_classes, 0.)

    def loss(self, inputs: torch.Tensor, data_samples: List) -> dict:
        feats, targets = self.extract_feat_aligned(inputs, data_samples)
        if targets is not None:
            for sample, t in zip(data_samples, targets):
                sample.set_gt_score(t)
        return self.head.loss(feats, data_samples)
