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
tokens), ``VisionTransformerDistilled`` (DeiT distilled) and ``SwinTransformer`` (shifted windows,
patch merging, average pooling). Others raise an error listing these.
"""
from __future__ import annotations

from typing import Iterable, List, Optional

import torch
import torch.nn as nn
from timm.layers import Attention, DropPath
from timm.models.deit import VisionTransformerDistilled
from timm.models.swin_transformer import (
    PatchMerging, SwinTransformer, SwinTransformerBlock, WindowAttention, window_partition, window_reverse,
)
from timm.models.vision_transformer import Block, VisionTransformer

from shared_core.tl_align import (
    aligned_target, attention_labels, compact_labels, dense_labels, merge_labels, residual_labels,
)
from shared_core.mixing import Mix
from .mixup import MixTarget

__all__ = ['TLAlign', 'TransMix', 'SUPPORTED_MODELS']


class _BlockCapture:
    """What one block's token path left for the label path."""
    __slots__ = ('q', 'k', 'keep', 'attn', 'mask', 'tokens')

    def __init__(self):
        self.q = self.k = self.keep = self.attn = self.mask = self.tokens = None


def _hook_drop_path(blk: nn.Module, cap: _BlockCapture, handles: list) -> None:
    if isinstance(blk.drop_path1, DropPath) and blk.drop_path1.drop_prob > 0 and blk.training:
        handles.append(blk.drop_path1.register_forward_hook(
            lambda m, i, o, c=cap: setattr(c, 'keep', _kept_samples(i[0], o))))


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
            _hook_drop_path(blk, cap, handles)
        return handles

    def num_tokens(self, captures: List[_BlockCapture]) -> int:
        return captures[0].q.shape[2]

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


