"""λ and boxes, drawn as timm's ``timm/data/mixup.py`` draws them (``rand_bbox``, ``rand_bbox_minmax``),
from an explicit ``torch.Generator`` instead of numpy's global RNG, and the share of each patch a pixel box
covers. Boxes are ``(y0, y1, x0, x1)`` half-open pixel (or token) coordinates.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from scipy.special import betaincinv

from .mix import grid_size

__all__ = [
    'BOX_ROUNDINGS',
    'check_box_rounding',
    'rand',
    'randint',
    'sample_beta',
    'rand_box',
    'minmax_sides',
    'rand_box_minmax',
    'box_token_share',
]

#: how a box's far side is rounded: ``'timm'`` (today's timm, ``cut - cut // 2`` after the centre) or
#: ``'public'`` (the timm the authors' code pinned, ``cut // 2`` on both sides: a box one cell smaller
#: for odd cuts)
BOX_ROUNDINGS = ('timm', 'public')


def check_box_rounding(rounding: str, name: str = 'box_rounding') -> str:
    if rounding not in BOX_ROUNDINGS:
        raise ValueError(f'{name}: expected one of {BOX_ROUNDINGS}, got {rounding!r}')
    return rounding


def rand(n: int, generator: Optional[torch.Generator]) -> torch.Tensor:
    """``n`` uniforms in [0, 1) as float64 from ``generator``."""
    return torch.rand(n, generator=generator, dtype=torch.float64)


def randint(low: torch.Tensor, high: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """Uniform integers in ``[low, high)`` elementwise; ``high > low`` is required."""
    if bool((high <= low).any()):
        raise ValueError('empty integer range (high <= low)')
    u = rand(low.numel(), generator)
    return (low + (u * (high - low)).floor().long()).clamp(max=high - 1)


def sample_beta(alpha: float, n: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """``n`` draws of Beta(α, α) as float64, by inverting the CDF of uniforms from ``generator``."""
    if alpha <= 0:
        raise ValueError(f'alpha: Beta(alpha, alpha) needs alpha > 0, got {alpha}')
    u = rand(n, generator)
    return torch.from_numpy(betaincinv(alpha, alpha, u.numpy()))


def rand_box(
    img_size: Tuple[int, int],
    lam: torch.Tensor,
    generator: Optional[torch.Generator] = None,
    rounding: str = 'timm',
) -> torch.Tensor:
    """timm's ``rand_bbox`` for a vector of λ: a box of side ``sqrt(1 - λ)`` times the image side,
    centred uniformly, clipped by the borders. Returns ``(n, 4)`` int64 ``(y0, y1, x0, x1)``.
    ``rounding`` (:data:`BOX_ROUNDINGS`): ``'public'`` gives the authors' pinned timm (``cut // 2`` on
    both sides of the centre)."""
    far = 1 if check_box_rounding(rounding, 'rounding') == 'timm' else 0
    H, W = img_size
    ratio = torch.sqrt(1.0 - lam.double())
    cut_h, cut_w = (H * ratio).long(), (W * ratio).long()
    n = lam.numel()
    cy = randint(torch.zeros(n, dtype=torch.long), torch.full((n,), H), generator)
    cx = randint(torch.zeros(n, dtype=torch.long), torch.full((n,), W), generator)
    y0 = (cy - cut_h // 2).clamp(0, H)
    y1 = (cy + (cut_h + far) // 2).clamp(0, H)
    x0 = (cx - cut_w // 2).clamp(0, W)
    x1 = (cx + (cut_w + far) // 2).clamp(0, W)
    return torch.stack([y0, y1, x0, x1], 1)


def minmax_sides(img_size: Tuple[int, int], minmax: Sequence[float]) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    """timm's box side ranges ``[int(side·min), int(side·max))``; an empty one is an error."""
    H, W = img_size
    lo_h, hi_h = int(H * minmax[0]), int(H * minmax[1])
    lo_w, hi_w = int(W * minmax[0]), int(W * minmax[1])
    if lo_h >= hi_h or lo_w >= hi_w:
        raise ValueError(
            f'cutmix_minmax {tuple(minmax)} gives an empty range of box sides on a {H}x{W} image '
            f'(heights [{lo_h}, {hi_h}), widths [{lo_w}, {hi_w})): widen it'
        )
    return (lo_h, hi_h), (lo_w, hi_w)


def rand_box_minmax(
    img_size: Tuple[int, int], minmax: Sequence[float], n: int, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """timm's ``rand_bbox_minmax``: box sides uniform in ``[min, max)`` times the image sides."""
    H, W = img_size
    (lo_h, hi_h), (lo_w, hi_w) = minmax_sides(img_size, minmax)
    cut_h = randint(torch.full((n,), lo_h), torch.full((n,), hi_h), generator)
    cut_w = randint(torch.full((n,), lo_w), torch.full((n,), hi_w), generator)
    y0 = randint(torch.zeros(n, dtype=torch.long), H - cut_h + 1, generator)
    x0 = randint(torch.zeros(n, dtype=torch.long), W - cut_w + 1, generator)
    return torch.stack([y0, y0 + cut_h, x0, x0 + cut_w], 1)


def box_token_share(boxes: torch.Tensor, img_size: Tuple[int, int], patch_size: Tuple[int, int]) -> torch.Tensor:
    """Fraction of each patch covered by each pixel box: ``(n, gh, gw)`` float32.

    The overlap of a box with a patch is separable: (overlap rows / ph) · (overlap cols / pw)
    (a last patch clipped by the image border counts its pixels inside the image).
    """
    ph, pw = patch_size
    gh, gw = grid_size(img_size, patch_size)
    y0, y1, x0, x1 = boxes.double().unbind(1)
    top = torch.arange(gh, dtype=torch.float64, device=boxes.device) * ph
    left = torch.arange(gw, dtype=torch.float64, device=boxes.device) * pw
    bottom, right = (top + ph).clamp(max=img_size[0]), (left + pw).clamp(max=img_size[1])  # clipped last patches
    oy = (torch.minimum(y1[:, None], bottom) - torch.maximum(y0[:, None], top)).clamp(min=0) / (bottom - top)
    ox = (torch.minimum(x1[:, None], right) - torch.maximum(x0[:, None], left)).clamp(min=0) / (right - left)
    return (oy[:, :, None] * ox[:, None, :]).float()
