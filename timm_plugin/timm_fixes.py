"""Fixes for the installed timm, each an explicit call (nothing is patched on import).

- timm 1.0.31's RandAugment/AutoAugment ``Posterize`` ops pass ``bits_to_keep = 0`` at the top of their
  range (``PosterizeIncreasing`` at magnitude 10, which ``mstd`` noise reaches: DeiT's
  ``rand-m9-mstd0.5-inc1`` draws it for roughly 1 image in 300), and Pillow >= 11 refuses 0 bits
  (``ValueError: bits must be between or equal to 1 and 8``), so a real training run crashes in its first
  epoch. Keeping 0 of 8 bits is the black image (what older Pillow returned); :func:`posterize` does that
  and :func:`fix_posterize` puts it in timm's op table. ``tokenaug-train`` calls it before any transform is
  built; a user of timm's own ``train.py`` with our tasks calls ``timm_plugin.fix_posterize()`` once.
"""

from __future__ import annotations

from PIL import Image, ImageOps
from timm.data import auto_augment

__all__ = ['posterize', 'fix_posterize']


def posterize(img: Image.Image, bits_to_keep: int, **__) -> Image.Image:
    """timm's ``posterize`` with ``bits_to_keep <= 0`` allowed: every bit dropped, a black image."""
    if bits_to_keep >= 8:
        return img
    if bits_to_keep <= 0:
        return Image.new(img.mode, img.size)
    return ImageOps.posterize(img, bits_to_keep)


def fix_posterize() -> None:
    """Idempotent: timm's Posterize ops in ``auto_augment.NAME_TO_OP`` use :func:`posterize`."""
    for name in ('Posterize', 'PosterizeIncreasing', 'PosterizeOriginal'):
        if auto_augment.NAME_TO_OP.get(name) is auto_augment.posterize:
            auto_augment.NAME_TO_OP[name] = posterize
