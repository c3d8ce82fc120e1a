"""The mixing core against small explicit references (pixel loops, counted overlaps) and timm."""

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
    CUT_KINDS,
    MIX_KINDS,
    TOKENMIX_MAX_ROUNDS,
    Mix,
    MixSampler,
    box_token_share,
    identity_mix,
    mix_images,
    mix_target,
    mix_tokens,
    one_hot,
    pair_target,
    rand_box,
    random_token_mask,
    tokenmix_masks,
)

KINDS_KW = {k: (dict(mixup_alpha=1.0) if k == 'mixup' else dict(mixup_alpha=0.8, cutmix_alpha=1.0)) for k in MIX_KINDS}


def reference_mix_images(x, mix: Mix):
    """Pixel by pixel: which source each output pixel comes from, straight from the definitions."""
    B, C, H, W = x.shape
    ph, pw = mix.patch_size
    out = torch.empty_like(x)
    for b in range(B):
        p = int(mix.partner[b])
        for y in range(H):
            for xx in range(W):
                if mix.boxes is not None and bool(mix.box_valid[b]):
                    y0, y1, x0, x1 = mix.boxes[b].tolist()
                    s = 1.0 if (y0 <= y < y1 and x0 <= xx < x1) else 0.0
                else:
                    s = float(mix.token_share[b, y // ph, xx // pw])
                if s == 0.0:
                    out[b, :, y, xx] = x[b, :, y, xx]
                elif s == 1.0:
                    out[b, :, y, xx] = x[p, :, y, xx]
                else:
                    out[b, :, y, xx] = x[b, :, y, xx] * (1 - s) + x[p, :, y, xx] * s
    return out


@pytest.mark.parametrize('kind', MIX_KINDS)
@pytest.mark.parametrize('mode', ['batch', 'pair', 'elem'])
@pytest.mark.parametrize('switch', [True, False])
def test_mix_images_matches_pixel_reference(kind, mode, switch):
    """Every output pixel is the sample's, the partner's (exactly) or their blend; with ``switch`` off the
    cut branch is taken every time, so masks and boxes are always exercised."""
    g = torch.Generator().manual_seed(3)
    kw = KINDS_KW[kind] if switch or kind == 'mixup' else dict(mixup_alpha=0.0, cutmix_alpha=1.0)
    sampler = MixSampler(kind, mode=mode, patch_size=(8, 4), **kw)
    for dtype in (torch.float32, torch.uint8):
        for _ in range(3):
            x = torch.randint(0, 256, (6, 3, 24, 16), generator=g).to(dtype)
            mix = sampler.sample(6, (24, 16), g)
            out = mix_images(x, mix)
            ref = reference_mix_images(x.float(), mix)
            if dtype == torch.uint8:
                ref = ref.round()
            # box/mask pixels are copied exactly; blends agree to float rounding
            assert torch.allclose(out.float(), ref, atol=1e-4 if dtype.is_floating_point else 1, rtol=0)
            if not switch and kind != 'mixup':
                assert torch.equal(out.float(), ref)


@pytest.mark.parametrize('kind', MIX_KINDS)
@pytest.mark.parametrize('mode', ['batch', 'pair', 'elem'])
def test_uint8_mix_is_the_rounded_per_pixel_lerp_bit_for_bit(kind, mode):
    """The collate path (uint8): whatever route a row takes (a bitwise select for 0/1 rows, a per-row weight for
    blends and box rows, the patch view otherwise, boxes pasted), each pixel is ``round(lerp(x, x[partner], s))``
    with ``s`` its partner share, bit for bit."""
    g = torch.Generator().manual_seed(5)
    sampler = MixSampler(kind, mode=mode, patch_size=(8, 4), **KINDS_KW[kind])
    for _ in range(4):
        x = torch.randint(0, 256, (10, 3, 24, 16), generator=g, dtype=torch.uint8)
        mix = sampler.sample(10, (24, 16), g)
        ref = torch.lerp(x.float(), x[mix.partner].float(), mix.pixel_share()).round_().to(torch.uint8)
        assert torch.equal(mix_images(x, mix), ref)


@pytest.mark.parametrize('kind', ['mixup', 'cutmix'])
def test_timm_kinds_work_when_the_patch_does_not_divide_the_image(kind):
    g = torch.Generator().manual_seed(0)
    kw = dict(mixup_alpha=0.0, cutmix_alpha=1.0) if kind == 'cutmix' else dict(mixup_alpha=1.0)
    mix = MixSampler(kind, mode='elem', patch_size=16, **kw).sample(4, (30, 37), g)
    assert mix.token_share.shape == (4, 2, 3)
    x = torch.randn(4, 3, 30, 37, generator=g)
    assert torch.allclose(mix_images(x, mix), reference_mix_images(x, mix), atol=1e-6)
    assert torch.allclose(mix.pixel_share().mean(dim=(1, 2, 3)), 1 - mix.lam, atol=1e-6)


@pytest.mark.parametrize('kind', CUT_KINDS)
def test_partner_fraction_is_one_minus_lambda(kind):
    g = torch.Generator().manual_seed(0)
    sampler = MixSampler(kind, mixup_alpha=0.0, cutmix_alpha=1.0, mode='elem', patch_size=8)
    mix = sampler.sample(16, (32, 48), g)
    x = torch.stack([torch.zeros(1, 32, 48), torch.ones(1, 32, 48)] * 8)  # partner of even i is odd: 0/1 images
    out = mix_images(x, mix)
    own = torch.where(x[:, :1] == x[mix.partner, :1], torch.nan, (out[:, :1] == x[:, :1]).float())
    frac_own = own.nanmean(dim=(1, 2, 3))
    assert torch.allclose(frac_own, mix.lam, atol=1e-6)
    assert torch.allclose(mix.pixel_share().mean(dim=(1, 2, 3)), 1 - mix.lam, atol=1e-6)


@pytest.mark.parametrize('kind', ['token_box', 'tokenmix_block', 'tokenmix_random'])
def test_token_masks_are_patch_aligned(kind):
    g = torch.Generator().manual_seed(1)
    sampler = MixSampler(kind, mixup_alpha=0.0, cutmix_alpha=1.0, mode='elem', patch_size=(8, 4))
    mix = sampler.sample(8, (32, 24), g)
    share = mix.pixel_share()[:, 0]
    patches = share.unfold(1, 8, 8).unfold(2, 4, 4)  # (B, gh, gw, 8, 4)
    assert torch.all(patches == patches[..., :1, :1])
    assert set(mix.token_share.unique().tolist()) <= {0.0, 1.0}


@settings(max_examples=60, deadline=None)
@given(H=st.integers(8, 64), W=st.integers(8, 64), lam=st.floats(0.0, 1.0), seed=st.integers(0, 2**31 - 1))
def test_rand_box_geometry_follows_timm(H, W, lam, seed):
    """timm's rand_bbox: sides int(H·sqrt(1-λ)), int(W·sqrt(1-λ)), centre uniform in the image, clipped."""
    b = rand_box((H, W), torch.tensor([lam], dtype=torch.float64), torch.Generator().manual_seed(seed))[0].tolist()
    y0, y1, x0, x1 = b
    cut_h, cut_w = int(H * np.sqrt(1 - lam)), int(W * np.sqrt(1 - lam))
    assert 0 <= y0 <= y1 <= H and 0 <= x0 <= x1 <= W
    assert y1 - y0 <= cut_h and x1 - x0 <= cut_w
    if 0 < y0 and y1 < H:
        assert y1 - y0 == cut_h
    if 0 < x0 and x1 < W:
        assert x1 - x0 == cut_w


@settings(max_examples=60, deadline=None)
@given(
    H=st.integers(16, 64),
    W=st.integers(16, 64),
    lo=st.floats(0.05, 0.5),
    span=st.floats(0.1, 0.5),
    seed=st.integers(0, 2**31 - 1),
)
def test_rand_box_minmax_sides_and_lambda(H, W, lo, span, seed):
    minmax = (lo, min(1.0, lo + span))
    s = MixSampler('cutmix', mixup_alpha=0.0, cutmix_minmax=minmax, mode='elem', patch_size=4)
    if int(H * minmax[0]) >= int(H * minmax[1]) or int(W * minmax[0]) >= int(W * minmax[1]):
        with pytest.raises(ValueError, match='cutmix_minmax'):
            s.sample(4, (H, W), torch.Generator().manual_seed(seed))
        return
    mix = s.sample(4, (H, W), torch.Generator().manual_seed(seed))
    h, w = mix.boxes[:, 1] - mix.boxes[:, 0], mix.boxes[:, 3] - mix.boxes[:, 2]
    assert (h >= int(H * minmax[0])).all() and (h < int(H * minmax[1])).all()
    assert (w >= int(W * minmax[0])).all() and (w < int(W * minmax[1])).all()
    assert (mix.boxes[:, 1] <= H).all() and (mix.boxes[:, 3] <= W).all() and (mix.boxes >= 0).all()
    assert torch.allclose(mix.lam, 1 - (h * w).float() / (H * W))
    t = mix_target(torch.arange(4), mix, 4)
    assert t.min() >= 0 and torch.allclose(t.sum(1), torch.ones(4))


def test_box_token_share_counts_pixels():
    boxes = torch.tensor([[3, 17, 5, 30], [0, 32, 0, 32], [10, 10, 4, 9], [8, 16, 16, 24]])
    share = box_token_share(boxes, (32, 32), (8, 8))
    for b, (y0, y1, x0, x1) in enumerate(boxes.tolist()):
        mask = torch.zeros(32, 32)
        mask[y0:y1, x0:x1] = 1
        expected = mask.view(4, 8, 4, 8).mean(dim=(1, 3))
        assert torch.allclose(share[b], expected)


def test_mixup_blend_and_target_match_timm():
    from timm.data.mixup import mixup_target

    x = torch.randn(4, 3, 16, 16)
    lam = 0.3
    mix = Mix(
        partner=torch.arange(3, -1, -1),
        lam=torch.full((4,), lam),
        token_share=torch.full((4, 2, 2), 1 - lam),
        img_size=(16, 16),
        patch_size=(8, 8),
        kind='mixup',
    )
    expected = x * lam + x.flip(0) * (1 - lam)
    assert torch.allclose(mix_images(x, mix), expected, atol=1e-6)
    y = torch.tensor([0, 1, 2, 3])
    assert torch.allclose(mix_target(y, mix, 5, 0.1), mixup_target(y, 5, lam, 0.1), atol=1e-6)


def test_cutmix_box_application_matches_timm():
    from timm.data.mixup import cutmix_bbox_and_lam

    np.random.seed(0)
    x = torch.randn(4, 3, 32, 32)
    (yl, yh, xl, xh), lam = cutmix_bbox_and_lam(x.shape, 0.6, correct_lam=True)
    expected = x.clone()
    expected[:, :, yl:yh, xl:xh] = x.flip(0)[:, :, yl:yh, xl:xh]
    box = torch.tensor([[yl, yh, xl, xh]] * 4)
    mix = Mix(
        partner=torch.arange(3, -1, -1),
        lam=torch.full((4,), float(lam)),
        token_share=box_token_share(box, (32, 32), (16, 16)),
        img_size=(32, 32),
        patch_size=(16, 16),
        kind='cutmix',
        boxes=box,
        box_valid=torch.ones(4, dtype=torch.bool),
    )
    assert torch.equal(mix_images(x, mix), expected)
    assert torch.allclose(1 - mix.pixel_share().mean(dim=(1, 2, 3)), torch.tensor(float(lam)))


def test_cutmix_lambda_correction_and_minmax():
    g = torch.Generator().manual_seed(0)
    s = MixSampler('cutmix', mixup_alpha=0.0, cutmix_alpha=1.0, mode='elem', patch_size=8)
    mix = s.sample(64, (32, 32), g)
    area = (mix.boxes[:, 1] - mix.boxes[:, 0]) * (mix.boxes[:, 3] - mix.boxes[:, 2])
    assert torch.allclose(mix.lam, 1 - area.float() / 1024)
    s = MixSampler('cutmix', mixup_alpha=0.0, cutmix_minmax=(0.25, 0.5), mode='elem', patch_size=8)
    mix = s.sample(64, (32, 32), g)
    h, w = mix.boxes[:, 1] - mix.boxes[:, 0], mix.boxes[:, 3] - mix.boxes[:, 2]
    assert h.min() >= 8 and h.max() < 16 and w.min() >= 8 and w.max() < 16
    assert (mix.boxes[:, 1] <= 32).all() and (mix.boxes[:, 3] <= 32).all()
    # without correction, λ is the Beta draw even where the border clipped the box
    s = MixSampler('cutmix', mixup_alpha=0.0, cutmix_alpha=1.0, mode='elem', patch_size=8, correct_lam=False)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    m_raw = s.sample(64, (32, 32), g1)
    lam_draw, _ = s._unit_params(64, g2)
    assert torch.allclose(m_raw.lam, torch.from_numpy(lam_draw).float())


def test_pair_mode_is_symmetric_and_batch_mode_shared():
    g = torch.Generator().manual_seed(2)
    m = MixSampler('tokenmix_block', mixup_alpha=0.0, cutmix_alpha=1.0, mode='pair', patch_size=4).sample(8, 16, g)
    assert torch.equal(m.lam, m.lam.flip(0)) and torch.equal(m.token_share, m.token_share.flip(0))
    m = MixSampler('cutmix', mixup_alpha=0.0, cutmix_alpha=1.0, mode='batch', patch_size=4).sample(8, 16, g)
    assert torch.all(m.lam == m.lam[0]) and torch.all(m.boxes == m.boxes[0])


def test_disabled_or_zero_prob_is_identity():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 16, 16)
    y = torch.tensor([0, 1, 2, 3])
    for s in [MixSampler('tokenmix_block', cutmix_alpha=1.0, prob=0.0, patch_size=8)]:
        mix = s.sample(4, 16, g)
        assert torch.equal(mix_images(x, mix), x)
        assert torch.allclose(mix_target(y, mix, 4, 0.1), one_hot(y, 4, 0.1))
    s = MixSampler('cutmix', cutmix_alpha=1.0, patch_size=8)
    s.mixup_enabled = False
    mix = s.sample(4, 16, g)
    assert mix.kind == 'none' and torch.equal(mix_images(x, mix), x)
    ident = identity_mix(4, 16, 8)
    assert torch.equal(mix_images(x, ident), x)


def test_mix_tokens_swaps_masked_tokens():
    g = torch.Generator().manual_seed(0)
    mix = MixSampler('tokenmix_random', mixup_alpha=0.0, cutmix_alpha=1.0, mode='elem', patch_size=4).sample(4, 16, g)
    t = torch.randn(4, 16, 5)
    out = mix_tokens(t, mix)
    for b in range(4):
        for n in range(16):
            src = int(mix.partner[b]) if mix.token_share_flat()[b, n] == 1 else b
            assert torch.equal(out[b, n], t[src, n])


def test_uint8_images_are_rounded_blends():
    x = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8)
    lam = 0.37
    mix = Mix(
        partner=torch.arange(3, -1, -1),
        lam=torch.full((4,), lam),
        token_share=torch.full((4, 1, 1), 1 - lam),
        img_size=(16, 16),
        patch_size=(16, 16),
        kind='mixup',
    )
    out = mix_images(x, mix)
    assert out.dtype == torch.uint8
    exact = x.float() * lam + x.flip(0).float() * (1 - lam)
    # rounded blends; a value within float error of a .5 tie may round either way
    assert ((out.float() - exact).abs() <= 0.5 + 1e-4).all()


