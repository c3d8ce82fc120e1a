"""The mixing core: one *mix* description for every pairwise mixing kind.

Papers:
- MixUp: Beyond Empirical Risk Minimization (https://arxiv.org/abs/1710.09412)
- CutMix (https://arxiv.org/abs/1905.04899); box sampling, λ correction and min/max boxes follow
  timm's ``timm/data/mixup.py`` so that ``cutmix`` here is a drop-in for timm's CutMix
- MixToken (Token Labeling, ``../shared/papers/token-labeling.md`` Sec. 3.3): a box on the token grid
- TokenMix (``tokenmix.md`` Sec. 3.2): blocks of tokens placed one after another (they may touch or
  overlap), or single random tokens, until exactly ``round((1 - λ) · N)`` tokens come from the partner

A :class:`Mix` says who is mixed with whom and where: the partner index of each sample, the share of
each patch token that comes from the partner (fractional where a pixel box cuts a patch, 0/1 for
token masks, the constant ``1 - λ`` for MixUp), and the image-level λ (the share of the sample's own
image, the weight of its own label in the area target). Images, token sequences and targets are all
mixed *from* a mix (:func:`mix_images`, :func:`mix_tokens`, :func:`mix_target`), so a method that
changes only the target (TL-Align, TokenMix's activation targets) reuses the same images.

Conventions (as in timm): λ is the weight of the sample itself; the partner of sample ``i`` is
``B - 1 - i`` (so the batch must be even); pixel boxes are ``(y0, y1, x0, x1)`` half-open.
All randomness comes from an explicit ``torch.Generator`` (``None``: torch's default generator).

This module imports neither timm nor any OpenMMLab package.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Optional, Sequence, Tuple, Union

import numpy as np
import torch
from scipy.special import betaincinv

__all__ = [
    'MIX_KINDS', 'CUT_KINDS', 'Mix', 'MixSampler', 'identity_mix', 'sample_beta', 'rand_box',
    'rand_box_minmax', 'box_token_share', 'grid_box_mask', 'random_token_mask', 'tokenmix_mask',
    'tokenmix_masks', 'one_hot', 'mix_images', 'mix_tokens', 'mix_target', 'pair_target', 'check_labels',
    'check_pairwise_batch', 'to_2tuple',
]

#: kinds whose "cut" branch replaces a region (pixel box, token box, token masks)
CUT_KINDS = ('cutmix', 'token_box', 'tokenmix_block', 'tokenmix_random')
#: every mixing kind a :class:`MixSampler` can draw
MIX_KINDS = ('mixup',) + CUT_KINDS
MODES = ('batch', 'pair', 'elem')

IntPair = Union[int, Sequence[int]]


def to_2tuple(value: IntPair, name: str) -> Tuple[int, int]:
    """``16 -> (16, 16)``; ``(h, w)`` stays; anything else is a ``ValueError`` naming ``name``."""
    if isinstance(value, int) and not isinstance(value, bool):
        out = (value, value)
    elif isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(v, int) for v in value):
        out = (int(value[0]), int(value[1]))
    else:
        raise ValueError(f'{name} must be an int or a pair of ints (h, w), got {value!r}')
    if min(out) <= 0:
        raise ValueError(f'{name} must be positive, got {value!r}')
    return out


# ----------------------------------------------------------------------------------------------
# The mix description
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class Mix:
    """Who is mixed with whom, and where.

    Attributes:
        partner: ``(B,)`` int64, the sample each sample takes its partner content from.
        lam: ``(B,)`` float32, image-level λ: the share of the sample's own image (weight of its own
            label in the area target). 1 means "not mixed".
        token_share: ``(B, gh, gw)`` float32 in [0, 1], the share of each patch token that comes from
            the partner (row-major over the patch grid).
        boxes: ``(B, 4)`` int64 pixel boxes ``(y0, y1, x0, x1)`` for samples mixed by a pixel box
            (CutMix), else ``None``. Their pixel region is the box, not a patch-aligned region.
        box_valid: ``(B,)`` bool, which rows of ``boxes`` apply (the others are blends or token masks).
        img_size: ``(H, W)`` of the images.
        patch_size: ``(ph, pw)`` of the token grid.
        kind: the sampler kind that produced it (``'mixup'``, ``'cutmix'``, ...; ``'none'``).
    """
    partner: torch.Tensor
    lam: torch.Tensor
    token_share: torch.Tensor
    img_size: Tuple[int, int]
    patch_size: Tuple[int, int]
    kind: str = 'none'
    boxes: Optional[torch.Tensor] = None
    box_valid: Optional[torch.Tensor] = None

    @property
    def batch_size(self) -> int:
        return self.partner.shape[0]

    @property
    def grid_size(self) -> Tuple[int, int]:
        return tuple(self.token_share.shape[1:])

    @property
    def num_tokens(self) -> int:
        gh, gw = self.grid_size
        return gh * gw

    def token_share_flat(self) -> torch.Tensor:
        """Partner share per patch token, ``(B, N)``, row-major over the grid."""
        return self.token_share.flatten(1)

    def pixel_share(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Partner share per pixel, ``(B, 1, H, W)``: token shares upsampled to their patches, and the
        exact pixel box for CutMix samples."""
        ph, pw = self.patch_size
        share = self.token_share.to(dtype)
        H, W = self.img_size
        share = share.repeat_interleave(ph, dim=1).repeat_interleave(pw, dim=2)[:, :H, :W]
        if self.boxes is not None:
            ys = torch.arange(H, device=share.device)
            xs = torch.arange(W, device=share.device)
            y0, y1, x0, x1 = self.boxes.unbind(1)
            inside = ((ys[None, :, None] >= y0[:, None, None]) & (ys[None, :, None] < y1[:, None, None])
                      & (xs[None, None, :] >= x0[:, None, None]) & (xs[None, None, :] < x1[:, None, None]))
            share = torch.where(self.box_valid[:, None, None], inside.to(dtype), share)
        return share.unsqueeze(1)

    def _map(self, fn) -> 'Mix':
        return replace(self, **{f.name: fn(getattr(self, f.name)) for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})

    def to(self, device, non_blocking: bool = False) -> 'Mix':
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> 'Mix':
        return self._map(lambda t: t.pin_memory())


