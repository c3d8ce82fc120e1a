"""TokenMixup (the TokenMixup paper) on timm ViTs: Horizontal (HTM) and Vertical (VTM) TokenMixup as hooks.

``tm = TokenMixup(model, htm_layers=(3,), vtm_layers=(4,), ...)``; in training ``logits, target = tm(x, target)``
gives the model's logits in input row order and the relabelled soft target, a :class:`TokenMixupTarget` that
also carries the ScoreNet loss (``target.aux_loss``, with gradient) and statistics (``target.stats``). Without a
target it is exactly ``model(x)``; in eval with one, ``model(x)`` and the target unchanged.
:class:`timm_plugin.tasks.TokenMixupTask` is the same as a timm training task. The maths and the hook driver
(:class:`~shared_core.tokenmixup.TokenMixupHooks`) are :mod:`shared_core.tokenmixup`; this module is timm's adapter
(blocks, attention, VTM's attention call).

- **HTM at block L** (a forward pre-hook on ``model.blocks[L]``): the ScoreNet (``model.tokenmixup_scorenet``,
  one per HTM layer, so optimizer, EMA and checkpoints hold it) reads the block's input ``x``; a sample is easy
  when ``0.1 · CE(scores.detach(), y) ≤ τ``. The saliency is block L's own attention on the pre-mix ``x``
  (``norm1`` → ``qkv`` → ``q_norm``/``k_norm`` → softmax of ``q kᵀ · scale``; head mean, fp32, no grad, before
  dropout). The plan (:func:`~shared_core.tokenmixup.htm_plan`) swaps patch tokens in place (prefix tokens never),
  partner tokens from the pre-mix batch, and the target is relabelled (Eq. 11).
- **VTM at block L**: from every block ``l < L``, the κ most salient tokens of block ``l``'s input (its own
  attention, captured by hooks on ``q_norm``/``k_norm``; gathered at ``P + index``, the prefix accounted for)
  become extra keys and values of block L's attention: queries from the block's tokens, keys/values from its
  tokens and the memory, both through block L's own ``norm1`` and weights (an instance-level ``forward`` of
  ``blk.attn`` for the call, then removed: the state dict is unchanged). Not applied in eval. HTM before VTM keeps
  every memory row the sample's own (rows are never reordered).

Supported: timm ``VisionTransformer`` / DeiT (``Block`` + ``Attention``) and the CCT models of
:mod:`timm_plugin.cct`. No module-level state: everything a forward needs lives in that call.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import Attention
from timm.models.vision_transformer import Block, VisionTransformer

from shared_core.compiling import guard_module_hooks
from shared_core.mix import one_hot
from shared_core.tokenmixup import DIFFICULTY_SCALE, SCORENETS, ScoreNet, TokenMixupHooks, check_tau, scorenets

from .carrier import CarrierTensor

__all__ = ['TokenMixup', 'TokenMixupTarget', 'ScoreNet', 'SCORENETS', 'attach_scorenets', 'TimmTokenMixupAdapter']


class TokenMixupTarget(CarrierTensor):
    """The relabelled ``(B, C)`` soft target of a TokenMixup step (a tensor: losses take it unchanged), carrying
    ``.aux_loss`` (the ScoreNet loss, a scalar with gradient; 0 without HTM), ``.stats`` (per HTM layer: easy
    samples, mixed samples, mean swapped tokens per mixed sample) and ``.mixes`` (the HTM plans as ``Mix`` es)."""

    _carried = ('aux_loss', 'stats', 'mixes')


def _check_model(model: nn.Module) -> None:
    from .cct import CCT  # CCT's blocks are timm Blocks too

    if not isinstance(model, (VisionTransformer, CCT)):
        raise ValueError(
            f'model: TokenMixup supports timm VisionTransformer/DeiT and tokenaug CCT models, got '
            f'{type(model).__module__}.{type(model).__name__}'
        )
    bad = [i for i, b in enumerate(model.blocks) if not isinstance(b, Block) or type(b.attn) is not Attention]
    if bad:
        raise ValueError(f'model: TokenMixup hooks timm Block/Attention blocks; blocks {bad} are not')
    if getattr(getattr(model, 'patch_drop', None), 'prob', 0.0) > 0:
        raise ValueError('model: patch dropout changes the token set; TokenMixup does not support it')
    if getattr(model, 'grad_checkpointing', False):
        raise ValueError('model: gradient checkpointing would run the TokenMixup hooks twice; switch it off')


def _has_class_token(model: nn.Module) -> bool:
    return int(getattr(model, 'num_prefix_tokens', 0)) >= 1 and getattr(model, 'cls_token', None) is not None


def attach_scorenets(model: nn.Module, layers: Sequence[int], scorenet: str = 'auto') -> nn.ModuleDict:
    """``model.tokenmixup_scorenet``: one ScoreNet per HTM block (kept where present), part of the model so the
    optimizer, EMA and checkpoints hold it (``tokenaug-convert`` drops it for transfer). Call it before building
    the optimizer (``TokenMixup`` calls it too, keeping what is there). ``scorenet='auto'``: ``'cls'`` with a class
    token, else ``'attn_pool'``."""
    dim = model.embed_dim if hasattr(model, 'embed_dim') else model.num_features
    P = int(getattr(model, 'num_prefix_tokens', 0))
    return scorenets(model, layers, dim, model.num_classes, P, _has_class_token(model), scorenet)


def block_qk(blk: Block, x: torch.Tensor):
    """The ``q``, ``k`` ``(B, H, T, d)`` of ``blk``'s attention on its input ``x`` (``norm1``, ``qkv``,
    ``q_norm``/``k_norm``; no grad, autocast off)."""
    a = blk.attn
    with torch.no_grad(), torch.autocast(device_type=x.device.type, enabled=False):
        h = blk.norm1(x.detach().to(a.qkv.weight.dtype))
        B, T, _ = h.shape
        q, k, _ = a.qkv(h).reshape(B, T, 3, a.num_heads, a.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        return a.q_norm(q), a.k_norm(k)


def _attention_with_memory(a: Attention, memory: torch.Tensor, norm: nn.Module):
    """Block L's attention with the memory as extra keys and values, through its own weights (Eq. 13)."""

    def forward(x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, **kwargs) -> torch.Tensor:
        if attn_mask is not None or kwargs.get('is_causal'):
            raise ValueError('x: VTM does not support attention masks')
        B, N, _ = x.shape
        kv_in = torch.cat([x, norm(memory)], 1)
        qkv = a.qkv(kv_in).reshape(B, kv_in.shape[1], 3, a.num_heads, a.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = a.q_norm(q[:, :, :N]), a.k_norm(k)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=a.attn_drop.p if a.training else 0.0)
        out = a.norm(out.transpose(1, 2).reshape(B, N, a.attn_dim))
        if a.gate is not None:
            out = out * a.gate(x).sigmoid()
        return a.proj_drop(a.proj(out))

    return forward


