"""TokenMixup for MMPretrain: ``TokenMixupClassifier``, an ``ImageClassifier`` trained with Horizontal (HTM) and
Vertical (VTM) TokenMixup (the TokenMixup paper).

Config: ``model = dict(type='TokenMixupClassifier', tokenmixup=dict(htm_layers=[3], vtm_layers=[4], ...), ...)``.
In ``loss`` the classifier runs the backbone under the hooks of :class:`shared_core.tokenmixup.TokenMixupHooks`
(the same driver as timm's :class:`timm_plugin.TokenMixup`; only this module's adapter is mm's), writes each
sample's relabelled ``gt_score`` (the incoming score of the stock or tokenaug MixUp/CutMix augments, else the
one-hot label) before the head's loss, and adds the ScoreNet loss as ``loss_scorenet`` (plus the logged
``htm_mixed`` count). Prediction is the stock classifier's. The ScoreNets are ``tokenmixup_scorenet.*`` of the
classifier (saved with it; ``tokenaug-convert`` drops them).

Label smoothing: mmpretrain smooths in the head's loss (``LabelSmoothLoss``), after the classifier has written
``gt_score``. HTM judges difficulty and trains the ScoreNet on the target the loss will see, as timm (whose mixers
smooth) and the public code do: the classifier runs the hooks on the smoothed score, then relabels the unsmoothed
``gt_score`` with the same plans (smoothing commutes with Eq. 11's relabelling), and the loss smooths it once.

Backbones: mmpretrain ``VisionTransformer`` (``TransformerEncoderLayer`` / ``MultiheadAttention``) and
``TIMMBackbone`` around a timm ViT/DeiT or a tokenaug CCT (``cct_7_3x1_32``; ``custom_imports`` with
``timm_plugin``).
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn as nn
from mmpretrain.models.backbones import TIMMBackbone, VisionTransformer
from mmpretrain.models.backbones.vision_transformer import TransformerEncoderLayer
from mmpretrain.models.classifiers import ImageClassifier
from mmpretrain.models.losses import LabelSmoothLoss
from mmpretrain.models.utils.attention import MultiheadAttention
from mmpretrain.registry import MODELS

from shared_core.label_maps import smooth
from shared_core.mix import one_hot
from shared_core.tokenmixup import DIFFICULTY_SCALE, TokenMixupHooks, mix_soft_target, scorenets

from .attention import attention_scale, split_qk

__all__ = ['TokenMixupClassifier', 'MMTokenMixupAdapter', 'mm_tokenmixup_adapter']


def _attention_with_memory(layer: TransformerEncoderLayer, memory: torch.Tensor):
    """The layer's ``MultiheadAttention`` with the memory as extra keys and values, through its own weights."""
    a = layer.attn

    def forward(x: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        kv_in = torch.cat([x, layer.ln1(memory)], 1)
        qkv = a.qkv(kv_in).reshape(B, kv_in.shape[1], 3, a.num_heads, a.head_dims).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0][:, :, :N], qkv[1], qkv[2]
        out = a.scaled_dot_product_attention(q, k, v, dropout_p=a.attn_drop if a.training else 0.0)
        out = a.proj(out.transpose(1, 2).reshape(B, N, a.embed_dims))
        return a.out_drop(a.gamma1(a.proj_drop(out)))

    return forward


class MMTokenMixupAdapter:
    """mmpretrain ``VisionTransformer``'s side of :class:`~shared_core.tokenmixup.TokenMixupHooks`."""

    def __init__(self, backbone: VisionTransformer):
        for i, layer in enumerate(backbone.layers):
            if type(layer) is not TransformerEncoderLayer or type(layer.attn) is not MultiheadAttention:
                raise ValueError(
                    f'backbone: TokenMixup hooks TransformerEncoderLayer/MultiheadAttention; layer {i} is '
                    f'{type(layer).__name__}'
                )
            if getattr(layer.attn, 'v_shortcut', False):
                raise ValueError('backbone: attention with v_shortcut has no TokenMixup rule')
        self.blocks = list(backbone.layers)
        self.num_prefix_tokens = int(backbone.num_extra_tokens)
        self.has_class_token = bool(backbone.with_cls_token)
        self.embed_dims = int(backbone.embed_dims)

    def qk(self, idx: int, x: torch.Tensor):
        layer = self.blocks[idx]
        with torch.no_grad(), torch.autocast(device_type=x.device.type, enabled=False):
            return split_qk(layer.attn, layer.attn.qkv(layer.ln1(x.detach().to(layer.attn.qkv.weight.dtype))))

    def capture_qk(self, idx: int, sink: dict) -> list:
        a = self.blocks[idx].attn

        def keep(m, i, o):
            sink['q'], sink['k'] = split_qk(a, o.detach())

        return [a.qkv.register_forward_hook(keep)]

    def scale(self, idx: int) -> float:
        return attention_scale(self.blocks[idx].attn)

    def attend_with_memory(self, idx: int, memory: torch.Tensor):
        layer = self.blocks[idx]
        layer.attn.forward = _attention_with_memory(layer, memory)  # this instance, this call
        return lambda: layer.attn.__dict__.pop('forward', None)


