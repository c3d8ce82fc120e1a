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

import copy
from typing import Optional, Sequence

import numpy as np
import torch
from timm.data import FastCollateMixup

from shared_core.mixing import MIX_KINDS, Mix, MixSampler, check_pairwise_batch, mix_images, mix_target
from shared_core.tokenmix import ACTIVATION_TARGETS, activation_target

__all__ = ['CarrierTensor', 'MixTarget', 'TokenMixer', 'FastCollateTokenMixup', 'create_mixer', 'MIXUP_TYPES', 'METHOD_TYPES']

MIXUP_TYPES = MIX_KINDS
#: methods that re-weight the target of a mixing kind (``method_mix``); their mixers carry the mix
METHOD_TYPES = ('tl_align', 'transmix')
PLAIN_TARGET_KINDS = ('mixup', 'cutmix')


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
        return self._wrap(moved, {k: v.to(moved.device, non_blocking=nb) if hasattr(v, 'to') else v
                                  for k, v in self.carried().items()})

    def pin_memory(self, *args, **kwargs):
        return self._wrap(self.as_tensor().pin_memory(*args, **kwargs),
                          {k: v.pin_memory() if hasattr(v, 'pin_memory') else v for k, v in self.carried().items()})

    def __deepcopy__(self, memo):
        return self._wrap(copy.deepcopy(self.as_tensor(), memo), copy.deepcopy(self.carried(), memo))


class MixTarget(CarrierTensor):
    """A ``(B, C)`` soft target that carries its :class:`Mix` as ``.mix``, and what it was made from:
    the class indices ``.labels``, ``.num_classes`` and ``.smoothing`` (methods that re-weight the
    two source labels, such as TL-Align, rebuild the target from them). See :class:`CarrierTensor`.
    """
    _carried = ('mix', 'labels', 'num_classes', 'smoothing')

    @staticmethod
    def wrap(target: torch.Tensor, mix: Mix, labels: torch.Tensor, num_classes: int,
             smoothing: float) -> 'MixTarget':
        return MixTarget._wrap(target, dict(mix=mix, labels=labels, num_classes=num_classes, smoothing=smoothing))


#: timm ``Mixup`` attributes a training loop may read or schedule
TIMM_ATTRIBUTES = ('mixup_alpha', 'cutmix_alpha', 'cutmix_minmax', 'mix_prob', 'switch_prob', 'correct_lam',
                   'mixup_enabled')


def _forwarding(owner: str, names):
    """Class decorator: each of ``names`` becomes a property reading/writing ``self.<owner>.<name>``, so
    timm's Mixup attributes stay live views of where the state really is."""
    def prop(name):
        def get(self):
            return getattr(getattr(self, owner), name)

        def set(self, value):
            setattr(getattr(self, owner), name, value)
        return property(get, set, doc=f'timm ``Mixup.{name}``, kept on ``{owner}``')

    def decorate(cls):
        for name in names:
            setattr(cls, name, prop(name))
        return cls
    return decorate


