"""timm-compatible mixers over the shared mixing core.

``create_mixer`` takes timm ``Mixup``'s argument names and defaults plus ``mixup_type`` and
``patch_size``, and returns a callable used exactly like timm's Mixup: ``x, target = mixer(x, y)``.

| mixup_type        | cut branch (``cutmix_alpha > 0``)   | target returned                          |
|-------------------|-------------------------------------|------------------------------------------|
| ``mixup``         | none (MixUp only)                   | ``(B, C)`` float tensor                  |
| ``cutmix``        | pixel box, timm's λ correction      | ``(B, C)`` float tensor                  |
| ``token_box``     | box on the token grid (MixToken)    | :class:`MixTarget` (carries the mix)     |
| ``tokenmix_block``| TokenMix multi-block token mask     | :class:`MixTarget`                       |
| ``tokenmix_random``| TokenMix random token mask         | :class:`MixTarget`                       |

With ``mixup_alpha > 0`` as well, every cut kind switches with a MixUp blend by ``switch_prob``,
as timm does for CutMix. A :class:`MixTarget` *is* the ``(B, C)`` soft target (a ``torch.Tensor``
subclass, so ``SoftTargetCrossEntropy`` and friends take it unchanged) and carries the
:class:`shared_core.mixing.Mix` as ``target.mix`` for methods that need where the mix happened.

``create_mixer(..., collate=True)`` gives :class:`FastCollateTokenMixup`, a subclass of timm's
``FastCollateMixup``, so timm's prefetcher and ``--mixup-off-epoch`` (``mixup_enabled``) keep working.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
from timm.data import FastCollateMixup

from shared_core.mixing import (
    MIX_KINDS, Mix, MixSampler, check_labels, check_pairwise_batch, mix_images, mix_target,
)

__all__ = ['MixTarget', 'TokenMixer', 'FastCollateTokenMixup', 'create_mixer', 'MIXUP_TYPES']

MIXUP_TYPES = MIX_KINDS
PLAIN_TARGET_KINDS = ('mixup', 'cutmix')


class MixTarget(torch.Tensor):
    """A ``(B, C)`` soft target that carries its :class:`Mix` as ``.mix``.

    Every torch operation on it returns a plain tensor (torch-function dispatch is disabled), so losses
    treat it as the target tensor; ``.to`` / ``.pin_memory`` keep the mix (timm's prefetcher moves
    targets with ``.to``), and it pickles with its mix (DataLoader workers).
    """
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def wrap(target: torch.Tensor, mix: Mix) -> 'MixTarget':
        out = target.as_subclass(MixTarget)
        out.mix = mix
        return out

    def to(self, *args, **kwargs) -> 'MixTarget':
        moved = torch.Tensor.to(self.as_subclass(torch.Tensor), *args, **kwargs)
        return MixTarget.wrap(moved, self.mix.to(moved.device))

    def pin_memory(self, *args, **kwargs) -> 'MixTarget':
        return MixTarget.wrap(torch.Tensor.pin_memory(self.as_subclass(torch.Tensor), *args, **kwargs), self.mix)

    def as_tensor(self) -> torch.Tensor:
        return self.as_subclass(torch.Tensor)


class TokenMixer:
    """Called like timm's ``Mixup``: ``x, target = mixer(x, y)``. See :func:`create_mixer`."""

    def __init__(self, mixup_type: str = 'mixup', *, mixup_alpha: float = 1., cutmix_alpha: float = 0.,
                 cutmix_minmax: Optional[Sequence[float]] = None, prob: float = 1.0, switch_prob: float = 0.5,
                 mode: str = 'batch', correct_lam: bool = True, label_smoothing: float = 0.1,
                 num_classes: int = 1000, patch_size=16, tokenmix_lam: Optional[float] = None,
                 carry_mix: Optional[bool] = None, generator: Optional[torch.Generator] = None):
        if not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f'num_classes must be an int >= 2, got {num_classes!r}')
        if not 0. <= label_smoothing < 1.:
            raise ValueError(f'label_smoothing must be in [0, 1), got {label_smoothing}')
        self.sampler = MixSampler(mixup_type, mixup_alpha=mixup_alpha, cutmix_alpha=cutmix_alpha,
                                  cutmix_minmax=cutmix_minmax, prob=prob, switch_prob=switch_prob,
                                  mode=mode, correct_lam=correct_lam, patch_size=patch_size,
                                  tokenmix_lam=tokenmix_lam)
        self.mixup_type = mixup_type
        self.label_smoothing = label_smoothing
        self.num_classes = num_classes
        self.carry_mix = mixup_type not in PLAIN_TARGET_KINDS if carry_mix is None else carry_mix
        self.generator = generator

    @property
    def mixup_enabled(self) -> bool:
        return self.sampler.mixup_enabled

    @mixup_enabled.setter
    def mixup_enabled(self, value: bool) -> None:
        self.sampler.mixup_enabled = bool(value)

    def sample(self, x: torch.Tensor, target: torch.Tensor) -> Mix:
        """Check the batch and draw its mix (without applying it)."""
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f'x: expected a (B, C, H, W) image tensor, got '
                             f'{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}')
        check_pairwise_batch(x.shape[0], 'x')
        check_labels(target, self.num_classes, 'target')
        if target.shape[0] != x.shape[0]:
            raise ValueError(f'target: {target.shape[0]} labels for a batch of {x.shape[0]} images')
        return self.sampler.sample(x.shape[0], tuple(x.shape[-2:]), self.generator, device=x.device)

    def make_target(self, target: torch.Tensor, mix: Mix) -> torch.Tensor:
        soft = mix_target(target, mix, self.num_classes, self.label_smoothing)
        return MixTarget.wrap(soft, mix) if self.carry_mix else soft

    def __call__(self, x: torch.Tensor, target: torch.Tensor):
        mix = self.sample(x, target)
        return mix_images(x, mix), self.make_target(target, mix)


