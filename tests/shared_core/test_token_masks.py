"""Token masks (``shared_core.token_masks``): patch alignment, TokenMix's exact counts and parts against a Python
reference, their sizes and aspect ratios, reproducibility and bad arguments."""

import math
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.ndimage import label
from scipy.stats import kstest

from shared_core import token_masks as mixing  # TOKENMIX_MAX_ROUNDS lives there
from shared_core.mixing import (
    MIX_KINDS,
    TOKENMIX_MAX_ROUNDS,
    MixSampler,
    random_token_mask,
    tokenmix_masks,
)

KINDS_KW = {k: (dict(mixup_alpha=1.0) if k == 'mixup' else dict(mixup_alpha=0.8, cutmix_alpha=1.0)) for k in MIX_KINDS}


@pytest.mark.parametrize('kind', ['token_box', 'tokenmix_block', 'tokenmix_random'])
def test_token_masks_are_patch_aligned(kind):
    g = torch.Generator().manual_seed(1)
    sampler = MixSampler(kind, mixup_alpha=0.0, cutmix_alpha=1.0, mode='elem', patch_size=(8, 4))
    mix = sampler.sample(8, (32, 24), g)
    share = mix.pixel_share()[:, 0]
    patches = share.unfold(1, 8, 8).unfold(2, 4, 4)  # (B, gh, gw, 8, 4)
    assert torch.all(patches == patches[..., :1, :1])
    assert set(mix.token_share.unique().tolist()) <= {0.0, 1.0}


