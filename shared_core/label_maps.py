"""Token labeling's targets from stored dense score maps (the Token Labeling paper, Sec. 3.2, Eq. 2-7).

An offline annotator scored every location of every *whole* training image (see
:mod:`shared_core.map_store`): per map cell the top-k class probabilities ``values`` and their class
``indices``, arrays ``(k, h, w)``. During training an image is cropped (RandomResizedCrop) and maybe
flipped; its token targets are the part of the map under the crop, resampled to the model's token
grid and flipped the same way.

Conventions, all in one place:

- *Geometry.* A crop is ``box = (x0, y0, x1, y1)``, the crop's corners in normalised coordinates of
  the full image (0 = left/top edge, 1 = right/bottom edge), and ``flip`` is a horizontal flip applied
  *after* the crop. Map cell ``(i, j)`` covers ``x ∈ [j/w, (j+1)/w]``, ``y ∈ [i/h, (i+1)/h]`` (the
  annotator saw the whole image). The crop is resampled with torchvision's ``roi_align`` given its
  box as ``(x1, y1, x2, y2)`` in map cells (``aligned=True``: cell centres at ``j + 0.5``; adaptive
  sampling, ``ceil(box size / grid)`` bilinear samples per token and axis). The public code passed
  ``(y1, x1, y2, x2)``, which mirrors the labels of every off-diagonal crop; the orientation tests
  read crops of each quadrant of a map whose quadrants are different classes.
- *Classes outside the top-k.* The stored values are the annotator's softmax probabilities of its
  top-k classes. A cell's distribution keeps them as they are and spreads the remaining mass
  ``1 - Σ top-k`` uniformly over the other ``C - k`` classes, then is renormalised to sum to 1 (this
  only absorbs fp16 rounding). Resampling averages distributions, so every token target is one.
- *Label smoothing* ``ε``: ``(1 - ε) · p + ε / C`` (timm's convention), so rows still sum to 1.
- *Geometric augmentation after the crop* (RandAugment's Rotate, ShearX/Y, TranslateX/Y): an optional
  chain of affines ``(L, 2, 3)`` per image, in normalised coordinates of the augmented crop (``u`` to the
  right, ``v`` down, both in [0, 1]): op ``l`` turned its input into its output by reading, at output
  point ``(u, v)``, the input at ``A_l @ (u, v, 1)``, and the ops ran in chain order after the crop and the
  flip (so the crop the box and flip describe is the input of the first). The targets follow with the
  same sampling as the crop path: each token averages bilinear samples at its sub-bin centres (as many
  per axis as RoIAlign would take, ``ceil(span in map cells / grid)``, now measured along the mapped
  axis), each sample mapped back through the chain; a sample that lands outside the image of any stage
  (the op's fill) counts as a uniform distribution, the public code's zero-logit fill. With identity
  affines this is RoIAlign exactly (:func:`normalised_affine` converts a pixel matrix of PIL or OpenCV).
- *The public order* (flip and RandAugment on the whole image, then the crop): :func:`crop_after_ops` writes it
  in the form above (the whole image as the box, the ops then the crop as the chain).
- *ReLabel* (the Token Labeling paper, Table 2): one label per crop, the mean of the map's distribution
  over the crop (:func:`crop_targets`, ``roi_align`` to a 1x1 grid).

:func:`token_targets` is the one-image reference entry point; :func:`token_targets_batch` does a
batch in one ``roi_align`` call (with affines, one vectorised sampling pass), on whatever device the rows
are on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torchvision.ops import roi_align

__all__ = [
    'CropMaps',
    'affine_extent',
    'check_affines',
    'check_crops',
    'register_center_square',
    'normalised_affine',
    'dense_maps',
    'token_targets',
    'token_targets_batch',
    'token_targets_sparse',
    'SparseTokenTargets',
    'axis_weights',
    'class_maps',
    'crop_targets',
    'crop_logit_targets',
    'check_map_row',
    'crop_box',
    'crop_after_ops',
    'rows_from_topk_logits',
    'smooth',
    'stack_affines',
]

Box = Union[Sequence[float], torch.Tensor]


def _as_tensor(a, dtype=None) -> torch.Tensor:
    if isinstance(a, np.ndarray):
        a = torch.from_numpy(np.ascontiguousarray(a))
    return torch.as_tensor(a, dtype=dtype)


def check_map_row(values, indices, num_classes: int, name: str = 'label map') -> None:
    """Refuse a corrupt map row: shapes ``(k, h, w)`` that agree, probabilities that are finite, in
    [0, 1] and sum to at most 1 per cell (fp16 slack), class indices in ``[0, num_classes)``."""
    v = np.asarray(values)
    i = np.asarray(indices)
    if v.ndim != 3 or v.shape != i.shape:
        raise ValueError(f'{name}: expected values and indices of one shape (k, h, w), got {v.shape} and {i.shape}')
    if v.shape[0] > num_classes:
        raise ValueError(f'{name}: k={v.shape[0]} top-k entries for num_classes={num_classes}')
    vf = v.astype(np.float32)
    if not np.isfinite(vf).all() or (vf < 0).any() or (vf.sum(0) > 1.01).any():
        raise ValueError(f'{name}: values must be probabilities (finite, >= 0, summing to <= 1 per cell)')
    if i.size and (i.min() < 0 or i.max() >= num_classes):
        raise ValueError(f'{name}: class indices must be in [0, {num_classes}), got [{i.min()}, {i.max()}]')
    if i.shape[0] > 1 and (np.diff(np.sort(i, axis=0), axis=0) == 0).any():
        raise ValueError(f'{name}: a cell lists the same class twice among its top-k')


def dense_maps(values: torch.Tensor, indices: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Full class distributions ``(B, C, h, w)`` float32 from top-k rows ``(B, k, h, w)``: the top-k
    probabilities, the rest of the mass spread uniformly over the other classes, renormalised."""
    values, indices = _as_tensor(values), _as_tensor(indices)
    if values.dim() != 4 or values.shape != indices.shape:
        raise ValueError(
            f'values/indices: expected (B, k, h, w) of one shape, got {tuple(values.shape)} and {tuple(indices.shape)}'
        )
    B, k, h, w = values.shape
    v = values.float().clamp_min(0.0)
    rest = num_classes - k
    fill = (1.0 - v.sum(1, keepdim=True)).clamp_min(0.0) / rest if rest else v.new_zeros(B, 1, h, w)
    out = fill.expand(B, num_classes, h, w).clone()
    out.scatter_(1, indices.long(), v)
    return out / out.sum(1, keepdim=True).clamp_min(1e-12)


