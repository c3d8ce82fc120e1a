"""Checkpoint key maps between timm and OpenMMLab models, strict: every key is mapped or named in an error.

``timm_vit_to_mmpretrain`` maps a timm ``VisionTransformer`` state dict onto an mmpretrain
``ImageClassifier`` with a ``VisionTransformer`` backbone and ``VisionTransformerClsHead``.
(``tokenaug-convert`` for mmseg/mmdet builds on these maps.)
"""
from __future__ import annotations

import re
from typing import Dict, Tuple

import torch

__all__ = ['timm_vit_to_mmpretrain']

_VIT_RULES: Tuple[Tuple[str, str], ...] = (
    (r'^cls_token$', 'backbone.cls_token'),
    (r'^pos_embed$', 'backbone.pos_embed'),
    (r'^patch_embed\.proj\.(weight|bias)$', r'backbone.patch_embed.projection.\1'),
    (r'^blocks\.(\d+)\.norm1\.(weight|bias)$', r'backbone.layers.\1.ln1.\2'),
    (r'^blocks\.(\d+)\.attn\.qkv\.(weight|bias)$', r'backbone.layers.\1.attn.qkv.\2'),
    (r'^blocks\.(\d+)\.attn\.proj\.(weight|bias)$', r'backbone.layers.\1.attn.proj.\2'),
    (r'^blocks\.(\d+)\.norm2\.(weight|bias)$', r'backbone.layers.\1.ln2.\2'),
    (r'^blocks\.(\d+)\.mlp\.fc1\.(weight|bias)$', r'backbone.layers.\1.ffn.layers.0.0.\2'),
    (r'^blocks\.(\d+)\.mlp\.fc2\.(weight|bias)$', r'backbone.layers.\1.ffn.layers.1.\2'),
    (r'^norm\.(weight|bias)$', r'backbone.ln1.\1'),
    (r'^head\.(weight|bias)$', r'head.layers.head.\1'),
)


def _apply(rules, state_dict: Dict[str, torch.Tensor], what: str) -> Dict[str, torch.Tensor]:
    out, unmapped = {}, []
    for key, value in state_dict.items():
        for pattern, repl in rules:
            if re.match(pattern, key):
                out[re.sub(pattern, repl, key)] = value
                break
        else:
            unmapped.append(key)
    if unmapped:
        raise ValueError(f'state_dict: {len(unmapped)} {what} keys have no mapping: {unmapped[:10]}'
                         f'{" ..." if len(unmapped) > 10 else ""}')
    return out


def timm_vit_to_mmpretrain(state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """timm ``VisionTransformer`` (ViT/DeiT, class token, no registers) -> mmpretrain ``ImageClassifier``
    (``VisionTransformer`` backbone, ``VisionTransformerClsHead``). Unknown keys are an error."""
    return _apply(_VIT_RULES, state_dict, 'timm ViT')