@_forwarding('sampler', TIMM_ATTRIBUTES)
class TokenMixer:
    """Called like timm's ``Mixup``: ``x, target = mixer(x, y)``. See :func:`create_mixer`.

    timm's attributes (:data:`TIMM_ATTRIBUTES`) are live views of the sampler, so a training loop that
    schedules them (or switches mixing off) works as with timm.
    """

    def __init__(self, mixup_type: str = 'mixup', *, mixup_alpha: float = 1., cutmix_alpha: float = 0.,
                 cutmix_minmax: Optional[Sequence[float]] = None, prob: float = 1.0, switch_prob: float = 0.5,
                 mode: str = 'batch', correct_lam: bool = True, label_smoothing: float = 0.1,
                 num_classes: int = 1000, patch_size=16, tokenmix_lam: Optional[float] = None,
                 tokenmix_min_tokens: Optional[int] = None, carry_mix: Optional[bool] = None,
                 activation_targets: Optional[str] = None, generator: Optional[torch.Generator] = None):
        if not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f'num_classes must be an int >= 2, got {num_classes!r}')
        if not 0. <= label_smoothing < 1.:
            raise ValueError(f'label_smoothing must be in [0, 1), got {label_smoothing}')
        self.sampler = MixSampler(mixup_type, mixup_alpha=mixup_alpha, cutmix_alpha=cutmix_alpha,
                                  cutmix_minmax=cutmix_minmax, prob=prob, switch_prob=switch_prob,
                                  mode=mode, correct_lam=correct_lam, patch_size=patch_size,
                                  tokenmix_lam=tokenmix_lam, tokenmix_min_tokens=tokenmix_min_tokens)
        self.mixup_type = mixup_type
        self.mode = mode
        self.label_smoothing = label_smoothing
        self.num_classes = num_classes
        self.carry_mix = mixup_type not in PLAIN_TARGET_KINDS if carry_mix is None else carry_mix
        if activation_targets is not None and activation_targets not in ACTIVATION_TARGETS:
            raise ValueError(f'activation_targets: expected one of {ACTIVATION_TARGETS} or None, '
                             f'got {activation_targets!r}')
        self.activation_targets = activation_targets
        self.generator = generator

    def sample(self, x: torch.Tensor, target: torch.Tensor, name: str = 'x') -> Mix:
        """Check the batch and draw its mix (on the CPU, without applying it)."""
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f'{name}: expected a (B, C, H, W) image tensor, got '
                             f'{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}')
        check_pairwise_batch(x.shape[0], name)
        if target.shape[0] != x.shape[0]:
            raise ValueError(f'target: {target.shape[0]} labels for a batch of {x.shape[0]} images')
        return self.sampler.sample(x.shape[0], tuple(x.shape[-2:]), self.generator)

    def make_target(self, target: torch.Tensor, mix: Mix) -> torch.Tensor:
        """The area target (checks the labels), or with ``activation_targets`` TokenMix's target from the
        teacher maps the target carries (:func:`shared_core.tokenmix.activation_target`); a
        :class:`MixTarget` carrying the mix on the target's device for the token-aware kinds."""
        if self.activation_targets is not None:
            if not all(hasattr(target, a) for a in ('values', 'indices', 'boxes', 'flips')):
                raise ValueError('target: activation-map targets need the teacher maps with each label (a '
                                 'TokenLabelTarget from timm_plugin.token_labeling.TokenLabelCollate)')
            labels = target.as_tensor()
            soft = activation_target(labels, mix, target.values, target.indices, target.boxes, target.flips,
                                     self.num_classes, self.label_smoothing, self.activation_targets)
            target = labels
        else:
            soft = mix_target(target, mix, self.num_classes, self.label_smoothing)
        if not self.carry_mix:
            return soft
        return MixTarget.wrap(soft, mix.to(soft.device, non_blocking=True), target.to(soft.device),
                              self.num_classes, self.label_smoothing)

    def __call__(self, x: torch.Tensor, target: torch.Tensor, name: str = 'x'):
        mix = self.sample(x, target, name)
        target = self.make_target(target, mix)
        return mix_images(x, mix), target


@_forwarding('mixer', TIMM_ATTRIBUTES + ('label_smoothing', 'num_classes'))
class FastCollateTokenMixup(FastCollateMixup):
    """timm's ``FastCollateMixup`` contract (uint8 images in, uint8 mixed batch + soft target out),
    for every mixing kind. The prefetcher normalises afterwards; ``mixup_enabled`` and timm's other
    attributes are live views of the inner :class:`TokenMixer`. ``mode='half'`` (timm) mixes per
    element and returns the first half of the batch (plain-target kinds only: the partners of a half
    batch are not in it, so no mix can be carried)."""

    def __init__(self, mixup_type: str = 'mixup', *, mode: str = 'batch', **kwargs):
        self.half = 'half' in mode
        self.mixer = TokenMixer(mixup_type, mode='elem' if self.half else mode, **kwargs)
        if self.half and self.mixer.carry_mix:
            raise ValueError(f"mode={mode!r} keeps only the first half of the batch, whose partners are dropped, "
                             f"so a mix cannot be carried: use mode 'batch', 'pair' or 'elem' for {mixup_type!r}")
        m = self.mixer
        # timm's constructor assigns its attributes; they land on the mixer through the properties above
        super().__init__(mixup_alpha=m.mixup_alpha, cutmix_alpha=m.cutmix_alpha, cutmix_minmax=m.cutmix_minmax,
                         prob=m.mix_prob, switch_prob=m.switch_prob, mode=mode, correct_lam=m.correct_lam,
                         label_smoothing=m.label_smoothing, num_classes=m.num_classes)

    def __call__(self, batch, _=None):
        check_pairwise_batch(len(batch), 'batch')
        images = [b[0] for b in batch]
        x = torch.from_numpy(np.stack(images)) if isinstance(images[0], np.ndarray) else torch.stack(images)
        if x.dtype != torch.uint8:
            raise ValueError(f'batch: fast collate expects uint8 images (timm ToNumpy/MaybeToTensor '
                             f'without normalisation), got {x.dtype}')
        target = torch.as_tensor([int(b[1]) for b in batch], dtype=torch.long)
        x, soft = self.mixer(x, target, name='batch')
        if self.half:
            n = x.shape[0] // 2
            x, soft = x[:n], soft[:n]
        return x, soft


