"""Token labeling targets from top-k maps: orientation against an explicit reference, sums, ReLabel."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared_core.label_maps import (
    CropMaps,
    check_map_row,
    crop_box,
    crop_targets,
    dense_maps,
    register_center_square,
    token_targets,
    token_targets_batch,
)


def reference_dense(values, indices, C):
    """Explicit loops: each cell keeps its top-k probabilities, the rest spread over the other classes."""
    k, h, w = values.shape
    out = np.zeros((C, h, w))
    for i in range(h):
        for j in range(w):
            v = values[:, i, j].astype(np.float64)
            rest = max(0.0, 1.0 - v.sum())
            out[:, i, j] = rest / (C - k) if C > k else 0.0
            for kk in range(k):
                out[indices[kk, i, j], i, j] = v[kk]
            out[:, i, j] /= out[:, i, j].sum()
    return out


def sample_count(lo, hi, cells, out):
    """RoIAlign's adaptive samples per bin, ceil(span / out), with its float32 arithmetic (coordinates
    scaled, shifted by -0.5, subtracted): the count is a ceil, so float64 would differ where a span sits on
    an integer."""
    f = np.float32
    start = f(f(lo) * f(cells)) - f(0.5)
    end = f(f(hi) * f(cells)) - f(0.5)
    return int(np.ceil(f(end - start) / f(out)))


def bilinear(dense, y, x):
    """The ``(C, h, w)`` map read at ``(y, x)`` in cell coordinates (cell centres on the integers), bilinearly,
    clamped at the border (RoIAlign's rule)."""
    _, h, w = dense.shape
    y, x = min(max(y, 0.0), h - 1.0), min(max(x, 0.0), w - 1.0)
    yl, xl = int(math.floor(y)), int(math.floor(x))
    yh, xh = min(yl + 1, h - 1), min(xl + 1, w - 1)
    ly, lx = y - yl, x - xl
    return (
        (1 - ly) * (1 - lx) * dense[:, yl, xl]
        + (1 - ly) * lx * dense[:, yl, xh]
        + ly * (1 - lx) * dense[:, yh, xl]
        + ly * lx * dense[:, yh, xh]
    )


def reference_targets(values, indices, C, box, flip, grid):
    """RoIAlign written out: the crop (x0, y0, x1, y1) in map cells (cell j spans [j, j+1]); each token
    averages ceil(size/grid)^2 bilinear samples at its sub-bin centres, cell values sitting at the
    cell centres (j + 0.5), clamped at the border; the result flipped left-right after the crop."""
    dense = reference_dense(values, indices, C)
    _, h, w = dense.shape
    gh, gw = grid
    x0, y0, x1, y1 = box[0] * w, box[1] * h, box[2] * w, box[3] * h
    bh, bw = (y1 - y0) / gh, (x1 - x0) / gw
    ny, nx = sample_count(box[1], box[3], h, gh), sample_count(box[0], box[2], w, gw)

    out = np.zeros((C, gh, gw))
    for a in range(gh):
        for b in range(gw):
            acc = np.zeros(C)
            for sy in range(ny):
                for sx in range(nx):
                    yc = y0 + a * bh + (sy + 0.5) * bh / ny  # continuous, cell centres at +0.5
                    xc = x0 + b * bw + (sx + 0.5) * bw / nx
                    acc += bilinear(dense, yc - 0.5, xc - 0.5)
            out[:, a, b] = acc / (ny * nx)
    return out[:, :, ::-1] if flip else out


def quadrant_map(h=8, w=8, k=2, C=6):
    """Top-left class 0, top-right 1, bottom-left 2, bottom-right 3 (prob 0.9), class 4 second (0.05)."""
    idx = np.zeros((k, h, w), np.uint16)
    idx[0, : h // 2, w // 2 :] = 1
    idx[0, h // 2 :, : w // 2] = 2
    idx[0, h // 2 :, w // 2 :] = 3
    idx[1] = 4
    val = np.zeros((k, h, w), np.float16)
    val[0], val[1] = 0.9, 0.05
    return val, idx, C


QUADRANTS = {  # crop box -> the class every token must read
    'top-left': ((0.0, 0.0, 0.5, 0.5), 0),
    'top-right': ((0.5, 0.0, 1.0, 0.5), 1),
    'bottom-left': ((0.0, 0.5, 0.5, 1.0), 2),
    'bottom-right': ((0.5, 0.5, 1.0, 1.0), 3),
    'top-right inner': ((0.6, 0.1, 0.9, 0.4), 1),
    'bottom-left inner': ((0.1, 0.6, 0.4, 0.9), 2),
}


@pytest.mark.parametrize('name', sorted(QUADRANTS))
@pytest.mark.parametrize('flip', [False, True])
def test_a_crop_of_a_quadrant_reads_that_quadrants_labels(name, flip):
    val, idx, C = quadrant_map()
    box, cls = QUADRANTS[name]
    t = token_targets(val, idx, C, box, flip, (4, 4))
    assert t.shape == (C, 4, 4)
    assert (t.argmax(0) == cls).all(), (name, t.argmax(0))
    np.testing.assert_allclose(t.numpy(), reference_targets(val, idx, C, box, flip, (4, 4)), atol=1e-5)


@pytest.mark.parametrize('flip', [False, True])
def test_a_crop_straddling_the_centre_keeps_orientation(flip):
    val, idx, C = quadrant_map()
    t = token_targets(val, idx, C, (0.25, 0.25, 0.75, 0.75), flip, (2, 2))
    expect = np.array([[0, 1], [2, 3]])
    if flip:
        expect = expect[:, ::-1]
    assert (t.argmax(0).numpy() == expect).all()
    np.testing.assert_allclose(
        t.numpy(), reference_targets(val, idx, C, (0.25, 0.25, 0.75, 0.75), flip, (2, 2)), atol=1e-5
    )


def test_transposed_box_order_would_read_mirrored_labels():
    """The public code's (y1, x1, y2, x2): a top-right crop would read the bottom-left quadrant."""
    val, idx, C = quadrant_map()
    right = token_targets(val, idx, C, (0.5, 0.0, 1.0, 0.5), False, (2, 2))
    wrong = token_targets(val, idx, C, (0.0, 0.5, 0.5, 1.0), False, (2, 2))
    assert (right.argmax(0) == 1).all() and (wrong.argmax(0) == 2).all()


@settings(max_examples=40, deadline=None)
@given(
    x0=st.floats(0, 0.8),
    y0=st.floats(0, 0.8),
    w=st.floats(0.1, 1.0),
    h=st.floats(0.1, 1.0),
    flip=st.booleans(),
    gh=st.integers(1, 7),
    gw=st.integers(1, 7),
    seed=st.integers(0, 2**16),
    k=st.integers(1, 4),
    smoothing=st.sampled_from([0.0, 0.1]),
)
def test_targets_match_the_reference_and_sum_to_one(x0, y0, w, h, flip, gh, gw, seed, k, smoothing):
    rng = np.random.default_rng(seed)
    C, mh, mw = 7, 5, 6
    logits = rng.normal(size=(C, mh, mw))
    p = np.exp(logits) / np.exp(logits).sum(0)
    order = np.argsort(-p, 0)[:k]
    val = np.take_along_axis(p, order, 0).astype(np.float16)
    box = (x0, y0, min(1.0, x0 + w), min(1.0, y0 + h))
    t = token_targets(val, order.astype(np.uint16), C, box, flip, (gh, gw), smoothing=smoothing)
    ref = reference_targets(val, order, C, box, flip, (gh, gw)) * (1 - smoothing) + smoothing / C
    np.testing.assert_allclose(t.numpy(), ref, atol=1e-5)
    assert (t >= 0).all()
    np.testing.assert_allclose(t.sum(0).numpy(), 1.0, atol=1e-5)


def test_dense_maps_spreads_the_rest_uniformly():
    val = np.array([[[0.5]], [[0.3]]], np.float16)
    idx = np.array([[[2]], [[0]]], np.uint16)
    d = dense_maps(torch.from_numpy(val)[None], torch.from_numpy(idx.astype(np.int64))[None], 5)[0, :, 0, 0]
    np.testing.assert_allclose(d.numpy(), [0.3, 0.2 / 3, 0.5, 0.2 / 3, 0.2 / 3], atol=1e-3)


def test_batch_equals_one_image_at_a_time_and_relabel_is_the_crop_mean():
    rng = np.random.default_rng(0)
    B, C, k = 3, 9, 3
    val = torch.from_numpy(rng.dirichlet(np.ones(C), size=(B, 4, 4)).astype(np.float16)[..., :k]).permute(0, 3, 1, 2)
    idx = torch.from_numpy(rng.integers(0, C, (B, k, 4, 4)))
    idx[:, 1] = (idx[:, 0] + 1) % C
    idx[:, 2] = (idx[:, 0] + 2) % C
    crops = torch.tensor([[0, 0, 1, 1], [0.2, 0.1, 0.7, 0.9], [0.5, 0.5, 1, 1]], dtype=torch.float32)
    flips = torch.tensor([True, False, True])
    batch = token_targets_batch(CropMaps(val, idx, C, crops, flips), (3, 2))
    for b in range(B):
        one = token_targets(val[b], idx[b], C, crops[b], bool(flips[b]), (3, 2))
        torch.testing.assert_close(batch[b], one)
    # the whole image pooled = the mean of the cells' distributions
    full = crop_targets(
        CropMaps(val, idx, C, torch.tensor([[0.0, 0.0, 1.0, 1.0]] * B), torch.zeros(B, dtype=torch.bool))
    )
    torch.testing.assert_close(full, dense_maps(val, idx, C).mean((2, 3)), atol=1e-6, rtol=0)


def test_bad_rows_and_boxes_are_refused():
    val, idx, C = quadrant_map()
    with pytest.raises(ValueError, match='class indices'):
        check_map_row(val, idx, 3)
    bad = val.copy()
    bad[0, 0, 0] = 2.0
    with pytest.raises(ValueError, match='probabilities'):
        check_map_row(bad, idx, C)
    with pytest.raises(ValueError, match='same shape|one shape'):
        check_map_row(val[:1], idx, C)
    with pytest.raises(ValueError, match='x0 < x1'):
        token_targets(val, idx, C, (0.5, 0.0, 0.5, 1.0), False, (2, 2))


def test_crop_box_is_normalised_x0_y0_x1_y1():
    assert crop_box(10, 20, 30, 40, 100, 200) == (0.1, 0.1, 0.3, 0.4)


def test_top_k_over_all_classes_is_renormalised_exactly():
    """k == C: no rest to spread; fp16 rows summing to slightly less than 1 still give targets summing to 1."""
    rng = np.random.default_rng(1)
    p = rng.dirichlet(np.ones(4), size=(6, 6))
    order = np.argsort(-p, -1)
    val = np.take_along_axis(p, order, -1).astype(np.float16).transpose(2, 0, 1)
    t = token_targets(val, order.transpose(2, 0, 1), 4, (0.1, 0.2, 0.9, 0.7), True, (5, 3))
    np.testing.assert_allclose(t.sum(0).numpy(), 1.0, atol=1e-6)
    np.testing.assert_allclose(
        t.numpy(), reference_targets(val, order.transpose(2, 0, 1), 4, (0.1, 0.2, 0.9, 0.7), True, (5, 3)), atol=1e-5
    )


def test_crops_outside_the_image_and_repeated_classes_are_refused():
    val, idx, C = quadrant_map()
    with pytest.raises(ValueError, match=r'inside the image'):
        token_targets(val, idx, C, (-0.2, 0.0, 0.5, 1.0), False, (2, 2))
    dup = idx.copy()
    dup[1] = dup[0]
    with pytest.raises(ValueError, match='same class twice'):
        check_map_row(val, dup, C)


def _column_map(k_classes=4, h=6, w=8):
    """A one-hot (k=1) map whose class is the map column's quarter: class ``c`` covers map x in [c/4, (c+1)/4)."""
    cls = torch.arange(w).div(w // k_classes, rounding_mode='floor').expand(h, w)
    return torch.ones(1, h, w, dtype=torch.float16), cls[None].clone()


@pytest.mark.parametrize('flip', [False, True])
@pytest.mark.parametrize('size', [(64, 48), (48, 64), (40, 40)])
def test_a_pixel_reads_the_map_where_the_annotator_saw_it_on_the_centre_square(size, flip):
    """Maps of the centre square (the released Token Labeling maps): a token reads the map cell the annotator saw
    its pixels in. A crop inside the centre square reads what a box moved into map coordinates reads (the map's own
    crop path, RoIAlign); a crop of the strip the annotator never saw is uniform; for a square image the
    registration changes nothing."""
    W, H = size
    s = min(W, H)
    values, indices = _column_map()
    C, grid = 4, (3, 4)

    def to_map(x, y):  # the annotator's view: the shorter side resized, the centre square cropped
        return (x * W - (W - s) / 2) / s, (y * H - (H - s) / 2) / s

    lo_x, lo_y = (W - s) / (2 * W), (H - s) / (2 * H)
    inside = (lo_x + 0.1 * s / W, lo_y + 0.05 * s / H, lo_x + 0.7 * s / W, lo_y + 0.9 * s / H)
    box, fl, chain = register_center_square(inside, flip, np.zeros((0, 2, 3)), (W, H))
    got = token_targets(values, indices, C, box, fl, grid, affine=chain)
    mapped = (*to_map(inside[0], inside[1]), *to_map(inside[2], inside[3]))
    want = token_targets(values, indices, C, mapped, flip, grid)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    if W > H:  # the left strip the annotator never saw: uniform
        strip = (0.0, 0.2, 0.9 * lo_x, 0.8)
        box, fl, chain = register_center_square(strip, flip, np.zeros((0, 2, 3)), (W, H))
        got = token_targets(values, indices, C, box, fl, grid, affine=chain)
        assert torch.allclose(got, torch.full_like(got, 1 / C), atol=1e-6)
        # registered on the whole image (the public code), the same crop reads the map's first column instead
        assert token_targets(values, indices, C, strip, flip, grid).argmax(0).eq(0).all()
    if W == H:
        box, fl, chain = register_center_square(inside, flip, np.zeros((0, 2, 3)), (W, H))
        got = token_targets(values, indices, C, box, fl, grid, affine=chain)
        assert torch.allclose(got, token_targets(values, indices, C, inside, flip, grid), atol=1e-5)