def identity_mix(batch_size: int, img_size: IntPair, patch_size: IntPair = 16,
                 device=None) -> Mix:
    """The mix that mixes nothing (λ = 1 everywhere)."""
    img_size, patch_size = to_2tuple(img_size, 'img_size'), to_2tuple(patch_size, 'patch_size')
    gh, gw = grid_size(img_size, patch_size)
    return Mix(partner=torch.arange(batch_size, device=device),
               lam=torch.ones(batch_size, device=device),
               token_share=torch.zeros(batch_size, gh, gw, device=device),
               img_size=img_size, patch_size=patch_size, kind='none')


# ----------------------------------------------------------------------------------------------
# Input checks shared by every adapter
# ----------------------------------------------------------------------------------------------

def check_pairwise_batch(batch_size: int, name: str = 'x') -> None:
    if batch_size % 2 != 0 or batch_size == 0:
        raise ValueError(f'{name}: pairwise mixing pairs sample i with B-1-i and needs an even, '
                         f'non-empty batch; got batch size {batch_size}')


def check_labels(labels: torch.Tensor, num_classes: int, name: str = 'target') -> None:
    """A 1-d integer tensor of class indices in ``[0, num_classes)``. The range is checked where the labels
    are on the CPU (the collates and loaders of tokenaug check them there): on an accelerator the check
    would stall every training step on a device sync, and the device's own index check still fails loudly."""
    if labels.dim() != 1 or labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f'{name}: expected a 1-d integer tensor of class indices, '
                         f'got dtype {labels.dtype} and shape {tuple(labels.shape)}')
    if labels.numel() and labels.device.type == 'cpu' and \
            (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        raise ValueError(f'{name}: class indices must lie in [0, num_classes={num_classes}), '
                         f'got min {int(labels.min())} and max {int(labels.max())}')


def grid_size(img_size: Tuple[int, int], patch_size: Tuple[int, int]) -> Tuple[int, int]:
    """The token grid over an image: whole patches, plus a clipped last row/column where the patch size
    does not divide the image (only blends and pixel boxes are defined there, see :class:`MixSampler`)."""
    return (-(-img_size[0] // patch_size[0]), -(-img_size[1] // patch_size[1]))


def divides(img_size: Tuple[int, int], patch_size: Tuple[int, int]) -> bool:
    return img_size[0] % patch_size[0] == 0 and img_size[1] % patch_size[1] == 0


def check_image_size(img_size: Tuple[int, int], patch_size: Tuple[int, int], name: str = 'x') -> None:
    if img_size[0] % patch_size[0] or img_size[1] % patch_size[1]:
        raise ValueError(f'{name}: image size {img_size[0]}x{img_size[1]} is not divisible by '
                         f'patch_size {patch_size[0]}x{patch_size[1]}; token-aware mixing needs a whole '
                         f'patch grid')


# ----------------------------------------------------------------------------------------------
# Samplers: λ, boxes and token masks
# ----------------------------------------------------------------------------------------------

def _rand(n: int, generator: Optional[torch.Generator]) -> torch.Tensor:
    return torch.rand(n, generator=generator, dtype=torch.float64)


def _randint(low: torch.Tensor, high: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """Uniform integers in ``[low, high)`` elementwise; ``high > low`` is required."""
    if bool((high <= low).any()):
        raise ValueError('empty integer range (high <= low)')
    u = _rand(low.numel(), generator)
    return (low + (u * (high - low)).floor().long()).clamp(max=high - 1)


def sample_beta(alpha: float, n: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """``n`` draws of Beta(α, α) as float64, by inverting the CDF of uniforms from ``generator``."""
    if alpha <= 0:
        raise ValueError(f'alpha: Beta(alpha, alpha) needs alpha > 0, got {alpha}')
    u = _rand(n, generator)
    return torch.from_numpy(betaincinv(alpha, alpha, u.numpy()))


def rand_box(img_size: Tuple[int, int], lam: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """timm's ``rand_bbox`` for a vector of λ: a box of side ``sqrt(1 - λ)`` times the image side,
    centred uniformly, clipped by the borders. Returns ``(n, 4)`` int64 ``(y0, y1, x0, x1)``."""
    H, W = img_size
    ratio = torch.sqrt(1. - lam.double())
    cut_h, cut_w = (H * ratio).long(), (W * ratio).long()
    n = lam.numel()
    cy = _randint(torch.zeros(n, dtype=torch.long), torch.full((n,), H), generator)
    cx = _randint(torch.zeros(n, dtype=torch.long), torch.full((n,), W), generator)
    y0 = (cy - cut_h // 2).clamp(0, H)
    y1 = (cy + (cut_h + 1) // 2).clamp(0, H)
    x0 = (cx - cut_w // 2).clamp(0, W)
    x1 = (cx + (cut_w + 1) // 2).clamp(0, W)
    return torch.stack([y0, y1, x0, x1], 1)


def minmax_sides(img_size: Tuple[int, int], minmax: Sequence[float]) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    """timm's box side ranges ``[int(side·min), int(side·max))``; an empty one is an error."""
    H, W = img_size
    lo_h, hi_h = int(H * minmax[0]), int(H * minmax[1])
    lo_w, hi_w = int(W * minmax[0]), int(W * minmax[1])
    if lo_h >= hi_h or lo_w >= hi_w:
        raise ValueError(f'cutmix_minmax {tuple(minmax)} gives an empty range of box sides on a {H}x{W} image '
                         f'(heights [{lo_h}, {hi_h}), widths [{lo_w}, {hi_w})): widen it')
    return (lo_h, hi_h), (lo_w, hi_w)


def rand_box_minmax(img_size: Tuple[int, int], minmax: Sequence[float], n: int,
                    generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """timm's ``rand_bbox_minmax``: box sides uniform in ``[min, max)`` times the image sides."""
    H, W = img_size
    (lo_h, hi_h), (lo_w, hi_w) = minmax_sides(img_size, minmax)
    cut_h = _randint(torch.full((n,), lo_h), torch.full((n,), hi_h), generator)
    cut_w = _randint(torch.full((n,), lo_w), torch.full((n,), hi_w), generator)
    y0 = _randint(torch.zeros(n, dtype=torch.long), H - cut_h + 1, generator)
    x0 = _randint(torch.zeros(n, dtype=torch.long), W - cut_w + 1, generator)
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


def grid_box_mask(grid_size: Tuple[int, int], lam: torch.Tensor,
                  generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """MixToken's box on the token grid: :func:`rand_box` applied to the ``(gh, gw)`` grid.
    Returns ``(n, gh, gw)`` bool (True = token from the partner)."""
    gh, gw = grid_size
    boxes = rand_box(grid_size, lam, generator)
    ys = torch.arange(gh)[None, :, None]
    xs = torch.arange(gw)[None, None, :]
    y0, y1, x0, x1 = (b[:, None, None] for b in boxes.unbind(1))
    return (ys >= y0) & (ys < y1) & (xs >= x0) & (xs < x1)


def random_token_mask(grid_size: Tuple[int, int], num_masked: torch.Tensor,
                      generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """TokenMix's *random* variant: exactly ``num_masked[i]`` tokens, uniformly without replacement.
    Returns ``(n, gh, gw)`` bool."""
    gh, gw = grid_size
    n = num_masked.numel()
    rank = torch.rand(n, gh * gw, generator=generator).argsort(1).argsort(1)
    return (rank < num_masked[:, None]).view(n, gh, gw)


# TokenMix block masks (tokenmix.md Sec. 3.2) --------------------------------------------------

#: part rounds before a still unfinished mask gets one finishing part (see :func:`tokenmix_masks`)
TOKENMIX_MAX_ROUNDS = 64


def _tokenmix_candidates(num_tokens: int, fewest_free: int) -> int:
    """Candidate parts drawn per unfinished mask in one round, from the fewest free tokens among those
    masks: 1 while more than half the grid is free, then ``2^floor(log2(num_tokens / fewest_free))``, at
    most 64. The first candidate that adds a token is placed, so this sets the speed, not the result's
    distribution."""
    return 1 << min(6, int(math.log2(num_tokens / fewest_free)))


def _tokenmix_part_sides(size: np.ndarray, ratio: np.ndarray, gh: int, gw: int) -> Tuple[np.ndarray, np.ndarray]:
    """Integer sides ``(h, w)`` of a part of ``size`` tokens and aspect ratio ``h / w ≈ ratio`` on a
    ``gh x gw`` grid, with ``h · w >= size`` for any ``size <= gh · gw``: both real sides
    ``sqrt(size · ratio)``, ``sqrt(size / ratio)`` are rounded (and clamped to the grid); if that is
    short of ``size``, the side rounded down more (relative to its length) grows to
    ``ceil(size / other side)``, and if the grid clamps it, the other side grows. Symmetric in h and w,
    so ``log(h / w)`` stays centred on ``log(ratio)``; ``h / w = ratio`` up to integer rounding except
    where a side is clamped by the grid."""
    h_real, w_real = np.sqrt(size * ratio), np.sqrt(size / ratio)
    h = np.minimum(np.maximum(np.rint(h_real), 1), gh)
    w = np.minimum(np.maximum(np.rint(w_real), 1), gw)
    short = h * w < size
    grow_h = short & (h_real * w >= w_real * h)  # h_real / h >= w_real / w
    h = np.where(grow_h, np.minimum(np.ceil(size / w), gh), h)
    w = np.where(short & ~grow_h, np.minimum(np.ceil(size / h), gw), w)
    still = h * w < size  # the grown side was clamped by the grid
    h, w = np.where(still & ~grow_h, np.ceil(size / w), h), np.where(still & grow_h, np.ceil(size / h), w)
    return h.astype(np.int64), w.astype(np.int64)


def _compact_first(free: np.ndarray, count: np.ndarray, cy2: np.ndarray, cx2: np.ndarray, h: np.ndarray,
                   w: np.ndarray, gh: int, gw: int) -> np.ndarray:
    """The first ``count[i]`` cells of ``free[i]`` (``(c, N)`` bool) in compact order around the point
    ``(cy2 / 2, cx2 / 2)`` (in cells; ``cy2``, ``cx2`` integers): with ``dy``, ``dx`` the distances of a
    cell's centre from it, cells come by ``max(dy / h, dx / w)`` (rings shaped like an ``h x w`` box),
    then by ``min(dy / h, dx / w)`` (edge middles before corners), then in raster order. Every prefix of
    this order is 4-connected (through the point's cell or cells), so a clipped part is one compact blob.
    Exact integer keys. Returns ``(c, N)`` bool."""
    N = gh * gw
    cell_y2 = np.repeat(2 * np.arange(gh) + 1, gw)  # twice the cell centres
    cell_x2 = np.tile(2 * np.arange(gw) + 1, gh)
    ay = np.abs(cell_y2 - cy2[:, None]) * w[:, None]  # 2 h w · dy / h
    ax = np.abs(cell_x2 - cx2[:, None]) * h[:, None]  # 2 h w · dx / w
    key = np.maximum(ay, ax) * (2 * N + 1) + np.minimum(ay, ax)  # both <= 2 N: an exact lexicographic key
    key[~free] = np.iinfo(np.int64).max
    order = np.argsort(key, axis=1, kind='stable')
    out = np.zeros_like(free)
    np.put_along_axis(out, order, np.arange(N) < count[:, None], axis=1)
    return out


def _is_int(v, low: int) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) and v >= low


def _check_tokenmix_args(grid_size, min_tokens, aspect) -> Tuple[int, int]:
    if not isinstance(grid_size, (tuple, list)) or len(grid_size) != 2 or not all(_is_int(s, 1) for s in grid_size):
        raise ValueError(f'grid_size must be two positive ints (grid_h, grid_w), got {grid_size!r}')
    if min_tokens is not None and not _is_int(min_tokens, 1):
        raise ValueError(f'min_tokens must be an int >= 1, got {min_tokens!r}')
    if (not isinstance(aspect, (tuple, list)) or len(aspect) != 2
            or not all(isinstance(a, (int, float, np.integer, np.floating)) and not isinstance(a, (bool, np.bool_))
                       and math.isfinite(a) and a > 0 for a in aspect)
            or aspect[0] > aspect[1]):
        raise ValueError(f'aspect must be (low, high) with 0 < low <= high, got {aspect!r}')
    return int(grid_size[0]), int(grid_size[1])


def tokenmix_mask(grid_h: int, grid_w: int, num_masked: int, *, generator: Optional[torch.Generator] = None,
                  min_tokens: int = 14, aspect: Tuple[float, float] = (0.3, 1 / 0.3)) -> torch.Tensor:
    """One TokenMix block mask: bool ``(grid_h, grid_w)`` with exactly ``num_masked`` True;
    :func:`tokenmix_masks` for a batch of one (note the fixed default ``min_tokens=14``)."""
    for name, v in (('grid_h', grid_h), ('grid_w', grid_w)):
        if not _is_int(v, 1):
            raise ValueError(f'{name} must be a positive int, got {v!r}')
    N = grid_h * grid_w
    if not _is_int(num_masked, 0) or num_masked > N:
        raise ValueError(f'num_masked must be an int in [0, {N}] for a {grid_h}x{grid_w} grid, got {num_masked!r}')
    return tokenmix_masks((int(grid_h), int(grid_w)), torch.tensor([int(num_masked)]), generator, min_tokens,
                          aspect)[0]


def tokenmix_masks(grid_size: Tuple[int, int], num_masked: torch.Tensor,
                   generator: Optional[torch.Generator] = None, min_tokens: Optional[int] = None,
                   aspect: Tuple[float, float] = (0.3, 1 / 0.3)) -> torch.Tensor:
    """TokenMix's *block* masks (tokenmix.md Sec. 3.2) for a batch: ``(n, gh, gw)`` bool, mask ``i``
    with exactly ``num_masked[i]`` True (True = token from the partner).

    A mask is built from parts placed one after another, as in BEiT's block masking (tokenmix.md
    ref. [1]) but with an exact count: with ``m = min(min_tokens, N)`` tokens and ``R`` still to mask,
    a part draws its size ``s ~ U[m, max(m, R)]`` and its aspect ratio ``h / w`` log-uniform in
    ``aspect``; its rectangle is ``h x w`` with ``h · w >= s`` (:func:`_tokenmix_part_sides`) at a
    uniform position. Parts may overlap; only their not-yet-masked tokens count. A part that would add
    no token would change nothing and is drawn again (candidates are drawn in bulk and the first that
    adds a token is placed), so the masks are distributed as with endless redrawing.

    Exact count: a part whose new tokens fit in ``R`` is painted whole; a part with more new tokens
    than ``R`` is the mask's last and is clipped to exactly ``R`` of its new tokens, taken from the
    centre of its rectangle outwards (:func:`_compact_first`: rings shaped like the rectangle, edge
    middles before corners, then raster order), so the clipped part stays one compact 4-connected
    blob (with the masked cells it overlaps) of about its own aspect ratio.

    Guarantees: every part's rectangle has at least ``m`` cells; every part but a mask's last is
    painted whole, so its ``>= m`` cells all end up masked; the last part masks exactly the ``R`` that
    remained before it. Hence whenever at least ``m`` tokens remain, the next part leaves at least
    ``m`` cells of its rectangle masked, and with ``num_masked <= m`` the mask is one 4-connected
    blob. The drawn ratio is log-uniform; a rectangle's ``h / w`` follows it up to integer rounding,
    except where a side is clamped by the grid (large parts on small or narrow grids).

    A mask still unfinished after :data:`TOKENMIX_MAX_ROUNDS` rounds (none in 10^5 masks at 14x14;
    a few per 1000 near-full masks at 32x32) gets one finishing part: its ``R`` free cells nearest a
    uniformly drawn free cell, in the compact order of a part with a drawn size and ratio.

    Vectorised over the batch with numpy; the Python loop runs over part rounds only (about 12 at
    λ = 0.5 on 14x14, every mask of the batch at once). ``min_tokens`` defaults to 14 on a 14x14 grid,
    scaled by the grid area otherwise (at least 1); only the token grid matters, not the patch size.
    All randomness comes from ``generator``: the same generator state gives the same masks.
    """
    gh, gw = _check_tokenmix_args(grid_size, min_tokens, aspect)
    N = gh * gw
    k = torch.as_tensor(num_masked)
    if k.dim() != 1 or k.dtype.is_floating_point or k.dtype.is_complex or k.dtype == torch.bool:
        raise ValueError(f'num_masked must be a 1-D integer tensor, got a {k.dim()}-D {k.dtype} tensor')
    k = k.cpu().numpy().astype(np.int64)
    if k.size and (k.min() < 0 or k.max() > N):
        raise ValueError(f'num_masked must be in [0, {N}] for a {gh}x{gw} grid, got values in [{k.min()}, {k.max()}]')
    if min_tokens is None:
        min_tokens = max(1, round(14 * N / 196))
    m = min(min_tokens, N)
    n = k.size
    log_lo = math.log(aspect[0])
    log_span = math.log(aspect[1]) - log_lo
    ys, xs = np.arange(gh), np.arange(gw)
    mask = np.zeros((n, N), dtype=bool)
    mask[k == N] = True  # a full mask is full whatever its parts
    rem = np.where(k == N, 0, k)  # R: tokens still to mask
    last = []  # each mask's last part, clipped after the loop (one batched sort)
    for _ in range(TOKENMIX_MAX_ROUNDS):
        act = np.flatnonzero(rem)
        if act.size == 0:
            break
        r = rem[act]
        a, K = act.size, _tokenmix_candidates(N, N - int((k[act] - r).max()))
        u = torch.rand(4, a, K, generator=generator, dtype=torch.float64).numpy()
        size = u[0] * (np.maximum(r, m) - m)[:, None] + m  # U[m, max(m, R)]
        h, w = _tokenmix_part_sides(size, np.exp(u[1] * log_span + log_lo), gh, gw)  # log-uniform h / w
        top = (u[2] * (gh + 1 - h)).astype(np.int64)  # uniform positions
        left = (u[3] * (gw + 1 - w)).astype(np.int64)
        # rows[i, c, y]: top <= y < top + h (one unsigned compare); cols likewise
        rows = (ys - top[..., None]).view(np.uint64) < h.view(np.uint64)[..., None]  # (a, K, gh)
        cols = (xs - left[..., None]).view(np.uint64) < w.view(np.uint64)[..., None]  # (a, K, gw)
        free = ~mask[act]
        if K > 1:  # new tokens of each candidate, rows · free · cols (exact in float32); the first that adds one
            cnt = np.einsum('akx,akx->ak', rows.astype(np.float32) @ free.reshape(a, gh, gw).astype(np.float32),
                            cols.astype(np.float32))
            pick = np.arange(a), (cnt > 0).argmax(1)  # none adds a token: candidate 0, a no-op
        else:
            pick = slice(None), 0
        h, w, top, left, rows, cols = h[pick], w[pick], top[pick], left[pick], rows[pick], cols[pick]
        new = (rows[:, :, None] & cols[:, None, :]).reshape(a, N) & free
        cnt = new.view(np.uint8).sum(1, dtype=np.int64)
        over = np.flatnonzero(cnt > r)
        if over.size:  # these masks' last part: clipped to R after the loop
            last.append((act[over], new[over], r[over], 2 * top[over] + h[over], 2 * left[over] + w[over],
                         h[over], w[over]))
            new[over] = False
            cnt[over] = r[over]
        mask[act] = ~free | new
        rem[act] = r - cnt
    if last:
        b, new, r, cy2, cx2, h, w = (np.concatenate(v) for v in zip(*last))
        mask[b] |= _compact_first(new, r, cy2, cx2, h, w, gh, gw)
    act = np.flatnonzero(rem)
    if act.size:  # finishing part around a uniformly drawn free cell
        r = rem[act]
        u = torch.rand(3, act.size, generator=generator, dtype=torch.float64).numpy()
        h, w = _tokenmix_part_sides(u[0] * (np.maximum(r, m) - m) + m, np.exp(u[1] * log_span + log_lo), gh, gw)
        free = ~mask[act]
        nth = (u[2] * free.sum(1)).astype(np.int64)
        anchor = (np.cumsum(free, 1) > nth[:, None]).argmax(1)  # the nth free cell in raster order
        mask[act] |= _compact_first(free, r, 2 * (anchor // gw) + 1, 2 * (anchor % gw) + 1, h, w, gh, gw)
    return torch.from_numpy(mask.reshape(n, gh, gw))


# ----------------------------------------------------------------------------------------------
# The sampler: timm's Mixup parameter logic, any cut kind
# ----------------------------------------------------------------------------------------------

class MixSampler:
    """Draws a :class:`Mix` with timm ``Mixup``'s parameter logic.

    ``kind`` names the *cut* branch: ``'cutmix'`` (pixel box, timm's λ correction and min/max
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
    """

    def __init__(self, kind: str = 'mixup', *, mixup_alpha: float = 1., cutmix_alpha: float = 0.,
                 cutmix_minmax: Optional[Sequence[float]] = None, prob: float = 1.0,
                 switch_prob: float = 0.5, mode: str = 'batch', correct_lam: bool = True,
                 patch_size: IntPair = 16, tokenmix_lam: Optional[float] = None,
                 tokenmix_min_tokens: Optional[int] = None):
        if kind not in MIX_KINDS:
            raise ValueError(f'mixup_type must be one of {MIX_KINDS}, got {kind!r}')
        if mode not in MODES:
            raise ValueError(f'mode must be one of {MODES}, got {mode!r}')
        if not 0. <= prob <= 1.:
            raise ValueError(f'prob must be in [0, 1], got {prob}')
        if not 0. <= switch_prob <= 1.:
            raise ValueError(f'switch_prob must be in [0, 1], got {switch_prob}')
        if mixup_alpha < 0 or cutmix_alpha < 0:
            raise ValueError(f'mixup_alpha and cutmix_alpha must be >= 0, got {mixup_alpha}, {cutmix_alpha}')
        if cutmix_minmax is not None:
            if kind != 'cutmix':
                raise ValueError(f"cutmix_minmax applies to mixup_type='cutmix' only, got {kind!r}")
            if len(cutmix_minmax) != 2 or not 0 < cutmix_minmax[0] < cutmix_minmax[1] <= 1:
                raise ValueError(f'cutmix_minmax must be (min, max) with 0 < min < max <= 1, got {cutmix_minmax}')
            cutmix_alpha = 1.0  # as timm: minmax forces the cut branch on
        if tokenmix_lam is not None:
            if not kind.startswith('tokenmix'):
                raise ValueError(f"tokenmix_lam applies to the TokenMix kinds only, got mixup_type={kind!r}")
            if not 0. <= tokenmix_lam <= 1.:
                raise ValueError(f'tokenmix_lam must be in [0, 1], got {tokenmix_lam}')
        if kind == 'mixup' and cutmix_alpha > 0:
            raise ValueError("cutmix_alpha: mixup_type='mixup' only blends; use mixup_type='cutmix' "
                             "(with mixup_alpha > 0) for timm's MixUp/CutMix switching")
        if mixup_alpha <= 0 and cutmix_alpha <= 0 and tokenmix_lam is None:
            raise ValueError(f'mixup_alpha and cutmix_alpha are both 0: nothing to mix for mixup_type={kind!r} '
                             f'(MixUp is active when mixup_alpha > 0, the {kind!r} cut when cutmix_alpha > 0)')
        self.kind = kind
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
        self.mixup_enabled = True  # timm's train loop switches this off after --mixup-off-epoch

    @property
    def has_blend(self) -> bool:
        return self.mixup_alpha > 0

    @property
    def has_cut(self) -> bool:
        return self.kind != 'mixup' and (self.cutmix_alpha > 0 or self.tokenmix_lam is not None)

    def _unit_params(self, n: int, generator) -> Tuple[torch.Tensor, torch.Tensor]:
        """λ (float64) and use-cut (bool) for ``n`` parameter units; λ = 1 where not mixed."""
        lam = torch.ones(n, dtype=torch.float64)
        use_cut = torch.zeros(n, dtype=torch.bool)
        if not self.mixup_enabled or n == 0:
            return lam, use_cut
        active = _rand(n, generator) < self.mix_prob
        if self.has_blend and self.has_cut:
            use_cut = _rand(n, generator) < self.switch_prob
        elif self.has_cut:
            use_cut = torch.ones(n, dtype=torch.bool)
        lam_blend = sample_beta(self.mixup_alpha, n, generator) if self.has_blend else lam
        if self.has_cut and self.kind.startswith('tokenmix') and self.tokenmix_lam is not None:
            lam_cut = torch.full((n,), float(self.tokenmix_lam), dtype=torch.float64)
        elif self.has_cut:
            lam_cut = sample_beta(self.cutmix_alpha, n, generator)
        else:
            lam_cut = lam
        lam = torch.where(active, torch.where(use_cut, lam_cut, lam_blend), lam)
        return lam, use_cut & active

    def sample(self, batch_size: int, img_size: IntPair, generator: Optional[torch.Generator] = None,
               device=None) -> Mix:
        """A mix for a batch of ``batch_size`` images of ``img_size``."""
        check_pairwise_batch(batch_size)
        img_size = to_2tuple(img_size, 'img_size')
        if self.kind not in ('mixup', 'cutmix'):
            check_image_size(img_size, self.patch_size)
        if self.cutmix_minmax is not None:
            minmax_sides(img_size, self.cutmix_minmax)  # fail on every batch, not only when a box is drawn
        n = {'batch': 1, 'pair': batch_size // 2, 'elem': batch_size}[self.mode]
        lam, use_cut = self._unit_params(n, generator)
        grid = grid_size(img_size, self.patch_size)
        N = grid[0] * grid[1]
        share = (1. - lam).float()[:, None, None].expand(n, *grid).clone()
        boxes = valid = None
        cut = use_cut.nonzero().flatten()
        if cut.numel():
            lam_c = lam[cut]
            if self.kind == 'cutmix':
                if self.cutmix_minmax is not None:
                    b = rand_box_minmax(img_size, self.cutmix_minmax, cut.numel(), generator)
                else:
                    b = rand_box(img_size, lam_c, generator)
                if self.correct_lam or self.cutmix_minmax is not None:
                    area = (b[:, 1] - b[:, 0]) * (b[:, 3] - b[:, 2])
                    lam_c = 1. - area.double() / (img_size[0] * img_size[1])
                share[cut] = box_token_share(b, img_size, self.patch_size)
                boxes = torch.zeros(n, 4, dtype=torch.long)
                boxes[cut] = b
                valid = use_cut
            else:
                if self.kind == 'token_box':
                    m = grid_box_mask(grid, lam_c, generator)
                else:
                    k = torch.round((1. - lam_c) * N).long()
                    if self.kind == 'tokenmix_block':
                        m = tokenmix_masks(grid, k, generator, self.tokenmix_min_tokens)
                    else:
                        m = random_token_mask(grid, k, generator)
                share[cut] = m.float()
                lam_c = 1. - m.flatten(1).sum(1).double() / N
            lam = lam.clone()
            lam[cut] = lam_c
        # expand parameter units to samples
        if self.mode == 'batch':
            idx = torch.zeros(batch_size, dtype=torch.long)
        elif self.mode == 'pair':
            half = torch.arange(batch_size // 2)
            idx = torch.cat([half, half.flip(0)])
        else:
            idx = torch.arange(batch_size)
        mix = Mix(partner=torch.arange(batch_size - 1, -1, -1), lam=lam[idx].float(),
                  token_share=share[idx], img_size=img_size, patch_size=self.patch_size,
                  kind=self.kind if self.mixup_enabled else 'none',
                  boxes=None if boxes is None else boxes[idx], box_valid=None if valid is None else valid[idx])
        return mix if device is None else mix.to(device)


# ----------------------------------------------------------------------------------------------
# Applying a mix
# ----------------------------------------------------------------------------------------------

def mix_images(x: torch.Tensor, mix: Mix) -> torch.Tensor:
    """Mixed images: each pixel is ``x · (1 - s) + x[partner] · s`` with ``s`` its partner share.

    Where ``s`` is 0 or 1 the output pixel is exactly the sample's or the partner's (boxes and token
    masks copy, no arithmetic); blends are ``torch.lerp(x, x[partner], 1 - λ)``, equal to timm's
    ``x · λ + x_flip · (1 - λ)`` up to float rounding. Integer images (uint8, the fast-collate path)
    are selected directly and blended in float then rounded, as timm's fast collate does.
    ``x`` is not modified.
    """
    if x.dim() != 4 or tuple(x.shape[-2:]) != tuple(mix.img_size) or x.shape[0] != mix.batch_size:
        raise ValueError(f'x: expected images (B={mix.batch_size}, C, {mix.img_size[0]}, {mix.img_size[1]}) '
                         f'for this mix, got {tuple(x.shape)}')
    dev = x.device
    partner = mix.partner.to(dev, non_blocking=True)
    share = mix.token_share.to(dev, non_blocking=True)
    # the row plan reads the mix where it lives (the samplers build it on the CPU: no device sync)
    n_box = int(mix.box_valid.sum()) if mix.boxes is not None else 0
    is_box = mix.box_valid.to(dev, non_blocking=True) if n_box else None
    if n_box == mix.batch_size:  # every row a pixel box: copy, then paste the boxes
        out = x.clone()
    else:  # token shares (blends, masks, token boxes) on a patch view; box rows keep their own pixels here
        if n_box:
            share = share.masked_fill(is_box[:, None, None], 0.)
        out = _mix_token_rows(x, partner, share, mix.patch_size)
    if n_box:
        boxes, valid = mix.boxes.tolist(), mix.box_valid.tolist()
        if n_box == mix.batch_size and all(b == boxes[0] for b in boxes):  # batch mode: one box
            y0, y1, x0, x1 = boxes[0]
            out[:, :, y0:y1, x0:x1] = x[:, :, y0:y1, x0:x1].index_select(0, partner)
        else:
            for b, (p, (y0, y1, x0, x1), v) in enumerate(zip(mix.partner.tolist(), boxes, valid)):
                if v:
                    out[b, :, y0:y1, x0:x1] = x[p, :, y0:y1, x0:x1]
    return out


def _mix_token_rows(x: torch.Tensor, partner: torch.Tensor, share: torch.Tensor, patch_size) -> torch.Tensor:
    """Mix images by a per-token partner share, on a patch view (no per-pixel share is materialised),
    writing into the gathered partners ``xp`` (a fresh tensor): large fresh allocations cost page
    faults on the CPU, so the result reuses that buffer."""
    xp = x.index_select(0, partner)
    B, C, H, W = x.shape
    gh, gw = share.shape[1:]
    ph, pw = patch_size
    if gh * ph == H and gw * pw == W:
        x6, xp6 = x.view(B, C, gh, ph, gw, pw), xp.view(B, C, gh, ph, gw, pw)
        s6 = share.view(B, 1, gh, 1, gw, 1)
    else:  # clipped grid: only MixUp/CutMix get here, whose token rows are constant (blends)
        x6, xp6, s6 = x, xp, share[:, :1, :1].view(B, 1, 1, 1)
    if x.dtype.is_floating_point:
        # xp + (x - xp) · (1 - s): exactly xp where s = 1 and exactly x where s = 0 (torch.lerp's rule)
        xp6.lerp_(x6, (1. - s6).to(x.dtype))
    else:  # integer images: select where every share of a chunk is 0/1, else blend in float and round
        binary = ((share == 0) | (share == 1)).flatten(1).all(1).tolist()
        for i in range(0, B, 8):  # a few rows at a time: small, reused float buffers
            sl = slice(i, i + 8)
            if all(binary[sl]):
                torch.where(s6[sl] > 0.5, xp6[sl], x6[sl], out=xp6[sl])
            else:
                xp6[sl] = torch.lerp(x6[sl].float(), xp6[sl].float(), s6[sl]).round_().to(x.dtype)
    return xp


def mix_tokens(tokens: torch.Tensor, mix: Mix) -> torch.Tensor:
    """Mix patch-token sequences ``(B, N, D)`` (row-major grid, no class token) by the token shares:
    ``t · (1 - s) + t[partner] · s``. For 0/1 token masks this is the token swap of MixToken/TokenMix."""
    if tokens.dim() != 3 or tokens.shape[0] != mix.batch_size or tokens.shape[1] != mix.num_tokens:
        raise ValueError(f'tokens: expected (B={mix.batch_size}, N={mix.num_tokens}, D) patch tokens, '
                         f'got {tuple(tokens.shape)}')
    s = mix.token_share_flat().to(tokens.device, tokens.dtype).unsqueeze(-1)
    return torch.addcmul(tokens * (1. - s), tokens[mix.partner.to(tokens.device)], s)


def one_hot(labels: torch.Tensor, num_classes: int, smoothing: float = 0.) -> torch.Tensor:
    """Label-smoothed one-hot rows (timm's convention: off = ε/C, on = 1 - ε + ε/C); rows sum to 1."""
    off = smoothing / num_classes
    out = torch.full((labels.shape[0], num_classes), off, device=labels.device)
    return out.scatter_(1, labels.long().view(-1, 1), 1. - smoothing + off)


def pair_target(labels: torch.Tensor, partner: torch.Tensor, lam: torch.Tensor, num_classes: int,
                smoothing: float = 0.) -> torch.Tensor:
    """``λ · y + (1 - λ) · y[partner]`` with label smoothing: ``(B, C)`` float32, rows sum to 1.
    ``lam`` is the weight of each sample's own label (a scalar or ``(B,)``)."""
    if not 0. <= smoothing < 1.:
        raise ValueError(f'label_smoothing must be in [0, 1), got {smoothing}')
    check_labels(labels, num_classes)
    y = one_hot(labels, num_classes, smoothing)
    lam = torch.as_tensor(lam, dtype=torch.float32).to(y.device).reshape(-1, 1)
    return y * lam + y[partner.to(y.device)] * (1. - lam)


def mix_target(labels: torch.Tensor, mix: Mix, num_classes: int, smoothing: float = 0.) -> torch.Tensor:
    """The area target ``λ · y + (1 - λ) · y[partner]`` with label smoothing: ``(B, C)`` float32,
    every row sums to 1."""
    return pair_target(labels, mix.partner, mix.lam, num_classes, smoothing)
