"""Token targets that follow geometric ops after the crop (RandAugment's rotate, shear, translate): an explicit
loop reference, the crop path at identity, exact shifts and quarter turns, the fill, and the pixel-matrix
conversions against real PIL and OpenCV warps."""

import math

import cv2
import numpy as np
import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from PIL import Image

from shared_core.label_maps import (
    CropMaps,
    affine_extent,
    class_maps,
    crop_targets,
    normalised_affine,
    stack_affines,
    token_targets,
    token_targets_batch,
    token_targets_sparse,
)
from timm_plugin.token_label_data import pil_op_affine

from ..shared_core.test_label_maps import bilinear, quadrant_map, reference_dense


def random_map(rng, C=7, h=5, w=6, k=3):
    logits = rng.normal(size=(C, h, w))
    p = np.exp(logits) / np.exp(logits).sum(0)
    order = np.argsort(-p, 0)[:k]
    return np.take_along_axis(p, order, 0).astype(np.float16), order.astype(np.int64), C


def reference_affine_targets(values, indices, C, box, flip, grid, chain):
    """Written out in float64: a token averages ny x nx bilinear samples at its sub-bin centres of the augmented
    crop (n = ceil(map cells a unit step spans along that output axis / grid), RoIAlign's count); each sample is
    mapped back through the chain, last op first, and counts as uniform if it leaves [0, 1]^2 at any stage;
    then it is un-flipped, placed in the crop, and read bilinearly from the dense map (cell centres at
    j + 0.5, clamped at the border)."""
    dense = reference_dense(values, indices, C)
    _, h, w = dense.shape
    gh, gw = grid
    chain = [np.asarray(a, np.float64) for a in chain]
    J = np.eye(2)
    for a in chain:
        J = J @ a[:, :2]
    E = np.diag([(box[2] - box[0]) * w, (box[3] - box[1]) * h]) @ J
    nx = max(1, math.ceil(np.linalg.norm(E[:, 0]) / gw))
    ny = max(1, math.ceil(np.linalg.norm(E[:, 1]) / gh))

    out = np.zeros((C, gh, gw))
    for a in range(gh):
        for b in range(gw):
            acc = np.zeros(C)
            for sy in range(ny):
                for sx in range(nx):
                    u, v = (b + (sx + 0.5) / nx) / gw, (a + (sy + 0.5) / ny) / gh
                    inside = True
                    for m in reversed(chain):
                        u, v = m @ np.array([u, v, 1.0])
                        inside = inside and 0 <= u <= 1 and 0 <= v <= 1
                    if not inside:
                        acc += 1.0 / C
                        continue
                    if flip:
                        u = 1.0 - u
                    x = (box[0] + u * (box[2] - box[0])) * w
                    y = (box[1] + v * (box[3] - box[1])) * h
                    acc += bilinear(dense, y - 0.5, x - 0.5)
            out[:, a, b] = acc / (ny * nx)
    return out


affine = st.tuples(
    st.floats(0.6, 1.4),
    st.floats(-0.5, 0.5),
    st.floats(-0.4, 0.4),
    st.floats(-0.5, 0.5),
    st.floats(0.6, 1.4),
    st.floats(-0.4, 0.4),
).map(lambda t: np.array(t, np.float64).reshape(2, 3))


