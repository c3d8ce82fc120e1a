"""Pictures of what the methods do, as arrays (``(..., H, W, 3)`` uint8 RGB; plotting and files are in
:mod:`shared_core.plotting`): mixed images, the partner share of every token on a two-colour scale, token
masks. The colours are exact and invertible (:func:`share_from_colour`), so a picture can be read back.

The share scale runs from :data:`OWN` (share 0: the token is the sample's own) to :data:`PARTNER` (share 1:
it comes from the partner), linear in between, rounded to the nearest integer per channel.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np
import torch

__all__ = [
    'OWN',
    'PARTNER',
    'images_uint8',
    'share_colours',
    'share_from_colour',
    'share_image',
    'token_plane',
    'grey_image',
    'overlay',
    'token_centres',
    'class_colours',
    'label_image',
    'class_from_colour',
]

#: share 0 (the sample's own token) and share 1 (the partner's), as in TL-Align's Fig. 6 two-colour scale
OWN = (40, 90, 220)
#: the partner's colour (share 1); OWN is the sample's own (share 0)
PARTNER = (230, 60, 40)


def images_uint8(x: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """Normalised images ``(B, C, H, W)`` (what a timm transform gives) back to ``(B, H, W, 3)`` uint8
    (one channel repeated for grayscale)."""
    if x.dim() != 4:
        raise ValueError(f'x: expected (B, C, H, W) images, got {tuple(x.shape)}')
    m = torch.as_tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    s = torch.as_tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    img = (x.detach().float().cpu() * s + m).clamp(0, 1).mul(255).round().to(torch.uint8)
    if img.shape[1] == 1:
        img = img.expand(-1, 3, -1, -1)
    return img.permute(0, 2, 3, 1).contiguous().numpy()


def share_colours(share) -> np.ndarray:
    """Partner shares in ``[0, 1]`` (any shape) as RGB ``(..., 3)`` uint8 on the OWN -> PARTNER scale."""
    s = np.clip(np.asarray(share, dtype=np.float64), 0.0, 1.0)[..., None]
    rgb = (1.0 - s) * np.asarray(OWN, dtype=np.float64) + s * np.asarray(PARTNER, dtype=np.float64)
    return np.rint(rgb).astype(np.uint8)


def share_from_colour(rgb) -> np.ndarray:
    """The share a colour of :func:`share_colours` stands for (least squares on the scale; exact to the
    rounding, about 1/380 here)."""
    rgb = np.asarray(rgb, dtype=np.float64)
    own, d = np.asarray(OWN, dtype=np.float64), np.asarray(PARTNER, dtype=np.float64) - np.asarray(OWN)
    return np.clip(((rgb - own) * d).sum(-1) / (d * d).sum(), 0.0, 1.0)


def token_plane(values, img_size: Tuple[int, int], patch_size: Tuple[int, int]) -> np.ndarray:
    """Per-token values ``(B, gh, gw, ...)`` spread over the image plane ``(B, H, W, ...)``: every pixel takes the
    value of the token it belongs to (pixel ``// patch``; a clipped last row/column belongs to its token)."""
    values = np.asarray(values)
    H, W = img_size
    ph, pw = patch_size
    rows = np.minimum(np.arange(H) // ph, values.shape[1] - 1)
    cols = np.minimum(np.arange(W) // pw, values.shape[2] - 1)
    return values[:, rows][:, :, cols]


def share_image(share: torch.Tensor, img_size: Tuple[int, int], patch_size: Tuple[int, int]) -> np.ndarray:
    """The token shares ``(B, gh, gw)`` painted over the image plane ``(B, H, W, 3)`` on the share scale."""
    share = torch.as_tensor(share).detach().float().cpu()
    if share.dim() != 3:
        raise ValueError(f'share: expected (B, gh, gw) token shares, got {tuple(share.shape)}')
    return token_plane(share_colours(share.numpy()), img_size, patch_size)


def grey_image(
    values: torch.Tensor,
    img_size: Tuple[int, int],
    patch_size: Tuple[int, int],
    value_range: Optional[Tuple[float, float]] = None,
) -> np.ndarray:
    """Per-token scores ``(B, gh, gw)`` (e.g. saliency) as grey levels over the image plane ``(B, H, W, 3)``,
    each sample stretched from its minimum (black) to its maximum (white), or on a fixed ``value_range``
    ``(lo, hi)`` (e.g. ``(0, 1)`` for probabilities: grey level ``round(255 · p)``, values outside clipped)."""
    v = torch.as_tensor(values).detach().float().cpu()
    if v.dim() != 3:
        raise ValueError(f'values: expected (B, gh, gw) token scores, got {tuple(v.shape)}')
    if value_range is None:
        lo, hi = v.amin((1, 2), keepdim=True), v.amax((1, 2), keepdim=True)
    else:
        lo, hi = (float(t) for t in value_range)
        if not hi > lo:
            raise ValueError(f'value_range: expected (lo, hi) with hi > lo, got {value_range}')
        v, lo, hi = v.clamp(lo, hi), torch.tensor(lo), torch.tensor(hi)
    grey = ((v - lo) / (hi - lo).clamp_min(1e-12) * 255).round().to(torch.uint8).numpy()
    return token_plane(np.repeat(grey[..., None], 3, -1), img_size, patch_size)


def overlay(images: np.ndarray, colours: np.ndarray, alpha: float = 0.45) -> np.ndarray:
    """``images`` tinted by ``colours`` (same shape, uint8): ``(1 - alpha) · image + alpha · colour``."""
    if images.shape != colours.shape:
        raise ValueError(f'colours: expected the images shape {images.shape}, got {colours.shape}')
    out = (1.0 - alpha) * images.astype(np.float64) + alpha * colours.astype(np.float64)
    return np.rint(out).astype(np.uint8)


def token_centres(grid: Tuple[int, int], patch_size: Tuple[int, int]) -> np.ndarray:
    """Pixel ``(row, col)`` of the centre of every token ``(gh · gw, 2)``, row-major: where a picture of
    token colours is read back."""
    gh, gw = grid
    ph, pw = patch_size
    r, c = np.meshgrid(np.arange(gh) * ph + ph // 2, np.arange(gw) * pw + pw // 2, indexing='ij')
    return np.stack([r.ravel(), c.ravel()], 1)


def class_colours(num_classes: int) -> np.ndarray:
    """``(C, 3)`` uint8: a distinct, fixed colour per class (hues spaced by the golden ratio, two brightness
    levels alternating), the same for every picture."""
    import colorsys

    out = []
    for c in range(int(num_classes)):
        h = (c * 0.6180339887498949) % 1.0
        v = 0.95 if c % 2 == 0 else 0.7
        out.append([round(255 * t) for t in colorsys.hsv_to_rgb(h, 0.85, v)])
    return np.asarray(out, dtype=np.uint8)


def label_image(probs: torch.Tensor, img_size: Tuple[int, int], patch_size: Tuple[int, int]) -> np.ndarray:
    """Per-token class distributions ``(B, gh, gw, C)`` painted over the image plane ``(B, H, W, 3)``: each
    token's colour is the probability-weighted mean of the class colours (a one-hot target shows its class's
    colour exactly; :func:`class_from_colour` reads it back)."""
    probs = torch.as_tensor(probs).detach().float().cpu()
    if probs.dim() != 4:
        raise ValueError(f'probs: expected (B, gh, gw, C) token distributions, got {tuple(probs.shape)}')
    colours = torch.as_tensor(class_colours(probs.shape[-1]), dtype=torch.float32)
    rgb = (probs @ colours).round().clamp(0, 255).to(torch.uint8).numpy()  # (B, gh, gw, 3)
    return token_plane(rgb, img_size, patch_size)


def class_from_colour(rgb, num_classes: int) -> np.ndarray:
    """The class whose colour (:func:`class_colours`) is nearest to each pixel ``(..., 3)``."""
    rgb = np.asarray(rgb, dtype=np.float64)[..., None, :]
    d = ((rgb - class_colours(num_classes).astype(np.float64)) ** 2).sum(-1)
    return d.argmin(-1)