class FastCollateTokenMixup(FastCollateMixup):
    """timm's ``FastCollateMixup`` contract (uint8 images in, uint8 mixed batch + soft target out),
    for every mixing kind. The prefetcher normalises afterwards; ``mixup_enabled`` is honoured.
    ``mode='half'`` (timm) mixes per element and returns the first half of the batch (plain-target kinds
    only: the partners of a half batch are not in it, so no mix can be carried)."""

    def __init__(self, mixup_type: str = 'mixup', *, mode: str = 'batch', **kwargs):
        self.half = 'half' in mode
        sampler_mode = 'elem' if self.half else mode
        self.mixer = TokenMixer(mixup_type, mode=sampler_mode, **kwargs)
        if self.half and self.mixer.carry_mix:
            raise ValueError(f"mode={mode!r} keeps only the first half of the batch, whose partners are dropped, "
                             f"so a mix cannot be carried: use mode 'batch', 'pair' or 'elem' for {mixup_type!r}")
        # timm's attributes (read by its train loop / prefetcher); mixup_enabled is ours (property)
        super().__init__(mixup_alpha=self.mixer.sampler.mixup_alpha, cutmix_alpha=self.mixer.sampler.cutmix_alpha,
                         cutmix_minmax=self.mixer.sampler.cutmix_minmax, prob=self.mixer.sampler.mix_prob,
                         switch_prob=self.mixer.sampler.switch_prob, mode=mode,
                         correct_lam=self.mixer.sampler.correct_lam, label_smoothing=self.mixer.label_smoothing,
                         num_classes=self.mixer.num_classes)

    @property
    def mixup_enabled(self) -> bool:
        return self.mixer.mixup_enabled

    @mixup_enabled.setter
    def mixup_enabled(self, value: bool) -> None:
        # timm's Mixup.__init__ assigns this before self.mixer may exist
        if 'mixer' in self.__dict__:
            self.mixer.mixup_enabled = value

    def __call__(self, batch, _=None):
        images = [b[0] for b in batch]
        x = torch.from_numpy(np.stack(images)) if isinstance(images[0], np.ndarray) else torch.stack(images)
        if x.dtype != torch.uint8:
            raise ValueError(f'batch: fast collate expects uint8 images (timm ToNumpy/MaybeToTensor '
                             f'without normalisation), got {x.dtype}')
        target = torch.as_tensor([int(b[1]) for b in batch], dtype=torch.long)
        x, soft = self.mixer(x, target)
        if self.half:
            n = x.shape[0] // 2
            x, soft = x[:n], soft[:n]
        return x, soft


def create_mixer(mixup_type: str = 'mixup', *, mixup_alpha: float = 1., cutmix_alpha: float = 0.,
                 cutmix_minmax: Optional[Sequence[float]] = None, prob: float = 1.0, switch_prob: float = 0.5,
                 mode: str = 'batch', correct_lam: bool = True, label_smoothing: float = 0.1,
                 num_classes: int = 1000, patch_size=16, tokenmix_lam: Optional[float] = None,
                 collate: bool = False, generator: Optional[torch.Generator] = None):
    """A mixer with timm ``Mixup``'s arguments and defaults (see the module docstring for the kinds).

    Args:
        mixup_type: one of :data:`MIXUP_TYPES`.
        mixup_alpha, cutmix_alpha, cutmix_minmax, prob, switch_prob, mode, correct_lam,
        label_smoothing, num_classes: as in ``timm.data.Mixup``.
        patch_size: the model's patch size (int or (h, w)); images must be divisible by it.
        tokenmix_lam: fix λ of the token-mask kinds (TokenMix uses 0.5) instead of Beta(cutmix_alpha).
        collate: return a :class:`FastCollateTokenMixup` (for timm's prefetcher loader).
        generator: a ``torch.Generator`` for reproducible mixing (default: torch's global RNG).
    """
    if mixup_type not in MIXUP_TYPES:
        raise ValueError(f'mixup_type must be one of {MIXUP_TYPES}, got {mixup_type!r}')
    kwargs = dict(mixup_alpha=mixup_alpha, cutmix_alpha=cutmix_alpha, cutmix_minmax=cutmix_minmax, prob=prob,
                  switch_prob=switch_prob, correct_lam=correct_lam, label_smoothing=label_smoothing,
                  num_classes=num_classes, patch_size=patch_size, tokenmix_lam=tokenmix_lam, generator=generator)
    if collate:
        return FastCollateTokenMixup(mixup_type, mode=mode, **kwargs)
    if 'half' in mode:
        raise ValueError(f"mode={mode!r} exists only for the collate mixer (collate=True)")
    return TokenMixer(mixup_type, mode=mode, **kwargs)
