"""The one lookup of a timm model's grid steps, used by every timm adapter. Each is ``<what>_stride(model) -> (sh,
sw)``, pixels per grid cell:

- :func:`token_stride`: the patch embedding's token grid (ViTs, MLP-Mixers, ConvNeXt's patchify stem);
- :func:`cnn_stride`: a CNN's final feature map;
- :func:`mixing_stride`: the grid a mixer draws on (tokens; :data:`DEFAULT_STRIDE` for models without them);
- :func:`tl_align_stride`: the grid TL-Align's label state starts on (tokens; a ResNet's first stage);
- :func:`token_labeling_stride`: the grid of token labeling's dense targets and MixToken (tokens; a CNN's final
  feature map).
"""

from __future__ import annotations

from typing import Tuple

import torch.nn as nn

from shared_core.options import DEFAULT_STRIDE

__all__ = [
    'DEFAULT_STRIDE',
    'cnn_classes',
    'cnn_features',
    'cnn_stride',
    'mixing_stride',
    'patch_embedding',
    'tl_align_stride',
    'token_labeling_stride',
    'token_stride',
]


def patch_embedding(model: nn.Module):
    """A timm model's patch embedding: ``patch_embed`` (ViTs, Swin, PVT, ...); for the MLP-Mixer family, a ``stem``
    that is timm's ``PatchEmbed``; for NaFlexViT, its ``embeds``; for ConvNeXt, its patchify stem conv (kernel =
    stride, whose ``stride`` is the token step); ``None`` for models without one (other CNNs)."""
    embed = getattr(model, 'patch_embed', None)
    if embed is None:
        from timm.layers import PatchEmbed
        from timm.models.naflexvit import NaFlexVit

        if isinstance(model, NaFlexVit):  # its ``NaFlexEmbeds`` (``patch_size``)
            return model.embeds
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


def cnn_classes() -> tuple:
    """The timm CNN families whose final feature map :func:`cnn_features` finds (ResNet covers ResNeSt, ResNeXt,
    SE-ResNet, ResNet-D and the other ``timm.models.resnet.ResNet`` builds)."""
    from timm.models.convnext import ConvNeXt
    from timm.models.resnet import ResNet

    return ResNet, ConvNeXt


def cnn_features(model: nn.Module):
    """For a timm CNN (:func:`cnn_classes`), the module whose output is ``forward_features``' ``(B, C, h, w)``
    map: ResNet's last block of ``layer4`` (called as such under gradient checkpointing too), ConvNeXt's
    ``norm_pre``; ``None`` for other models."""
    resnet_like = cnn_classes()
    if isinstance(model, resnet_like[0]):
        return model.layer4[-1]
    if isinstance(model, resnet_like[1]):
        return model.norm_pre
    return None


def cnn_stride(model: nn.Module) -> Tuple[int, int]:
    """Pixels per position of a timm CNN's final feature map (``feature_info[-1]['reduction']``: 32 for ResNet
    and ConvNeXt, less for dilated builds)."""
    info = getattr(model, 'feature_info', None)
    if not info:
        raise ValueError(f'model: {type(model).__name__} has no feature_info, so no final feature stride')
    r = int(info[-1]['reduction'])
    return r, r


def tl_align_stride(model: nn.Module, input_size=None) -> Tuple[int, int]:
    """Pixels per token of the grid TL-Align's label state starts on: :func:`token_stride` for models with a patch
    embedding; for a timm ResNet, MetaFormer, DaViT or EfficientFormer, the grid its first stage runs on
    (``layer1``'s / ``stages.0``'s ``feature_info`` reduction: 4); for Twins, its first patch embedding's stride
    (4); for the conv nets of TL-Align's graph route, its first map at stride >= 4
    (:class:`~timm_plugin.tl_align.graph.GraphTracer`, compiled for ``input_size``; it reads that map off the graph,
    whatever a ``patch_embed`` of the model declares)."""
    from .tl_align import SUPPORTED_MODELS

    if not hasattr(model, '_orig_mod') and not isinstance(model, tuple(SUPPORTED_MODELS)):
        return _graph_stride(model, input_size)
    if patch_embedding(model) is not None:
        return token_stride(model)
    if isinstance(model, cnn_classes()[0]):
        r = next(int(f['reduction']) for f in model.feature_info if f['module'] == 'layer1')
        return r, r
    from timm.models.davit import DaVit
    from timm.models.efficientformer import EfficientFormer
    from timm.models.metaformer import MetaFormer

    if isinstance(model, (MetaFormer, DaVit, EfficientFormer)):  # the stem's grid, which the first stage runs on (4)
        r = next(int(f['reduction']) for f in model.feature_info if f['module'] == 'stages.0')
        return r, r
    from timm.models.twins import Twins

    if isinstance(model, Twins):  # the first patch embedding's grid (4)
        stride = model.patch_embeds[0].proj.stride
        return int(stride[0]), int(stride[1])
    return _graph_stride(model, input_size)


def _graph_stride(model: nn.Module, input_size) -> Tuple[int, int]:
    from .tl_align import timm_tracer

    tracer = timm_tracer(model, input_size=input_size)  # the graph route's first stride >= 4 map, or why not
    stride = getattr(tracer, 'stride', None)
    if stride is None:
        raise ValueError(f'model: {type(model).__name__} has no patch embedding or first stage, so no label grid')
    return stride, stride


def token_labeling_stride(model: nn.Module) -> Tuple[int, int]:
    """The grid token labeling works on: a CNN's final feature map (:func:`cnn_stride`), else the tokens
    (:func:`token_stride`); MixToken's box and the dense targets are drawn on it, and
    ``TokenLabelCollate(label_stride=)`` takes it to build the dense targets in the loader."""
    return cnn_stride(model) if cnn_features(model) is not None else token_stride(model)


def mixing_stride(model: nn.Module, method=None, input_size=None) -> Tuple[int, int]:
    """The grid a mixer draws on: for TL-Align, the grid its label state starts on (:func:`tl_align_stride`, the
    graph route's compiled for ``input_size``); else :func:`token_stride` for models with a patch embedding;
    else :data:`DEFAULT_STRIDE` (MixUp/CutMix need no grid; TokenMix's masks are then drawn in image space)."""
    if method == 'tl_align':
        return tl_align_stride(model, input_size)
    if patch_embedding(model) is not None:
        return token_stride(model)
    return DEFAULT_STRIDE
