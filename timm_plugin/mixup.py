"""timm-compatible mixers over the shared mixing core.

``create_mixer`` takes timm ``Mixup``'s argument names and defaults plus ``mix_kind`` (what the sampler
draws), ``method`` (what will re-weight the target: ``'tl_align'``, ``'transmix'``) and ``patch_size``, and
returns a callable used exactly like timm's Mixup: ``x, target = mixer(x, y)``.

The kinds:

====================== ===================================== ======================================
``mix_kind``           cut branch (``cutmix_alpha > 0``)     target returned
====================== ===================================== ======================================
``mixup``              none (MixUp only)                     ``(B, C)`` float tensor
``cutmix``             pixel box, timm's λ correction        ``(B, C)`` float tensor
``token_box``          box on the token grid (MixToken)      :class:`MixTarget` (carries the mix)
``tokenmix_block``     TokenMix multi-block token mask       :class:`MixTarget`
``tokenmix_random``    TokenMix random token mask            :class:`MixTarget`
====================== ===================================== ======================================

With ``mixup_alpha > 0`` as well, every cut kind switches with a MixUp blend by ``switch_prob``,
as timm does for CutMix. A :class:`MixTarget` *is* the ``(B, C)`` soft target (a ``torch.Tensor``
subclass, so ``SoftTargetCrossEntropy`` and friends take it unchanged) and carries the
:class:`shared_core.mix.Mix` as ``target.mix`` for methods that need where the mix happened.

``create_mixer(..., collate=True)`` gives :class:`FastCollateTokenMixup`, a subclass of timm's
``FastCollateMixup``, so timm's prefetcher and ``--mixup-off-epoch`` (``mixup_enabled``) keep working.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import numpy as np
import torch
from timm.data import FastCollateMixup

from shared_core.checks import check_real
from shared_core.mix import (
    Mix,
    check_image_batch,
    check_pairwise_batch,
    mix_images,
    mix_images_reversed,
    mix_target,
    multi_label_target,
    pair_target,
)
from shared_core.options import TARGET_METHODS
from shared_core.samplers import MIX_KINDS, MODES, MixSampler
from shared_core.tokenmix import ACTIVATION_TARGETS, activation_target

from .carrier import MixTarget

__all__ = [
    'TokenAwareMixup',
    'FastCollateTokenMixup',
    'create_mixer',
    'MIX_KINDS',
    'TARGET_METHODS',
]

PLAIN_TARGET_KINDS = ('mixup', 'cutmix')


#: timm ``Mixup``'s constructor parameters in their positional order
TIMM_POSITIONAL = (
    'mixup_alpha',
    'cutmix_alpha',
    'cutmix_minmax',
    'prob',
    'switch_prob',
    'mode',
    'correct_lam',
    'label_smoothing',
    'num_classes',
    'multi_label',
)


def timm_positional(lead: int):
    """Let a mixer constructor take timm ``Mixup``'s positional arguments as well as its keywords: after the
    ``lead`` leading arguments (``self`` of a method) and an optional mixing kind (a string or ``None``), positional
    values fill :data:`TIMM_POSITIONAL` in order, so ``create_mixer(0.8, 1.0)`` is ``Mixup(0.8, 1.0)`` and
    ``create_mixer('token_box', 0.8, 1.0)`` the same over token boxes. A value given both ways, or more values
    than timm takes, is a ``TypeError``, as Python's own."""

    def wrap(func):
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            head, rest = args[:lead], list(args[lead:])
            kind = (
                rest.pop(0) if rest and (rest[0] is None or isinstance(rest[0], str)) else kwargs.pop('mix_kind', None)
            )
            if len(rest) > len(TIMM_POSITIONAL):
                raise TypeError(
                    f'{func.__qualname__}: at most {len(TIMM_POSITIONAL)} positional arguments after the mixing kind '
                    f"(timm Mixup's {', '.join(TIMM_POSITIONAL)}), got {len(rest)}"
                )
            for name, value in zip(TIMM_POSITIONAL, rest):
                if name in kwargs:
                    raise TypeError(f'{func.__qualname__}: got multiple values for argument {name!r}')
                kwargs[name] = value
            return func(*head, kind, **kwargs)

        return wrapper

    return wrap