def smooth(target: torch.Tensor, smoothing: float, dim: int = 1) -> torch.Tensor:
    """``(1 - ε) · p + ε / C`` along ``dim`` (rows that summed to 1 still do)."""
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f'smoothing must be in [0, 1), got {smoothing}')
    if not smoothing:
        return target
    return target * (1.0 - smoothing) + smoothing / target.shape[dim]


def check_crops(crops: torch.Tensor) -> None:
    """Refuse crops that are not ``(B, 4)`` normalised ``(x0, y0, x1, y1)`` inside the image with
    ``x0 < x1``, ``y0 < y1``. Values are checked on the CPU only (the collates check them there): on an
    accelerator a check would stall every training step on a device sync."""
    if crops.dim() != 2 or crops.shape[1] != 4:
        raise ValueError(f'crops: expected (B, 4) crops (x0, y0, x1, y1), got {tuple(crops.shape)}')
    if crops.device.type != 'cpu':
        return
    b = crops.float()
    if not ((b[:, 0] < b[:, 2]) & (b[:, 1] < b[:, 3])).all():
        raise ValueError('crops: expected x0 < x1 and y0 < y1 (normalised crop corners)')
    if not ((b >= -1e-6) & (b <= 1.0 + 1e-6)).all():
        raise ValueError('crops: expected crops inside the image, corners in [0, 1]')


def axis_weights(lo: torch.Tensor, hi: torch.Tensor, cells: int, out: int) -> torch.Tensor:
    """RoIAlign's interpolation weights along one axis, ``(B, out, cells)``: ``roi_align`` (aligned,
    adaptive sampling) of a one-hot basis of ``cells`` rows over the spans ``[lo, hi]`` (normalised).
    RoIAlign of an axis-aligned box is separable: its 2-D weight of map cell ``(i, j)`` for token
    ``(a, b)`` is ``Wy[a, i] · Wx[b, j]``, sample counts and border clamping included."""
    spans = torch.stack([lo.float(), hi.float()], 1)  # (B, 2)
    offset, matrix = _span_rois(spans.device, (cells,), ((0, 1),))
    return _span_weights(torch.addmm(offset, spans, matrix), cells, out)


def _span_weights(rois: torch.Tensor, cells: int, out: int) -> torch.Tensor:
    """:func:`axis_weights` of RoIAlign boxes ``(K, 5)`` over the one-hot basis of ``cells`` rows."""
    basis = _constant('basis', rois.device, cells, lambda: torch.eye(cells).view(1, cells, cells, 1))
    return roi_align(basis, rois, output_size=(out, 1), spatial_scale=1.0, sampling_ratio=-1, aligned=True)[
        ..., 0
    ].transpose(1, 2)


def _span_rois(device, cells: Tuple[int, ...], columns: Tuple[Tuple[int, int], ...]):
    """``(offset, matrix)`` of ``addmm``: rows of normalised spans, axis ``a``'s ``(lo, hi)`` in ``columns[a]`` of
    ``2 · axes`` columns, to the RoIAlign boxes ``(K, 5 · axes)`` of :func:`_span_weights` over ``cells[a]`` (each
    axis's box: batch index 0, ``x`` over the basis's single column ``[0, 1]``, ``y`` over ``[lo, hi] · cells``)."""

    def make():
        n = len(cells)
        matrix, offset = torch.zeros(2 * n, 5 * n), torch.zeros(1, 5 * n)
        for a, (c, (lo, hi)) in enumerate(zip(cells, columns)):
            matrix[lo, 5 * a + 2] = matrix[hi, 5 * a + 4] = float(c)
            offset[0, 5 * a + 3] = 1.0
        return offset, matrix

    return _constant('span_rois', device, (cells, columns), make)


_CONSTANTS: dict = {}


def _constant(name: str, device, key, make):
    """``make()`` (a tensor or a tuple of them, built on the CPU) on ``device``, built once per
    ``(name, device, key)``: the targets are built every step, and constants made there would cost a
    host-to-device copy each. Not kept while a compiler traces, nor when a mode made them fake."""
    device = torch.device(device)
    k = (name, device, key)
    hit = _CONSTANTS.get(k)
    if hit is not None:
        return hit
    made = make()
    value = tuple(t.to(device) for t in made) if isinstance(made, tuple) else made.to(device)
    plain = all(type(t) is torch.Tensor for t in (value if isinstance(value, tuple) else (value,)))
    if plain and not torch.compiler.is_compiling():  # not a fake or traced tensor of a compiler
        _CONSTANTS[k] = value
    return value


