"""What a block's attention computed, read where the token path computes it: torch function modes that are
active for one forward and record, while a watched module runs, its one ``scaled_dot_product_attention`` call
(:class:`SdpaCapture`: ``q`` and ``k`` as the kernel saw them, the bias or mask, the scale) or its one softmax
(:class:`SoftmaxCapture`: the attention probabilities of a model that computes them itself). The label rules then
need no copy of the model's attention code: RoPE, relative position terms and biases are in what is recorded.
Framework-free: timm's tracers use both (EVA, BEiT, MetaFormer, Hiera, Twins: :class:`SdpaCapture`; MViTv2:
:class:`SoftmaxCapture`), mm's softmax ViTs (EVA-02, BEiT) :class:`SoftmaxCapture`."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .tl_align import LabelCapture

__all__ = ['SdpaCapture', 'SoftmaxCapture']


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

    def _record(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        cap = self.current
        if cap.q is not None:
            raise ValueError('model: an attention module called scaled_dot_product_attention twice; TL-Align reads one')
        if is_causal:
            raise ValueError('model: causal attention has no TL-Align rule')
        if k.shape[1] != q.shape[1]:  # grouped-query attention: each key head serves a group of query heads
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        cap.q, cap.k = q.detach(), k.detach()
        cap.mask = attn_mask.detach() if isinstance(attn_mask, torch.Tensor) else None
        cap.scale = q.shape[-1] ** -0.5 if scale is None else float(scale)


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