#: timm ``Mixup`` attributes a training loop may read or schedule
TIMM_ATTRIBUTES = (
    'mixup_alpha',
    'cutmix_alpha',
    'cutmix_minmax',
    'mix_prob',
    'switch_prob',
    'correct_lam',
    'mixup_enabled',
)


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
class TokenAwareMixup:
    """timm's ``Mixup`` for every mixing kind: ``x, target = mixer(x, y)``. See :func:`create_mixer` for the
    arguments (timm ``Mixup``'s, plus ``mix_kind``, ``patch_size``, TokenMix's and the carried mix).

    timm's attributes (:data:`TIMM_ATTRIBUTES`) are live views of the sampler, so a training loop that
    schedules them (or switches mixing off) works as with timm.
    """

    @timm_positional(lead=1)
    def __init__(
        self,
        mix_kind: Optional[str] = None,
        *,
        mixup_alpha: float = 1.0,
        cutmix_alpha: float = 0.0,
        cutmix_minmax: Optional[Sequence[float]] = None,
        prob: float = 1.0,
        switch_prob: float = 0.5,
        mode: str = 'batch',
        correct_lam: bool = True,
        label_smoothing: float = 0.1,
        num_classes: int = 1000,
        patch_size=16,
        tokenmix_lam: Optional[float] = None,
        tokenmix_min_tokens: Optional[int] = None,
        box_rounding: str = 'timm',
        tokenmix_rule: str = 'paper',
        carry_mix: Optional[bool] = None,
        activation_targets: Optional[str] = None,
        generator: Optional[torch.Generator] = None,
        multi_label: bool = False,
    ):
        mix_kind = infer_mix_kind(mix_kind, cutmix_alpha, cutmix_minmax)
        if multi_label and activation_targets is not None:
            raise ValueError('multi_label: activation-map targets are built from class indices, not dense targets')
        self.multi_label = bool(multi_label)
        if not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f'num_classes must be an int >= 2, got {num_classes!r}')
        label_smoothing = check_real(label_smoothing, 'label_smoothing', 0.0, 1.0, hi_open=True)
        self.sampler = MixSampler(
            mix_kind,
            mixup_alpha=mixup_alpha,
            cutmix_alpha=cutmix_alpha,
            cutmix_minmax=cutmix_minmax,
            prob=prob,
            switch_prob=switch_prob,
            mode=mode,
            correct_lam=correct_lam,
            patch_size=patch_size,
            tokenmix_lam=tokenmix_lam,
            tokenmix_min_tokens=tokenmix_min_tokens,
            box_rounding=box_rounding,
            tokenmix_rule=tokenmix_rule,
        )
        self.mix_kind = mix_kind
        self.mode = mode
        self.label_smoothing = label_smoothing
        self.num_classes = num_classes
        self.carry_mix = mix_kind not in PLAIN_TARGET_KINDS if carry_mix is None else carry_mix
        if activation_targets is not None and activation_targets not in ACTIVATION_TARGETS:
            raise ValueError(
                f'activation_targets: expected one of {ACTIVATION_TARGETS} or None, got {activation_targets!r}'
            )
        self.activation_targets = activation_targets
        self.generator = generator

    def sample(self, x: torch.Tensor, target: torch.Tensor, name: str = 'x') -> Mix:
        """Check the batch and draw its mix (on the CPU, without applying it)."""
        self.sample_checks(x, target, name)
        return self.sampler.sample(x.shape[0], tuple(x.shape[-2:]), self.generator)

    @staticmethod
    def sample_checks(x: torch.Tensor, target: torch.Tensor, name: str = 'x') -> None:
        """A ``(B, C, H, W)`` image batch (not channels-last) of an even size and a target per image."""
        check_image_batch(x, name)
        check_pairwise_batch(x.shape[0], name)
        if not torch.is_tensor(target):
            raise ValueError(f'target: expected a tensor, got {type(target).__name__}')
        if target.shape[0] != x.shape[0]:
            raise ValueError(f'target: {target.shape[0]} labels for a batch of {x.shape[0]} images')

    def make_target(self, target: torch.Tensor, mix: Mix) -> torch.Tensor:
        """The area target (checks the labels), or with ``activation_targets`` TokenMix's target from the
        teacher maps the target carries (:func:`shared_core.tokenmix.activation_target`); a
        :class:`MixTarget` carrying the mix on the target's device for the token-aware kinds."""
        if self.activation_targets is not None:
            maps = getattr(target, 'maps', None)
            if maps is None:
                raise ValueError(
                    'target: activation-map targets need the teacher maps with each label (a '
                    'TokenLabelTarget from timm_plugin.token_labeling.TokenLabelCollate)'
                )
            labels = target.as_tensor()
            soft = activation_target(labels, mix, maps, self.label_smoothing, self.activation_targets)
            target = labels
        elif self.multi_label:
            soft = multi_label_target(target, mix, self.num_classes, self.label_smoothing)
        else:
            soft = mix_target(target, mix, self.num_classes, self.label_smoothing)
        if not self.carry_mix:
            return soft
        return MixTarget.wrap(
            soft, mix.to(soft.device, non_blocking=True), target.to(soft.device), self.num_classes, self.label_smoothing
        )

    def _plain_batch(self, x: torch.Tensor) -> bool:
        """Whether this call takes timm's own path without a :class:`Mix`: batch-mode MixUp / CutMix of float
        images into a plain area target (nothing carries or re-weights the mix)."""
        return (
            self.mode == 'batch'
            and self.mix_kind in PLAIN_TARGET_KINDS
            and not self.carry_mix
            and not self.multi_label
            and self.activation_targets is None
            and self.cutmix_minmax is None
            and isinstance(x, torch.Tensor)
            and x.dtype.is_floating_point
        )

    def __call__(self, x: torch.Tensor, target: torch.Tensor, name: str = 'x'):
        if self._plain_batch(x):  # λ and the box drawn on the host, mixed against x.flip(0), as timm does
            self.sample_checks(x, target, name)
            lam, box = self.sampler.plain_batch(x.shape[0], tuple(x.shape[-2:]), self.generator)
            soft = pair_target(target, None, lam, self.num_classes, self.label_smoothing, reversed_pairs=True)
            return mix_images_reversed(x, lam, box), soft
        mix = self.sample(x, target, name)
        target = self.make_target(target, mix)
        return mix_images(x, mix), target


