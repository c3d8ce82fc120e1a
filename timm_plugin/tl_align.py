"""TL-Align for timm models: a wrapper that traces token labels beside the unchanged token path.

``TLAlign(model)`` wraps a supported timm model. In training, ``logits, target = wrapped(x, mix_target)``
with ``mix_target`` the :class:`timm_plugin.MixTarget` from a token-aware mixer: the logits are exactly
the model's, and ``target`` is the aligned ``(B, C)`` soft target (``tl-align.md`` Eq. 12). In eval
mode (or without a target) it is the plain model call: same logits, no extra work.

How the labels are traced: forward hooks on each attention's ``q_norm`` / ``k_norm`` (identity modules
unless qk-norm is on) keep the detached ``q``, ``k`` the token path fed to its fused attention (autograd
holds them anyway), and a hook on ``drop_path1`` notes which samples' attention branch stochastic
depth dropped. After the forward, the label state (compact ``(B, T, 1)`` partner shares, or dense
``(B, T, C)`` for :meth:`TLAlign.trace`) goes through the blocks with the rules of
:mod:`shared_core.tl_align`; the attention is recomputed for the labels by a fused
``scaled_dot_product_attention`` call with the labels as values (on accelerators; on the CPU a
transient softmax is faster), and the token path is untouched: still the model's fused attention.

Supported: timm ``VisionTransformer`` (ViT / DeiT, class token or ``global_pool='avg'``, register
tokens) and ``VisionTransformerDistilled`` (DeiT distilled). Others raise an error listing these.
"""
from __future__ import annotations

from typing import Iterable, List, Optional

import torch
import torch.nn as nn
from timm.layers import Attention, DropPath
from timm.models.deit import VisionTransformerDistilled
from timm.models.vision_transformer import Block, VisionTransformer

from shared_core.tl_align import (
    aligned_target, attention_labels, compact_labels, dense_labels, residual_labels,
)
from .mixup import MixTarget

__all__ = ['TLAlign', 'SUPPORTED_MODELS']


class _BlockCapture:
    """What one block's token path left for the label path."""
    __slots__ = ('q', 'k', 'keep')

    def __init__(self):
        self.q = self.k = self.keep = None


class ViTTracer:
    """Label rules for timm's ``VisionTransformer`` (pre-norm blocks: attention residual, MLP residual)."""

    def __init__(self, model: VisionTransformer):
        bad = [i for i, b in enumerate(model.blocks) if type(b) is not Block or type(b.attn) is not Attention]
        if bad:
            raise ValueError(f'model: TL-Align traces timm ViT blocks of type Block with Attention; blocks {bad} '
                             f'are {type(model.blocks[bad[0]]).__name__}')
        if getattr(model, 'attn_pool', None) is not None:
            raise ValueError("model: global_pool='map' (attention pooling) has no TL-Align rule; use 'token' or 'avg'")
        if model.global_pool not in ('token', 'avg'):
            raise ValueError(f"model: global_pool={model.global_pool!r} has no TL-Align rule; use 'token' or 'avg'")
        if getattr(model.patch_drop, 'prob', 0.) > 0:
            raise ValueError('model: patch dropout changes the token set; TL-Align does not trace it')
        self.model = model
        self.num_prefix_tokens = model.num_prefix_tokens

    def register(self, captures: List[_BlockCapture]) -> list:
        handles = []
        for blk in self.model.blocks:
            cap = _BlockCapture()
            captures.append(cap)
            handles.append(blk.attn.q_norm.register_forward_hook(lambda m, i, o, c=cap: setattr(c, 'q', o.detach())))
            handles.append(blk.attn.k_norm.register_forward_hook(lambda m, i, o, c=cap: setattr(c, 'k', o.detach())))
            if isinstance(blk.drop_path1, DropPath) and blk.drop_path1.drop_prob > 0 and blk.training:
                handles.append(blk.drop_path1.register_forward_hook(
                    lambda m, i, o, c=cap: setattr(c, 'keep', _kept_samples(i[0], o))))
        return handles

    def propagate(self, captures: List[_BlockCapture], labels: torch.Tensor, layers: Optional[set],
                  normalise: bool, fused: Optional[bool]) -> torch.Tensor:
        for idx, (blk, cap) in enumerate(zip(self.model.blocks, captures)):
            if layers is not None and idx not in layers:
                continue  # not aligned here: the labels pass unchanged
            branch = attention_labels(cap.q, cap.k, labels, scale=blk.attn.scale, fused=fused)  # Eq. 9
            labels = residual_labels(labels, branch, cap.keep, normalise)  # Eq. 11 (the MLP residual: Y)
        return labels

    def readout(self, labels: torch.Tensor, output) -> torch.Tensor:
        """The label of what the classifier reads."""
        if self.model.global_pool == 'token':
            return labels[:, 0]
        tokens = labels if self.model.pool_include_prefix else labels[:, self.num_prefix_tokens:]
        return tokens.mean(1)


