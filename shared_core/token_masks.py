"""Token masks on the patch grid: MixToken's box (Token Labeling Sec. 3.3), TokenMix's random and block
masks (the TokenMix paper, Sec. 3.2: blocks of tokens placed one after another, they may touch or overlap,
until exactly ``round((1 - λ) · N)`` tokens come from the partner). True = token from the partner.

All randomness comes from an explicit ``torch.Generator`` (``None``: torch's default generator).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import numpy as np
import torch

from .boxes import rand, rand_box
from .options import TOKENMIX_RULES

__all__ = [
    'TOKENMIX_RULES',
    'grid_box_mask',
    'random_token_mask',
    'tokenmix_masks',
    'tokenmix_public_count',
    'tokenmix_masks_public',
    'TOKENMIX_MAX_ROUNDS',
    'num_dropped',
    'patch_ranks',
    'occlusion_mask',
    'batch_masks',
]


def grid_box_mask(
    grid_size: Tuple[int, int], lam: torch.Tensor, generator: Optional[torch.Generator] = None, rounding: str = 'timm'
) -> torch.Tensor:
    """MixToken's box on the token grid: :func:`rand_box` applied to the ``(gh, gw)`` grid (``rounding``
    as there). Returns ``(n, gh, gw)`` bool (True = token from the partner)."""
    gh, gw = grid_size
    boxes = rand_box(grid_size, lam, generator, rounding)
    ys = torch.arange(gh)[None, :, None]
    xs = torch.arange(gw)[None, None, :]
    y0, y1, x0, x1 = (b[:, None, None] for b in boxes.unbind(1))
    return (ys >= y0) & (ys < y1) & (xs >= x0) & (xs < x1)


def random_token_mask(
    grid_size: Tuple[int, int], num_masked: torch.Tensor, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """TokenMix's *random* variant: exactly ``num_masked[i]`` tokens, uniformly without replacement.
    Returns ``(n, gh, gw)`` bool."""
    gh, gw = grid_size
    n = num_masked.numel()
    rank = torch.rand(n, gh * gw, generator=generator).argsort(1).argsort(1)
    return (rank < num_masked[:, None]).view(n, gh, gw)


# TokenMix block masks (the TokenMix paper, Sec. 3.2) --------------------------------------------------

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


def _compact_first(
    free: np.ndarray,
    count: np.ndarray,
    cy2: np.ndarray,
    cx2: np.ndarray,
    h: np.ndarray,
    w: np.ndarray,
    gh: int,
    gw: int,
) -> np.ndarray:
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
    if (
        not isinstance(aspect, (tuple, list))
        or len(aspect) != 2
        or not all(
            isinstance(a, (int, float, np.integer, np.floating))
            and not isinstance(a, (bool, np.bool_))
            and math.isfinite(a)
            and a > 0
            for a in aspect
        )
        or aspect[0] > aspect[1]
    ):
        raise ValueError(f'aspect must be (low, high) with 0 < low <= high, got {aspect!r}')
    return int(grid_size[0]), int(grid_size[1])


def tokenmix_masks(
    grid_size: Tuple[int, int],
    num_masked: torch.Tensor,
    generator: Optional[torch.Generator] = None,
    min_tokens: Optional[int] = None,
    aspect: Tuple[float, float] = (0.3, 1 / 0.3),
) -> torch.Tensor:
    """TokenMix's *block* masks (the TokenMix paper, Sec. 3.2) for a batch: ``(n, gh, gw)`` bool, mask ``i``
    with exactly ``num_masked[i]`` True (True = token from the partner).

    A mask is built from parts placed one after another, as in BEiT's block masking (the TokenMix paper
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

    A mask still unfinished after :data:`TOKENMIX_MAX_ROUNDS` rounds (rare; the count stays exact either way) gets
    one finishing part: its ``R`` free cells nearest a uniformly drawn free cell, in the compact order of a part
    with a drawn size and ratio.

    Vectorised over the batch with numpy; the Python loop runs over part rounds only (every mask of the batch at
    once). ``min_tokens`` defaults to 14 on a 14x14 grid,
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
            cnt = np.einsum(
                'akx,akx->ak',
                rows.astype(np.float32) @ free.reshape(a, gh, gw).astype(np.float32),
                cols.astype(np.float32),
            )
            pick = np.arange(a), (cnt > 0).argmax(1)  # none adds a token: candidate 0, a no-op
        else:
            pick = slice(None), 0
        h, w, top, left, rows, cols = h[pick], w[pick], top[pick], left[pick], rows[pick], cols[pick]
        new = (rows[:, :, None] & cols[:, None, :]).reshape(a, N) & free
        cnt = new.view(np.uint8).sum(1, dtype=np.int64)
        over = np.flatnonzero(cnt > r)
        if over.size:  # these masks' last part: clipped to R after the loop
            last.append(
                (act[over], new[over], r[over], 2 * top[over] + h[over], 2 * left[over] + w[over], h[over], w[over])
            )
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


# Occlusion masks (TokenMix Sec. 5.3, PatchDrop of Naseer et al.): a fixed random drop order per image --------