class TimmTokenMixupAdapter:
    """timm's side of :class:`~shared_core.tokenmixup.TokenMixupHooks`: ``Block`` / ``Attention`` of a ViT or CCT."""

    def __init__(self, model: nn.Module):
        _check_model(model)
        self.model = model
        self.blocks = list(model.blocks)
        self.num_prefix_tokens = int(getattr(model, 'num_prefix_tokens', 0))
        self.has_class_token = _has_class_token(model)
        self.embed_dims = int(getattr(model, 'embed_dim', None) or model.num_features)

    def qk(self, idx: int, x: torch.Tensor):
        return block_qk(self.blocks[idx], x)

    def capture_qk(self, idx: int, sink: dict) -> list:
        a = self.blocks[idx].attn
        return [
            a.q_norm.register_forward_hook(lambda m, i, o: sink.__setitem__('q', o.detach())),
            a.k_norm.register_forward_hook(lambda m, i, o: sink.__setitem__('k', o.detach())),
        ]

    def scale(self, idx: int) -> float:
        return self.blocks[idx].attn.scale

    def attend_with_memory(self, idx: int, memory: torch.Tensor):
        blk = self.blocks[idx]
        blk.attn.forward = _attention_with_memory(blk.attn, memory, blk.norm1)  # this instance, this call
        return lambda: blk.attn.__dict__.pop('forward', None)


