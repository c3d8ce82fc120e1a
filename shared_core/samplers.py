"""The sampler: timm ``Mixup``'s parameter logic (which batches mix, MixUp/cut switching, λ, modes) for
every mixing kind, drawing a :class:`~shared_core.mix.Mix` without applying it.

Papers: MixUp (https://arxiv.org/abs/1710.09412); CutMix (https://arxiv.org/abs/1905.04899), with box
sampling, λ correction and min/max boxes as timm's ``timm/data/mixup.py``; MixToken (Token Labeling,
the Token Labeling paper, Sec. 3.3): a box on the token grid; TokenMix (the TokenMix paper, Sec. 3.2): token masks.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import numpy as np
import torch
from scipy.special import betaincinv

from .boxes import (
    box_token_share,
    box_token_share_one,
    check_box_rounding,
    minmax_sides,
    rand,
    rand_box,
    rand_box_minmax,
    rand_box_one,
    sample_beta,
)
from .checks import check_int, check_real
from .mix import IntPair, Mix, check_image_size, check_pairwise_batch, grid_size, to_2tuple
from .options import CUT_KINDS, MIX_KINDS
from .token_masks import (
    TOKENMIX_RULES,
    grid_box_mask,
    random_token_mask,
    tokenmix_masks,
    tokenmix_masks_public,
    tokenmix_public_count,
)

__all__ = ['MIX_KINDS', 'CUT_KINDS', 'MODES', 'MixSampler']

MODES = ('batch', 'pair', 'elem')


class MixSampler:
    """Draws a :class:`Mix` with timm ``Mixup``'s parameter logic.

    ``mix_kind`` names the *cut* branch: ``'cutmix'`` (pixel box, timm's λ correction and min/max
    option), ``'token_box'`` (MixToken: a box on the token grid), ``'tokenmix_block'`` /
    ``'tokenmix_random'`` (TokenMix masks). ``'mixup'`` has no cut branch. As in timm, the MixUp
    blend is active when ``mixup_alpha > 0``, the cut branch when ``cutmix_alpha > 0`` (or
    ``cutmix_minmax`` is set for ``'cutmix'``), and with both the cut branch is taken with
    probability ``switch_prob``. ``prob`` is the probability of mixing at all; ``mode`` draws one
    set of parameters per ``'batch'``, per ``'pair'`` (i and B-1-i) or per ``'elem'``.
    ``cutmix_alpha = 0`` (and no ``cutmix_minmax`` / ``tokenmix_lam``) leaves MixUp only, as in timm.

    Token kinds need the patch size to divide the image. ``'mixup'`` and ``'cutmix'`` do not (timm's
    Mixup works at any size, e.g. 299 px CNN inputs): the token grid then ends in clipped patches.

    The cut branch's λ is always the exact own share afterwards for token kinds
    (``1 - masked / N``); for ``'cutmix'`` it is corrected to the clipped box area when
    ``correct_lam`` (or with ``cutmix_minmax``), as timm does. For token masks λ ~ Beta(cutmix_alpha)
    unless ``tokenmix_lam`` fixes it (TokenMix's λ = 0.5: the partner gets half of the tokens).

    Switches to the authors' public samplers (docs: departures): ``box_rounding='public'`` rounds boxes
    (CutMix's pixel box, MixToken's token box) as their pinned timm did (``cut // 2`` on both sides);
    ``tokenmix_rule='public'`` draws TokenMix masks by their rule (``int((1 - λ) N) + tokenmix_min_tokens``
    tokens targeted, parts from 1 token, :func:`~shared_core.token_masks.tokenmix_masks_public`).
    """

    def __init__(
        self,
        mix_kind: str = 'mixup',
        *,
        mixup_alpha: float = 1.0,
        cutmix_alpha: float = 0.0,
        cutmix_minmax: Optional[Sequence[float]] = None,
        prob: float = 1.0,
        switch_prob: float = 0.5,
        mode: str = 'batch',
        correct_lam: bool = True,
        patch_size: IntPair = 16,
        tokenmix_lam: Optional[float] = None,
        tokenmix_min_tokens: Optional[int] = None,
        box_rounding: str = 'timm',
        tokenmix_rule: str = 'paper',
    ):
        check_box_rounding(box_rounding)
        if tokenmix_rule not in TOKENMIX_RULES:
            raise ValueError(f'tokenmix_rule: expected one of {TOKENMIX_RULES}, got {tokenmix_rule!r}')
        if mix_kind not in MIX_KINDS:
            raise ValueError(f'mix_kind must be one of {MIX_KINDS}, got {mix_kind!r}')
        if mode not in MODES:
            raise ValueError(f'mode must be one of {MODES}, got {mode!r}')
        prob = check_real(prob, 'prob', 0.0, 1.0)
        switch_prob = check_real(switch_prob, 'switch_prob', 0.0, 1.0)
        mixup_alpha = check_real(mixup_alpha, 'mixup_alpha', 0.0)
        cutmix_alpha = check_real(cutmix_alpha, 'cutmix_alpha', 0.0)
        if tokenmix_min_tokens is not None:
            tokenmix_min_tokens = check_int(tokenmix_min_tokens, 'tokenmix_min_tokens', 1)
        if cutmix_minmax is not None:
            if mix_kind != 'cutmix':
                raise ValueError(f"cutmix_minmax applies to mix_kind='cutmix' only, got {mix_kind!r}")
            if len(cutmix_minmax) != 2 or not all(math.isfinite(float(m)) for m in cutmix_minmax):
                raise ValueError(f'cutmix_minmax must be (min, max) with 0 < min < max <= 1, got {cutmix_minmax}')
            if not 0 < cutmix_minmax[0] < cutmix_minmax[1] <= 1:
                raise ValueError(f'cutmix_minmax must be (min, max) with 0 < min < max <= 1, got {cutmix_minmax}')
            cutmix_alpha = 1.0  # as timm: minmax forces the cut branch on
        if tokenmix_lam is not None:
            if not mix_kind.startswith('tokenmix'):
                raise ValueError(f'tokenmix_lam applies to the TokenMix kinds only, got mix_kind={mix_kind!r}')
            tokenmix_lam = check_real(tokenmix_lam, 'tokenmix_lam', 0.0, 1.0)
        if mix_kind == 'mixup' and cutmix_alpha > 0:
            raise ValueError(
                "cutmix_alpha: mix_kind='mixup' only blends; use mix_kind='cutmix' "
                "(with mixup_alpha > 0) for timm's MixUp/CutMix switching"
            )
        if mixup_alpha <= 0 and cutmix_alpha <= 0 and tokenmix_lam is None:
            raise ValueError(
                f'mixup_alpha and cutmix_alpha are both 0: nothing to mix for mix_kind={mix_kind!r} '
                f'(MixUp is active when mixup_alpha > 0, the {mix_kind!r} cut when cutmix_alpha > 0)'
            )
        self.mix_kind = mix_kind
        self.mixup_alpha = float(mixup_alpha)
        self.cutmix_alpha = float(cutmix_alpha)
        self.cutmix_minmax = tuple(cutmix_minmax) if cutmix_minmax is not None else None
        self.mix_prob = float(prob)
        self.switch_prob = float(switch_prob)
        self.mode = mode
        self.correct_lam = correct_lam
        self.patch_size = to_2tuple(patch_size, 'patch_size')
        self.tokenmix_lam = tokenmix_lam
        self.tokenmix_min_tokens = tokenmix_min_tokens
        self.box_rounding = box_rounding
        self.tokenmix_rule = tokenmix_rule
        self.mixup_enabled = True  # timm's train loop switches this off after --mixup-off-epoch

    @property
    def has_blend(self) -> bool:
        return self.mixup_alpha > 0

    @property
    def has_cut(self) -> bool:
        return self.mix_kind != 'mixup' and (self.cutmix_alpha > 0 or self.tokenmix_lam is not None)

    def _unit_params(self, n: int, generator) -> Tuple[np.ndarray, np.ndarray]:
        """λ (float64) and use-cut (bool) for ``n`` parameter units, host arrays; λ = 1 where not mixed."""
        lam = np.ones(n)
        use_cut = np.zeros(n, dtype=bool)
        if not self.mixup_enabled or n == 0:
            return lam, use_cut
        active = rand(n, generator).numpy() < self.mix_prob
        if self.has_blend and self.has_cut:
            use_cut = rand(n, generator).numpy() < self.switch_prob
        elif self.has_cut:
            use_cut = np.ones(n, dtype=bool)
        lam_blend = sample_beta(self.mixup_alpha, n, generator).numpy() if self.has_blend else lam
        if self.has_cut and self.mix_kind.startswith('tokenmix') and self.tokenmix_lam is not None:
            lam_cut = np.full(n, float(self.tokenmix_lam))
        elif self.has_cut:
            lam_cut = sample_beta(self.cutmix_alpha, n, generator).numpy()
        else:
            lam_cut = lam
        lam = np.where(active, np.where(use_cut, lam_cut, lam_blend), lam)
        return lam, use_cut & active

    def sample(
        self,
        batch_size: int,
        img_size: IntPair,
        generator: Optional[torch.Generator] = None,
        device=None,
        allow_odd: bool = False,
    ) -> Mix:
        """A mix for a batch of ``batch_size`` images of ``img_size``; ``allow_odd``: an odd batch's middle
        sample partners itself (it stays as it is), as mmpretrain's augments take any batch size.

        λ, the switch and the boxes are drawn and combined on the host (numpy; the generator's draws are the
        only tensor ops), as timm draws them; TokenMix's masks come from their own samplers."""
        check_pairwise_batch(batch_size, allow_odd=allow_odd)
        img_size = to_2tuple(img_size, 'img_size')
        if self.mix_kind not in ('mixup', 'cutmix'):
            check_image_size(img_size, self.patch_size)
        if self.cutmix_minmax is not None:
            minmax_sides(img_size, self.cutmix_minmax)  # fail on every batch, not only when a box is drawn
        if self.mode == 'batch' and self.mix_kind in ('mixup', 'cutmix', 'token_box') and self.cutmix_minmax is None:
            mix = self._sample_batch_mode(batch_size, img_size, generator)
            return mix if device is None else mix.to(device)
        n = {'batch': 1, 'pair': (batch_size + 1) // 2, 'elem': batch_size}[self.mode]
        lam, use_cut = self._unit_params(n, generator)
        grid = grid_size(img_size, self.patch_size)
        N = grid[0] * grid[1]
        share = np.broadcast_to((1.0 - lam).astype(np.float32)[:, None, None], (n, *grid)).copy()
        boxes = valid = None
        cut = np.flatnonzero(use_cut)
        if cut.size:
            lam_c = lam[cut]
            if self.mix_kind == 'cutmix':
                if self.cutmix_minmax is not None:
                    b = rand_box_minmax(img_size, self.cutmix_minmax, cut.size, generator).numpy()
                else:
                    b = rand_box(img_size, lam_c, generator, self.box_rounding).numpy()
                if self.correct_lam or self.cutmix_minmax is not None:
                    area = (b[:, 1] - b[:, 0]) * (b[:, 3] - b[:, 2])
                    lam_c = 1.0 - area.astype(np.float64) / (img_size[0] * img_size[1])
                share[cut] = box_token_share(b, img_size, self.patch_size).numpy()
                boxes = np.zeros((n, 4), dtype=np.int64)
                boxes[cut] = b
                valid = use_cut
            else:
                lam_t = torch.from_numpy(lam_c)
                if self.mix_kind == 'token_box':
                    m = grid_box_mask(grid, lam_t, generator, self.box_rounding)
                elif self.tokenmix_rule == 'public':
                    extra = self.tokenmix_min_tokens
                    k = tokenmix_public_count(grid, lam_t, max(1, round(14 * N / 196)) if extra is None else extra)
                    if self.mix_kind == 'tokenmix_block':
                        m = tokenmix_masks_public(grid, k, generator)
                    else:
                        m = random_token_mask(grid, k, generator)
                else:
                    k = torch.from_numpy(np.round((1.0 - lam_c) * N).astype(np.int64))
                    if self.mix_kind == 'tokenmix_block':
                        m = tokenmix_masks(grid, k, generator, self.tokenmix_min_tokens)
                    else:
                        m = random_token_mask(grid, k, generator)
                m = m.numpy()
                share[cut] = m
                lam_c = 1.0 - m.reshape(cut.size, -1).sum(1).astype(np.float64) / N
            lam = lam.copy()
            lam[cut] = lam_c
        # expand parameter units to samples
        if self.mode == 'batch':
            idx = np.zeros(batch_size, dtype=np.int64)
        elif self.mode == 'pair':  # an odd batch's middle sample is its own pair (its own unit)
            half = np.arange(batch_size // 2)
            idx = np.concatenate([half, np.arange(batch_size // 2, n), half[::-1]])
        else:
            idx = np.arange(batch_size)
        mix = Mix(
            partner=torch.arange(batch_size - 1, -1, -1),
            lam=torch.from_numpy(lam[idx].astype(np.float32)),
            token_share=torch.from_numpy(share[idx]),
            img_size=img_size,
            patch_size=self.patch_size,
            kind=self.mix_kind if self.mixup_enabled else 'none',
            boxes=None if boxes is None else torch.from_numpy(boxes[idx]),
            box_valid=None if valid is None else torch.from_numpy(valid[idx]),
            reversed_pairs=True,
            blend=not cut.size,
            batch_lam=float(lam[0]) if self.mode == 'batch' else None,
        )
        return mix if device is None else mix.to(device)

    def _batch_draw(self, generator) -> Tuple[float, bool]:
        """``mode='batch'``: λ and whether the cut branch is taken, drawn on the host in Python numbers, the same
        draws in the same order as the vector path (a seed gives the same mix; the generator's doubles are
        sequential whether drawn one by one or together)."""
        if not self.mixup_enabled:
            return 1.0, False
        both = self.has_blend and self.has_cut
        u = rand(1 + both + self.has_blend + self.has_cut, generator).tolist()
        active = u.pop(0) < self.mix_prob
        use_cut = u.pop(0) < self.switch_prob if both else self.has_cut
        lam_blend = float(betaincinv(self.mixup_alpha, self.mixup_alpha, u.pop(0))) if self.has_blend else 1.0
        lam_cut = float(betaincinv(self.cutmix_alpha, self.cutmix_alpha, u.pop(0))) if self.has_cut else 1.0
        if not active:
            return 1.0, False
        return (lam_cut, True) if use_cut else (lam_blend, False)

    def _batch_box(self, img_size: Tuple[int, int], lam: float, generator) -> Tuple[float, Tuple[int, int, int, int]]:
        """CutMix's one pixel box of a batch and its (corrected) λ: :func:`rand_box` in Python numbers."""
        box = y0, y1, x0, x1 = rand_box_one(img_size, lam, generator, self.box_rounding)
        if self.correct_lam:
            lam = 1.0 - (y1 - y0) * (x1 - x0) / (img_size[0] * img_size[1])
        return lam, box

    def plain_batch(
        self, batch_size: int, img_size: IntPair, generator: Optional[torch.Generator] = None
    ) -> Tuple[float, Optional[Tuple[int, int, int, int]]]:
        """``mode='batch'`` MixUp / CutMix without a :class:`Mix` (timm's path, for a plain area target): ``(λ,
        box)``, the batch's own share λ and CutMix's pixel box ``(y0, y1, x0, x1)`` (``None`` for a blend), the
        same draws as :meth:`sample` (a seed gives the same λ and box). Every sample's partner is the reversed
        batch: :func:`~shared_core.mix.mix_images_reversed` and :func:`~shared_core.mix.pair_target` apply it."""
        if self.mode != 'batch' or self.mix_kind not in ('mixup', 'cutmix') or self.cutmix_minmax is not None:
            raise ValueError(
                f"plain_batch: mode='batch' MixUp / CutMix without cutmix_minmax only; got mode={self.mode!r}, "
                f'mix_kind={self.mix_kind!r}, cutmix_minmax={self.cutmix_minmax}'
            )
        check_pairwise_batch(batch_size)
        img_size = to_2tuple(img_size, 'img_size')
        lam, use_cut = self._batch_draw(generator)
        return self._batch_box(img_size, lam, generator) if use_cut else (lam, None)

    def _sample_batch_mode(self, batch_size: int, img_size: Tuple[int, int], generator) -> Mix:
        """``mode='batch'`` MixUp / CutMix / MixToken's token box on the host (:meth:`_batch_draw`); a handful of
        tensor ops build the :class:`Mix`."""
        lam, use_cut = self._batch_draw(generator)
        gh, gw = grid_size(img_size, self.patch_size)
        box = None
        if use_cut and self.mix_kind == 'token_box':  # MixToken: a box on the token grid, λ its exact own share
            y0, y1, x0, x1 = rand_box_one((gh, gw), lam, generator, self.box_rounding)
            lam = 1.0 - (y1 - y0) * (x1 - x0) / (gh * gw)
            share = torch.zeros(batch_size, gh, gw)
            share[:, y0:y1, x0:x1] = 1.0
        elif use_cut:  # CutMix: rand_box and box_token_share for one box, in Python numbers (the same arithmetic)
            lam, box = self._batch_box(img_size, lam, generator)
            share = box_token_share_one(box, img_size, self.patch_size).expand(batch_size, gh, gw).clone()
        else:
            share = torch.full((batch_size, gh, gw), 1.0 - lam)
        return Mix(
            partner=torch.arange(batch_size - 1, -1, -1),
            lam=torch.full((batch_size,), lam),
            token_share=share,
            img_size=img_size,
            patch_size=self.patch_size,
            kind=self.mix_kind if self.mixup_enabled else 'none',
            boxes=None if box is None else torch.tensor([box]).expand(batch_size, 4).clone(),
            box_valid=None if box is None else torch.ones(batch_size, dtype=torch.bool),
            reversed_pairs=True,
            blend=not use_cut,
            batch_lam=lam,
        )
