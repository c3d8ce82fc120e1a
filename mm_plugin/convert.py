"""Checkpoint key maps between timm and OpenMMLab models, strict: every key is mapped or named in an error.

- ``timm_vit_to_mmpretrain``: a timm ``VisionTransformer`` onto an mmpretrain ``ImageClassifier``
  (``VisionTransformer`` backbone, ``VisionTransformerClsHead``), for parity tests.
- ``to_dense_backbone``: timm or mmpretrain classification checkpoints (ViT/DeiT, Swin, LV-ViT) onto the
  mmseg / mmdet backbones (LV-ViT: :class:`mm_plugin.lvvit.LVViT`, same key names), used by
  ``tokenaug-convert`` (:mod:`mm_plugin.convert_cli`).

Layout facts handled here: mmseg's ViT uses ``nn.MultiheadAttention``
(``attn.attn.in_proj_*`` = timm's ``qkv``); timm's Swin puts ``PatchMerging`` at the *start* of a stage,
OpenMMLab at the *end* of the previous one, and OpenMMLab merges with ``nn.Unfold`` (channel-major,
kernel offsets row-major) where timm concatenates the four offsets ``(0,0), (1,0), (0,1), (1,1)``.
"""

from __future__ import annotations

import re
from typing import Dict, Tuple

import torch

from shared_core.state_dict_maps import rename_strict as _apply

__all__ = ['timm_vit_to_mmpretrain', 'mmpretrain_to_timm']

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


