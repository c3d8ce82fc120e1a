"""The mix description and how it applies (``shared_core.mix``, through the ``shared_core.mixing`` facade): images and
tokens against pixel references, targets, uint8 rounding, flipped partners and bad input."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared_core.mixing import (
    CUT_KINDS,
    MIX_KINDS,
    Mix,
    MixSampler,
    box_token_share,
    mix_images,
    mix_target,
    mix_tokens,
    pair_target,
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
