"""TokenMix's activation-map targets (tokenmix.md Eq. 2): a hand computation, sums, fallbacks, the mixer."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared_core.label_maps import CropMaps, class_maps, token_targets_batch
from shared_core.mixing import Mix, MixSampler, pair_target
from shared_core.tokenmix import activation_lam, activation_target
from timm_plugin import create_mixer
from timm_plugin.token_labeling import TokenLabelTarget


def two_by_two_maps():
    """Two images, 2x2 maps = 2x2 token grid, k = 1 of C = 3 classes; full crops, no flips.
    Image 0 (class 0): its class sits in the top-left cell (0.8), weakly elsewhere (0.2 / 0.2 / 0.0 rest).
    Image 1 (class 1): its class only in the bottom-right cell (0.9), the other cells show class 2."""
    idx = np.zeros((2, 1, 2, 2), np.int64)
    val = np.zeros((2, 1, 2, 2), np.float16)
    val[0, 0] = [[0.8, 0.2], [0.2, 0.2]]  # class 0 everywhere as top-1
    idx[1, 0] = [[2, 2], [2, 1]]
    val[1, 0] = [[0.9, 0.9], [0.9, 0.9]]  # class 2 in three cells, class 1 bottom-right
    crops = torch.tensor([[0.0, 0.0, 1.0, 1.0]] * 2)
    return torch.from_numpy(val), torch.from_numpy(idx), crops, torch.zeros(2, dtype=torch.bool)


def test_hand_computed_target_for_a_small_map_and_mask():
    val, idx, crops, flips = two_by_two_maps()
    # image 0 receives image 1's bottom-right token (the only place image 1's class is): mask share 1 there
    share = torch.tensor([[[0.0, 0.0], [0.0, 1.0]], [[0.0, 0.0], [0.0, 1.0]]])
    mix = Mix(
        partner=torch.tensor([1, 0]),
        lam=torch.tensor([0.75, 0.75]),
        token_share=share,
        img_size=(32, 32),
        patch_size=(16, 16),
        kind='tokenmix_block',
    )
    # by hand: class maps (C = 3, k = 1 -> the rest spread over the other 2 classes)
    # image 0, class 0: [[.8, .2], [.2, .2]] -> normalised / 1.4
    # image 1, class 1: [[.05, .05], [.05, .9]]: the three class-2 cells give (1 - .9) / 2 = .05 to class 1
    A0 = np.array([0.8, 0.2, 0.2, 0.2]) / 1.4
    A1 = np.array([0.05, 0.05, 0.05, 0.9]) / 1.05
    w_own0, w_part0 = A0[:3].sum(), A1[3]  # image 0 keeps 3 tokens, gets image 1's 4th
    w_own1, w_part1 = A1[:3].sum(), A0[3]
    lam = torch.tensor([w_own0 / (w_own0 + w_part0), w_own1 / (w_own1 + w_part1)], dtype=torch.float32)
    crops = CropMaps(val, idx, 3, crops, flips)
    maps = class_maps(crops, torch.tensor([0, 1]), (2, 2))
    np.testing.assert_allclose(maps[0].flatten().numpy(), [0.8, 0.2, 0.2, 0.2], atol=1e-3)
    np.testing.assert_allclose(maps[1].flatten().numpy(), [0.05, 0.05, 0.05, 0.9], atol=1e-3)
    torch.testing.assert_close(activation_lam(maps, mix), lam, atol=1e-3, rtol=0)
    t = activation_target(torch.tensor([0, 1]), mix, crops, smoothing=0.0)
    expect = np.array([[lam[0], 1 - lam[0], 0.0], [1 - lam[1], lam[1], 0.0]])
    np.testing.assert_allclose(t.numpy(), expect, atol=1e-3)
    # the area target says 0.75 / 0.25 for both; the maps say each image shows 6/7 of its own activation and
    # 6/7 of its partner's (image 1's class is all in the one token it gives away): 1/2 each
    torch.testing.assert_close(lam, torch.tensor([0.5, 0.5]), atol=1e-3, rtol=0)


def random_rows(B, C=6, k=3, h=4, w=4, seed=0):
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(C) * 0.5, size=(B, h, w))
    o = np.argsort(-p, -1)[..., :k]
    v = np.take_along_axis(p, o, -1)
    return (
        torch.from_numpy(v.astype(np.float16)).permute(0, 3, 1, 2).contiguous(),
        torch.from_numpy(o).permute(0, 3, 1, 2).contiguous(),
    )


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    kind=st.sampled_from(['tokenmix_block', 'tokenmix_random', 'cutmix', 'mixup']),
    smoothing=st.sampled_from([0.0, 0.1]),
    mode=st.sampled_from(['true_class', 'distribution']),
)
def test_targets_are_probabilities_with_and_without_smoothing(seed, kind, smoothing, mode):
    B, C = 6, 6
    g = torch.Generator().manual_seed(seed)
    kw = dict(mixup_alpha=1.0) if kind == 'mixup' else dict(mixup_alpha=0.0, cutmix_alpha=1.0)
    mix = MixSampler(kind, mode='elem', patch_size=16, **kw).sample(B, (64, 64), generator=g)
    val, idx = random_rows(B, C, seed=seed)
    crops = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.1, 0.2, 0.6, 0.9]] * 3)
    flips = torch.tensor([True, False] * 3)
    labels = torch.randint(0, C, (B,), generator=g)
    t = activation_target(labels, mix, CropMaps(val, idx, C, crops, flips), smoothing, mode)
    assert (t >= 0).all()
    torch.testing.assert_close(t.sum(1), torch.ones(B))
    if kind == 'mixup' and mode == 'true_class':  # a blend: every token has the same share -> the area target
        torch.testing.assert_close(t, pair_target(labels, mix.partner, mix.lam, C, smoothing))


def test_class_maps_is_the_class_channel_of_the_token_targets():
    val, idx = random_rows(4, seed=3)
    crops = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.2, 0.1, 0.7, 0.6], [0.5, 0.5, 1.0, 1.0], [0.0, 0.3, 0.4, 1.0]])
    flips = torch.tensor([False, True, True, False])
    cls = torch.tensor([0, 3, 5, 2])
    maps = CropMaps(val, idx, 6, crops, flips)
    full = token_targets_batch(maps, (3, 5))
    torch.testing.assert_close(class_maps(maps, cls, (3, 5)), full[torch.arange(4), cls])


def test_both_weights_vanishing_falls_back_to_the_area():
    mix = MixSampler('tokenmix_block', mixup_alpha=0.0, cutmix_alpha=1.0, mode='pair', patch_size=16).sample(
        2, (64, 64), generator=torch.Generator().manual_seed(0)
    )
    share = mix.token_share_flat()
    maps = torch.zeros(2, 16)
    maps[0] = share[0] * 0  # image 0: nothing anywhere -> spread evenly, weighs by area
    lam = activation_lam(maps, mix)
    torch.testing.assert_close(lam, mix.lam, atol=1e-6, rtol=0)
    # each image's activation only on the tokens it loses, its partner's only on the tokens the partner keeps:
    # both weights are 0, so λ falls back to the area
    m = torch.zeros(2, 16)
    m[0][share[0] > 0] = 1.0
    m[1][share[1] == 0] = 1.0
    assert (share[0] > 0).any() and (share[0] == 0).any()
    torch.testing.assert_close(activation_lam(m, mix)[0], mix.lam[0])


def test_the_mixer_uses_the_maps_and_refuses_plain_labels():
    B, C = 4, 6
    val, idx = random_rows(B, C)
    y = torch.tensor([0, 1, 2, 3])
    target = TokenLabelTarget.of(
        y, CropMaps(val, idx, C, torch.tensor([[0.0, 0.0, 1.0, 1.0]] * B), torch.zeros(B, dtype=torch.bool))
    )
    mixer = create_mixer(
        'tokenmix_block',
        mixup_alpha=0.0,
        cutmix_alpha=1.0,
        num_classes=C,
        patch_size=16,
        activation_targets='true_class',
        generator=torch.Generator().manual_seed(0),
    )
    x, t = mixer(torch.randn(B, 3, 64, 64), target)
    mix = t.mix
    maps = class_maps(target.maps, y, mix.grid_size)
    torch.testing.assert_close(t.as_tensor(), pair_target(y, mix.partner, activation_lam(maps, mix), C, 0.1))
    with pytest.raises(ValueError, match='teacher maps'):
        mixer(torch.randn(B, 3, 64, 64), y)
    with pytest.raises(ValueError, match='activation_targets'):
        create_mixer('tokenmix_block', cutmix_alpha=1.0, activation_targets='logits')
    with pytest.raises(ValueError, match='collate'):
        create_mixer('tokenmix_block', cutmix_alpha=1.0, activation_targets='true_class', collate=True)
