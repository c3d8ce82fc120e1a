"""The one lookup of a timm model's token grid step, used by every timm adapter (mixers, TL-Align's mix grid,
token labeling, occlusion)."""

from __future__ import annotations

from typing import Tuple

import torch.nn as nn

__all__ = ['token_stride', 'patch_embedding']


def patch_embedding(model: nn.Module):
    """A timm model's patch embedding: ``patch_embed`` (ViTs, Swin, PVT, ...); for the MLP-Mixer family, a ``stem``
    that is timm's ``PatchEmbed``; for ConvNeXt, its patchify stem conv (kernel = stride, whose ``stride`` is
    the token step); ``None`` for models without one (other CNNs)."""
    embed = getattr(model, 'patch_embed', None)
    if embed is None:
        from timm.layers import PatchEmbed
        from timm.models.convnext import ConvNeXt

        stem = getattr(model, 'stem', None)
        if isinstance(stem, PatchEmbed):
            embed = stem
        elif isinstance(model, ConvNeXt) and isinstance(stem, nn.Sequential) and isinstance(stem[0], nn.Conv2d):
            conv = stem[0]  # ConvNeXt's patchify stem: a conv with kernel = stride
            embed = conv if conv.kernel_size == conv.stride else None
    return embed


def token_stride(model: nn.Module) -> Tuple[int, int]:
    """Pixels per token along (h, w) of a timm model's first token grid, in this order: the patch embedding's
    ``token_stride`` where it declares one (LV-ViT's conv stem: 16, while its ``proj`` steps 8); else
    ``img_size / grid_size`` where they divide (hybrid ViTs, whose ``proj`` runs on backbone features);
    else the stride of its ``proj`` convolution (PVT v2's overlapping 7x7 embedding: 4), or of the embedding itself
    where it is a convolution (ConvNeXt's patchify stem: 4); else ``patch_size``."""
    embed = patch_embedding(model)
    if embed is None:
        raise ValueError(f'model: {type(model).__name__} has no patch_embed (or PatchEmbed stem), so no token grid')
    stride = getattr(embed, 'token_stride', None)
    img_size, grid_size = getattr(embed, 'img_size', None), getattr(embed, 'grid_size', None)
    if (
        stride is None
        and img_size is not None
        and grid_size is not None
        and all(i % g == 0 for i, g in zip(img_size, grid_size))
    ):
        stride = tuple(i // g for i, g in zip(img_size, grid_size))
    proj = embed if isinstance(embed, nn.Conv2d) else getattr(embed, 'proj', None)
    if stride is None and isinstance(proj, nn.Conv2d):
        stride = proj.stride
    if stride is None:
        stride = getattr(embed, 'patch_size', None)
    if stride is None:
        raise ValueError(
            f'model: {type(model).__name__}.patch_embed has no token_stride / grid_size / proj.stride / patch_size'
        )
    stride = (stride, stride) if isinstance(stride, int) else tuple(stride)
    return int(stride[0]), int(stride[1])