@_forwarding('mixer', TIMM_ATTRIBUTES + ('label_smoothing', 'num_classes'))
class FastCollateTokenMixup(FastCollateMixup):
    """timm's ``FastCollateMixup`` contract (uint8 images in, uint8 mixed batch + soft target out),
    for every mixing kind. The prefetcher normalises afterwards; ``mixup_enabled`` and timm's other
    attributes are live views of the inner :class:`TokenAwareMixup`. ``mode='half'`` (timm) mixes per
    element and returns the first half of the batch (plain-target kinds only: the partners of a half
    batch are not in it, so no mix can be carried)."""

    @timm_positional(lead=1)
    def __init__(self, mix_kind: Optional[str] = None, *, mode: str = 'batch', **kwargs):
        self.half = 'half' in mode
        self.mixer = TokenAwareMixup(mix_kind, mode='elem' if self.half else mode, **kwargs)
        if self.half and self.mixer.carry_mix:
            raise ValueError(
                f'mode={mode!r} keeps only the first half of the batch, whose partners are dropped, '
                f"so a mix cannot be carried: use mode 'batch', 'pair' or 'elem' for {mix_kind!r}"
            )
        m = self.mixer
        # timm's constructor assigns its attributes; they land on the mixer through the properties above
        super().__init__(
            mixup_alpha=m.mixup_alpha,
            cutmix_alpha=m.cutmix_alpha,
            cutmix_minmax=m.cutmix_minmax,
            prob=m.mix_prob,
            switch_prob=m.switch_prob,
            mode=mode,
            correct_lam=m.correct_lam,
            label_smoothing=m.label_smoothing,
            num_classes=m.num_classes,
        )

    def __call__(self, batch, _=None):
        check_pairwise_batch(len(batch), 'batch')
        images = [b[0] for b in batch]
        x = torch.from_numpy(np.stack(images)) if isinstance(images[0], np.ndarray) else torch.stack(images)
        if x.dtype != torch.uint8:
            raise ValueError(
                f'batch: fast collate expects uint8 images (timm ToNumpy/MaybeToTensor '
                f'without normalisation), got {x.dtype}'
            )
        if self.mixer.multi_label:  # dense (C,) targets per sample
            target = torch.stack([torch.as_tensor(b[1]) for b in batch]).float()
        else:
            target = torch.as_tensor([int(b[1]) for b in batch], dtype=torch.long)
        x, soft = self.mixer(x, target, name='batch')
        if self.half:
            n = x.shape[0] // 2
            x, soft = x[:n], soft[:n]
        return x, soft