def num_dropped(num_patches: int, ratio: float) -> int:
    """Patches dropped at ``ratio``: ``round(ratio * num_patches)``, halves rounded up."""
    if not 0 <= ratio < 1:
        raise ValueError(f'ratio: expected a fraction in [0, 1), got {ratio}')
    return int(math.floor(round(ratio * num_patches, 9) + 0.5))


def _generator(seed: int, index: int, repeat: int) -> torch.Generator:
    if min(seed, index, repeat) < 0:
        raise ValueError(f'seed, index, repeat: expected values >= 0, got {seed}, {index}, {repeat}')
    state = np.random.SeedSequence((seed, repeat, index)).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state))


def patch_ranks(num_patches: int, seed: int, index: int, repeat: int = 0) -> torch.Tensor:
    """Position of each patch in image ``index``'s random drop order, ``(num_patches,)`` int64.

    Patch p is dropped at ratio rho iff ``rank[p] < num_dropped(num_patches, rho)``."""
    order = torch.randperm(num_patches, generator=_generator(seed, index, repeat))
    ranks = torch.empty_like(order)
    ranks[order] = torch.arange(num_patches)
    return ranks


def occlusion_mask(
    num_patches_h: int, num_patches_w: int, ratio: float, seed: int, index: int, repeat: int = 0
) -> torch.Tensor:
    """Bool ``(num_patches_h, num_patches_w)``: True where image ``index`` has its patch dropped at ``ratio``."""
    n = num_patches_h * num_patches_w
    k = num_dropped(n, ratio)
    return (patch_ranks(n, seed, index, repeat) < k).view(num_patches_h, num_patches_w)


def batch_masks(ranks: torch.Tensor, grid: tuple[int, int], ratio: float) -> torch.Tensor:
    """Bool ``(B, h, w)`` drop masks at ``ratio`` from stacked :func:`patch_ranks` ``(B, h * w)``."""
    return (ranks < num_dropped(grid[0] * grid[1], ratio)).view(-1, *grid)


def tokenmix_public_count(grid_size: Tuple[int, int], lam: torch.Tensor, extra: int) -> torch.Tensor:
    """The public code's targeted count of masked tokens: ``min(N, int((1 - λ) N) + extra)`` (its
    ``mask_token_num_start``, the ``minimum_tokens=14`` of its ``Mixup``), ``(n,)`` int64."""
    N = int(grid_size[0]) * int(grid_size[1])
    return ((1.0 - lam.double()) * N).floor().long().add(int(extra)).clamp(max=N)


def tokenmix_masks_public(
    grid_size: Tuple[int, int],
    num_masked: torch.Tensor,
    generator: Optional[torch.Generator] = None,
    aspect: Tuple[float, float] = (0.3, 1 / 0.3),
    attempts: int = 10,
) -> torch.Tensor:
    """TokenMix block masks drawn by the rule of the authors' public code (``generate_mask``, BEiT's
    masking loop), for ``grid_size`` and targeted counts ``num_masked`` (:func:`tokenmix_public_count`):
    while fewer than the target are masked, up to ``attempts`` parts are tried, each with an area
    ``U(1, remaining)``, a log-uniform aspect ratio in ``aspect``, sides ``round(sqrt(area · ratio))`` x
    ``round(sqrt(area / ratio))`` that must be smaller than the grid's, at a uniform position; the first
    part whose new tokens are between 1 and the remaining count is painted whole. When all attempts fail
    the mask stops short of its target (so a mask may hold fewer tokens). Randomness from ``generator``
    (the same distribution as the public code's Python ``random``, not its stream). Returns ``(n, gh, gw)``
    bool; per-mask Python loops (slower than :func:`tokenmix_masks`, fine at one mask per batch)."""
    gh, gw = _check_tokenmix_args(grid_size, None, aspect)
    N = gh * gw
    k = torch.as_tensor(num_masked).view(-1).cpu().numpy().astype(np.int64)
    if k.size and (k.min() < 0 or k.max() > N):
        raise ValueError(f'num_masked must be in [0, {N}] for a {gh}x{gw} grid, got values in [{k.min()}, {k.max()}]')
    lo, hi = math.log(aspect[0]), math.log(aspect[1])
    out = np.zeros((k.size, gh, gw), dtype=bool)
    for i, target in enumerate(k.tolist()):
        mask, count = out[i], 0
        while count < target:
            room = target - count
            delta = 0
            for _ in range(attempts):
                u = rand(4, generator).tolist()
                area = 1.0 + (room - 1.0) * u[0]
                ratio = math.exp(lo + (hi - lo) * u[1])
                h, w = int(round(math.sqrt(area * ratio))), int(round(math.sqrt(area / ratio)))
                if w < gw and h < gh:
                    top, left = min(int(u[2] * (gh - h + 1)), gh - h), min(int(u[3] * (gw - w + 1)), gw - w)
                    part = mask[top : top + h, left : left + w]
                    new = h * w - int(part.sum())
                    if 0 < new <= room:
                        part[:] = True
                        delta = new
                        break
            if delta == 0:
                break
            count += delta
    return torch.from_numpy(out)