def _support(weights: torch.Tensor):
    """The cells each output row reads, ``(weights, cell indices)``, ``(B, out, R)``. A bin spans at most
    ``cells / out`` cells and its bilinear samples touch at most ``ceil(span) + 1`` of them, so
    ``R = min(cells, ceil(cells / out) + 2)`` holds every non-zero weight (the rest are zeros): a static
    bound, no device sync."""
    out, cells = weights.shape[-2:]
    return weights.topk(min(cells, -(-cells // out) + 2), dim=-1)


def _cells(values: torch.Tensor, num_classes: int):
    """Per cell: ``f (B, h, w)``, the constant probability of every class (the rest of the mass over the
    ``C - k`` others), and ``u (B, k, h, w)``, the top-k probabilities above it (``v - f``); top-k values
    renormalised where fp16 rounding made them exceed 1."""
    B, k, h, w = values.shape
    v = values.float().clamp_min(0.0)
    rest = num_classes - k
    # with classes outside the top-k, only an excess (fp16 rounding) is scaled away; with k == C the
    # top-k is the whole distribution, renormalised exactly
    v = v / v.sum(1, keepdim=True).clamp_min(1.0 if rest else 1e-12)
    f = ((1.0 - v.sum(1)).clamp_min(0.0) / rest) if rest else v.new_zeros(B, h, w)
    return f, v - f[:, None]


def _resample(wy: torch.Tensor, maps: torch.Tensor, wx: torch.Tensor) -> torch.Tensor:
    """``wy @ maps @ wxᵀ`` for ``(B, gh, h)``, ``(B, h, w)``, ``(B, gw, w)``: maps ``(B, h, w)`` resampled by
    :func:`_axes`' weights to ``(B, gh, gw)`` (two ``bmm``: ``@`` adds expands and views around each)."""
    return torch.bmm(torch.bmm(wy, maps), wx.transpose(1, 2))


def _batch_geometry(crops, flips, device):
    """Crops ``(B, 4)`` float32 (checked) and flips ``(B,)`` bool on ``device``."""
    crops = _as_tensor(crops).to(device, torch.float32)
    check_crops(crops)
    return crops, _as_tensor(flips).to(device, torch.bool).view(-1)


def _axes(crops, flips, map_size: Tuple[int, int], grid, device):
    """RoIAlign's separable weights of a batch of crops: ``wy (B, gh, h)``, ``wx (B, gw, w)`` (flipped
    rows where the image was flipped after the crop), and the grid."""
    h, w = map_size
    crops, flips = _batch_geometry(crops, flips, device)
    gh, gw = (grid, grid) if isinstance(grid, int) else tuple(grid)
    B = crops.shape[0]
    # both axes' RoIAlign boxes in one addmm on the crops (x0, y0, x1, y1): rows 2b, 2b + 1 the x, y box of crop b
    offset, matrix = _span_rois(crops.device, (w, h), ((0, 2), (1, 3)))
    rois = torch.addmm(offset, crops, matrix).view(2 * B, 5)
    if (h, gh) == (w, gw):  # a square map and grid: both axes in one RoIAlign call
        both = _span_weights(rois, h, gh)
        wx, wy = both[0::2], both[1::2]
    else:
        wx, wy = _span_weights(rois[0::2], w, gw), _span_weights(rois[1::2], h, gh)
    wx = torch.where(flips.view(-1, 1, 1), wx.flip(1), wx)
    return wy, wx, (gh, gw)


def normalised_affine(
    matrix, width: int, height: int, direction: str = 'output_to_input', corner: float = 0.0
) -> np.ndarray:
    """An image op's pixel affine as the normalised ``(2, 3)`` matrix the targets take: at output point
    ``(u, v)`` the op read its input at ``M @ (u, v, 1)`` (both in [0, 1] of the image, ``u`` right, ``v``
    down).

    Args:
        matrix: the op's ``2x3`` (or ``3x3``) matrix in pixel coordinates of the ``width x height`` image.
        direction: ``'output_to_input'`` (PIL's ``Image.transform`` data, as timm's RandAugment passes it)
            or ``'input_to_output'`` (what ``cv2.warpAffine`` is given without ``WARP_INVERSE_MAP``, as
            mmcv's ``imrotate`` / ``imshear`` / ``imtranslate`` do).
        corner: the pixel coordinate of the image's top-left corner: ``0.0`` where pixel ``i`` spans
            ``[i, i + 1]`` (PIL), ``-0.5`` where pixel centres sit on the integers (OpenCV).
    """
    m = np.asarray(matrix, dtype=np.float64)
    if m.shape not in ((2, 3), (3, 3)) or not np.isfinite(m).all():
        raise ValueError(f'matrix: expected a finite 2x3 pixel affine, got {m.tolist()!r}')
    if direction not in ('output_to_input', 'input_to_output'):
        raise ValueError(f"direction: expected 'output_to_input' or 'input_to_output', got {direction!r}")
    if width <= 0 or height <= 0:
        raise ValueError(f'width/height: expected a positive image size, got {width}x{height}')
    p = np.eye(3)
    p[:2] = m[:2]
    if direction == 'input_to_output':
        p = np.linalg.inv(p)
    n = np.array([[width, 0.0, corner], [0.0, height, corner], [0.0, 0.0, 1.0]])
    return (np.linalg.inv(n) @ p @ n)[:2]


def check_affines(affines, batch: int) -> Optional[torch.Tensor]:
    """The batch's affine chains as ``(B, L, 2, 3)`` float32 (``(B, 2, 3)`` is one op each), or ``None``
    when there are none (``L == 0``). Values are checked (finite) on the CPU only."""
    a = _as_tensor(affines)
    if a.dim() == 3:
        a = a[:, None]
    if a.dim() != 4 or a.shape[0] != batch or tuple(a.shape[2:]) != (2, 3):
        raise ValueError(
            f'affines: expected one chain of 2x3 affines per map row, (B={batch}, L, 2, 3), got {tuple(a.shape)}'
        )
    if a.shape[1] == 0:
        return None
    a = a.float()
    if a.device.type == 'cpu' and not torch.isfinite(a).all():
        raise ValueError('affines: expected finite matrices')
    return a


def stack_affines(chains: Sequence, crops, map_size: Tuple[int, int]):
    """A batch's per-image affine chains (each ``(L_i, 2, 3)``, or ``None`` / empty for no op) as
    ``(affines (B, L, 2, 3), extent)``: the chains padded with identities at their end to the longest, and
    the batch's largest :func:`affine_extent` as host floats (the data path calls this on the CPU).
    ``(None, None)`` when no image had an op."""
    empty = np.zeros((0, 2, 3), np.float32)
    chains = [empty if c is None else np.asarray(c, np.float32).reshape(-1, 2, 3) for c in chains]
    L = max((len(c) for c in chains), default=0)
    if L == 0:
        return None, None
    out = np.tile(np.eye(3, dtype=np.float32)[:2], (len(chains), L, 1, 1))
    for i, c in enumerate(chains):
        out[i, : len(c)] = c
    affines = check_affines(torch.from_numpy(out), len(chains))
    extent = affine_extent(_as_tensor(crops).cpu(), affines, map_size).amax(0).tolist()
    return affines, tuple(extent)


def _chain_linear(affines: torch.Tensor) -> torch.Tensor:
    """The linear part ``(B, 2, 2)`` of each chain, ``L_1 @ L_2 @ ... @ L_L`` (output to crop)."""
    J = affines[:, 0, :, :2]
    for i in range(1, affines.shape[1]):
        J = J @ affines[:, i, :, :2]
    return J


def affine_extent(crops, affines, map_size: Tuple[int, int]) -> torch.Tensor:
    """Per image ``(B, 2)``: how many map cells a unit step down (``v``) and to the right (``u``) of the
    augmented crop spans, ``(ey, ex)``; a token's samples per axis are ``ceil(e / grid)`` (RoIAlign's
    adaptive count along the mapped axis). The data path computes its batch maximum on the CPU and hands it
    to the targets, so that they take no device sync (``extent=``)."""
    crops = _as_tensor(crops).float()
    a = check_affines(affines, crops.shape[0])
    h, w = map_size
    # (B, 2) x, y: the crop's span in map cells as RoIAlign computes it (aligned: each end times the cells, less
    # half a cell, then the difference, in float32), so that an identity chain takes the crop path's sample
    # counts exactly where a span sits on a multiple of the grid ((hi - lo) · cells may round to the other side)
    size = torch.stack(
        [(crops[:, 2] * w - 0.5) - (crops[:, 0] * w - 0.5), (crops[:, 3] * h - 0.5) - (crops[:, 1] * h - 0.5)], 1
    )
    if a is None:
        return size.flip(1)
    E = size[:, :, None] * _chain_linear(a.to(crops.device))  # rows: map x, y; columns: output u, v
    return torch.stack([E[:, :, 1].norm(dim=1), E[:, :, 0].norm(dim=1)], 1)


def _affine_samples(crops, flips, affines, map_size, grid, extent=None):
    """The crop-and-affine path's sampling: per token the map cells it reads and their weights
    ``(B, N, P)`` (bilinear corners of every sample, divided by the image's sample count) and ``fill
    (B, N)``, the share of its samples that fell outside an image (uniform). See the module docstring."""
    h, w = map_size
    gh, gw = (grid, grid) if isinstance(grid, int) else tuple(grid)
    B = crops.shape[0]
    dev = crops.device
    ext = affine_extent(crops, affines, map_size)  # (B, 2): ey, ex
    if extent is None:  # the padded sample counts must be host ints: a device sync where no extent is given
        extent = ext.amax(0).tolist()
    Sy, Sx = max(1, math.ceil(float(extent[0]) / gh)), max(1, math.ceil(float(extent[1]) / gw))
    ny = torch.ceil(ext[:, 0] / gh).clamp(1, Sy)  # (B,) each image's own counts (RoIAlign's)
    nx = torch.ceil(ext[:, 1] / gw).clamp(1, Sx)
    f32 = dict(device=dev, dtype=torch.float32)
    N, S = gh * gw, Sy * Sx
    # sample points (u, v), flat (B, M) token-major (M = N * S): built from per-axis values by index (a
    # broadcast over the small sample axes would run innermost loops of length Sx)
    v = ((torch.arange(gh, **f32)[:, None] + (torch.arange(Sy, **f32) + 0.5) / ny.view(B, 1, 1)) / gh).view(B, -1)
    u = ((torch.arange(gw, **f32)[:, None] + (torch.arange(Sx, **f32) + 0.5) / nx.view(B, 1, 1)) / gw).view(B, -1)
    ty, tx, sy, sx = (
        t.reshape(-1)
        for t in torch.meshgrid(
            *(torch.arange(n, device=dev) for n in (gh, gw, Sy, Sx)),
            indexing='ij',
        )
    )
    v, u = v.index_select(1, ty * Sy + sy), u.index_select(1, tx * Sx + sx)
    # each sub-bin's share of its token (0 for the padding beyond the image's own counts)
    share = ((torch.arange(Sy, device=dev) < ny.view(B, 1)).float() / ny.view(B, 1))[:, :, None] * (
        (torch.arange(Sx, device=dev) < nx.view(B, 1)).float() / nx.view(B, 1)
    )[:, None, :]
    share = share.view(B, S).index_select(1, sy * Sx + sx)  # (B, M)

    def at(m):  # the affine m (B, 2, 3) of every sample point, elementwise (no matmul: no TF32 on a GPU)
        c = m.float().reshape(B, 6, 1).unbind(1)
        return c[0] * u + c[1] * v + c[2], c[3] * u + c[4] * v + c[5]

    # suffix composites in float64: where each op read its input
    comp = torch.eye(3, dtype=torch.float64, device=dev).expand(B, 3, 3)
    inside = torch.ones(B, u.shape[1], dtype=torch.bool, device=dev)
    for i in reversed(range(affines.shape[1])):  # the last op first: output -> its input -> ... -> the crop
        a = torch.cat([affines[:, i].double(), comp.new_tensor([0.0, 0.0, 1.0]).expand(B, 1, 3)], 1)
        comp = (a[:, :, :, None] * comp[:, None, :, :]).sum(2)  # a @ comp
        qu, qv = at(comp[:, :2])
        inside &= (qu >= 0) & (qu <= 1) & (qv >= 0) & (qv <= 1)
    # un-flip and place in the crop, in map cells with RoIAlign's aligned coordinates (cell centres at j + 0.5)
    x0, y0, x1, y1 = crops.double().unbind(1)
    sign = torch.where(flips, -1.0, 1.0).double()
    place = torch.zeros(B, 3, 3, dtype=torch.float64, device=dev)
    place[:, 0, 0], place[:, 0, 2] = sign * (x1 - x0) * w, torch.where(flips, x1, x0) * w - 0.5
    place[:, 1, 1], place[:, 1, 2] = (y1 - y0) * h, y0 * h - 0.5
    place[:, 2, 2] = 1.0
    X, Y = at((place[:, :, :, None] * comp[:, None, :, :]).sum(2)[:, :2])
    # RoIAlign's bilinear rule, clamped at the border
    X, Y = X.clamp_(0, w - 1), Y.clamp_(0, h - 1)
    xl, yl = X.floor(), Y.floor()
    fx, fy = X.sub_(xl), Y.sub_(yl)
    xl, yl = xl.long(), yl.long()
    xu, yu = (xl + 1).clamp_(max=w - 1), (yl + 1).clamp_(max=h - 1)
    live = share * inside
    wy0, wy1 = (1 - fy).mul_(live), fy.mul_(live)
    fxl = 1 - fx
    # (B, N, 4, S): a token's entries, in any order
    weights = torch.stack([(a * b).view(B, N, S) for a in (wy0, wy1) for b in (fxl, fx)], 2)
    yl, yu = yl.mul_(w), yu.mul_(w)
    cells = torch.stack([(a + b).view(B, N, S) for a in (yl, yu) for b in (xl, xu)], 2)
    fill = (share * ~inside).view(B, N, S).sum(-1)
    return cells.view(B, N, -1), weights.view(B, N, -1), fill, (gh, gw)


class SparseTokenTargets(NamedTuple):
    """Per-token targets kept sparse: every class gets ``base``, plus ``weight`` at the classes ``cls``:
    ``t[b, n] = base[b, n] + Σ_j weight[b, n, j] · onehot(cls[b, n, j])``. ``base (B, N)``,
    ``cls``/``weight (B, N, M)``; tokens in row-major grid order.
    :func:`shared_core.token_labeling.soft_cross_entropy` takes it without building the ``(B, N, C)``
    tensor; its ``dense()`` builds it."""

    base: torch.Tensor
    cls: torch.Tensor
    weight: torch.Tensor
    num_classes: int

    def dense(self) -> torch.Tensor:
        B, N = self.base.shape
        out = self.base.unsqueeze(-1).expand(B, N, self.num_classes).contiguous()
        return out.scatter_add_(2, self.cls, self.weight)

    def to(self, *args, **kwargs) -> 'SparseTokenTargets':
        """The same targets moved (``Tensor.to``'s arguments; a loader's batch goes to the device this way)."""
        return SparseTokenTargets(*(t.to(*args, **kwargs) for t in self[:3]), self.num_classes)

    def pin_memory(self) -> 'SparseTokenTargets':
        return SparseTokenTargets(*(t.pin_memory() for t in self[:3]), self.num_classes)


@dataclass(frozen=True)
class CropMaps:
    """A batch of label-map rows and the crops they are read through: the one input of every target function of
    the maps (:func:`token_targets_sparse`, :func:`token_targets_batch`, :func:`class_maps`, :func:`crop_targets`,
    :func:`shared_core.tokenmix.activation_target`, :func:`shared_core.token_labeling.token_labeling_targets`).
    Both adapters build it: timm's ``TokenLabelCollate`` (``TokenLabelTarget.maps``), mm's ``token_label_batch``.

    Attributes:
        values: ``(B, k, h, w)`` the top-k probabilities of each map cell (fp16 as stored, or fp32).
        indices: ``(B, k, h, w)`` their classes (int64).
        num_classes: the number of classes ``C``.
        crops: ``(B, 4)`` each image's crop, normalised ``(x0, y0, x1, y1)`` of the whole image.
        flips: ``(B,)`` bool, a horizontal flip after the crop.
        affines: ``(B, L, 2, 3)`` the geometric ops after the crop and flip (module docstring), or ``None``.
        extent: their largest sample extent ``(ey, ex)`` as host floats (:func:`affine_extent`; else computed
            from ``affines`` when needed: a device sync on an accelerator).
        tokens: the sparse token targets built ahead (in a DataLoader's workers), for the grid ``token_grid`` at
            label smoothing ``token_smoothing``, or ``None`` (then built when asked for).
    """

    values: torch.Tensor
    indices: torch.Tensor
    num_classes: int
    crops: torch.Tensor
    flips: torch.Tensor
    affines: Optional[torch.Tensor] = None
    extent: Optional[Tuple[float, float]] = None
    tokens: Optional[SparseTokenTargets] = None
    token_grid: Optional[Tuple[int, int]] = None
    token_smoothing: Optional[float] = None

    def __post_init__(self):
        values, indices = _as_tensor(self.values), _as_tensor(self.indices)
        if values.dim() != 4 or values.shape != indices.shape:
            raise ValueError(
                f'values/indices: expected (B, k, h, w) of one shape, got {tuple(values.shape)} and '
                f'{tuple(indices.shape)}'
            )
        B = values.shape[0]
        crops, flips = _as_tensor(self.crops), _as_tensor(self.flips)
        if tuple(crops.shape) != (B, 4):
            raise ValueError(
                f'crops: expected one crop (x0, y0, x1, y1) per map row, ({B}, 4), got {tuple(crops.shape)}'
            )
        if tuple(flips.shape) != (B,):
            raise ValueError(f'flips: expected one flag per map row, ({B},), got {tuple(flips.shape)}')
        if isinstance(self.num_classes, bool) or not isinstance(self.num_classes, int) or self.num_classes < 1:
            raise ValueError(f'num_classes: expected a positive int, got {self.num_classes!r}')
        if values.device.type == 'cpu' and values.numel():  # checked where it costs no device sync
            if not torch.isfinite(values).all() or values.min() < 0:
                raise ValueError('values: expected probabilities (finite, >= 0)')
            lo, hi = int(indices.long().min()), int(indices.long().max())  # (no min of uint16 tensors in torch)
            if lo < 0 or hi >= self.num_classes:
                raise ValueError(f'indices: class indices must be in [0, {self.num_classes}), got [{lo}, {hi}]')
        for name, t in (('values', values), ('indices', indices), ('crops', crops), ('flips', flips)):
            object.__setattr__(self, name, t)

    @property
    def batch_size(self) -> int:
        return self.values.shape[0]

    @classmethod
    def stack(cls, values, indices, crops, flips, chains, num_classes: int) -> 'CropMaps':
        """A batch from its images' rows on the CPU: ``values``/``indices`` ``(k, h, w)`` each, ``crops`` one crop
        each, ``flips`` one flag each, ``chains`` each image's ``(L, 2, 3)`` affines or ``None``. The crops are
        checked (:func:`check_crops`), the chains padded (:func:`stack_affines`)."""
        v = torch.from_numpy(np.stack([np.asarray(r) for r in values]))
        i = torch.from_numpy(np.stack([np.asarray(r) for r in indices]).astype(np.int64))
        b = torch.tensor(np.array([np.asarray(x, np.float32) for x in crops]).reshape(-1, 4))
        check_crops(b)
        f = torch.tensor([bool(x) for x in flips], dtype=torch.bool)
        affines, extent = stack_affines(list(chains), b, tuple(v.shape[-2:]))
        return cls(v, i, int(num_classes), b, f, affines, extent)

    def _map_tensors(self, fn) -> 'CropMaps':
        """The same maps with ``fn`` applied to every tensor field (the host-side ``extent`` stays)."""
        names = ('values', 'indices', 'crops', 'flips', 'affines', 'tokens')
        return replace(self, **{k: fn(getattr(self, k)) for k in names if getattr(self, k) is not None})

    def to(self, *args, **kwargs) -> 'CropMaps':
        """The same maps moved (``Tensor.to``'s arguments; a loader's batch goes to the device this way)."""
        return self._map_tensors(lambda t: t.to(*args, **kwargs))

    def pin_memory(self) -> 'CropMaps':
        return self._map_tensors(lambda t: t.pin_memory())

    def with_tokens(self, grid: Tuple[int, int], smoothing: float = 0.0) -> 'CropMaps':
        """These maps carrying their sparse token targets for ``grid`` at ``smoothing``, built now (in a loader)."""
        grid = tuple(grid)
        return replace(
            self, tokens=token_targets_sparse(self, grid, smoothing), token_grid=grid, token_smoothing=float(smoothing)
        )


def token_targets_sparse(maps: CropMaps, grid: Tuple[int, int], smoothing: float = 0.0) -> SparseTokenTargets:
    """:func:`token_targets_batch` as :class:`SparseTokenTargets` (what the training loss reads).

    Equal to ``roi_align`` of the full distributions (:func:`dense_maps`), without building them: a cell's
    distribution is a constant ``f`` (the rest of its mass over the ``C - k`` others) plus its top-k
    entries ``v - f``, so a token's target is its interpolated ``f`` for every class plus its few
    supporting cells' top-k entries at their classes (RoIAlign is separable: :func:`axis_weights`).

    With the maps' ``affines`` (each image's geometric ops after the crop and flip, module docstring; ``L == 0``
    is the crop path) each token reads the bilinear corners of its samples (still sparse) and its share of fill
    samples goes to the uniform ``base``.
    """
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f'smoothing must be in [0, 1), got {smoothing}')
    with torch.autocast(maps.values.device.type, enabled=False):  # targets in fp32 under a training autocast
        f, u = _cells(maps.values, maps.num_classes)  # u: the top-k entries above the constant
        # a fill sample is uniform; label smoothing folded in: (1 - ε) · (constant + top-k entries) + ε / C
        return _resample_sparse(maps, grid, f, u, uniform_fill=True, scale=1.0 - smoothing, offset=smoothing)


def _resample_sparse(
    maps: CropMaps, grid, f: torch.Tensor, u: torch.Tensor, uniform_fill: bool, scale: float = 1.0, offset: float = 0.0
) -> SparseTokenTargets:
    """Per-cell vectors "``f`` for every class, plus ``u`` at the top-k classes" (``f (B, h, w)``, ``u (B, k, h,
    w)``) under each crop, resampled to ``grid`` as RoIAlign resamples (through the affines where given; a sample
    in an op's fill reads ``1 / C`` for every class with ``uniform_fill``, else 0), kept sparse, as ``scale · t +
    offset / C``."""
    values, indices, num_classes, crops, flips = maps.values, maps.indices, maps.num_classes, maps.crops, maps.flips
    B, k, h, w = values.shape
    affines, extent = None if maps.affines is None else check_affines(maps.affines, B), maps.extent
    if affines is not None:
        u = u.flatten(2)
        cell, weight, fill_share, _ = _affine_samples(
            *_batch_geometry(crops, flips, values.device), affines.to(values.device), (h, w), grid, extent
        )
        N, P = cell.shape[1:]
        base = (torch.gather(f.flatten(1), 1, cell.flatten(1)).view(B, N, P) * weight).sum(-1)
        if uniform_fill:
            base = base + fill_share / num_classes
        base = base * scale + offset / num_classes
        cell = cell[:, :, None].expand(B, N, k, P)
        src = torch.gather(u[:, None].expand(B, N, k, h * w), 3, cell) * (weight[:, :, None] * scale)
        cls = torch.gather(indices.long().flatten(2)[:, None].expand(B, N, k, h * w), 3, cell)
        return SparseTokenTargets(base, cls.reshape(B, N, k * P), src.reshape(B, N, k * P), num_classes)
    wy, wx, (gh, gw) = _axes(crops, flips, (h, w), grid, values.device)
    N = gh * gw
    base = _resample(wy, f, wx).view(B, N) * scale + offset / num_classes
    sy, iy = _support(wy)  # (B, gh, Ry)
    sx, ix = _support(wx)  # (B, gw, Rx)
    Ry, Rx = sy.shape[-1], sx.shape[-1]
    R = Ry * Rx
    # each token's R = Ry · Rx supporting cells (row-major) and their weights, (B, N, 1, R)
    weight = (sy.view(B, gh, 1, Ry, 1) * sx.view(B, 1, gw, 1, Rx)).view(B, N, 1, R)
    cell = torch.add(ix.view(B, 1, gw, 1, Rx), iy.view(B, gh, 1, Ry, 1), alpha=w).view(B, N, 1, R)
    cell = cell.expand(B, N, k, R)
    src = torch.gather(u.view(B, 1, k, h * w).expand(B, N, k, h * w), 3, cell) * (weight * scale)
    cls = torch.gather(indices.long().view(B, 1, k, h * w).expand(B, N, k, h * w), 3, cell)
    return SparseTokenTargets(base, cls.view(B, N, k * R), src.view(B, N, k * R), num_classes)


def token_targets_batch(maps: CropMaps, grid: Tuple[int, int], smoothing: float = 0.0) -> torch.Tensor:
    """Per-token targets ``(B, C, gh, gw)`` for a batch: the map rows under each crop, resampled to ``grid`` by
    RoIAlign, flipped where the crop is, through the affines where given, label-smoothed. Every token's target
    sums to 1. Built from :func:`token_targets_sparse`; channels-last (a ``(B, gh, gw, C)`` tensor seen as
    ``(B, C, gh, gw)``)."""
    t = token_targets_sparse(maps, grid, smoothing)
    gh, gw = (grid, grid) if isinstance(grid, int) else tuple(grid)
    return t.dense().view(-1, gh, gw, maps.num_classes).permute(0, 3, 1, 2)


def class_maps(maps: CropMaps, classes: torch.Tensor, grid: Tuple[int, int]) -> torch.Tensor:
    """One channel of the token targets per image, ``(B, gh, gw)``: the probability of class
    ``classes[b]`` at each token of image ``b`` (e.g. its true class: TokenMix's activation map), equal to
    ``token_targets_batch(maps, grid)[b, classes[b]]`` without building the other classes."""
    values, indices, num_classes, crops, flips = maps.values, maps.indices, maps.num_classes, maps.crops, maps.flips
    B, k, h, w = values.shape
    classes = _as_tensor(classes).to(values.device).long().view(-1)
    if classes.numel() != B:
        raise ValueError(f'classes: expected one class per map row ({B}), got {classes.numel()}')
    affines, extent = None if maps.affines is None else check_affines(maps.affines, B), maps.extent
    with torch.autocast(values.device.type, enabled=False):
        f, u = _cells(values, num_classes)
        d = f + (u * (indices.long() == classes.view(B, 1, 1, 1))).sum(1)  # (B, h, w)
        if affines is not None:
            cell, weight, fill, (gh, gw) = _affine_samples(
                *_batch_geometry(crops, flips, values.device), affines.to(values.device), (h, w), grid, extent
            )
            p = (torch.gather(d.flatten(1), 1, cell.flatten(1)).view_as(weight) * weight).sum(-1)
            return (p + fill / num_classes).view(B, gh, gw)
        wy, wx, _ = _axes(crops, flips, (h, w), grid, values.device)
        return _resample(wy, d, wx)


def token_targets(
    values,
    indices,
    num_classes: int,
    box: Box,
    flip: bool,
    grid: Tuple[int, int],
    smoothing: float = 0.0,
    affine=None,
) -> torch.Tensor:
    """One image: ``values``/``indices`` its ``(k, h, w)`` top-k map, ``box = (x0, y0, x1, y1)`` the crop
    in normalised full-image coordinates, ``flip`` a horizontal flip after the crop, ``grid`` the
    model's token grid ``(gh, gw)``, ``affine`` a ``(2, 3)`` matrix (or a chain ``(L, 2, 3)``, first op
    first) in normalised coordinates of the augmented crop: the content at output point ``(u, v)`` came
    from ``M @ (u, v, 1)`` of the crop before the op (``None``: no op). Tokens whose samples all fall
    outside the source get a uniform distribution. Returns ``(num_classes, gh, gw)`` probabilities."""
    v, i = _as_tensor(values), _as_tensor(indices)
    if v.dim() != 3:
        raise ValueError(f"values: expected one image's (k, h, w) top-k map, got {tuple(v.shape)}")
    box_t = _as_tensor(box, torch.float32).reshape(1, 4)
    if affine is not None:
        a = _as_tensor(affine, torch.float32)
        if a.dim() not in (2, 3) or tuple(a.shape[-2:]) != (2, 3):
            raise ValueError(f'affine: expected a 2x3 matrix or a chain (L, 2, 3), got {tuple(a.shape)}')
        affine = a.reshape(1, -1, 2, 3)
    flip_t = torch.tensor([bool(flip)])
    t = token_targets_batch(CropMaps(v[None], i[None], num_classes, box_t, flip_t, affine), grid, smoothing)
    return t[0].contiguous()


def crop_targets(maps: CropMaps, smoothing: float = 0.0) -> torch.Tensor:
    """ReLabel: one label ``(B, C)`` per crop, the mean of the map's distribution over the crop (a flip
    does not change it; with the maps' affines, over what the augmented crop shows, fill uniform)."""
    return token_targets_batch(maps, (1, 1), smoothing)[:, :, 0, 0]


def crop_logit_targets(maps: CropMaps, smoothing: float = 0.0) -> torch.Tensor:
    """The public Token Labeling code's class target of each crop (its ``get_label`` at ``label_size=1``):
    ``softmax`` of the crop's RoIAlign mean of the *logit* map, logit 0 outside each cell's top-k, label-smoothed
    as :func:`crop_targets`; ``(B, C)``. :func:`crop_targets` averages the distributions instead (ReLabel).

    A stored row is the softmax of such a logit map (``tokenaug-maps import``: :func:`rows_from_topk_logits`),
    so the logits are recovered from it: ``l = log(p / r)`` at the top-k, ``r = (1 - Σ top-k) / (C - k)`` the
    probability of every other class (logit 0), exactly but for fp16 storage, with the rest's mass floored at
    fp16's resolution near 1 (``2⁻¹¹``) where rounding left none. A row of ``generate`` (a full softmax's top-k) is
    read the same way: the logit map whose softmax the row is under the uniform rest. Samples in an op's fill read
    logit 0, the public code's fill."""
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f'smoothing must be in [0, 1), got {smoothing}')
    C = maps.num_classes
    with torch.autocast(maps.values.device.type, enabled=False):
        v = maps.values.float().clamp_min(1e-30)
        k = v.shape[1]
        rest = (1.0 - v.sum(1)).clamp_min(2.0**-11) / (C - k) if C > k else v.new_ones(v.shape[:1] + v.shape[2:])
        logits = (v.log() - rest.log()[:, None]) if C > k else v.log()
        t = _resample_sparse(maps, (1, 1), torch.zeros_like(rest), logits, uniform_fill=False)
        pooled = t.base[:, 0, None].expand(-1, C).contiguous().scatter_add_(1, t.cls[:, 0], t.weight[:, 0])
        return pooled.softmax(1) * (1.0 - smoothing) + smoothing / C


def crop_box(top: int, left: int, height: int, width: int, img_height: int, img_width: int) -> Tuple[float, ...]:
    """A pixel crop (torchvision's ``RandomResizedCrop.get_params`` order ``i, j, h, w``) of an image
    ``img_height x img_width`` as the normalised box ``(x0, y0, x1, y1)``."""
    if height <= 0 or width <= 0:
        raise ValueError(f'crop: expected a positive size, got {height}x{width}')
    return (left / img_width, top / img_height, (left + width) / img_width, (top + height) / img_height)


def crop_after_ops(box, flip: bool, affines) -> Tuple[Tuple[float, ...], np.ndarray]:
    """The public Token Labeling order — the whole image flipped (``flip``), then its geometric ops (``affines
    (L, 2, 3)`` as recorded, in normalised coordinates of the whole image, first op first), then cropped to
    ``box`` (normalised in the augmented image) — in this module's form, a box, then the same ``flip``, then a
    chain: ``(box, chain)``.

    With no op, a flip then a crop is the mirrored crop then a flip: the box mirrored where flipped and no chain
    (the crop path). With ops, the box is the whole image and the chain the ops followed by the crop's own affine
    (at output point ``(u, v)`` the crop read the augmented image at ``(x0 + u (x1 - x0), y0 + v (y1 - y0))``)."""
    x0, y0, x1, y1 = (float(c) for c in box)
    chain = np.asarray(affines, np.float32).reshape(-1, 2, 3)
    if not len(chain):
        return ((1.0 - x1, y0, 1.0 - x0, y1) if flip else (x0, y0, x1, y1)), chain
    crop = np.array([[x1 - x0, 0.0, x0], [0.0, y1 - y0, y0]], np.float32)
    return (0.0, 0.0, 1.0, 1.0), np.concatenate([chain, crop[None]])


def register_center_square(
    box, flip: bool, affines, image_size: Sequence[int]
) -> Tuple[Tuple[float, ...], bool, np.ndarray]:
    """``(box, flip, chain)`` of a crop (this module's form: the box, the flip, then the ops ``affines``) of an image
    of ``image_size = (W, H)`` pixels, for a map that covers the image's centre square instead of the whole image
    (the maps released with Token Labeling: the shorter side resized, the centre square cropped,
    :data:`shared_core.map_format.CENTER_SQUARE`): each token reads the map where the annotator saw its pixels, and
    the parts of the image the annotator never saw count as uniform (the fill rule).

    In this module's form: the whole map as the box, no flip, and the chain the registration (at output point
    ``(u, v)`` of the whole image, the map at ``((u W - (W - s) / 2) / s, (v H - (H - s) / 2) / s)`` with ``s =
    min(W, H)``), then the crop with its flip, then the ops."""
    W, H = (float(v) for v in image_size)
    s = min(W, H)
    register = np.array([[W / s, 0.0, -(W - s) / (2 * s)], [0.0, H / s, -(H - s) / (2 * s)]], np.float32)
    x0, y0, x1, y1 = (float(c) for c in box)
    if flip:  # the crop's output point u read the crop's input at 1 - u
        crop = np.array([[x0 - x1, 0.0, x1], [0.0, y1 - y0, y0]], np.float32)
    else:
        crop = np.array([[x1 - x0, 0.0, x0], [0.0, y1 - y0, y0]], np.float32)
    chain = np.asarray(affines, np.float32).reshape(-1, 2, 3)
    return (0.0, 0.0, 1.0, 1.0), False, np.concatenate([register[None], crop[None], chain])


def rows_from_topk_logits(logits, indices, num_classes: int) -> Tuple[np.ndarray, np.ndarray]:
    """A store row ``(values (k, h, w) float16 descending, indices (k, h, w) int64)`` from the public Token Labeling
    maps' top-k *raw logits* and their class indices (``generate_label.py``'s ``(2, k, h, w)`` file). What the
    public training consumes is a dense map with logit 0 for every class outside the top-k, softmaxed over all
    ``C`` classes: class ``i`` of the top-k has probability ``exp(l_i) / (Σ_j exp(l_j) + C − k)`` and every other
    class ``1 / (Σ_j exp(l_j) + C − k)``, which is exactly the store's rule for the mass outside the top-k (spread
    uniformly). Computed in float64 (max-shifted); indices must be whole numbers in ``[0, C)``, distinct per
    cell."""
    lg = torch.as_tensor(logits).double()
    ix = torch.as_tensor(indices).double()
    if lg.dim() != 3 or lg.shape != ix.shape:
        raise ValueError(f'logits/indices: expected two (k, h, w) arrays, got {tuple(lg.shape)} and {tuple(ix.shape)}')
    k = lg.shape[0]
    if not 1 <= k <= num_classes:
        raise ValueError(f'k: {k} top classes for num_classes={num_classes}')
    if not torch.isfinite(lg).all():
        raise ValueError('logits: expected finite values')
    if not (torch.isfinite(ix).all() and (ix == ix.round()).all() and ix.min() >= 0 and ix.max() < num_classes):
        raise ValueError(f'indices: expected whole class indices in [0, {num_classes})')
    ix = ix.long()
    if k > 1 and (ix.sort(0).values.diff(dim=0) == 0).any():
        raise ValueError('indices: a class appears twice in one cell')
    m = lg.max(0).values.clamp_min(0.0)  # the others' logit is 0
    e = (lg - m).exp()
    p = e / (e.sum(0) + (num_classes - k) * (-m).exp())
    order = p.argsort(dim=0, descending=True, stable=True)
    return p.gather(0, order).to(torch.float16).numpy(), ix.gather(0, order).numpy()
