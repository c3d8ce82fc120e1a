"""Targets that carry side data through timm's data path (DataLoader workers, ``pin_memory``, the
prefetcher's ``.to(device, non_blocking=True)``) to the training step: the mixing methods' :class:`MixTarget`
(a soft target carrying its :class:`~shared_core.mix.Mix`) and token labeling's label-map targets."""

from __future__ import annotations

import copy

import torch

from shared_core.mix import Mix

__all__ = ['CarrierTensor', 'MixTarget']


class CarrierTensor(torch.Tensor):
    """A tensor that carries side data to where the training step needs it (targets travel through
    DataLoader workers, ``pin_memory`` and timm's prefetcher, which calls ``.to(device, non_blocking=True)``).

    Every torch operation on it returns a plain tensor (torch-function dispatch is disabled), so losses
    treat it as the tensor it wraps. The names in ``_carried`` are kept by ``.to`` / ``.pin_memory`` /
    ``deepcopy`` (values with those methods are moved along: tensors, :class:`Mix`) and by pickling.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl
    _carried: tuple = ()

    @classmethod
    def _wrap(cls, data: torch.Tensor, carried: dict):
        out = data.as_subclass(cls)
        for name in cls._carried:
            setattr(out, name, carried[name])
        return out

    def carried(self) -> dict:
        return {name: getattr(self, name) for name in self._carried}

    def as_tensor(self) -> torch.Tensor:
        return self.as_subclass(torch.Tensor)

    def to(self, *args, **kwargs):
        moved = self.as_tensor().to(*args, **kwargs)
        nb = kwargs.get('non_blocking', False)
        return self._wrap(
            moved,
            {k: v.to(moved.device, non_blocking=nb) if hasattr(v, 'to') else v for k, v in self.carried().items()},
        )

    def pin_memory(self, *args, **kwargs):
        return self._wrap(
            self.as_tensor().pin_memory(*args, **kwargs),
            {k: v.pin_memory() if hasattr(v, 'pin_memory') else v for k, v in self.carried().items()},
        )

    def __deepcopy__(self, memo):
        return self._wrap(copy.deepcopy(self.as_tensor(), memo), copy.deepcopy(self.carried(), memo))


class MixTarget(CarrierTensor):
    """A ``(B, C)`` soft target that carries its :class:`Mix` as ``.mix``, and what it was made from:
    the class indices ``.labels``, ``.num_classes`` and ``.smoothing`` (methods that re-weight the
    two source labels, such as TL-Align, rebuild the target from them). See :class:`CarrierTensor`.
    """

    _carried = ('mix', 'labels', 'num_classes', 'smoothing')

    @staticmethod
    def wrap(target: torch.Tensor, mix: Mix, labels: torch.Tensor, num_classes: int, smoothing: float) -> 'MixTarget':
        return MixTarget._wrap(target, dict(mix=mix, labels=labels, num_classes=num_classes, smoothing=smoothing))
