"""λ and boxes, drawn as timm's ``timm/data/mixup.py`` draws them (``rand_bbox``, ``rand_bbox_minmax``),
from an explicit ``torch.Generator`` instead of numpy's global RNG, and the share of each patch a pixel box
covers. Boxes are ``(y0, y1, x0, x1)`` half-open pixel (or token) coordinates.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import numpy as np
import torch
from scipy.special import betaincinv

from .mix import grid_size
from .options import BOX_ROUNDINGS

__all__ = [
    'BOX_ROUNDINGS',
    'check_box_rounding',
    'rand',
    'randint',
    'sample_beta',
    'rand_box',
    'rand_box_one',
    'minmax_sides',
    'rand_box_minmax',
    'box_token_share',
    'box_token_share_one',
]


def check_box_rounding(rounding: str, name: str = 'box_rounding') -> str:
    if rounding not in BOX_ROUNDINGS:
        raise ValueError(f'{name}: expected one of {BOX_ROUNDINGS}, got {rounding!r}')
    return rounding


def rand(n: int, generator: Optional[torch.Generator]) -> torch.Tensor:
    """``n`` uniforms in [0, 1) as float64 from ``generator``."""
    return torch.rand(n, generator=generator, dtype=torch.float64)


def _host(values, dtype) -> np.ndarray:
    """A host array of ``values`` (a tensor on any device, an array, a number or a sequence)."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    return np.asarray(values, dtype=dtype).reshape(-1)


def _randint(low: np.ndarray, high: np.ndarray, generator: Optional[torch.Generator]) -> np.ndarray:
    if (high <= low).any():
        raise ValueError('empty integer range (high <= low)')
    u = rand(low.size, generator).numpy()
    return np.minimum(low + np.floor(u * (high - low)).astype(np.int64), high - 1)


def randint(low, high, generator: Optional[torch.Generator]) -> torch.Tensor:
    """Uniform integers in ``[low, high)`` elementwise (int64); ``high > low`` is required. The arithmetic runs
    on the host in numpy (float64, as torch's): one tensor op, the draw."""
    return torch.from_numpy(_randint(_host(low, np.int64), _host(high, np.int64), generator))