def mm_tokenmixup_adapter(backbone: nn.Module):
    """The adapter of a supported backbone (``TIMMBackbone``: timm's adapter, imported only then)."""
    if type(backbone) is VisionTransformer:
        return MMTokenMixupAdapter(backbone)
    if isinstance(backbone, TIMMBackbone):
        from timm_plugin.tokenmixup import TimmTokenMixupAdapter

        return TimmTokenMixupAdapter(backbone.timm_model)
    raise ValueError(
        f'backbone: TokenMixup supports mmpretrain.models.VisionTransformer and TIMMBackbone around a '
        f'timm ViT or CCT; got {type(backbone).__module__}.{type(backbone).__name__}'
    )


def head_smoothing(head: nn.Module) -> float:
    """The label smoothing ``ε`` the head's loss applies to a soft target as ``(1 − ε) y + ε / C``: mmpretrain's
    ``LabelSmoothLoss`` (``'original'``: its ``label_smooth_val``; ``'classy_vision'``: ``val / (1 + val)``); 0 for
    any other loss. A ``'multi_label'`` smoothing has no such form and is refused."""
    loss = getattr(head, 'loss_module', None)
    if not isinstance(loss, LabelSmoothLoss):
        return 0.0
    if loss.mode == 'multi_label':
        raise ValueError("head.loss: TokenMixup relabels soft scores; LabelSmoothLoss(mode='multi_label') is not one")
    val = float(loss.label_smooth_val)
    return val / (1.0 + val) if loss.mode == 'classy_vision' else val


@MODELS.register_module()
class TokenMixupClassifier(ImageClassifier):
    """``ImageClassifier`` trained with TokenMixup (see the module docstring).

    Args:
        tokenmixup: ``dict(htm_layers=[], vtm_layers=[], rho=0.005, tau=0.2, kappa=3, saliency='auto',
            scorenet='auto', scorenet_weight=1e-3, scorenet_stopgrad=False, vtm_stopgrad=False,
            difficulty_scale=0.1, vtm_memory='mixed')``, as :class:`timm_plugin.TokenMixup`.

    The other arguments: as ``ImageClassifier``.
    """

    KEYS = (
        'htm_layers',
        'vtm_layers',
        'rho',
        'tau',
        'kappa',
        'saliency',
        'scorenet',
        'scorenet_weight',
        'scorenet_stopgrad',
        'vtm_stopgrad',
        'difficulty_scale',
        'vtm_memory',
    )

    def __init__(self, *args, tokenmixup: Optional[dict] = None, **kwargs):
        super().__init__(*args, **kwargs)
        cfg = dict(tokenmixup or {})
        unknown = sorted(set(cfg) - set(self.KEYS))
        if unknown:
            raise ValueError(f'tokenmixup: unknown keys {unknown} (expected {", ".join(self.KEYS)})')
        adapter = mm_tokenmixup_adapter(self.backbone)
        saliency = cfg.get('saliency', 'auto')
        saliency = ('cls' if adapter.has_class_token else 'mean') if saliency == 'auto' else saliency
        try:
            self.tokenmixup = TokenMixupHooks(
                adapter,
                None,
                cfg.get('htm_layers', ()),
                cfg.get('vtm_layers', ()),
                cfg.get('rho', 0.005),
                cfg.get('tau', 0.2),
                cfg.get('kappa', 3),
                saliency,
                cfg.get('scorenet_weight', 1e-3),
                cfg.get('scorenet_stopgrad', False),
                cfg.get('vtm_stopgrad', False),
                cfg.get('difficulty_scale', DIFFICULTY_SCALE),
                cfg.get('vtm_memory', 'mixed'),
            )
        except ValueError as e:
            raise ValueError(f'tokenmixup.{e}') from None
        if self.tokenmixup.htm_layers:
            self.tokenmixup.nets = scorenets(
                self,
                self.tokenmixup.htm_layers,
                adapter.embed_dims,
                self.head.num_classes,
                adapter.num_prefix_tokens,
                adapter.has_class_token,
                cfg.get('scorenet', 'auto'),
            )

    def loss(self, inputs: torch.Tensor, data_samples: List) -> dict:
        C = self.head.num_classes
        if 'gt_score' in data_samples[0]:  # MixUp/CutMix scores of the batch augments
            y = torch.stack([s.gt_score for s in data_samples]).float().to(inputs.device)
        else:
            y = one_hot(torch.cat([s.gt_label for s in data_samples]).to(inputs.device), C)
        if y.shape != (len(data_samples), C):
            raise ValueError(f'data_samples: TokenMixup needs one label or a ({C},) score per sample')
        eps = head_smoothing(self.head)  # judge the target the loss sees (module docstring)
        feats, judged, aux, stats, mixes = self.tokenmixup.run(smooth(y, eps), lambda: self.extract_feat(inputs))
        if eps:
            for mix in mixes:
                y = mix_soft_target(y, mix)
        else:
            y = judged
        for sample, score in zip(data_samples, y):
            sample.set_gt_score(score)
        losses = self.head.loss(feats, data_samples)
        if self.tokenmixup.htm_layers:
            losses['loss_scorenet'] = aux
            losses['htm_mixed'] = torch.tensor(float(sum(s['mixed'] for s in stats.values())), device=inputs.device)
        return losses
