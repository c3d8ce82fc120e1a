"""What the token path leaves for TL-Align's label path, and the hooks that record it.

- :class:`LabelCapture`: one block's record (``q``/``k``, attention probabilities, mask, scale, the samples its
  token-mixing branch kept); :class:`Captures`: one per block, in the order ``layers`` indexes, and the first
  token ``grid`` (and the readout's pooling weights where a model pools by learnt weights).
- The stochastic-depth hook (:func:`hook_drop_path`: the samples a drop path kept at its first call), which
  :meth:`shared_core.tracer.Tracer.register` puts on every block of timm's and mm's tracers alike (and timm ViTs'
  shared attention pass on its own).
- Torch function modes that are active for one forward and record, while a watched module runs, its one
  ``scaled_dot_product_attention`` call (:class:`SdpaCapture`: ``q`` and ``k`` as the kernel saw them, the bias or
  mask, the scale) or its one softmax (:class:`SoftmaxCapture`: the attention probabilities of a model that computes
  them itself). The label rules then need no copy of the model's attention code: RoPE, relative position terms
  and biases are in what is recorded. timm's EVA, BEiT, MetaFormer, Hiera and Twins tracers use
  :class:`SdpaCapture`; MViTv2 and mm's softmax ViTs (EVA-02, BEiT) :class:`SoftmaxCapture`.

Framework-free.
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = [
    'hook_map_grid',
    'LabelCapture',
    'Captures',
    'check_captured',
    'kept_samples',
    'hook_drop_path',
    'SdpaCapture',
    'SoftmaxCapture',
    'sdpa_record',
]


class LabelCapture:
    """What one block's token path left for the label path (each tracer fills the fields it needs):
    ``q``/``k`` ``(B, H, T, d)`` (or the projections they are split from), ``keep`` the samples whose
    token-mixing branch ran, ``attn`` materialised attention probabilities, ``mask`` an attention mask,
    ``bias`` an additive attention bias the token path computed (a position bias), ``tokens`` the token grid or
    count the block saw, ``scale`` the attention's scale."""

    __slots__ = ('q', 'k', 'keep', 'attn', 'mask', 'bias', 'tokens', 'scale')

    def __init__(self):
        self.q = self.k = self.keep = self.attn = self.mask = self.bias = self.tokens = self.scale = None


class Captures(list):
    """One :class:`LabelCapture` per block (the blocks ``layers`` indexes, in order), and what the model's other
    parts left: ``grid``, the first token grid ``(H, W)`` (or the patch count of a model whose tokens are no grid
    when the label path starts), ``pool``, the weights of a learnt pooling the classifier reads (CCT's
    SeqPool), and ``attention``, the attention calls a whole-graph tracer reads (per watched module, in order)."""

    def __init__(self):
        super().__init__()
        self.grid = None
        self.pool = None
        self.attention = None


def check_captured(captures: List[LabelCapture], fields, why: str) -> None:
    """Refuse a forward after which a block's capture lacks a field the rule reads (``why``: the likely cause)."""
    for i, c in enumerate(captures):
        if any(getattr(c, f) is None for f in fields):
            raise ValueError(f'model: block {i} left no {"/".join(fields)} for the label path: {why}')


def kept_samples(inp: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``(B,)`` bool: the samples whose residual branch survived DropPath (it zeroes whole samples; a
    branch input that is all zero counts as kept), from a drop-path module's input and output."""
    return (out.flatten(1) != 0).any(1) | (inp.flatten(1) == 0).all(1)


def hook_drop_path(
    module: Optional[nn.Module], cap: LabelCapture, handles: list, kept: Optional[Callable] = None
) -> bool:
    """Where the drop path ``module`` (timm's or mmcv's ``DropPath``: ``drop_prob``) may drop samples in this
    forward, a hook that gives the samples its first call kept (:func:`kept_samples`; a block that calls one drop
    path for its token-mixing branch, then its MLP's, is read at the token mixing) to ``kept(keep)`` (default:
    kept as ``cap.keep``); whether it did."""
    if module is None or not (getattr(module, 'drop_prob', 0.0) > 0 and module.training):
        return False

    def hook(m, i, o, c=cap):
        if kept is not None:
            kept(kept_samples(i[0], o))
        elif c.keep is None:
            c.keep = kept_samples(i[0], o)

    handles.append(module.register_forward_hook(hook))
    return True


class _WatchingMode(TorchFunctionMode):
    """A torch function mode that records into the capture of the watched module that is running. It is active only
    while a watched module runs (entered by the module's pre-hook, left by its hook), so the rest of the forward
    pays nothing for it."""

    def __init__(self):
        super().__init__()
        self.current: Optional[LabelCapture] = None

    def watch(self, module: nn.Module, cap: LabelCapture, handles: list) -> None:
        """Record the call made while ``module`` runs into ``cap``."""
        handles.append(module.register_forward_pre_hook(lambda m, a, c=cap: self._enter(c)))
        handles.append(module.register_forward_hook(lambda m, a, o: self._leave()))

    def _enter(self, cap: LabelCapture) -> None:
        self.current = cap
        self.__enter__()

    def _leave(self) -> None:
        if self.current is not None:
            self.current = None
            self.__exit__(None, None, None)

    def start(self, handles: list) -> None:
        """Add the mode to ``handles``: its :meth:`remove` leaves it if a forward stopped inside a watched module."""
        handles.append(self)

    def remove(self) -> None:
        """Leave the mode if a watched module is still running (a hook handle's ``remove``)."""
        self._leave()


class SdpaCapture(_WatchingMode):
    """Records the ``scaled_dot_product_attention`` call of the attention module that is running into its
    :class:`LabelCapture` (``q``, ``k`` detached, ``mask`` the bias or mask, ``scale``); calls made
    while no watched module runs pass untouched. Entered by ``start``, left by ``remove`` (a handle)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and self.current is not None:
            self._record(*args, **kwargs)
        return func(*args, **kwargs)

    def _record(self, *args, **kwargs):
        cap = self.current
        if cap.q is not None:
            raise ValueError('model: an attention module called scaled_dot_product_attention twice; TL-Align reads one')
        cap.q, cap.k, cap.mask, cap.scale = sdpa_record(*args, **kwargs)


def sdpa_record(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``(q, k, mask, scale)`` of one ``scaled_dot_product_attention`` call, detached (a grouped-query call's keys
    repeated for each query head of their group; ``mask`` the bias or mask, ``None`` where none)."""
    if is_causal:
        raise ValueError('model: causal attention has no TL-Align rule')
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each key head serves a group of query heads
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    mask = attn_mask.detach() if isinstance(attn_mask, torch.Tensor) else None
    return q.detach(), k.detach(), mask, q.shape[-1] ** -0.5 if scale is None else float(scale)


_SOFTMAX = (torch.Tensor.softmax, torch.softmax, F.softmax)


class SoftmaxCapture(_WatchingMode):
    """Keeps the output of the one softmax the running attention module computes (its attention probabilities,
    before dropout) in its capture's ``attn``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.current is not None and func in _SOFTMAX:
            if self.current.attn is not None:
                raise ValueError('model: an attention module computed two softmaxes; TL-Align reads one')
            self.current.attn = out.detach()
        return out


def hook_map_grid(module: nn.Module, captures: Captures, handles: list) -> None:
    """``captures.grid``: the ``(H, W)`` of ``module``'s ``(B, C, H, W)`` output (a stem whose grid the label map
    starts on)."""
    handles.append(module.register_forward_hook(lambda m, i, o: setattr(captures, 'grid', tuple(o.shape[-2:]))))