# ---------------------------------------------------------------- properties (hypothesis)


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(MIX_KINDS),
    mode=st.sampled_from(['batch', 'pair', 'elem']),
    half_batch=st.integers(1, 6),
    gh=st.integers(1, 6),
    gw=st.integers(1, 6),
    smoothing=st.sampled_from([0.0, 0.1, 0.3]),
    seed=st.integers(0, 2**31 - 1),
    prob=st.sampled_from([0.0, 0.5, 1.0]),
)
def test_mix_properties(kind, mode, half_batch, gh, gw, smoothing, seed, prob):
    B, C = 2 * half_batch, 7
    g = torch.Generator().manual_seed(seed)
    mix = MixSampler(kind, mode=mode, prob=prob, patch_size=4, **KINDS_KW[kind]).sample(B, (4 * gh, 4 * gw), g)
    assert mix.token_share.shape == (B, gh, gw)
    assert mix.token_share.min() >= 0 and mix.token_share.max() <= 1
    assert mix.lam.min() >= 0 and mix.lam.max() <= 1
    assert torch.equal(mix.partner, torch.arange(B - 1, -1, -1))
    y = torch.randint(0, C, (B,), generator=g)
    t = mix_target(y, mix, C, smoothing)
    assert t.min() >= 0
    assert torch.allclose(t.sum(1), torch.ones(B), atol=1e-6)
    if kind != 'cutmix':  # token kinds and blends: λ is exactly the own token share
        assert torch.allclose(mix.lam, 1 - mix.token_share.flatten(1).mean(1), atol=1e-6)


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