def infer_mix_kind(mix_kind: Optional[str], cutmix_alpha: float, cutmix_minmax=None) -> str:
    """timm ``Mixup``'s kind from its arguments when none is named: ``'cutmix'`` (the MixUp/CutMix switch when
    ``mixup_alpha > 0`` too) if ``cutmix_alpha > 0`` or ``cutmix_minmax`` is set, else ``'mixup'``."""
    if mix_kind is not None:
        return mix_kind
    try:
        cut = cutmix_minmax is not None or float(cutmix_alpha) > 0
    except (TypeError, ValueError):
        raise ValueError(f'cutmix_alpha: expected a number, got {cutmix_alpha!r}') from None
    return 'cutmix' if cut else 'mixup'


@timm_positional(lead=0)
def create_mixer(
    mix_kind: Optional[str] = None,
    *,
    mixup_alpha: float = 1.0,
    cutmix_alpha: float = 0.0,
    cutmix_minmax: Optional[Sequence[float]] = None,
    prob: float = 1.0,
    switch_prob: float = 0.5,
    mode: str = 'batch',
    correct_lam: bool = True,
    label_smoothing: float = 0.1,
    num_classes: int = 1000,
    patch_size=16,
    tokenmix_lam: Optional[float] = None,
    tokenmix_min_tokens: Optional[int] = None,
    box_rounding: str = 'timm',
    tokenmix_rule: str = 'paper',
    carry_mix: Optional[bool] = None,
    method: Optional[str] = None,
    collate: bool = False,
    activation_targets: Optional[str] = None,
    generator: Optional[torch.Generator] = None,
    multi_label: bool = False,
):
    """A mixer with timm ``Mixup``'s arguments and defaults (see the module docstring for the kinds):
    ``create_mixer(**mixup_args)`` is ``timm.data.Mixup(**mixup_args)``, and timm's positional order works too:
    ``create_mixer(0.8, 1.0)`` is ``Mixup(0.8, 1.0)``, ``create_mixer('token_box', 0.8, 1.0)`` the same over token
    boxes. ``mixup_alpha``, ``cutmix_alpha``, ``cutmix_minmax``, ``prob``, ``switch_prob``, ``mode``,
    ``correct_lam``, ``label_smoothing`` and ``num_classes`` are as in ``timm.data.Mixup``.

    Args:
        mix_kind: what the sampler draws, one of :data:`MIX_KINDS`; ``None`` infers it as timm does
            (``'cutmix'`` when ``cutmix_alpha > 0`` or ``cutmix_minmax``, else ``'mixup'``).
        multi_label: dense ``(B, C)`` targets, smoothed towards 0.5 and mixed by λ (timm's ``multi_label``);
            not with a ``method`` or ``activation_targets``, which re-weight class labels.
        patch_size: the model's patch size (int or (h, w)); token kinds need images divisible by it.
        tokenmix_lam: fix λ of the TokenMix kinds (TokenMix uses 0.5) instead of Beta(cutmix_alpha).
        tokenmix_min_tokens: smallest block of ``tokenmix_block`` (default 14 on a 14x14 grid, scaled); with
            ``tokenmix_rule='public'`` the tokens added to ``int((1 - λ) N)``, as the public code's ``minimum_tokens``.
        box_rounding: ``'timm'`` or ``'public'`` (the public code's ``cut // 2`` boxes: CutMix and token boxes).
        tokenmix_rule: ``'paper'`` (exact counts) or ``'public'`` (the public code's mask sampler).
        carry_mix: return a :class:`MixTarget` (default: for the token kinds, and under a ``method``).
        method: the method that will re-weight the target (``'tl_align'``, ``'transmix'``, :data:`TARGET_METHODS`):
            the mixer carries the mix (the TL-Align paper, Table 7: ``'cutmix'`` with ``mixup_alpha > 0`` is the
            MixUp/CutMix switch; ``'mixup'``, ``'tokenmix_random'``, ``'tokenmix_block'``).
        collate: return a :class:`FastCollateTokenMixup` (for timm's prefetcher loader).
        activation_targets: TokenMix's targets from a teacher's activation maps (``'true_class'``, the
            paper / public code, or ``'distribution'``, our extension; :mod:`shared_core.tokenmix`): the
            mixer is then called with the :class:`~timm_plugin.token_label_data.TokenLabelTarget` of
            ``TokenLabelCollate`` (the maps follow each crop and flip); not with ``collate=True``.
        generator: a ``torch.Generator`` for reproducible mixing (default: torch's global RNG).
    """
    mix_kind = infer_mix_kind(mix_kind, cutmix_alpha, cutmix_minmax)
    if multi_label and method is not None:
        raise ValueError(f'multi_label: {method} re-weights class labels; it does not take dense multi-label targets')
    if mix_kind in TARGET_METHODS:
        raise ValueError(
            f'mix_kind: {mix_kind!r} is a method, not a mixing kind; pass method={mix_kind!r} and the '
            f"mix_kind it re-weights (one of {MIX_KINDS}, e.g. 'cutmix')"
        )
    if method is not None:
        if method not in TARGET_METHODS:
            raise ValueError(f'method: expected one of {TARGET_METHODS} or None, got {method!r}')
        if mix_kind != 'mixup' and cutmix_alpha <= 0 and cutmix_minmax is None and tokenmix_lam is None:
            raise ValueError(
                f'cutmix_alpha: {method} over mix_kind={mix_kind!r} needs cutmix_alpha > 0; without a '
                f'cut branch every token has the same share and the target is the area target'
            )
        carry_mix = True
    kwargs = dict(
        mixup_alpha=mixup_alpha,
        cutmix_alpha=cutmix_alpha,
        cutmix_minmax=cutmix_minmax,
        prob=prob,
        switch_prob=switch_prob,
        correct_lam=correct_lam,
        label_smoothing=label_smoothing,
        num_classes=num_classes,
        patch_size=patch_size,
        tokenmix_lam=tokenmix_lam,
        tokenmix_min_tokens=tokenmix_min_tokens,
        box_rounding=box_rounding,
        tokenmix_rule=tokenmix_rule,
        carry_mix=carry_mix,
        generator=generator,
        multi_label=multi_label,
    )
    if activation_targets is not None:
        if collate:
            raise ValueError('activation_targets: mix on the device (collate=False), after TokenLabelCollate')
        kwargs['activation_targets'] = activation_targets
    modes = MODES + ('half',)  # timm's FastCollateMixup modes ('half': the collate mixer only, below)
    if not isinstance(mode, str) or mode not in modes:
        raise ValueError(f'mode: expected one of {modes}, got {mode!r}')
    if collate:
        return FastCollateTokenMixup(mix_kind, mode=mode, **kwargs)
    if 'half' in mode:
        raise ValueError(f'mode={mode!r} exists only for the collate mixer (collate=True)')
    return TokenAwareMixup(mix_kind, mode=mode, **kwargs)
