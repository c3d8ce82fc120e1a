"""Token-aware batch augments for MMPretrain that draw a :class:`shared_core.mix.Mix`. ``TA`` = *token-aware*:
``TAMixup`` / ``TACutMix`` are mmpretrain's ``Mixup`` / ``CutMix`` whose mix (partner, λ, per-token shares)
stays known, and ``TAMixToken`` / ``TATokenMix`` add the token-grid kinds.

Each class is registered in mmpretrain's ``BATCH_AUGMENTS`` and works two ways:

- with the stock ``ClsDataPreprocessor``: ``inputs, score = aug(inputs, batch_score)`` (the stock
  contract; the mix is applied and then forgotten);
- with :class:`mm_plugin.TokenAugDataPreprocessor`: the same call, and the preprocessor reads the mix it
  kept (``aug.last_mix``) and puts it on the data samples, where token-aware heads read it.

The mixing itself (λ, boxes, masks, images, targets) lives in the core (:mod:`shared_core.mix`,
:mod:`shared_core.samplers`; one import for users: :mod:`shared_core.mixing`); these classes only translate
config keys. As in timm, sample ``i`` is paired with ``B - 1 - i`` (the
dataloader shuffles, so this is a random pairing) and λ is the share of the sample's own image.

A bad argument (at build, or scores that are not ``(N, num_classes)``) raises
:class:`shared_core.checks.ArgumentError`: a ``ValueError``, and the ``AssertionError`` that mmpretrain's
augments raise for it.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from mmpretrain.registry import BATCH_AUGMENTS

from shared_core.checks import ArgumentError, argument_errors, check_int, check_real
from shared_core.mix import Mix, check_image_batch, check_pairwise_batch, mix_images, mix_rows, own_lam
from shared_core.samplers import MixSampler
from shared_core.tokenmix import ACTIVATION_TARGETS

__all__ = ['MixBatchAugment', 'TAMixup', 'TACutMix', 'TAMixToken', 'TATokenMix']


class MixBatchAugment:
    """Base: one mixing kind of :class:`shared_core.samplers.MixSampler` (its cut branch only).

    Args:
        alpha: Beta(α, α) parameter of λ.
        patch_size: the backbone's patch size (token-aware kinds need the image divisible by it).
            ``None``: the data preprocessor's ``patch_size`` (16 under the stock preprocessor).
        mode: ``'batch'`` (one λ per batch, as mmpretrain's Mixup/CutMix), ``'pair'`` or ``'elem'``.
        activation_targets: TokenMix's targets from a teacher's activation maps (the TokenMix paper, Eq. 2;
            ``'true_class'`` or our ``'distribution'``, see :mod:`shared_core.tokenmix`) instead of the area
            target; needs :class:`TokenAugDataPreprocessor` and the token-label pipeline
            (``LoadTokenLabelMap`` ... ``PackTokenLabelInputs``) carrying each image's map, crop and flip.
        **sampler_kwargs: further :class:`MixSampler` arguments.
    """

    #: the sampler's mixing kind (set by each subclass)
    mix_kind = 'mixup'

    def __init__(
        self,
        alpha: float = 1.0,
        patch_size=None,
        mode: str = 'batch',
        activation_targets: Optional[str] = None,
        **sampler_kwargs,
    ):
        with argument_errors():  # ValueError and, as mmpretrain's, AssertionError
            if activation_targets is not None and activation_targets not in ACTIVATION_TARGETS:
                raise ValueError(
                    f'activation_targets: expected one of {ACTIVATION_TARGETS} or None, got {activation_targets!r}'
                )
            alpha = check_real(alpha, 'alpha', 0.0, lo_open=True)  # a config's '1.0' or nan named here, at build
            if self.mix_kind == 'mixup':
                args = dict(mixup_alpha=alpha, cutmix_alpha=0.0)
            else:
                args = dict(mixup_alpha=0.0, cutmix_alpha=alpha)
            self.sampler = MixSampler(
                self.mix_kind, patch_size=16 if patch_size is None else patch_size, mode=mode, **args, **sampler_kwargs
            )
        self.activation_targets = activation_targets
        self.alpha = alpha
        self.patch_size_given = patch_size is not None
        self.generator: Optional[torch.Generator] = None  # set by TokenAugDataPreprocessor(generator=...)
        self.last_mix: Optional[Mix] = None

    def sample_mix(self, batch_size: int, img_size: Tuple[int, int]) -> Mix:
        """The mix of a batch (on the CPU; :func:`mix_images` and :func:`mix_target` move what they need). Any
        batch size, as mmpretrain's augments: sample i partners B-1-i, so an odd batch's middle sample (and a
        batch of 1) is mixed with itself and stays as it is."""
        check_pairwise_batch(batch_size, 'inputs', allow_odd=True)  # any batch size, as mmpretrain's augments
        return self.sampler.sample(batch_size, img_size, self.generator, allow_odd=True)

    def __call__(self, batch_inputs: torch.Tensor, batch_score: torch.Tensor):
        """The stock mmpretrain contract: mix images and one-hot (or soft) scores ``(N, C)``."""
        check_image_batch(batch_inputs, 'batch_inputs')
        if batch_score.ndim != 2 or batch_score.shape[0] != batch_inputs.shape[0]:
            raise ArgumentError(
                f'batch_score: expected (N={batch_inputs.shape[0]}, num_classes) scores, got {tuple(batch_score.shape)}'
            )
        mix = self.sample_mix(batch_inputs.shape[0], tuple(batch_inputs.shape[-2:]))
        self.last_mix = mix
        share = 1.0 - own_lam(mix)
        return mix_images(batch_inputs, mix), mix_rows(batch_score.float(), mix.partner, share, mix.reversed_pairs)


@BATCH_AUGMENTS.register_module()
class TAMixup(MixBatchAugment):
    """MixUp (λ ~ Beta(α, α), every token gets the partner share 1 - λ); mmpretrain's ``Mixup`` with the mix
    carried to the token-aware methods.

    Args:
        alpha (float): Beta(α, α) parameter of λ. Defaults to 1.0.
        patch_size (int | tuple, optional): the backbone's patch size; ``None``: the data preprocessor's.
        mode (str): ``'batch'`` (one λ per batch, as mmpretrain's ``Mixup``), ``'pair'`` or ``'elem'``.
            Defaults to ``'batch'``.
        activation_targets (str, optional): ``'true_class'`` or ``'distribution'``: TokenMix's targets from a
            teacher's activation maps instead of the area target (:class:`MixBatchAugment`). Defaults to None.
    """

    mix_kind = 'mixup'


@BATCH_AUGMENTS.register_module()
class TACutMix(MixBatchAugment):
    """CutMix with timm's box sampling: λ corrected to the clipped box area (``correct_lam``), or a
    box from ``cutmix_minmax``. Patch tokens cut by the box get fractional partner shares.

    Args:
        alpha (float): Beta(α, α) parameter of λ. Defaults to 1.0.
        cutmix_minmax (tuple, optional): ``(min, max)``, the box's side as a fraction of the image side, drawn
            uniformly in ``[min, max]`` (timm's ``cutmix_minmax``) instead of from λ. Defaults to None.
        correct_lam (bool): λ from the box's area after clipping to the image (timm's default). Defaults to True.
        patch_size (int | tuple, optional): the backbone's patch size; ``None``: the data preprocessor's.
        mode (str): ``'batch'``, ``'pair'`` or ``'elem'``. Defaults to ``'batch'``.
        activation_targets (str, optional): TokenMix's activation-map targets (see :class:`TAMixup`).
        box_rounding (str): ``'timm'`` or ``'public'`` (the public code's box: ``cut // 2`` on both sides of the
            centre). Defaults to ``'timm'``.
    """

    mix_kind = 'cutmix'

    def __init__(
        self,
        alpha: float = 1.0,
        cutmix_minmax: Optional[Sequence[float]] = None,
        correct_lam: bool = True,
        patch_size=None,
        mode: str = 'batch',
        activation_targets: Optional[str] = None,
        box_rounding: str = 'timm',
    ):
        super().__init__(
            alpha,
            patch_size=patch_size,
            mode=mode,
            cutmix_minmax=cutmix_minmax,
            correct_lam=correct_lam,
            activation_targets=activation_targets,
            box_rounding=box_rounding,
        )


@BATCH_AUGMENTS.register_module()
class TAMixToken(MixBatchAugment):
    """MixToken's box on the token grid (Token Labeling, Sec. 3.3), here as an image-level batch augment (the
    token labeling classifier mixes the patch tokens themselves, :class:`TokenLabelingClassifier`).

    Args:
        alpha (float): Beta(α, α) parameter of λ. Defaults to 1.0.
        patch_size (int | tuple, optional): the backbone's patch size; ``None``: the data preprocessor's.
        mode (str): ``'batch'``, ``'pair'`` or ``'elem'``. Defaults to ``'batch'``.
        activation_targets (str, optional): TokenMix's activation-map targets (see :class:`TAMixup`).
        **sampler_kwargs: further :class:`~shared_core.samplers.MixSampler` arguments, e.g.
            ``box_rounding='public'`` (the public code's box).
    """

    mix_kind = 'token_box'


@BATCH_AUGMENTS.register_module()
class TATokenMix(MixBatchAugment):
    """TokenMix masks (TokenMix, Sec. 3.2): the partner's tokens in several separated parts or single tokens.

    Args:
        alpha (float): Beta(α, α) parameter of λ when ``lam`` is None. Defaults to 1.0.
        mask (str): ``'block'`` (several separated parts, at least ``min_tokens`` each) or ``'random'`` (single
            tokens). Defaults to ``'block'``.
        lam (float, optional): a fixed λ in [0, 1] (TokenMix: 0.5) instead of a draw. Defaults to None.
        min_tokens (int, optional): the smallest part of a block mask; None: the sampler's default.
        patch_size (int | tuple, optional): the backbone's patch size; ``None``: the data preprocessor's.
        mode (str): ``'batch'``, ``'pair'`` or ``'elem'``. Defaults to ``'batch'``.
        activation_targets (str, optional): ``'true_class'`` (TokenMix Eq. 2) or ``'distribution'``: targets from
            a teacher's activation maps instead of the area target (see :class:`TAMixup`). Defaults to None.
        rule (str): ``'paper'`` or ``'public'`` (masks drawn as the public code: ``int((1 - λ) N) + min_tokens``
            tokens targeted, parts from 1 token; :data:`~shared_core.options.TOKENMIX_RULES`). Defaults to
            ``'paper'``.
    """

    def __init__(
        self,
        alpha: float = 1.0,
        mask: str = 'block',
        lam: Optional[float] = None,
        min_tokens: Optional[int] = None,
        patch_size=None,
        mode: str = 'batch',
        activation_targets: Optional[str] = None,
        rule: str = 'paper',
    ):
        with argument_errors():
            if mask not in ('block', 'random'):
                raise ValueError(f"mask must be 'block' or 'random', got {mask!r}")
            lam = None if lam is None else check_real(lam, 'lam', 0.0, 1.0)
            min_tokens = None if min_tokens is None else check_int(min_tokens, 'min_tokens', 1)
        self.mix_kind = f'tokenmix_{mask}'
        super().__init__(
            alpha,
            patch_size=patch_size,
            mode=mode,
            tokenmix_lam=lam,
            tokenmix_min_tokens=min_tokens,
            activation_targets=activation_targets,
            tokenmix_rule=rule,
        )