def test_bad_input_errors_name_the_argument():
    s = MixSampler('cutmix', cutmix_alpha=1.0, patch_size=16)
    with pytest.raises(ValueError, match='even'):
        s.sample(5, 32)
    with pytest.raises(ValueError, match='image size 32x40 is not divisible by patch_size 16x16'):
        MixSampler('tokenmix_block', cutmix_alpha=1.0, patch_size=16).sample(4, (32, 40))
    with pytest.raises(ValueError, match=r'cutmix_minmax \(0.5, 0.52\) gives an empty range'):
        MixSampler('cutmix', cutmix_minmax=(0.5, 0.52), patch_size=16).sample(4, 32)
    mix = s.sample(4, 32)
    with pytest.raises(ValueError, match=r'num_classes=3'):
        mix_target(torch.tensor([0, 1, 2, 3]), mix, 3)
    with pytest.raises(ValueError, match='target'):
        mix_target(torch.tensor([0, -1, 2, 1]), mix, 3)
    with pytest.raises(ValueError, match='mix_kind must be one of'):
        MixSampler('cutout')
    with pytest.raises(ValueError, match='cutmix_alpha'):
        MixSampler('mixup', cutmix_alpha=1.0)
    with pytest.raises(ValueError, match='both 0: nothing to mix'):
        MixSampler('tokenmix_block', mixup_alpha=0.0, cutmix_alpha=0.0)
    with pytest.raises(ValueError, match='tokenmix_lam applies to the TokenMix kinds only'):
        MixSampler('token_box', cutmix_alpha=1.0, tokenmix_lam=0.5)
    with pytest.raises(ValueError, match='mode'):
        MixSampler('mixup', mode='row')
    with pytest.raises(ValueError, match='x:'):
        mix_images(torch.zeros(4, 3, 16, 16), mix)
    with pytest.raises(ValueError, match='num_masked'):
        tokenmix_masks((3, 3), torch.tensor([10]))
    with pytest.raises(ValueError, match='label_smoothing'):
        mix_target(torch.tensor([0, 1, 2, 0]), mix, 3, smoothing=1.0)


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(['mixup', 'cutmix', 'token_box']),
    alphas=st.sampled_from([(0.8, 0.0), (0.0, 1.0), (0.8, 1.0), (0.2, 0.5)]),
    prob=st.sampled_from([1.0, 0.6]),
    correct_lam=st.booleans(),
    rounding=st.sampled_from(['timm', 'public']),
    H=st.integers(8, 40),
    W=st.integers(8, 40),
    B=st.sampled_from([2, 4, 7]),
    seed=st.integers(0, 2**31 - 1),
)
def test_batch_mode_host_sampler_draws_what_the_vector_sampler_draws(
    kind, alphas, prob, correct_lam, rounding, H, W, B, seed
):
    """``mode='batch'`` MixUp/CutMix/MixToken boxes are drawn on the host in Python numbers; it consumes the
    generator as the vector path does and gives the same mix: the vector path's one-unit case is ``mode='pair'``
    with B = 2."""
    if kind == 'mixup' and alphas[1] > 0:
        alphas = (alphas[0] or 0.5, 0.0)
    if kind == 'token_box':  # token kinds need whole patches
        H, W = H - H % 4 or 4, W - W % 8 or 8
    kw = dict(mixup_alpha=alphas[0], cutmix_alpha=alphas[1], prob=prob, correct_lam=correct_lam)
    kw.update(patch_size=(4, 8), box_rounding=rounding)
    fast = MixSampler(kind, mode='batch', **kw).sample(B, (H, W), torch.Generator().manual_seed(seed), allow_odd=True)
    ref = MixSampler(kind, mode='pair', **kw).sample(2, (H, W), torch.Generator().manual_seed(seed))
    assert fast.reversed_pairs and fast.batch_lam is not None and fast.blend == ref.blend
    if fast.blend:  # the flag's promise: a constant share 1 - λ
        assert torch.allclose(fast.token_share, 1 - fast.lam[:, None, None].expand_as(fast.token_share), atol=1e-6)
    assert torch.equal(fast.partner, torch.arange(B - 1, -1, -1))
    assert torch.equal(fast.lam, ref.lam[:1].expand(B)) and fast.batch_lam == pytest.approx(float(ref.lam[0]))
    assert torch.equal(fast.token_share, ref.token_share[:1].expand(B, *ref.grid_size))
    if fast.boxes is None:
        assert ref.boxes is None or not bool(ref.box_valid.any())
    else:
        assert torch.equal(fast.boxes, ref.boxes[:1].expand(B, 4)) and bool(fast.box_valid.all())


