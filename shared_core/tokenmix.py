"""TokenMix's targets from a teacher's activation maps (the TokenMix paper, Sec. 3.2, Eq. 2; Table 7).

The teacher's maps are the label-map store of :mod:`shared_core.map_store` (``tokenaug-maps generate``
with any timm teacher): per image, the teacher's class probabilities at every location of the whole
image. They follow each training image's crop and flip exactly as token labeling's targets do
(:mod:`shared_core.label_maps`), resampled to the mix's token grid.

Eq. 2 weighs each source by the *sum of its spatially normalised activation over the tokens it
contributes*::

    A_a = map_a / Σ_tokens map_a                   (spatial normalisation, per image)
    w_a = Σ_i (1 - s_i) · A_a,i                    (the tokens the sample keeps)
    w_b = Σ_i s_i · A_b,i                          (the tokens its partner b gives it)
    λ'  = w_a / (w_a + w_b),    ỹ = λ' · y_a + (1 - λ') · y_b, then label smoothing

with ``s`` the partner share of each token (0/1 for token masks, fractional where a pixel CutMix box cuts a
patch: the refinement of CutMix, Table 7; constant for MixUp, where λ' is the area λ).

- ``mode='true_class'`` (default; what the public code reads): ``map_a`` is the channel of the image's own
  ground-truth class. The weights are renormalised so the target sums to 1 (the public code does not,
  and with smoothing its targets can go negative); when both weights vanish (the teacher sees neither
  class where the sources are visible) λ' falls back to the area λ. A map that is zero everywhere is
  spread evenly (its sample then weighs by area).
- ``mode='distribution'`` (our extension, not in the paper): the teacher's full class distribution over
  what each sample shows, ``ỹ = mean_i [(1 - s_i) · p_a,i + s_i · p_b,i]`` (``p`` the per-token
  distributions of :func:`shared_core.label_maps.token_targets_batch`), then label smoothing.
"""

from __future__ import annotations

import torch

from .label_maps import CropMaps, class_maps, smooth, token_targets_batch
from .mix import Mix, check_labels, mix_rows, pair_target
from .options import ACTIVATION_TARGETS

__all__ = ['ACTIVATION_TARGETS', 'activation_lam', 'activation_target']


def activation_lam(maps: torch.Tensor, mix: Mix, eps: float = 1e-12) -> torch.Tensor:
    """Eq. 2's own-label weight ``λ' (B,)`` from each sample's activation map ``(B, gh, gw)`` (or
    ``(B, N)``) on the mix's token grid; the area λ where both weights vanish."""
    A = maps.reshape(maps.shape[0], -1).float().clamp_min(0.0)
    if A.shape != (mix.batch_size, mix.num_tokens):
        raise ValueError(
            f'maps: expected one (grid {mix.grid_size}) map per sample of the mix, got {tuple(maps.shape)}'
        )
    total = A.sum(1, keepdim=True)
    A = torch.where(total > eps, A / total.clamp_min(eps), torch.full_like(A, 1.0 / A.shape[1]))
    s = mix.token_share_flat().to(A.device, A.dtype)
    partner = mix.partner.to(A.device)
    w_own = ((1.0 - s) * A).sum(1)
    w_partner = (s * A[partner]).sum(1)
    both = w_own + w_partner
    area = mix.lam.to(A.device, A.dtype)
    return torch.where(both > eps, w_own / both.clamp_min(eps), area)


def activation_target(
    labels: torch.Tensor,
    mix: Mix,
    maps: CropMaps,
    smoothing: float = 0.0,
    mode: str = 'true_class',
) -> torch.Tensor:
    """The ``(B, C)`` target of a mixed batch from the teacher's map rows under each image's crop and geometric
    ops (``maps``, :class:`~shared_core.label_maps.CropMaps`); rows sum to 1 (label smoothing included). See the
    module docstring."""
    if mode not in ACTIVATION_TARGETS:
        raise ValueError(f'mode: expected one of {ACTIVATION_TARGETS}, got {mode!r}')
    num_classes, device = maps.num_classes, maps.values.device
    labels = labels.to(device)
    check_labels(labels, num_classes)
    mix = mix.to(device)
    if mode == 'true_class':
        lam = activation_lam(class_maps(maps, labels, mix.grid_size), mix)
        return pair_target(labels, mix.partner, lam, num_classes, smoothing, reversed_pairs=mix.reversed_pairs)
    p = token_targets_batch(maps, mix.grid_size)
    p = p.flatten(2).transpose(1, 2)  # (B, N, C)
    shown = mix_rows(p, mix.partner, mix.token_share_flat(), mix.reversed_pairs)
    return smooth(shown.mean(1), smoothing)