class TokenMixup(nn.Module):
    """TokenMixup around a timm ViT (see the module docstring).

    Args:
        model: timm ``VisionTransformer`` / DeiT or a tokenaug CCT.
        htm_layers: blocks whose input HTM mixes (0-based; the public recipes: CCT 2, ViT-B 3).
        vtm_layers: blocks whose attention also attends to the earlier blocks' salient tokens.
        rho: ρ, the saliency margin of a swapped token (Eq. 9).
        tau: τ, a sample is easy when ``difficulty_scale · CE ≤ τ``.
        kappa: κ, salient tokens taken from each earlier block for VTM.
        saliency: ``'cls'`` (class-token row, the public ViT code), ``'mean'`` (Eq. 3, the public CCT code) or
            ``'auto'`` (``'cls'`` with a class token).
        scorenet: ``'cls'``, ``'attn_pool'``, ``'avg'`` or ``'auto'`` (``'cls'`` with a class token, else
            ``'attn_pool'``).
        scorenet_weight: λ_s of the ScoreNet loss ``λ_s · CE(scores, y)`` (in ``target.aux_loss``).
        scorenet_stopgrad: the ScoreNet reads the tokens detached (the public ViT recipe).
        vtm_stopgrad: the memory tokens are detached (off in every public run).
        difficulty_scale: the public code's 0.1.
        vtm_memory: how VTM picks the memory tokens of an HTM block: ``'mixed'`` (default) by the block's attention
            on its mixed input; ``'public'``: by HTM's pre-mix saliency, gathered from the mixed input (the public
            code).
        smoothing: label smoothing of the one-hot target made from class indices (a soft target, e.g. from a
            MixUp/CutMix mixer, is taken as it is).
    """

    def __init__(
        self,
        model: nn.Module,
        htm_layers: Sequence[int] = (),
        vtm_layers: Sequence[int] = (),
        rho: float = 0.005,
        tau: float = 0.2,
        kappa: int = 3,
        saliency: str = 'auto',
        scorenet: str = 'auto',
        scorenet_weight: float = 1e-3,
        scorenet_stopgrad: bool = False,
        vtm_stopgrad: bool = False,
        difficulty_scale: float = DIFFICULTY_SCALE,
        smoothing: float = 0.0,
        vtm_memory: str = 'mixed',
    ):
        guard_module_hooks()  # per-call hooks under torch.compile
        super().__init__()
        adapter = TimmTokenMixupAdapter(model)
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f'smoothing: expected [0, 1), got {smoothing}')
        saliency = ('cls' if adapter.has_class_token else 'mean') if saliency == 'auto' else saliency
        self.hooks = TokenMixupHooks(
            adapter,
            None,
            htm_layers,
            vtm_layers,
            rho,
            tau,
            kappa,
            saliency,
            scorenet_weight,
            scorenet_stopgrad,
            vtm_stopgrad,
            difficulty_scale,
            vtm_memory,
        )
        self.model, self.smoothing = model, float(smoothing)
        if self.hooks.htm_layers:
            self.hooks.nets = attach_scorenets(model, self.hooks.htm_layers, scorenet)

    @property
    def tau(self) -> float:
        """τ of the difficulty threshold (settable, e.g. for a schedule)."""
        return self.hooks.tau

    @tau.setter
    def tau(self, value: float) -> None:
        self.hooks.tau = check_tau(value)

    def forward(self, x: torch.Tensor, target: Optional[torch.Tensor] = None, forward=None):
        """``model(x)`` without a target; with one, ``(logits, TokenMixupTarget)`` in train and eval mode alike (in
        eval: the plain model's logits and the target as it came, no ScoreNet loss), so that ``logits, target =
        tm(x, y)`` never unpacks the rows of a 2-sample batch."""
        if target is None:
            return self.model(x)
        if not self.training:
            y = self._soft_target(target).to(x.device)
            zero = torch.zeros((), device=x.device)
            return self.model(x), TokenMixupTarget._wrap(y, dict(aux_loss=zero, stats={}, mixes=[]))
        return self.mix_forward(x, target, forward)

    def _soft_target(self, target: torch.Tensor) -> torch.Tensor:
        t = target.as_subclass(torch.Tensor) if isinstance(target, torch.Tensor) else torch.as_tensor(target)
        C = self.model.num_classes
        if t.dim() == 1:
            return one_hot(t.long(), C, self.smoothing)
        if t.dim() != 2 or t.shape[1] != C:
            raise ValueError(f'target: expected class indices (B,) or a soft target (B, {C}), got {tuple(t.shape)}')
        return t.float()

    def mix_forward(self, x: torch.Tensor, target: torch.Tensor, forward=None):
        """``(logits, TokenMixupTarget)``; ``forward()`` (default ``self.model(x)``; a task passes its DDP-wrapped
        module) runs the token path while the hooks act."""
        y = self._soft_target(target).to(x.device)
        logits, y, aux, stats, mixes = self.hooks.run(y, forward or (lambda: self.model(x)))
        return logits, TokenMixupTarget._wrap(y, dict(aux_loss=aux, stats=stats, mixes=mixes))