@pytest.mark.parametrize('kind', MIX_KINDS)
@pytest.mark.parametrize('mode', ['batch', 'pair', 'elem'])
def test_flipped_partner_targets_equal_the_gathered_ones(kind, mode):
    """The samplers' targets against ``y.flip(0)`` (one lerp) equal the general pairwise rule on the partner
    indices, rows summing to 1."""
    g = torch.Generator().manual_seed(5)
    sampler = MixSampler(kind, mode=mode, patch_size=8, prob=0.8, **KINDS_KW[kind])
    for _ in range(5):
        mix = sampler.sample(6, (32, 32), g)
        labels = torch.randint(0, 10, (6,), generator=g)
        fast = mix_target(labels, mix, 10, 0.1)
        ref = pair_target(labels, mix.partner, mix.lam, 10, 0.1)
        assert mix.reversed_pairs and torch.allclose(fast, ref, atol=1e-6, rtol=0)
        assert torch.allclose(fast.sum(1), torch.ones(6))


@settings(max_examples=60, deadline=None)
@given(
    H=st.integers(4, 40),
    W=st.integers(4, 40),
    lams=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=6),
    rounding=st.sampled_from(['timm', 'public']),
    seed=st.integers(0, 2**31 - 1),
)
def test_rand_box_equals_rand_bbox_written_per_box(H, W, lams, rounding, seed):
    """``rand_box`` (vectorised on the host) against timm's ``rand_bbox`` written box by box in Python numbers,
    fed the generator's uniforms as ``rand_box`` draws them (every box's centre row, then every centre column);
    ``rounding='public'``: the authors' pinned timm, ``cut // 2`` on both sides."""
    n = len(lams)
    g = torch.Generator().manual_seed(seed)
    uy, ux = (torch.rand(n, generator=g, dtype=torch.float64).tolist() for _ in range(2))
    expected = []
    for lam, u, v in zip(lams, uy, ux):
        cut_h, cut_w = int(H * math.sqrt(1 - lam)), int(W * math.sqrt(1 - lam))
        cy, cx = min(math.floor(u * H), H - 1), min(math.floor(v * W), W - 1)
        far_h = cut_h - cut_h // 2 if rounding == 'timm' else cut_h // 2
        far_w = cut_w - cut_w // 2 if rounding == 'timm' else cut_w // 2
        box = (cy - cut_h // 2, cy + far_h, cx - cut_w // 2, cx + far_w)
        expected.append([min(max(c, 0), side) for c, side in zip(box, (H, H, W, W))])
    got = rand_box((H, W), torch.tensor(lams, dtype=torch.float64), torch.Generator().manual_seed(seed), rounding)
    assert got.dtype == torch.int64 and got.tolist() == expected
    for patch in ((4, 4), (3, 5)):  # one box at a time (batch mode) = the vector
        one = torch.cat([box_token_share([b], (H, W), patch) for b in expected])
        assert torch.equal(one, box_token_share(got, (H, W), patch))


@settings(max_examples=60, deadline=None)
@given(
    H=st.integers(4, 40),
    W=st.integers(4, 40),
    lam=st.floats(0.0, 1.0),
    rounding=st.sampled_from(['timm', 'public']),
    seed=st.integers(0, 2**31 - 1),
)
def test_one_box_host_functions_equal_their_vector_twins(H, W, lam, rounding, seed):
    """``rand_box_one`` / ``box_token_share_one`` (batch mode on the host) give exactly what ``rand_box`` /
    ``box_token_share`` give for one box and the same generator state."""
    from shared_core.boxes import box_token_share_one, rand_box_one

    one = rand_box_one((H, W), lam, torch.Generator().manual_seed(seed), rounding)
    ref = rand_box((H, W), torch.tensor([lam], dtype=torch.float64), torch.Generator().manual_seed(seed), rounding)
    assert list(one) == ref[0].tolist()
    for patch in ((4, 4), (3, 5)):
        assert torch.equal(box_token_share_one(one, (H, W), patch), box_token_share(ref, (H, W), patch))