class SwinTracer:
    """Label rules for timm's ``SwinTransformer``: per block, the labels take the block's cyclic shift,
    window partition, head-mean window attention (relative-position bias and shift mask included: the
    attention the token path used), window reverse and shift back, then the residual average; each
    stage's ``PatchMerging`` (timm puts it at the start of a stage) averages the 2x2 labels it merges
    (sum, then Norm); the target is the mean label (global average pooling).

    timm's ``WindowAttention`` materialises its softmax unless fused attention is switched on: the
    hook then takes the attention probabilities the token path computed; with fused attention it takes
    ``q``, ``k`` and the shift mask and recomputes the label attention (fused on accelerators)."""

    num_prefix_tokens = 0

    def __init__(self, model: SwinTransformer):
        if model.global_pool != 'avg':
            raise ValueError(f"model: Swin with global_pool={model.global_pool!r} has no TL-Align rule; use 'avg'")
        for stage in model.layers:
            if not isinstance(stage.downsample, (nn.Identity, PatchMerging)):
                raise ValueError(f'model: Swin downsample {type(stage.downsample).__name__} has no TL-Align rule')
            for blk in stage.blocks:
                if type(blk) is not SwinTransformerBlock or type(blk.attn) is not WindowAttention:
                    raise ValueError(f'model: TL-Align traces timm SwinTransformerBlock/WindowAttention, '
                                     f'got {type(blk).__name__}')
        self.model = model

    def _blocks(self):
        return [blk for stage in self.model.layers for blk in stage.blocks]

    def register(self, captures: List[_BlockCapture]) -> list:
        handles = []
        for blk in self._blocks():
            cap = _BlockCapture()
            captures.append(cap)
            handles.append(blk.register_forward_pre_hook(
                lambda m, i, c=cap: setattr(c, 'tokens', tuple(i[0].shape[1:3]))))
            if blk.attn.fused_attn:
                handles.append(blk.attn.register_forward_pre_hook(
                    lambda m, a, kw, c=cap: setattr(c, 'mask', kw.get('mask', a[1] if len(a) > 1 else None)),
                    with_kwargs=True))
                handles.append(blk.attn.qkv.register_forward_hook(
                    lambda m, i, o, c=cap, a=blk.attn: _set_qk(c, o.detach(), a.num_heads)))
            else:
                handles.append(blk.attn.softmax.register_forward_hook(
                    lambda m, i, o, c=cap: setattr(c, 'attn', o.detach())))
            _hook_drop_path(blk, cap, handles)
        return handles

    def num_tokens(self, captures: List[_BlockCapture]) -> int:
        H, W = captures[0].tokens
        return H * W

    def _window_labels(self, blk: SwinTransformerBlock, cap: _BlockCapture, Y: torch.Tensor,
                       fused: Optional[bool]) -> torch.Tensor:
        B, H, W, K = Y.shape
        ws, ss = blk.window_size, blk.shift_size
        if H % ws[0] or W % ws[1]:
            raise ValueError(f'x: a {H}x{W} token grid is padded to {ws[0]}x{ws[1]} windows by timm\'s Swin; '
                             f'TL-Align traces unpadded grids only (choose the image size accordingly)')
        Ys = torch.roll(Y, shifts=(-ss[0], -ss[1]), dims=(1, 2)) if any(ss) else Y
        Yw = window_partition(Ys, ws).view(-1, ws[0] * ws[1], K)
        if cap.attn is not None:  # the token path's own attention probabilities
            out = cap.attn.float().mean(1) @ Yw
        else:
            a = blk.attn
            N = Yw.shape[1]
            bias = a._get_rel_pos_bias()
            if cap.mask is not None:
                nw = cap.mask.shape[0]
                mask = cap.mask.view(1, nw, 1, N, N).expand(Yw.shape[0] // nw, -1, a.num_heads, -1, -1)
                bias = bias + mask.reshape(-1, a.num_heads, N, N)
            out = attention_labels(cap.q, cap.k, Yw, attn_mask=bias, scale=a.scale, fused=fused)
        out = window_reverse(out.view(-1, ws[0], ws[1], K), ws, H, W)
        return torch.roll(out, shifts=ss, dims=(1, 2)) if any(ss) else out

    def propagate(self, captures: List[_BlockCapture], labels: torch.Tensor, layers: Optional[set],
                  normalise: bool, fused: Optional[bool]) -> torch.Tensor:
        H, W = captures[0].tokens
        Y = labels.view(labels.shape[0], H, W, labels.shape[-1])
        idx = 0
        for stage in self.model.layers:
            if isinstance(stage.downsample, PatchMerging):
                B, H, W, K = Y.shape
                if H % 2 or W % 2:
                    raise ValueError(f'x: patch merging pads a {H}x{W} grid; TL-Align traces even grids only')
                Y = merge_labels(Y.view(B, H // 2, 2, W // 2, 2, K).permute(0, 1, 3, 2, 4, 5).reshape(
                    B, H // 2, W // 2, 4, K))
            for blk in stage.blocks:
                cap = captures[idx]
                if layers is None or idx in layers:
                    Y = residual_labels(Y, self._window_labels(blk, cap, Y, fused), cap.keep, normalise)
                idx += 1
        return Y.flatten(1, 2)

    def readout(self, labels: torch.Tensor, output) -> torch.Tensor:
        return labels.mean(1)


def _set_qk(cap: _BlockCapture, qkv: torch.Tensor, num_heads: int) -> None:
    B_, N, _ = qkv.shape
    q, k, _ = qkv.reshape(B_, N, 3, num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
    cap.q, cap.k = q, k


# most specific class first
SUPPORTED_MODELS = {VisionTransformerDistilled: DistilledViTTracer, VisionTransformer: ViTTracer,
                    SwinTransformer: SwinTracer}


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

    method = 'tl_align'

    def __init__(self, model: nn.Module, layers: Optional[Iterable[int]] = None, normalise: bool = True,
                 fused: Optional[bool] = None):
        super().__init__()
        self.tracer = _tracer_for(model)
        self.model = model
        self.layers = None if layers is None else set(int(i) for i in layers)
        if self.layers is not None and not self.layers <= set(range(self.depth)):
            raise ValueError(f'layers: block indices must be in [0, {self.depth}), got {sorted(self.layers)}')
        self.normalise = normalise
        self.fused = fused

    @property
    def num_prefix_tokens(self) -> int:
        return self.tracer.num_prefix_tokens

    @property
    def depth(self) -> int:
        m = self.model
        return sum(len(s.blocks) for s in m.layers) if isinstance(m, SwinTransformer) else len(m.blocks)

    def _capture(self, x: torch.Tensor):
        """The model's forward, keeping what each block's token path leaves for the label path."""
        captures: List[_BlockCapture] = []
        handles = self.tracer.register(captures)
        try:
            output = self.model(x)
        finally:
            for h in handles:
                h.remove()
        return output, captures

    def _check_mix(self, target) -> Mix:
        if not isinstance(target, MixTarget):
            raise ValueError(f'target: {type(self).__name__} needs the MixTarget of a mixer with carry_mix '
                             f"(create_mixer(..., carry_mix=True) / --mixup-type {self.method}), got a plain tensor")
        return target.mix

    def _run(self, x: torch.Tensor, labels: torch.Tensor):
        output, captures = self._capture(x)
        if self.tracer.num_tokens(captures) != labels.shape[1]:
            raise ValueError(f'labels: {labels.shape[1]} token labels for {self.tracer.num_tokens(captures)} '
                             f'tokens (prefix {self.num_prefix_tokens} + patches): the patch grid of x does not match')
        with torch.no_grad():
            state = self.tracer.propagate(captures, labels.to(x.device), self.layers, self.normalise, self.fused)
        return output, self.tracer.readout(state, output)

    def forward(self, x: torch.Tensor, target: Optional[torch.Tensor] = None):
        if not self.training or target is None:
            return self.model(x)
        mix = self._check_mix(target)
        output, share = self._run(x, compact_labels(mix, self.num_prefix_tokens))
        aligned = aligned_target(share[:, 0], target.labels, mix, target.num_classes, target.smoothing)
        return output, aligned

    def trace(self, x: torch.Tensor, token_labels: torch.Tensor, cls_label: Optional[torch.Tensor] = None):
        """Reference entry point: dense per-patch labels ``(B, N_patches, C)`` (rows sum to 1, row-major
        over the patch grid of ``x``) through the model; returns ``(output, label)`` with ``label`` the
        aligned ``(B, C)`` label of what the classifier reads. ``cls_label`` (default: the mean of
        ``token_labels``) starts every prefix token."""
        return self._run(x, dense_labels(token_labels, cls_label, self.num_prefix_tokens))


class TransMix(TLAlign):
    """TransMix (Chen et al., "TransMix: Attend to Mix for Vision Transformers"), the baseline TL-Align
    compares with: the partner share of the target is read from the last block's attention over the
    mixed region instead of the area.

    Rule (``mode='paper'``): ``λ_partner = A · M``, with ``A`` the head-mean attention of the class
    token to the patch tokens in the last block, renormalised over the patches (a softmax over the
    patch keys), and ``M`` the partner share of each patch token (fractional where a pixel box cuts a
    patch). ``mode='average'`` is what the public TransMix code does: the mean of that and the area
    share. Default ``'paper'``: the papers are this project's specification; ``'average'`` reproduces
    the public numbers. DeiT distilled: the class token's attention.

    Our extension, for models without a class token (``global_pool='avg'`` ViTs, Swin): ``A`` is the
    mean over all query tokens of the last block's attention (a distribution over keys), i.e. the
    pooled compact label after the last block's attention alone (Swin: at its own window geometry and
    merged resolution).
    """
    method = 'transmix'
    MODES = ('paper', 'average')

    def __init__(self, model: nn.Module, mode: str = 'paper', fused: Optional[bool] = None):
        super().__init__(model, fused=fused)
        if mode not in self.MODES:
            raise ValueError(f'mode must be one of {self.MODES}, got {mode!r}')
        self.mode = mode

    def partner_share(self, output, captures: List[_BlockCapture], mix: Mix) -> torch.Tensor:
        """``(B,)`` partner share of the target from the last block's attention."""
        t, last = self.tracer, captures[-1]
        with torch.no_grad():
            if isinstance(t, ViTTracer) and t.model.global_pool == 'token':
                P = t.num_prefix_tokens
                share = attention_labels(last.q[:, :, :1], last.k[:, :, P:], mix.token_share_flat()[..., None],
                                         scale=t.model.blocks[-1].attn.scale, fused=self.fused)[:, 0, 0]
            else:
                state = t.propagate(captures, compact_labels(mix, t.num_prefix_tokens), {self.depth - 1},
                                    False, self.fused)
                share = t.readout(state, output)[:, 0]
        if self.mode == 'average':
            share = 0.5 * share + 0.5 * (1. - mix.lam.to(share.device))
        return share

    def forward(self, x: torch.Tensor, target: Optional[torch.Tensor] = None):
        if not self.training or target is None:
            return self.model(x)
        mix = self._check_mix(target)
        output, captures = self._capture(x)
        share = self.partner_share(output, captures, mix)
        return output, aligned_target(share, target.labels, mix, target.num_classes, target.smoothing)
