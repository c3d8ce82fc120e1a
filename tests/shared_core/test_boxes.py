"""Pixel boxes (``shared_core.boxes``): timm's box geometry, the min/max sides, each token's share of a box, the
host twins of the vector samplers."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared_core.mixing import (
    MIX_KINDS,
    MixSampler,
    box_token_share,
    mix_target,
    rand_box,
)

KINDS_KW = {k: (dict(mixup_alpha=1.0) if k == 'mixup' else dict(mixup_alpha=0.8, cutmix_alpha=1.0)) for k in MIX_KINDS}


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