def sample_beta(alpha: float, n: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """``n`` draws of Beta(α, α) as float64, by inverting the CDF of uniforms from ``generator``."""
    if alpha <= 0:
        raise ValueError(f'alpha: Beta(alpha, alpha) needs alpha > 0, got {alpha}')
    u = rand(n, generator)
    return torch.from_numpy(betaincinv(alpha, alpha, u.numpy()))


def rand_box(
    img_size: Tuple[int, int],
    lam,
    generator: Optional[torch.Generator] = None,
    rounding: str = 'timm',
) -> torch.Tensor:
    """timm's ``rand_bbox`` for a vector of λ (a tensor, array or sequence): a box of side ``sqrt(1 - λ)`` times
    the image side, centred uniformly, clipped by the borders. Returns ``(n, 4)`` int64 ``(y0, y1, x0, x1)`` on
    the CPU. ``rounding`` (:data:`BOX_ROUNDINGS`): ``'public'`` gives the authors' pinned timm (``cut // 2`` on
    both sides of the centre). Computed on the host (numpy, float64): the samplers' pair and elem modes draw
    their boxes here with two tensor ops (the centres' rows, then their columns; :func:`rand_box_one` is batch
    mode's one box in Python numbers)."""
    far = 1 if check_box_rounding(rounding, 'rounding') == 'timm' else 0
    H, W = img_size
    ratio = np.sqrt(1.0 - _host(lam, np.float64))
    cut_h, cut_w = (H * ratio).astype(np.int64), (W * ratio).astype(np.int64)
    n = ratio.size
    cy = _randint(np.zeros(n, np.int64), np.full(n, H), generator)
    cx = _randint(np.zeros(n, np.int64), np.full(n, W), generator)
    y0 = np.minimum(np.maximum(cy - cut_h // 2, 0), H)
    y1 = np.minimum(np.maximum(cy + (cut_h + far) // 2, 0), H)
    x0 = np.minimum(np.maximum(cx - cut_w // 2, 0), W)
    x1 = np.minimum(np.maximum(cx + (cut_w + far) // 2, 0), W)
    return torch.from_numpy(np.stack([y0, y1, x0, x1], 1))


def rand_box_one(
    size: Tuple[int, int], lam: float, generator: Optional[torch.Generator] = None, rounding: str = 'timm'
) -> Tuple[int, int, int, int]:
    """:func:`rand_box` for one λ in Python integers (the samplers' batch mode, drawn on the host): the same two
    draws from ``generator`` and the same arithmetic, so both give the same box for a seed."""
    H, W = size
    far = 1 if check_box_rounding(rounding, 'rounding') == 'timm' else 0
    ratio = math.sqrt(1.0 - lam)
    cut_h, cut_w = int(H * ratio), int(W * ratio)
    uy, ux = rand(2, generator).tolist()
    cy, cx = min(math.floor(uy * H), H - 1), min(math.floor(ux * W), W - 1)
    y0, y1 = min(max(cy - cut_h // 2, 0), H), min(max(cy + (cut_h + far) // 2, 0), H)
    x0, x1 = min(max(cx - cut_w // 2, 0), W), min(max(cx + (cut_w + far) // 2, 0), W)
    return y0, y1, x0, x1


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
    """timm's ``rand_bbox_minmax``: box sides uniform in ``[min, max)`` times the image sides (host, as
    :func:`rand_box`)."""
    H, W = img_size
    (lo_h, hi_h), (lo_w, hi_w) = minmax_sides(img_size, minmax)
    cut_h = _randint(np.full(n, lo_h), np.full(n, hi_h), generator)
    cut_w = _randint(np.full(n, lo_w), np.full(n, hi_w), generator)
    y0 = _randint(np.zeros(n, np.int64), H - cut_h + 1, generator)
    x0 = _randint(np.zeros(n, np.int64), W - cut_w + 1, generator)
    return torch.from_numpy(np.stack([y0, y0 + cut_h, x0, x0 + cut_w], 1))


def box_token_share(boxes, img_size: Tuple[int, int], patch_size: Tuple[int, int]) -> torch.Tensor:
    """Fraction of each patch covered by each pixel box ``(n, 4)`` (a tensor, array or sequence of boxes):
    ``(n, gh, gw)`` float32, on the boxes' device (a tensor's; else the CPU). Computed on the host.

    The overlap of a box with a patch is separable: (overlap rows / ph) · (overlap cols / pw)
    (a last patch clipped by the image border counts its pixels inside the image).
    """
    ph, pw = patch_size
    gh, gw = grid_size(img_size, patch_size)
    y0, y1, x0, x1 = _host(boxes, np.float64).reshape(-1, 4).T
    top, left = np.arange(gh, dtype=np.float64) * ph, np.arange(gw, dtype=np.float64) * pw
    bottom, right = np.minimum(top + ph, img_size[0]), np.minimum(left + pw, img_size[1])  # clipped last patches
    oy = np.maximum(np.minimum(y1[:, None], bottom) - np.maximum(y0[:, None], top), 0) / (bottom - top)
    ox = np.maximum(np.minimum(x1[:, None], right) - np.maximum(x0[:, None], left), 0) / (right - left)
    share = torch.from_numpy((oy[:, :, None] * ox[:, None, :]).astype(np.float32))
    return share.to(boxes.device) if isinstance(boxes, torch.Tensor) else share


def box_token_share_one(box: Sequence[int], img_size: Tuple[int, int], patch_size: Tuple[int, int]) -> torch.Tensor:
    """:func:`box_token_share` of one box ``(y0, y1, x0, x1)`` in Python numbers (the separable overlap in doubles,
    rounded once to float32, as there): ``(1, gh, gw)``."""

    def cover(lo: int, hi: int, size: int, side: int) -> list:
        edges = [(c, min(c + size, side)) for c in range(0, side, size)]  # a last patch clipped by the border
        return [max(min(hi, b) - max(lo, a), 0) / (b - a) for a, b in edges]

    (y0, y1, x0, x1), (ph, pw) = box, patch_size
    oy, ox = cover(y0, y1, ph, img_size[0]), cover(x0, x1, pw, img_size[1])
    return torch.tensor([[[a * b for b in ox] for a in oy]], dtype=torch.float32)