@settings(max_examples=30, deadline=None)
@given(gh=st.integers(1, 14), gw=st.integers(1, 14), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_tokenmix_mask_exact_count(gh, gw, seed, data):
    k = data.draw(st.integers(0, gh * gw))
    g = torch.Generator().manual_seed(seed)
    m = tokenmix_masks((gh, gw), torch.tensor([k]), g, max(1, gh * gw // 14))[0]
    assert m.shape == (gh, gw) and m.dtype == torch.bool and int(m.sum()) == k
    r = random_token_mask((gh, gw), torch.tensor([k, gh * gw - k]), g)
    assert r.flatten(1).sum(1).tolist() == [k, gh * gw - k]


# ---------------------------------------------------------------- TokenMix block masks


def reference_tokenmix_masks(grid_size, counts, generator=None, min_tokens=None, aspect=(0.3, 1 / 0.3)):
    """TokenMix block masks straight from the definition, one mask and one candidate part at a time.

    Draws exactly what ``tokenmix_masks`` draws, in the same order: per round ``torch.rand(4, a, K)``
    (size, ratio, top, left) for the ``a`` unfinished masks with ``K`` candidates each; after
    ``TOKENMIX_MAX_ROUNDS`` rounds ``torch.rand(3, a)`` for the finishing parts. Returns the masks
    ``(n, gh, gw)`` and, per mask, its parts as dicts (rectangle, tokens remaining before, clipped).
    """
    gh, gw = grid_size
    N = gh * gw
    if min_tokens is None:
        min_tokens = max(1, round(14 * N / 196))
    m = min(min_tokens, N)
    log_lo = math.log(aspect[0])
    log_span = math.log(aspect[1]) - log_lo
    counts = [int(c) for c in counts]
    mask = [[c == N] * N for c in counts]
    rem = [0 if c == N else c for c in counts]
    parts = [[] for _ in counts]

    def sides(size, ratio):  # round both real sides; if short of size, lengthen the one rounded down more
        h_real, w_real = math.sqrt(size * ratio), math.sqrt(size / ratio)
        h, w = min(max(round(h_real), 1), gh), min(max(round(w_real), 1), gw)
        if h * w < size:
            if h_real * w >= w_real * h:
                h = min(math.ceil(size / w), gh)
                w = w if h * w >= size else math.ceil(size / h)
            else:
                w = min(math.ceil(size / h), gw)
                h = h if h * w >= size else math.ceil(size / w)
        return h, w

    def compact(cells, cy2, cx2, h, w):  # centre out: rings shaped like h x w, edges before corners, raster
        def key(cell):
            ay = abs(2 * (cell // gw) + 1 - cy2) * w
            ax = abs(2 * (cell % gw) + 1 - cx2) * h
            return max(ay, ax), min(ay, ax), cell

        return sorted(cells, key=key)

    for _ in range(TOKENMIX_MAX_ROUNDS):
        act = [b for b in range(len(counts)) if rem[b] > 0]
        if not act:
            break
        fewest_free = min(N - sum(mask[b]) for b in act)
        K = 1 << min(6, int(math.log2(N / fewest_free)))
        u = torch.rand(4, len(act), K, generator=generator, dtype=torch.float64).tolist()
        for i, b in enumerate(act):
            for c in range(K):
                size = u[0][i][c] * (max(rem[b], m) - m) + m
                h, w = sides(size, math.exp(u[1][i][c] * log_span + log_lo))
                top, left = int(u[2][i][c] * (gh + 1 - h)), int(u[3][i][c] * (gw + 1 - w))
                rect = [y * gw + x for y in range(top, top + h) for x in range(left, left + w)]
                new = [cell for cell in rect if not mask[b][cell]]
                if new:
                    break
            if not new:
                continue  # no candidate adds a token this round
            part = dict(top=top, left=left, h=h, w=w, rect=rect, remaining=rem[b], clipped=len(new) > rem[b])
            if part['clipped']:
                new = compact(new, 2 * top + h, 2 * left + w, h, w)[: rem[b]]
            for cell in new:
                mask[b][cell] = True
            rem[b] -= len(new)
            parts[b].append(part)
    act = [b for b in range(len(counts)) if rem[b] > 0]
    if act:
        u = torch.rand(3, len(act), generator=generator, dtype=torch.float64).tolist()
        for i, b in enumerate(act):
            h, w = sides(u[0][i] * (max(rem[b], m) - m) + m, math.exp(u[1][i] * log_span + log_lo))
            free = [cell for cell in range(N) if not mask[b][cell]]
            anchor = free[int(u[2][i] * len(free))]
            for cell in compact(free, 2 * (anchor // gw) + 1, 2 * (anchor % gw) + 1, h, w)[: rem[b]]:
                mask[b][cell] = True
            parts[b].append(dict(remaining=rem[b], finishing=True, clipped=True))
            rem[b] = 0
    return torch.tensor(mask, dtype=torch.bool).view(len(counts), gh, gw), parts


@settings(max_examples=60, deadline=None)
@given(
    gh=st.integers(1, 12),
    gw=st.integers(1, 12),
    n=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
    min_tokens=st.one_of(st.none(), st.integers(1, 40)),
    aspect=st.sampled_from([(0.3, 1 / 0.3), (1.0, 1.0), (0.5, 4.0)]),
    data=st.data(),
)
def test_tokenmix_block_matches_the_python_reference(gh, gw, n, seed, min_tokens, aspect, data):
    """Same generator state: the vectorised sampler and the one-at-a-time reference give the same masks and
    leave the generator in the same state (same draws, same order)."""
    counts = data.draw(st.lists(st.integers(0, gh * gw), min_size=n, max_size=n))
    g1, g2 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    masks = tokenmix_masks((gh, gw), torch.tensor(counts), g1, min_tokens, aspect)
    ref, _ = reference_tokenmix_masks((gh, gw), counts, g2, min_tokens, aspect)
    assert torch.equal(masks, ref)
    assert torch.equal(g1.get_state(), g2.get_state())


@pytest.mark.parametrize('max_rounds', [1, 3])
def test_tokenmix_finishing_part_matches_the_reference_and_is_exact(monkeypatch, max_rounds):
    """With the round budget cut, most masks end with the finishing part (R free cells nearest a drawn free cell)."""
    monkeypatch.setattr(mixing, 'TOKENMIX_MAX_ROUNDS', max_rounds)
    monkeypatch.setattr(sys.modules[__name__], 'TOKENMIX_MAX_ROUNDS', max_rounds)
    for grid in [(14, 14), (5, 9), (1, 5)]:
        N = grid[0] * grid[1]
        counts = torch.arange(N + 1)
        g1, g2 = torch.Generator().manual_seed(N), torch.Generator().manual_seed(N)
        masks = tokenmix_masks(grid, counts, g1)
        ref, parts = reference_tokenmix_masks(grid, counts.tolist(), g2)
        assert torch.equal(masks, ref) and torch.equal(g1.get_state(), g2.get_state())
        assert masks.flatten(1).sum(1).tolist() == counts.tolist()
        if N > 5:
            assert sum(p[-1].get('finishing', False) for p in parts if p) > N // 4


def test_tokenmix_every_count_on_several_grids():
    g = torch.Generator().manual_seed(0)
    for gh, gw in [(14, 14), (7, 7), (12, 20), (1, 5), (2, 2), (4, 10), (1, 1), (24, 24)]:
        N = gh * gw
        counts = torch.arange(N + 1)
        for min_tokens in (None, 1, N, N + 5):
            for _ in range(2):
                masks = tokenmix_masks((gh, gw), counts, g, min_tokens)
                assert masks.shape == (N + 1, gh, gw) and masks.dtype == torch.bool
                assert masks.flatten(1).sum(1).tolist() == counts.tolist()
    assert tokenmix_masks((3, 4), torch.zeros(0, dtype=torch.long), g).shape == (0, 3, 4)


@pytest.mark.parametrize('grid,min_tokens', [((14, 14), None), ((7, 7), 5), ((12, 20), None), ((6, 6), 40)])
def test_tokenmix_parts_keep_the_minimum_size(grid, min_tokens):
    """What is guaranteed, checked part by part on the reference (whose masks equal the sampler's): every
    part's rectangle has at least m = min(min_tokens, N) cells; every part but a mask's last is painted
    whole; only the last is clipped, to exactly the R tokens that remained; so every part leaves at least
    min(m, R) cells of its rectangle masked."""
    gh, gw = grid
    N = gh * gw
    m = min(max(1, round(14 * N / 196)) if min_tokens is None else min_tokens, N)
    counts = torch.arange(N + 1).repeat(3)
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    masks = tokenmix_masks(grid, counts, g1, min_tokens)
    ref, parts = reference_tokenmix_masks(grid, counts.tolist(), g2, min_tokens)
    assert torch.equal(masks, ref)
    for mask, k, ps in zip(masks.flatten(1).tolist(), counts.tolist(), parts):
        assert not any(p.get('finishing') for p in ps)
        assert [p['clipped'] for p in ps[:-1]] == [False] * (len(ps) - 1)
        if k in (0, N):
            assert ps == []
        for p in ps:
            assert p['h'] * p['w'] >= m
            covered = sum(mask[cell] for cell in p['rect'])
            if not p['clipped']:
                assert covered == len(p['rect'])
            assert covered >= min(m, p['remaining'])
        if k <= m and 0 < k < N:  # one part, clipped (or exactly filled): one 4-connected blob
            assert len(ps) == 1


@pytest.mark.parametrize('grid', [(14, 14), (12, 20), (5, 30)])
def test_tokenmix_up_to_min_tokens_is_one_compact_blob(grid):
    """num_masked <= min_tokens: a single part, clipped from its centre outwards -> one 4-connected piece
    whose bounding box is at most the part's (bounded by sqrt(m / 0.3) + 1 on each side)."""
    gh, gw = grid
    m = max(1, round(14 * gh * gw / 196))
    counts = torch.arange(1, m + 1).repeat(20)
    masks = tokenmix_masks(grid, counts, torch.Generator().manual_seed(0)).numpy()
    side = math.sqrt(m / 0.3) + 2
    for mask in masks:
        assert label(mask)[1] == 1
        ys, xs = np.nonzero(mask)
        assert np.ptp(ys) + 1 <= side and np.ptp(xs) + 1 <= side


def test_tokenmix_part_aspect_ratio_is_log_uniform():
    """The parts' rectangles: log(h / w) uniform on [log 0.3, log 1/0.3] (KS test), on a grid large enough that
    no side is clamped and integer rounding moves log(h / w) little (sides >= sqrt(400 · 0.3) ~ 11)."""
    lo, hi = 0.3, 1 / 0.3
    uniform = ('uniform', (math.log(lo), math.log(hi) - math.log(lo)))
    counts = [900] * 400
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    masks = tokenmix_masks((96, 96), torch.tensor(counts), g1, min_tokens=400)
    ref, parts = reference_tokenmix_masks((96, 96), counts, g2, min_tokens=400)
    assert torch.equal(masks, ref)
    log_ratio = np.array([math.log(p['h'] / p['w']) for ps in parts for p in ps])
    assert len(log_ratio) > 800
    assert np.all(np.abs(log_ratio) <= math.log(hi) + 0.02)
    assert kstest(log_ratio, *uniform).statistic < 0.07  # 0.056 is the 1 % point for 850 exact draws
    # on the default 14x14 grid: the first parts (placed on an empty grid, never redrawn) are symmetric in h / w,
    # span the range and follow it up to integer rounding and the grid clamping large parts
    _, parts = reference_tokenmix_masks((14, 14), [98] * 400, torch.Generator().manual_seed(1))
    first = np.array([math.log(ps[0]['h'] / ps[0]['w']) for ps in parts])
    assert abs(np.mean(first > 0) - np.mean(first < 0)) < 0.1 and abs(first.mean()) < 0.05
    assert first.min() < math.log(0.4) and first.max() > math.log(1 / 0.4)
    assert np.all(np.abs(first) <= math.log(hi) + 0.1)
    assert kstest(first, *uniform).statistic < 0.12


def test_tokenmix_half_masks_have_several_parts():
    """λ = 0.5 on 14x14 (TokenMix's default): several separated pieces on average, rarely one rectangle."""
    masks = tokenmix_masks((14, 14), torch.full((512,), 98), torch.Generator().manual_seed(0)).numpy()
    pieces = np.array([label(mask)[1] for mask in masks])
    one_rectangle = []
    for mask in masks:
        ys, xs = np.nonzero(mask)
        one_rectangle.append((np.ptp(ys) + 1) * (np.ptp(xs) + 1) == mask.sum())
    assert pieces.mean() > 1.2, pieces.mean()
    assert np.mean(one_rectangle) < 0.2, np.mean(one_rectangle)


def test_tokenmix_masks_are_reproducible():
    k = torch.tensor([0, 1, 13, 14, 50, 98, 150, 195, 196])
    a = tokenmix_masks((14, 14), k, torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(5)
    b = tokenmix_masks((14, 14), k, g)
    assert torch.equal(a, b)
    assert not torch.equal(tokenmix_masks((14, 14), k, g), a)  # the generator moved on
    assert not torch.equal(tokenmix_masks((14, 14), k, torch.Generator().manual_seed(6)), a)
    one = tokenmix_masks((14, 14), torch.tensor([98]), torch.Generator().manual_seed(3), 14)[0]
    assert torch.equal(one, tokenmix_masks((14, 14), torch.tensor([98]), torch.Generator().manual_seed(3), 14)[0])
    assert torch.equal(
        one, tokenmix_masks((np.int64(14), 14), torch.tensor([np.int64(98)]), torch.Generator().manual_seed(3), 14)[0]
    )
    torch.manual_seed(11)
    c = tokenmix_masks((7, 9), torch.tensor([5, 30]))
    torch.manual_seed(11)
    assert torch.equal(c, tokenmix_masks((7, 9), torch.tensor([5, 30])))


def test_tokenmix_bad_arguments_name_the_argument():
    k = torch.tensor([3])
    for grid in [(0, 5), (14,), 14, (14.0, 14), (True, 3)]:
        with pytest.raises(ValueError, match='grid_size'):
            tokenmix_masks(grid, k)
    for bad in [torch.tensor([-1]), torch.tensor([10]), torch.tensor([1.0]), torch.tensor([[1]]), torch.tensor([True])]:
        with pytest.raises(ValueError, match='num_masked'):
            tokenmix_masks((3, 3), bad)
    for mt in [0, -2, 1.5, True]:
        with pytest.raises(ValueError, match='min_tokens'):
            tokenmix_masks((3, 3), k, min_tokens=mt)
    for aspect in [(0.0, 1.0), (2.0, 1.0), (1.0,), (0.3, float('inf'))]:
        with pytest.raises(ValueError, match='aspect'):
            tokenmix_masks((3, 3), k, aspect=aspect)
    with pytest.raises(ValueError, match='grid_size'):
        tokenmix_masks((0, 3), torch.tensor([1]))
    with pytest.raises(ValueError, match='grid_size'):
        tokenmix_masks((3, -1), torch.tensor([1]))
    with pytest.raises(ValueError, match='num_masked'):
        tokenmix_masks((3, 3), torch.tensor([10]))
    with pytest.raises(ValueError, match='num_masked'):
        tokenmix_masks((3, 3), torch.tensor([2.0]))


# ---------------------------------------------------------------- bad input