def create_mixer(mixup_type: str = 'mixup', *, mixup_alpha: float = 1., cutmix_alpha: float = 0.,
                 cutmix_minmax: Optional[Sequence[float]] = None, prob: float = 1.0, switch_prob: float = 0.5,
                 mode: str = 'batch', correct_lam: bool = True, label_smoothing: float = 0.1,
                 num_classes: int = 1000, patch_size=16, tokenmix_lam: Optional[float] = None,
                 tokenmix_min_tokens: Optional[int] = None, carry_mix: Optional[bool] = None,
                 method_mix: str = 'cutmix', collate: bool = False, activation_targets: Optional[str] = None,
                 generator: Optional[torch.Generator] = None):
    """A mixer with timm ``Mixup``'s arguments and defaults (see the module docstring for the kinds).

    Args:
        mixup_type: one of :data:`MIXUP_TYPES`, or a method of :data:`METHOD_TYPES` (``'tl_align'``,
            ``'transmix'``): the mixer of ``method_mix`` with ``carry_mix=True``, whose targets
            :class:`timm_plugin.TLAlign` / ``TransMix`` re-weight.
        mixup_alpha, cutmix_alpha, cutmix_minmax, prob, switch_prob, mode, correct_lam,
        label_smoothing, num_classes: as in ``timm.data.Mixup``.
        patch_size: the model's patch size (int or (h, w)); token kinds need images divisible by it.
        tokenmix_lam: fix λ of the TokenMix kinds (TokenMix uses 0.5) instead of Beta(cutmix_alpha).
        tokenmix_min_tokens: smallest block of ``tokenmix_block`` (default 14 on a 14x14 grid, scaled).
        carry_mix: return a :class:`MixTarget` (default: for the token kinds only); TL-Align needs it with
            ``mixup``/``cutmix`` too.
        method_mix: the mixing kind under a method (tl-align.md Table 7: ``'cutmix'`` with
            ``mixup_alpha > 0`` is the MixUp/CutMix switch, ``'mixup'``, ``'tokenmix_random'``,
            ``'tokenmix_block'``).
        collate: return a :class:`FastCollateTokenMixup` (for timm's prefetcher loader).
        activation_targets: TokenMix's targets from a teacher's activation maps (``'true_class'``, the
            paper / public code, or ``'distribution'``, our extension; :mod:`shared_core.tokenmix`): the
            mixer is then called with the :class:`~timm_plugin.token_labeling.TokenLabelTarget` of
            ``TokenLabelCollate`` (the maps follow each crop and flip); not with ``collate=True``.
        generator: a ``torch.Generator`` for reproducible mixing (default: torch's global RNG).
    """
    if mixup_type in METHOD_TYPES:
        if method_mix not in MIXUP_TYPES:
            raise ValueError(f'method_mix must be one of {MIXUP_TYPES} for mixup_type={mixup_type!r}, '
                             f'got {method_mix!r}')
        if method_mix != 'mixup' and cutmix_alpha <= 0 and cutmix_minmax is None and tokenmix_lam is None:
            raise ValueError(f"cutmix_alpha: {mixup_type} over {method_mix!r} needs cutmix_alpha > 0; without a cut "
                             f"branch every token has the same share and the target is the area target")
        mixup_type, carry_mix = method_mix, True
    kwargs = dict(mixup_alpha=mixup_alpha, cutmix_alpha=cutmix_alpha, cutmix_minmax=cutmix_minmax, prob=prob,
                  switch_prob=switch_prob, correct_lam=correct_lam, label_smoothing=label_smoothing,
                  num_classes=num_classes, patch_size=patch_size, tokenmix_lam=tokenmix_lam,
                  tokenmix_min_tokens=tokenmix_min_tokens, carry_mix=carry_mix, generator=generator)
    if activation_targets is not None:
        if collate:
            raise ValueError('activation_targets: mix on the device (collate=False), after TokenLabelCollate')
        kwargs['activation_targets'] = activation_targets
    if collate:
        return FastCollateTokenMixup(mixup_type, mode=mode, **kwargs)
    if 'half' in mode:
        raise ValueError(f"mode={mode!r} exists only for the collate mixer (collate=True)")
    return TokenMixer(mixup_type, mode=mode, **kwargs)