def timm_vit_to_mmpretrain(state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """timm ``VisionTransformer`` (ViT/DeiT, class token, no registers) -> mmpretrain ``ImageClassifier``
    (``VisionTransformer`` backbone, ``VisionTransformerClsHead``). Unknown keys are an error."""
    return _apply(_VIT_RULES, state_dict, 'timm ViT')


#: mmpretrain ``ImageClassifier`` keys -> timm model keys, per architecture: ViT/DeiT (mmpretrain's
#: ``VisionTransformer`` backbone and ``VisionTransformerClsHead``: the inverse of ``_VIT_RULES``) and timm models
#: held by mmpretrain's ``TIMMBackbone`` (``backbone.timm_model.``, our LV-ViT configs) with a ``LinearClsHead``
_MMPRETRAIN_HEADS = (
    (r'^head\.(?:layers\.)?head\.(weight|bias)$', r'head.\1'),  # VisionTransformerClsHead, TokenLabelingHead
    (r'^head\.fc\.(weight|bias)$', r'head.\1'),  # LinearClsHead
    (r'^head\.aux_head\.(weight|bias)$', r'aux_head.\1'),  # token labeling's aux head
    (r'^(tokenmixup_scorenet\..+)$', r'\1'),  # TokenMixup's ScoreNets: the same names on a timm model
)
_MMPRETRAIN_TO_TIMM = {
    'vit': (
        (r'^backbone\.(cls_token|pos_embed)$', r'\1'),
        (r'^backbone\.patch_embed\.projection\.(weight|bias)$', r'patch_embed.proj.\1'),
        (r'^backbone\.layers\.(\d+)\.ln1\.(weight|bias)$', r'blocks.\1.norm1.\2'),
        (r'^backbone\.layers\.(\d+)\.attn\.(qkv|proj)\.(weight|bias)$', r'blocks.\1.attn.\2.\3'),
        (r'^backbone\.layers\.(\d+)\.ln2\.(weight|bias)$', r'blocks.\1.norm2.\2'),
        (r'^backbone\.layers\.(\d+)\.ffn\.layers\.0\.0\.(weight|bias)$', r'blocks.\1.mlp.fc1.\2'),
        (r'^backbone\.layers\.(\d+)\.ffn\.layers\.1\.(weight|bias)$', r'blocks.\1.mlp.fc2.\2'),
        (r'^backbone\.ln1\.(weight|bias)$', r'norm.\1'),
    )
    + _MMPRETRAIN_HEADS,
    'lvvit': ((r'^backbone\.timm_model\.(?!model\.)(.+)$', r'\1'),) + _MMPRETRAIN_HEADS,
}


def mmpretrain_to_timm(state_dict: Dict[str, torch.Tensor], arch: str) -> Dict[str, torch.Tensor]:
    """An mmpretrain classifier's state dict as the timm model's (``arch``: ``'vit'`` or ``'lvvit'``), the
    classifier kept; the preprocessor's buffers (``data_preprocessor.*``) dropped. Unknown keys are an error."""
    if arch not in _MMPRETRAIN_TO_TIMM:
        raise ValueError(f'model: no mmpretrain -> timm key map for {arch!r} (ViT/DeiT, LV-ViT)')
    kept = {k: v for k, v in state_dict.items() if not k.startswith('data_preprocessor.')}
    return _apply(_MMPRETRAIN_TO_TIMM[arch], kept, f'mmpretrain {arch}')


# ------------------------------------------------------------------------------------------------
# classification checkpoints -> mmseg / mmdet backbones (bare backbone keys)
# ------------------------------------------------------------------------------------------------

#: keys a classification checkpoint has that a dense-prediction backbone does not use (dropped, reported)
DROP_RULES = (
    r'^head\.',
    r'^head_dist\.',
    r'^fc_norm\.',
    r'^aux_head\.',
    r'^tokenmixup_scorenet\.',
    r'^dist_token$',
    r'^neck\.',
    r'^data_preprocessor\.',
)

_TIMM_VIT_DENSE = (
    (r'^cls_token$', 'cls_token'),
    (r'^pos_embed$', 'pos_embed'),
    (r'^patch_embed\.proj\.(weight|bias)$', r'patch_embed.projection.\1'),
    (r'^blocks\.(\d+)\.norm1\.(weight|bias)$', r'layers.\1.ln1.\2'),
    (r'^blocks\.(\d+)\.attn\.qkv\.(weight|bias)$', r'layers.\1.attn.attn.in_proj_\2'),
    (r'^blocks\.(\d+)\.attn\.proj\.(weight|bias)$', r'layers.\1.attn.attn.out_proj.\2'),
    (r'^blocks\.(\d+)\.norm2\.(weight|bias)$', r'layers.\1.ln2.\2'),
    (r'^blocks\.(\d+)\.mlp\.fc1\.(weight|bias)$', r'layers.\1.ffn.layers.0.0.\2'),
    (r'^blocks\.(\d+)\.mlp\.fc2\.(weight|bias)$', r'layers.\1.ffn.layers.1.\2'),
    (r'^norm\.(weight|bias)$', r'ln1.\1'),
)
_MMPRETRAIN_VIT_DENSE = (
    (r'^backbone\.(cls_token|pos_embed)$', r'\1'),
    (r'^backbone\.patch_embed\.projection\.(weight|bias)$', r'patch_embed.projection.\1'),
    (r'^backbone\.layers\.(\d+)\.attn\.qkv\.(weight|bias)$', r'layers.\1.attn.attn.in_proj_\2'),
    (r'^backbone\.layers\.(\d+)\.attn\.proj\.(weight|bias)$', r'layers.\1.attn.attn.out_proj.\2'),
    (r'^backbone\.layers\.(\d+)\.(ln1|ln2|ffn\.layers\.0\.0|ffn\.layers\.1)\.(weight|bias)$', r'layers.\1.\2.\3'),
    (r'^backbone\.ln1\.(weight|bias)$', r'ln1.\1'),
)
_TIMM_SWIN_DENSE = (
    (r'^patch_embed\.proj\.(weight|bias)$', r'patch_embed.projection.\1'),
    (r'^patch_embed\.norm\.(weight|bias)$', r'patch_embed.norm.\1'),
    (r'^layers\.(\d+)\.blocks\.(\d+)\.(norm1|norm2)\.(weight|bias)$', r'stages.\1.blocks.\2.\3.\4'),
    (r'^layers\.(\d+)\.blocks\.(\d+)\.attn\.(qkv|proj)\.(weight|bias)$', r'stages.\1.blocks.\2.attn.w_msa.\3.\4'),
    (
        r'^layers\.(\d+)\.blocks\.(\d+)\.attn\.relative_position_bias_table$',
        r'stages.\1.blocks.\2.attn.w_msa.relative_position_bias_table',
    ),
    (r'^layers\.(\d+)\.blocks\.(\d+)\.mlp\.fc1\.(weight|bias)$', r'stages.\1.blocks.\2.ffn.layers.0.0.\3'),
    (r'^layers\.(\d+)\.blocks\.(\d+)\.mlp\.fc2\.(weight|bias)$', r'stages.\1.blocks.\2.ffn.layers.1.\3'),
    # layers.{i}.downsample (start of stage i) -> stages.{i-1}.downsample (end of stage i-1): see _shift_downsample
    (r'^layers\.(\d+)\.downsample\.(norm\.weight|norm\.bias|reduction\.weight)$', r'DOWNSAMPLE.\1.\2'),
    (r'^norm\.(weight|bias)$', r'FINALNORM.\1'),  # the last stage's output norm: norm{last stage}
)
_MMPRETRAIN_SWIN_DENSE = (
    (r'^backbone\.(patch_embed\..*|stages\..*)$', r'\1'),
    (r'^backbone\.norm(\d+)\.(weight|bias)$', r'norm\1.\2'),
)
# LV-ViT (timm_plugin.lvvit): mm_plugin's mmseg backbone keeps timm's module names, so the map is the identity
# on exactly the keys an LV-ViT has (anything else, e.g. a DeiT's qkv bias, stays for the strict check to name)
_TIMM_LVVIT_DENSE = (
    (r'^(cls_token|pos_embed)$', r'\1'),
    (r'^patch_embed\.(conv[123]\.weight|proj\.(?:weight|bias))$', r'patch_embed.\1'),
    (r'^patch_embed\.(bn[123])\.(weight|bias|running_mean|running_var|num_batches_tracked)$', r'patch_embed.\1.\2'),
    (r'^blocks\.(\d+)\.(norm1|norm2|attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)\.(weight|bias)$', r'blocks.\1.\2.\3'),
    (r'^norm\.(weight|bias)$', r'norm.\1'),
)
# mmpretrain's TIMMBackbone holds the timm model as ``backbone.timm_model`` (``features_only=True``: timm's
# feature wrapper adds ``model.``)
_MMPRETRAIN_LVVIT_DENSE = tuple((r'^backbone\.timm_model\.(?:model\.)?' + p[1:], r) for p, r in _TIMM_LVVIT_DENSE)


def _unfold_order_reduction(w: torch.Tensor) -> torch.Tensor:
    """timm's 4C order (offset-major: (0,0), (1,0), (0,1), (1,1); channels inner) -> nn.Unfold's
    (channel-major; offsets (0,0), (0,1), (1,0), (1,1)) for the reduction weight ``(out, 4C)``."""
    out, c4 = w.shape
    return w.reshape(out, 4, c4 // 4)[:, [0, 2, 1, 3], :].transpose(1, 2).reshape(out, c4)


def _unfold_order_norm(v: torch.Tensor) -> torch.Tensor:
    return v.reshape(4, -1)[[0, 2, 1, 3], :].transpose(0, 1).reshape(-1)


def _split(state_dict: Dict[str, torch.Tensor]):
    dropped = {k: v for k, v in state_dict.items() if any(re.match(p, k) for p in DROP_RULES)}
    kept = {k: v for k, v in state_dict.items() if k not in dropped}
    return kept, sorted(dropped)


def to_dense_backbone(state_dict: Dict[str, torch.Tensor], arch: str, source: str = 'timm'):
    """Map a classification checkpoint to OpenMMLab dense-prediction backbone keys (no prefix).

    Args:
        arch: ``'vit'`` (ViT/DeiT), ``'swin'`` or ``'lvvit'`` (:mod:`timm_plugin.lvvit`; keys unchanged).
        source: ``'timm'`` (tokenaug-train / plain timm files) or ``'mmpretrain'`` (for LV-ViT: an
            ``ImageClassifier`` with mmpretrain's ``TIMMBackbone``).
    Returns:
        ``(backbone_state_dict, dropped_keys)``; any key neither mapped nor a known training-only part
        is an error naming it.
    """
    kept, dropped = _split(state_dict)
    rules = {
        ('vit', 'timm'): _TIMM_VIT_DENSE,
        ('vit', 'mmpretrain'): _MMPRETRAIN_VIT_DENSE,
        ('swin', 'timm'): _TIMM_SWIN_DENSE,
        ('swin', 'mmpretrain'): _MMPRETRAIN_SWIN_DENSE,
        ('lvvit', 'timm'): _TIMM_LVVIT_DENSE,
        ('lvvit', 'mmpretrain'): _MMPRETRAIN_LVVIT_DENSE,
    }.get((arch, source))
    if rules is None:
        raise ValueError(
            f'arch/source: no key map for arch={arch!r} from {source!r} (vit, swin, lvvit; timm, mmpretrain)'
        )
    out = _apply(rules, kept, f'{source} {arch}')
    if arch == 'swin' and source == 'timm':
        out = _shift_downsample(out)
    return out, dropped


def _shift_downsample(sd: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    out = {}
    last = max(int(m.group(1)) for k in sd for m in [re.match(r'^stages\.(\d+)\.', k)] if m)
    for k, v in sd.items():
        m = re.match(r'^DOWNSAMPLE\.(\d+)\.(.*)$', k)
        if k.startswith('FINALNORM.'):
            out[f'norm{last}.' + k.split('.', 1)[1]] = v
            continue
        if not m:
            out[k] = v
            continue
        stage, part = int(m.group(1)), m.group(2)
        if stage == 0:
            raise ValueError(f'state_dict: {k!r}: a downsample at the start of stage 0 has no OpenMMLab place')
        v = _unfold_order_reduction(v) if part == 'reduction.weight' else _unfold_order_norm(v)
        out[f'stages.{stage - 1}.downsample.{part}'] = v
    return out