class DistilledViTTracer(ViTTracer):
    """DeiT distilled: the class head reads token 0, the distillation head token 1. In distilled training
    (two outputs) the target is the class token's (the distillation head learns from the teacher);
    otherwise the two heads are averaged, and so are the two tokens' labels."""

    def readout(self, labels: torch.Tensor, output) -> torch.Tensor:
        if isinstance(output, (tuple, list)):
            return labels[:, 0]
        return (labels[:, 0] + labels[:, 1]) / 2


def _kept_samples(inp: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Samples whose residual branch survived DropPath (it zeroes whole samples)."""
    return (out.flatten(1) != 0).any(1) | (inp.flatten(1) == 0).all(1)


# most specific class first
SUPPORTED_MODELS = {VisionTransformerDistilled: DistilledViTTracer, VisionTransformer: ViTTracer}


def _tracer_for(model: nn.Module):
    for cls, tracer in SUPPORTED_MODELS.items():
        if isinstance(model, cls):
            return tracer(model)
    names = ', '.join(f'{c.__module__}.{c.__name__}' for c in SUPPORTED_MODELS)
    raise ValueError(f'model: TL-Align has no tracer for {type(model).__module__}.{type(model).__name__}; '
                     f'supported: {names}')


class TLAlign(nn.Module):
    """Token-label alignment around a timm model (see the module docstring).

    Args:
        model: a supported timm model.
        layers: align only at these block indices (Table 8 ablation); ``None``: every block.
        normalise: ``False`` drops the residual from the label path (Table 8, "normalization disabled").
        fused: the label attention as a fused SDPA call (``True``), or a transient softmax (``False``);
            default: fused on accelerators, transient on the CPU, whichever is faster there
            (:func:`shared_core.tl_align.attention_labels`). The token path is the model's either way.
    """

    def __init__(self, model: nn.Module, layers: Optional[Iterable[int]] = None, normalise: bool = True,
                 fused: Optional[bool] = None):
        super().__init__()
        self.tracer = _tracer_for(model)
        self.model = model
        self.layers = None if layers is None else set(int(i) for i in layers)
        if self.layers is not None and not self.layers <= set(range(len(model.blocks))):
            raise ValueError(f'layers: block indices must be in [0, {len(model.blocks)}), got {sorted(self.layers)}')
        self.normalise = normalise
        self.fused = fused

    @property
    def num_prefix_tokens(self) -> int:
        return self.tracer.num_prefix_tokens

    def _run(self, x: torch.Tensor, labels: torch.Tensor):
        captures: List[_BlockCapture] = []
        handles = self.tracer.register(captures)
        try:
            output = self.model(x)
        finally:
            for h in handles:
                h.remove()
        if captures[0].q.shape[2] != labels.shape[1]:
            raise ValueError(f'labels: {labels.shape[1]} token labels for {captures[0].q.shape[2]} tokens '
                             f'(prefix {self.num_prefix_tokens} + patches): the patch grid of x does not match')
        state = self.tracer.propagate(captures, labels.to(x.device), self.layers, self.normalise, self.fused)
        return output, self.tracer.readout(state, output)

    def forward(self, x: torch.Tensor, target: Optional[torch.Tensor] = None):
        if not self.training or target is None:
            return self.model(x)
        if not isinstance(target, MixTarget):
            raise ValueError('target: TL-Align needs the MixTarget of a token-aware mixer '
                             "(create_mixer(..., carry_mix) / mixup_type 'tl_align'), got a plain tensor")
        mix = target.mix
        output, share = self._run(x, compact_labels(mix, self.num_prefix_tokens))
        aligned = aligned_target(share[:, 0], target.labels, mix, target.num_classes, target.smoothing)
        return output, aligned

    def trace(self, x: torch.Tensor, token_labels: torch.Tensor, cls_label: Optional[torch.Tensor] = None):
        """Reference entry point: dense per-patch labels ``(B, N_patches, C)`` (rows sum to 1, row-major
        over the patch grid of ``x``) through the model; returns ``(output, label)`` with ``label`` the
        aligned ``(B, C)`` label of what the classifier reads. ``cls_label`` (default: the mean of
        ``token_labels``) starts every prefix token."""
        return self._run(x, dense_labels(token_labels, cls_label, self.num_prefix_tokens))
