"""Token labeling's targets from stored dense score maps (``token-labeling.md`` Sec. 3.2, Eq. 2-7).

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
- *ReLabel* (``token-labeling.md`` Table 2): one label per crop, the mean of the map's distribution
  over the crop (:func:`crop_targets`, ``roi_align`` to a 1x1 grid).

:func:`token_targets` is the one-image reference entry point; :func:`token_targets_batch` does a
batch in one ``roi_align`` call, on whatever device the rows are on.
"""
from __future__ import annotations

from typing import Sequence, Tuple, Union

import numpy as np
import torch
from torchvision.ops import roi_align

__all__ = ['dense_maps', 'token_targets', 'token_targets_batch', 'crop_targets', 'check_map_row',
           'crop_box', 'smooth']

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


def dense_maps(values: torch.Tensor, indices: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Full class distributions ``(B, C, h, w)`` float32 from top-k rows ``(B, k, h, w)``: the top-k
    probabilities, the rest of the mass spread uniformly over the other classes, renormalised."""
    values, indices = _as_tensor(values), _as_tensor(indices)
    if values.dim() != 4 or values.shape != indices.shape:
        raise ValueError(f'values/indices: expected (B, k, h, w) of one shape, got {tuple(values.shape)} '
                         f'and {tuple(indices.shape)}')
    B, k, h, w = values.shape
    v = values.float().clamp_min(0.)
    rest = num_classes - k
    fill = (1. - v.sum(1, keepdim=True)).clamp_min(0.) / rest if rest else v.new_zeros(B, 1, h, w)
    out = fill.expand(B, num_classes, h, w).clone()
    out.scatter_(1, indices.long(), v)
    return out / out.sum(1, keepdim=True).clamp_min(1e-12)


def smooth(target: torch.Tensor, smoothing: float, dim: int = 1) -> torch.Tensor:
    """``(1 - ε) · p + ε / C`` along ``dim`` (rows that summed to 1 still do)."""
    if not 0. <= smoothing < 1.:
        raise ValueError(f'smoothing must be in [0, 1), got {smoothing}')
    if not smoothing:
        return target
    return target * (1. - smoothing) + smoothing / target.shape[dim]


def _rois(boxes: torch.Tensor, map_size: Tuple[int, int]) -> torch.Tensor:
    """``roi_align`` boxes ``(B, 5)``: batch index, then ``(x1, y1, x2, y2)`` in map cells."""
    if boxes.dim() != 2 or boxes.shape[1] != 4:
        raise ValueError(f'boxes: expected (B, 4) crops (x0, y0, x1, y1), got {tuple(boxes.shape)}')
    h, w = map_size
    b = boxes.float()
    if not ((b[:, 0] < b[:, 2]) & (b[:, 1] < b[:, 3])).all():
        raise ValueError('boxes: expected x0 < x1 and y0 < y1 (normalised crop corners)')
    scale = b.new_tensor([w, h, w, h])
    idx = torch.arange(b.shape[0], device=b.device, dtype=b.dtype)[:, None]
    return torch.cat([idx, b * scale], 1)


def token_targets_batch(values: torch.Tensor, indices: torch.Tensor, num_classes: int, boxes: torch.Tensor,
                        flips: torch.Tensor, grid: Tuple[int, int], smoothing: float = 0.) -> torch.Tensor:
    """Per-token targets ``(B, C, gh, gw)`` for a batch: the map rows ``(B, k, h, w)`` under each crop
    ``boxes (B, 4)`` (normalised ``(x0, y0, x1, y1)``), resampled to ``grid`` by ``roi_align``,
    flipped where ``flips (B,)`` is set, label-smoothed. Every token's target sums to 1."""
    dense = dense_maps(values, indices, num_classes)
    boxes = _as_tensor(boxes).to(dense.device)
    if boxes.shape[0] != dense.shape[0]:
        raise ValueError(f'boxes: expected one crop per map row ({dense.shape[0]}), got {boxes.shape[0]}')
    gh, gw = (grid, grid) if isinstance(grid, int) else tuple(grid)
    out = roi_align(dense, _rois(boxes, dense.shape[-2:]), output_size=(gh, gw), spatial_scale=1.,
                    sampling_ratio=-1, aligned=True)
    flips = _as_tensor(flips).to(device=dense.device, dtype=torch.bool).view(-1, 1, 1, 1)
    out = torch.where(flips, out.flip(-1), out)
    return smooth(out, smoothing)


def token_targets(values, indices, num_classes: int, box: Box, flip: bool, grid: Tuple[int, int],
                  smoothing: float = 0.) -> torch.Tensor:
    """One image: ``values``/``indices`` its ``(k, h, w)`` top-k map, ``box = (x0, y0, x1, y1)`` the crop
    in normalised full-image coordinates, ``flip`` a horizontal flip after the crop, ``grid`` the
    model's token grid ``(gh, gw)``. Returns ``(num_classes, gh, gw)`` probabilities."""
    v, i = _as_tensor(values), _as_tensor(indices)
    if v.dim() != 3:
        raise ValueError(f'values: expected one image\'s (k, h, w) top-k map, got {tuple(v.shape)}')
    box_t = _as_tensor(box, torch.float32).reshape(1, 4)
    return token_targets_batch(v[None], i[None], num_classes, box_t, torch.tensor([bool(flip)]), grid, smoothing)[0]


def crop_targets(values: torch.Tensor, indices: torch.Tensor, num_classes: int, boxes: torch.Tensor,
                 smoothing: float = 0.) -> torch.Tensor:
    """ReLabel: one label ``(B, C)`` per crop, the mean of the map's distribution over the crop (a flip
    does not change it)."""
    flips = torch.zeros(len(boxes), dtype=torch.bool)
    return token_targets_batch(values, indices, num_classes, boxes, flips, (1, 1), smoothing)[:, :, 0, 0]


def crop_box(top: int, left: int, height: int, width: int, img_height: int, img_width: int) -> Tuple[float, ...]:
    """A pixel crop (torchvision's ``RandomResizedCrop.get_params`` order ``i, j, h, w``) of an image
    ``img_height x img_width`` as the normalised box ``(x0, y0, x1, y1)``."""
    if height <= 0 or width <= 0:
        raise ValueError(f'crop: expected a positive size, got {height}x{width}')
    return (left / img_width, top / img_height, (left + width) / img_width, (top + height) / img_height)