@settings(max_examples=40, deadline=None)
@given(
    x0=st.floats(0, 0.6),
    y0=st.floats(0, 0.6),
    bw=st.floats(0.15, 1.0),
    bh=st.floats(0.15, 1.0),
    flip=st.booleans(),
    gh=st.integers(1, 6),
    gw=st.integers(1, 6),
    chain=st.lists(affine, min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
    smoothing=st.sampled_from([0.0, 0.1]),
)
def test_targets_through_affines_match_the_loop_reference_and_sum_to_one(
    x0, y0, bw, bh, flip, gh, gw, chain, seed, smoothing
):
    val, idx, C = random_map(np.random.default_rng(seed))
    box = (x0, y0, min(1.0, x0 + bw), min(1.0, y0 + bh))
    # the sample count is a ceil: where a span sits on a multiple of the grid, float32 and float64 may differ
    ey, ex = affine_extent(torch.tensor([box], dtype=torch.float64), np.stack(chain)[None], (5, 6))[0].tolist()
    assume(min(abs(ey / gh - round(ey / gh)), abs(ex / gw - round(ex / gw))) > 1e-3)
    t = token_targets(val, idx, C, box, flip, (gh, gw), smoothing, affine=np.stack(chain))
    ref = reference_affine_targets(val, idx, C, box, flip, (gh, gw), chain) * (1 - smoothing) + smoothing / C
    np.testing.assert_allclose(t.numpy(), ref, atol=2e-5)
    assert (t >= 0).all()
    np.testing.assert_allclose(t.sum(0).numpy(), 1.0, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(
    x0=st.floats(0, 0.7),
    y0=st.floats(0, 0.7),
    bw=st.floats(0.1, 1.0),
    bh=st.floats(0.1, 1.0),
    flip=st.booleans(),
    gh=st.integers(1, 9),
    gw=st.integers(1, 9),
    seed=st.integers(0, 2**16),
)
@example(x0=0.0, y0=0.26363196041689546, bw=1.0, bh=0.6, flip=False, gh=1, gw=1, seed=0)  # a span of 3 cells
def test_identity_affines_are_the_crop_path(x0, y0, bw, bh, flip, gh, gw, seed):
    val, idx, C = random_map(np.random.default_rng(seed))
    box = (x0, y0, min(1.0, x0 + bw), min(1.0, y0 + bh))
    plain = token_targets(val, idx, C, box, flip, (gh, gw))
    ident = token_targets(val, idx, C, box, flip, (gh, gw), affine=np.eye(3)[:2][None].repeat(2, 0))
    torch.testing.assert_close(ident, plain, atol=2e-6, rtol=0)


def test_a_shift_by_whole_tokens_moves_the_targets_and_fills_uniformly():
    """Map cells = tokens, the whole image: content moved 2 tokens right and 1 down reads the unshifted
    targets 2 columns left and 1 row up; the vacated tokens are uniform."""
    val, idx, C = random_map(np.random.default_rng(0), h=8, w=8)
    box = (0.0, 0.0, 1.0, 1.0)
    plain = token_targets(val, idx, C, box, False, (8, 8))
    shift = np.array([[1.0, 0.0, -2 / 8], [0.0, 1.0, -1 / 8]])  # output (u, v) came from (u - 2/8, v - 1/8)
    t = token_targets(val, idx, C, box, False, (8, 8), affine=shift)
    torch.testing.assert_close(t[:, 1:, 2:], plain[:, :-1, :-2], atol=1e-6, rtol=0)
    vacated = torch.ones(8, 8, dtype=torch.bool)
    vacated[1:, 2:] = False
    torch.testing.assert_close(t[:, vacated], torch.full((C, int(vacated.sum())), 1.0 / C), atol=1e-7, rtol=0)


@pytest.mark.parametrize('flip', [False, True])
def test_a_quarter_turn_of_a_square_crop_turns_the_targets(flip):
    """PIL's rotate(90) (counter-clockwise) of a square crop, through pil_op_affine: the targets are the
    unrotated ones turned a quarter counter-clockwise (np.rot90); 180 degrees turns them twice."""
    val, idx, C = random_map(np.random.default_rng(1), h=6, w=6)
    box = (0.25, 0.0, 0.75, 0.5)  # square in a square map
    plain = token_targets(val, idx, C, box, flip, (4, 4)).numpy()
    for deg, turns in ((90, 1), (180, 2), (270, 3)):
        m = pil_op_affine('Rotate', (64, 64), (deg,))
        t = token_targets(val, idx, C, box, flip, (4, 4), affine=m).numpy()
        np.testing.assert_allclose(t, np.rot90(plain, turns, axes=(1, 2)), atol=1e-5)


def test_tokens_wholly_outside_are_uniform_and_partly_outside_blend():
    val, idx, C = quadrant_map()
    out = np.array([[1.0, 0.0, 1.5], [0.0, 1.0, 0.0]])  # every output point reads u + 1.5 > 1: all fill
    t = token_targets(val, idx, C, (0.0, 0.0, 1.0, 1.0), False, (4, 4), affine=out)
    torch.testing.assert_close(t, torch.full_like(t, 1.0 / C))
    half = np.array([[1.0, 0.0, 0.5], [0.0, 1.0, 0.0]])  # the right half of the output is fill
    t = token_targets(val, idx, C, (0.0, 0.0, 1.0, 1.0), False, (2, 2), affine=half)
    assert t[:, :, 1].max() - t[:, :, 1].min() < 1e-6  # uniform
    assert t[:, 0, 0].argmax() == 1 and t[:, 1, 0].argmax() == 3  # the right quadrants moved left


def test_two_ops_that_cancel_still_keep_the_first_ops_fill():
    """Translate right by 0.25, then left by 0.25: the composition is the identity, but the first op's fill
    (the left quarter) was moved to the right quarter, where the targets must be uniform."""
    val, idx, C = quadrant_map()
    right = np.array([[1.0, 0.0, -0.25], [0.0, 1.0, 0.0]])
    left = np.array([[1.0, 0.0, 0.25], [0.0, 1.0, 0.0]])
    t = token_targets(val, idx, C, (0.0, 0.0, 1.0, 1.0), False, (4, 4), affine=np.stack([right, left]))
    plain = token_targets(val, idx, C, (0.0, 0.0, 1.0, 1.0), False, (4, 4))
    torch.testing.assert_close(t[:, :, :3], plain[:, :, :3], atol=1e-6, rtol=0)
    torch.testing.assert_close(t[:, :, 3], torch.full((C, 4), 1.0 / C), atol=1e-7, rtol=0)


def test_batch_paths_agree_and_class_maps_and_relabel_follow_the_affines():
    rng = np.random.default_rng(3)
    B, grid = 5, (3, 4)
    rows = [random_map(rng, C=9, h=7, w=5) for _ in range(B)]
    C = 9
    vals = torch.from_numpy(np.stack([r[0] for r in rows]))
    idxs = torch.from_numpy(np.stack([r[1] for r in rows]))
    crops = torch.tensor(
        [[0.1, 0.0, 0.9, 0.7], [0.0, 0.2, 0.5, 1.0], [0.3, 0.3, 0.6, 0.9], [0, 0, 1, 1], [0.2, 0.1, 1, 0.5]]
    )
    flips = torch.tensor([True, False, True, False, True])
    chains = [
        None,
        pil_op_affine('Rotate', (40, 30), (25,))[None],
        [],
        np.stack([pil_op_affine('ShearX', (40, 30), (0.3,)), pil_op_affine('TranslateYRel', (40, 30), (-0.2,))]),
        pil_op_affine('ShearY', (40, 30), (-0.25,))[None],
    ]
    affines, extent = stack_affines(chains, crops, (7, 5))
    assert affines.shape == (B, 2, 2, 3) and len(extent) == 2
    torch.testing.assert_close(affine_extent(crops, affines, (7, 5)).amax(0), torch.tensor(extent))
    maps = CropMaps(vals, idxs, C, crops, flips, affines, extent)
    dense = token_targets_batch(maps, grid, 0.1)
    for b in range(B):
        one = token_targets(rows[b][0], rows[b][1], C, crops[b], bool(flips[b]), grid, 0.1, affine=affines[b])
        torch.testing.assert_close(dense[b], one, atol=1e-6, rtol=0)
    # without the host extent (computed from the tensors) the same
    sp = token_targets_sparse(CropMaps(vals, idxs, C, crops, flips, affines), grid, 0.1)
    torch.testing.assert_close(sp.dense().view(B, *grid, C).permute(0, 3, 1, 2), dense)
    cls = torch.tensor([0, 3, 8, 2, 5])
    one_class = class_maps(maps, cls, grid)
    plain_smooth = token_targets_batch(maps, grid, 0.0)
    torch.testing.assert_close(one_class, plain_smooth[torch.arange(B), cls], atol=1e-6, rtol=0)
    relabel = crop_targets(maps, 0.0)
    one_token = token_targets_batch(maps, (1, 1), 0.0)[:, :, 0, 0]
    torch.testing.assert_close(relabel, one_token)
    assert stack_affines([None, []], crops[:2], (7, 5)) == (None, None)


def test_bad_affines_are_refused():
    val, idx, C = quadrant_map()
    with pytest.raises(ValueError, match='affine: expected a 2x3'):
        token_targets(val, idx, C, (0, 0, 1, 1), False, (2, 2), affine=np.eye(3))
    with pytest.raises(ValueError, match='affines: expected finite'):
        token_targets(val, idx, C, (0, 0, 1, 1), False, (2, 2), affine=np.full((2, 3), np.nan))
    with pytest.raises(ValueError, match=r'affines: expected one chain .*B=2'):
        maps = CropMaps(
            torch.from_numpy(val)[None].repeat(2, 1, 1, 1),
            torch.from_numpy(idx.astype(np.int64))[None].repeat(2, 1, 1, 1),
            C,
            torch.tensor([[0, 0, 1, 1.0]] * 2),
            torch.zeros(2, dtype=torch.bool),
            affines=torch.zeros(3, 1, 2, 3),
        )
        token_targets_batch(maps, (2, 2))
    with pytest.raises(ValueError, match='direction'):
        normalised_affine(np.eye(3)[:2], 4, 4, direction='forward')
    with pytest.raises(ValueError, match='name: expected one of'):
        pil_op_affine('Solarize', (4, 4), (1,))


def _texture(h, w, seed=0):
    """An image of random 1-pixel colours (every pixel distinct in practice)."""
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _read_back(src, out, m, margin=0.05):
    """For output pixels whose source point (centre mapped by the normalised m) lies inside the source and
    at least ``margin`` pixels from a pixel edge, the output pixel must be that source pixel."""
    H, W = src.shape[:2]
    ys, xs = np.mgrid[0:H, 0:W]
    u, v = (xs + 0.5) / W, (ys + 0.5) / H
    su = (m[0, 0] * u + m[0, 1] * v + m[0, 2]) * W
    sv = (m[1, 0] * u + m[1, 1] * v + m[1, 2]) * H
    ok = (su > margin) & (su < W - margin) & (sv > margin) & (sv < H - margin)
    ok &= (np.abs(su - np.round(su)) > margin) & (np.abs(sv - np.round(sv)) > margin)
    si, sj = np.floor(sv[ok]).astype(int), np.floor(su[ok]).astype(int)
    assert ok.sum() > 0.15 * H * W
    np.testing.assert_array_equal(out[ok], src[si, sj])


@pytest.mark.parametrize(
    'name,args',
    [
        ('Rotate', (23.0,)),
        ('Rotate', (-30.0,)),
        ('ShearX', (0.3,)),
        ('ShearY', (-0.25,)),
        ('TranslateXRel', (0.2,)),
        ('TranslateYRel', (-0.3,)),
        ('TranslateX', (-7,)),
    ],
)
def test_pil_op_affine_is_the_matrix_timms_op_applies(name, args):
    """timm's own op function on a non-square image (nearest neighbour): each output pixel is the source pixel
    at the recorded normalised affine of its centre."""
    from timm.data.auto_augment import NAME_TO_OP

    src = _texture(30, 48)
    out = np.asarray(NAME_TO_OP[name](Image.fromarray(src), *args, resample=Image.NEAREST, fillcolor=(0, 0, 0)))
    _read_back(src, out, pil_op_affine(name, (48, 30), args))


@pytest.mark.parametrize('op', ['rotate', 'shear_h', 'shear_v', 'translate'])
def test_normalised_affine_of_opencv_forward_matrices(op):
    """mmcv's warps (OpenCV, pixel centres on the integers, matrix input -> output) on a non-square image."""
    import mmcv

    src = _texture(30, 48, seed=1)
    H, W = src.shape[:2]
    if op == 'rotate':
        fwd = cv2.getRotationMatrix2D(((W - 1) * 0.5, (H - 1) * 0.5), -17.0, 1.0)
        out = mmcv.imrotate(src, 17.0, interpolation='nearest')
    elif op == 'shear_h':
        fwd = np.float32([[1, 0.3, 0], [0, 1, 0]])
        out = mmcv.imshear(src, 0.3, 'horizontal', interpolation='nearest')
    elif op == 'shear_v':
        fwd = np.float32([[1, 0, 0], [-0.2, 1, 0]])
        out = mmcv.imshear(src, -0.2, 'vertical', interpolation='nearest')
    else:
        fwd = np.float32([[1, 0, -9.6], [0, 1, 0]])
        out = mmcv.imtranslate(src, -9.6, 'horizontal', interpolation='nearest')
    _read_back(src, out, normalised_affine(fwd, W, H, 'input_to_output', corner=-0.5))
