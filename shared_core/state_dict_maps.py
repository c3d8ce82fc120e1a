"""Key maps between state-dict layouts, strict: every key is mapped or named in an error. Used by the converters
(``mm_plugin.convert``, ``tokenaug-convert``) and the loaders of the authors' checkpoints (``timm_plugin.cct``).

- :func:`rename_strict`: the first matching ``(pattern, replacement)`` rule renames each key; a key no rule
  matches is an error naming it.
- :func:`fuse_qkv`: separate ``query`` / ``key`` / ``value`` projections (the public ViT-B/16 of TokenMixup, the
  ``Attention_Vertical`` of its VTM blocks) as one ``qkv`` projection, timm's layout (rows ``[q; k; v]``).
- :func:`tokenmixup_vit_to_timm`: mlvlab/TokenMixup's ViT-B/16 checkpoints (a port of jeonsworld/ViT-pytorch,
  ``experiments/vit/models/modeling.py``) as timm's ``VisionTransformer``; its HTM block's ScoreNet (a linear layer
  on the class token) as ``tokenmixup_scorenet.L.fc``.
"""

from __future__ import annotations

import re
from typing import Dict, Sequence, Tuple

import torch

__all__ = ['rename_strict', 'fuse_qkv', 'tokenmixup_vit_to_timm', 'TOKENMIXUP_VIT_RULES']

Rules = Sequence[Tuple[str, str]]


def rename_strict(rules: Rules, state_dict: Dict[str, torch.Tensor], what: str) -> Dict[str, torch.Tensor]:
    """``state_dict`` with each key renamed by the first rule whose pattern matches; unmatched keys are an error."""
    out, unmapped = {}, []
    for key, value in state_dict.items():
        for pattern, repl in rules:
            if re.match(pattern, key):
                out[re.sub(pattern, repl, key)] = value
                break
        else:
            unmapped.append(key)
    if unmapped:
        raise ValueError(
            f'state_dict: {len(unmapped)} {what} keys have no mapping: {unmapped[:10]}'
            f'{" ..." if len(unmapped) > 10 else ""}'
        )
    return out


def fuse_qkv(state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Every ``P.query.{weight,bias}``, ``P.key.*``, ``P.value.*`` triple as ``P.qkv.*`` (rows ``[q; k; v]``, what
    timm's ``Attention`` splits); other keys unchanged. A triple with a part missing is an error."""
    out = dict(state_dict)
    for key in [k for k in state_dict if re.search(r'\.query\.(weight|bias)$', k)]:
        prefix, kind = key.rsplit('.query.', 1)
        parts = [f'{prefix}.{name}.{kind}' for name in ('query', 'key', 'value')]
        missing = [p for p in parts if p not in state_dict]
        if missing:
            raise ValueError(f'state_dict: {key} has no {missing}')
        out[f'{prefix}.qkv.{kind}'] = torch.cat([out.pop(p) for p in parts], 0)
    return out


#: TokenMixup's ViT (jeonsworld/ViT-pytorch names) -> timm's VisionTransformer, before :func:`fuse_qkv`
TOKENMIXUP_VIT_RULES: Rules = (
    (r'^transformer\.embeddings\.cls_token$', 'cls_token'),
    (r'^transformer\.embeddings\.position_embeddings$', 'pos_embed'),
    (r'^transformer\.embeddings\.patch_embeddings\.(weight|bias)$', r'patch_embed.proj.\1'),
    (r'^transformer\.encoder\.layer\.(\d+)\.attention_norm\.', r'blocks.\1.norm1.'),
    (r'^transformer\.encoder\.layer\.(\d+)\.ffn_norm\.', r'blocks.\1.norm2.'),
    (r'^transformer\.encoder\.layer\.(\d+)\.ffn\.(fc1|fc2)\.', r'blocks.\1.mlp.\2.'),
    (r'^transformer\.encoder\.layer\.(\d+)\.attn\.(query|key|value)\.', r'blocks.\1.attn.\2.'),
    (r'^transformer\.encoder\.layer\.(\d+)\.attn\.out\.', r'blocks.\1.attn.proj.'),
    (r'^transformer\.encoder\.layer\.(\d+)\.scorenet\.', r'tokenmixup_scorenet.\1.fc.'),
    (r'^transformer\.encoder\.encoder_norm\.', 'norm.'),
    (r'^head\.(weight|bias)$', r'head.\1'),
)


def tokenmixup_vit_to_timm(state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """A TokenMixup ViT checkpoint (the bare state dict its ``train.py`` saves, ``module.`` stripped) in timm's
    ``VisionTransformer`` names; its ScoreNet, where present, as ``tokenmixup_scorenet.L.fc``."""
    state_dict = {k[7:] if k.startswith('module.') else k: v for k, v in state_dict.items()}
    return fuse_qkv(rename_strict(TOKENMIXUP_VIT_RULES, state_dict, 'TokenMixup ViT'))
