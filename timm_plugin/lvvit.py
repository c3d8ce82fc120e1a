"""LV-ViT as timm models (``lvvit_t``, ``lvvit_s``, ``lvvit_m``, ``lvvit_l``), built from timm's ViT parts.

Paper: Jiang et al., *All Tokens Matter: Token Labeling for Training Better Vision Transformers*
(NeurIPS 2021, arXiv:2104.10858) and its supplement; code https://github.com/zihangJiang/TokenLabeling
(``tlt/models/lvvit.py``).

What differs from timm's ``VisionTransformer`` (everything else is timm's: attention, MLP, pos-embed,
pretrained loading, ``forward_intermediates``, ``set_input_size``, dynamic image sizes):

- patch embedding: 4 convolutions (supplement Table 3, row ``[7,3,3,8]`` strides ``[2,1,1,8]``; public
  code ``PatchEmbed4_2``): conv 7x7/2 -> BN -> ReLU, conv 3x3 -> BN -> ReLU, conv 3x3 -> BN -> ReLU
  (64 channels, 128 for LV-ViT-L), then ``proj`` with kernel = stride = patch_size / 2. The token grid
  steps ``patch_size`` (16) pixels, not ``proj.stride`` (8): :attr:`ConvPatchEmbed.token_stride`.
- enhanced residual (supplement Table 4): ``X <- X + F(X) / skip_lam`` for attention and MLP: 1 for T, 2 for
  S and M, 3 for L, as the public code's ``lvvit_t/s/m/l`` (not in the state dict: a kwarg of the constructor;
  an official LV-ViT-T checkpoint loads strictly whatever the value, so it must be the public one).
- no qkv bias, MLP ratio 3 (paper Table 1; supplement Table 2).
- an auxiliary head on the patch tokens (``aux_head``), trained by token labeling. At inference the
  public code predicts ``head(cls) + 0.5 * max_over_tokens(aux_head(patch tokens))``; here that is
  ``head_rule='cls+aux'`` (default); ``head_rule='cls'`` reads the class token only.

Sizes (paper Table 1): T 12 blocks / 240 / 4 heads (8.5M), S 16 / 384 / 6 (26M), M 20 / 512 / 8 (56M),
L 24 / 768 / 12 at 288 px with a 128-channel stem (150M); parameter counts include both heads.

No weights are published through timm: ``pretrained=True`` needs ``pretrained_cfg_overlay=dict(file=...)``
(a ``tokenaug-train`` checkpoint, a plain state dict, or the public LV-ViT release: same key names).
"""

from __future__ import annotations

from functools import partial
from typing import Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import (
    Format,
    LayerNorm,
    PatchEmbed,
    get_device_dtype,
    nchw_to,
    resample_abs_pos_embed,
    to_2tuple,
    trunc_normal_,
)
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models.vision_transformer import Block, VisionTransformer

from shared_core.token_labeling import AUX_WEIGHT, HEAD_RULES, inference_logits

__all__ = ['ConvPatchEmbed', 'LVBlock', 'LVViT', 'HEAD_RULES', 'AUX_WEIGHT', 'checkpoint_filter_fn']

#: inference rules of :meth:`LVViT.forward_head`


class ConvPatchEmbed(PatchEmbed):
    """LV-ViT's 4-convolution patch embedding (supplement Table 3; public ``PatchEmbed4_2``), with timm
    ``PatchEmbed``'s interface: ``(B, N, C)`` tokens (or ``output_fmt``), ``img_size``, ``patch_size``,
    ``grid_size``, ``num_patches``, ``strict_img_size``, ``dynamic_img_pad``.

    ``patch_size`` is the step of the token grid in pixels (the stem halves the image, ``proj`` steps
    ``patch_size // 2``), also given as :attr:`token_stride`; ``proj.stride`` is half of it.
    """

    def __init__(
        self,
        img_size: Optional[Union[int, Tuple[int, int]]] = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        embed_dim: int = 768,
        stem_chans: int = 64,
        norm_layer=None,
        flatten: bool = True,
        output_fmt: Optional[str] = None,
        bias: bool = True,
        strict_img_size: bool = True,
        dynamic_img_pad: bool = False,
        device=None,
        dtype=None,
    ):
        ps = to_2tuple(patch_size)
        if any(p % 2 for p in ps):
            raise ValueError(f'patch_size: the conv stem halves the image first, so it must be even; got {patch_size}')
        super().__init__(
            img_size=img_size,
            patch_size=ps,
            in_chans=in_chans,
            embed_dim=embed_dim,
            norm_layer=norm_layer,
            flatten=flatten,
            output_fmt=output_fmt,
            bias=bias,
            strict_img_size=strict_img_size,
            dynamic_img_pad=dynamic_img_pad,
            device=device,
            dtype=dtype,
        )
        dd = dict(device=device, dtype=dtype)
        del self.proj  # PatchEmbed's single conv; rebuilt below after the stem (the public code's key order)
        self.conv1 = nn.Conv2d(in_chans, stem_chans, kernel_size=7, stride=2, padding=3, bias=False, **dd)
        self.bn1 = nn.BatchNorm2d(stem_chans, **dd)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(stem_chans, stem_chans, kernel_size=3, stride=1, padding=1, bias=False, **dd)
        self.bn2 = nn.BatchNorm2d(stem_chans, **dd)
        self.conv3 = nn.Conv2d(stem_chans, stem_chans, kernel_size=3, stride=1, padding=1, bias=False, **dd)
        self.bn3 = nn.BatchNorm2d(stem_chans, **dd)
        half = tuple(p // 2 for p in ps)
        self.proj = nn.Conv2d(stem_chans, embed_dim, kernel_size=half, stride=half, bias=bias, **dd)

    @property
    def token_stride(self) -> Tuple[int, int]:
        """The step of the token grid in pixels (what token-aware mixing must align to)."""
        return self.patch_size

    def set_input_size(self, img_size=None, patch_size=None):
        if patch_size is not None and to_2tuple(patch_size) != self.patch_size:
            raise ValueError(
                f'patch_size: the conv stem of LV-ViT fixes the token stride at {self.patch_size}; got {patch_size}'
            )
        super().set_input_size(img_size=img_size)

    def _check_and_pad(self, x: torch.Tensor) -> torch.Tensor:
        """timm ``PatchEmbed``'s input rules: exact size if strict, else divisible by the patch (or padded)."""
        H, W = x.shape[-2:]
        if self.img_size is not None:
            if self.strict_img_size:
                if (H, W) != tuple(self.img_size):
                    raise ValueError(f'input: image size ({H}, {W}) does not match the model {tuple(self.img_size)}')
            elif not self.dynamic_img_pad and (H % self.patch_size[0] or W % self.patch_size[1]):
                raise ValueError(f'input: image size ({H}, {W}) is not divisible by patch size {self.patch_size}')
        if self.dynamic_img_pad:
            pad_h = (self.patch_size[0] - H % self.patch_size[0]) % self.patch_size[0]
            pad_w = (self.patch_size[1] - W % self.patch_size[1]) % self.patch_size[1]
            x = F.pad(x, (0, pad_w, 0, pad_h))
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._check_and_pad(x)
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.relu(self.bn2(self.conv2(x)))
        x = self.relu(self.bn3(self.conv3(x)))
        x = self.proj(x)
        if self.flatten:
            x = x.flatten(2).transpose(1, 2)  # NCHW -> NLC
        elif self.output_fmt != Format.NCHW:
            x = nchw_to(x, self.output_fmt)
        return self.norm(x)


class LVBlock(Block):
    """timm's pre-norm ``Block`` with LV-ViT's enhanced residual (supplement Table 4):
    ``x <- x + F(x) / skip_lam`` for the attention and the MLP branch."""

    def __init__(self, *args, skip_lam: float = 2.0, **kwargs):
        super().__init__(*args, **kwargs)
        if skip_lam <= 0:
            raise ValueError(f'skip_lam: expected a positive residual scale, got {skip_lam}')
        self.skip_lam = skip_lam

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False):
        attn = self.attn(self.norm1(x), attn_mask=attn_mask, is_causal=is_causal)
        x = x + self.drop_path1(self.ls1(attn)) / self.skip_lam
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x)))) / self.skip_lam
        return x


class LVViT(VisionTransformer):
    """LV-ViT: timm's ``VisionTransformer`` with :class:`ConvPatchEmbed`, :class:`LVBlock` and an aux head. Its
    arguments are ``VisionTransformer``'s, which all pass through, and these:

    Args:
        skip_lam: residual scale of every block (``X + F(X) / skip_lam``); each size sets the public code's value.
        stem_chans: channels of the three stem convolutions (64; 128 for LV-ViT-L).
        head_rule: ``'cls+aux'`` (default, the public code's inference): ``head(cls token) + 0.5 *
            max over patch tokens of aux_head(patch token)``; ``'cls'``: ``head(cls token)`` only.
            ``forward_head(x, pre_logits=True)`` returns the pooled class token either way.

    ``forward_features`` returns the normed ``(B, 1 + N, C)`` tokens; token 0 feeds ``head``, tokens
    ``1:`` feed ``aux_head`` (what token labeling trains; its wrapper reads the two heads itself). The
    head rule holds in training mode too: a plain classification loop trains the ``'cls+aux'`` output,
    use ``head_rule='cls'`` to train the class head alone. ``qkv_bias`` defaults to False, ``mlp_ratio``
    to 3, the LayerNorm eps to 1e-5 (``nn.LayerNorm``'s, as the public code).
    """

    def __init__(
        self,
        img_size: Union[int, Tuple[int, int]] = 224,
        patch_size: int = 16,
        embed_dim: int = 384,
        depth: int = 16,
        num_heads: int = 6,
        mlp_ratio: float = 3.0,
        qkv_bias: bool = False,
        skip_lam: float = 2.0,
        stem_chans: int = 64,
        head_rule: str = 'cls+aux',
        norm_layer=None,
        **kwargs,
    ):
        if head_rule not in HEAD_RULES:
            raise ValueError(f'head_rule: expected one of {HEAD_RULES}, got {head_rule!r}')
        for name in ('embed_layer', 'block_fn'):
            if name in kwargs:
                raise ValueError(f'{name}: LV-ViT fixes it (ConvPatchEmbed / LVBlock)')
        super().__init__(
            img_size=img_size,
            patch_size=patch_size,
            embed_dim=embed_dim,
            depth=depth,
            num_heads=num_heads,
            mlp_ratio=mlp_ratio,
            qkv_bias=qkv_bias,
            norm_layer=norm_layer or partial(LayerNorm, eps=1e-5),
            embed_layer=partial(ConvPatchEmbed, stem_chans=stem_chans),
            block_fn=partial(LVBlock, skip_lam=skip_lam),
            **kwargs,
        )
        if self.num_prefix_tokens != 1 or not self.has_class_token:
            raise ValueError(
                'class_token / reg_tokens: LV-ViT reads exactly one class token (head) and the patch '
                f'tokens (aux_head); got {self.num_prefix_tokens} prefix tokens'
            )
        self.skip_lam = skip_lam
        self.head_rule = head_rule
        self.aux_head = self._new_aux_head(self.num_classes, get_device_dtype(self))
        if kwargs.get('weight_init', '') != 'skip':
            self._init_aux_head()

    def _new_aux_head(self, num_classes: int, dd: dict) -> nn.Module:
        return nn.Linear(self.embed_dim, num_classes, **dd) if num_classes > 0 else nn.Identity()

    def _init_aux_head(self) -> None:
        if isinstance(self.aux_head, nn.Linear):  # as timm inits ``head`` (and the public code both heads)
            trunc_normal_(self.aux_head.weight, std=0.02)
            nn.init.zeros_(self.aux_head.bias)

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        """Reset ``head`` (timm's rules) and ``aux_head`` alike; ``num_classes=0`` makes both identities."""
        super().reset_classifier(num_classes, global_pool)
        self.aux_head = self._new_aux_head(num_classes, get_device_dtype(self))
        self._init_aux_head()
        self.aux_head.train(self.training)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """timm's head on the class token; in eval mode with ``head_rule='cls+aux'`` (and classifiers present)
        the public code's inference rule, :func:`shared_core.token_labeling.inference_logits`. In training the
        class logits alone (as the public model, which returns the aux logits separately there): the method
        (:class:`timm_plugin.TokenLabelingTask`) reads the aux head itself."""
        out = super().forward_head(x, pre_logits=pre_logits)
        if pre_logits or self.training or self.head_rule == 'cls' or not isinstance(self.aux_head, nn.Linear):
            return out
        return inference_logits(out, self.aux_head(x[:, self.num_prefix_tokens :]), self.head_rule)


def checkpoint_filter_fn(state_dict: dict, model: LVViT) -> dict:
    """A state dict (timm, ``tokenaug-train``, public LV-ViT: the same keys) for ``model``: unwraps
    ``model`` / ``state_dict`` entries, strips ``module.`` and resamples ``pos_embed`` to the model's grid
    (a square source grid is assumed, as the public code and timm do)."""
    state_dict = state_dict.get('model', state_dict)
    state_dict = state_dict.get('state_dict', state_dict)
    out = {}
    for k, v in state_dict.items():
        k = k[len('module.') :] if k.startswith('module.') else k
        if k == 'pos_embed' and v.shape != model.pos_embed.shape:
            v = resample_abs_pos_embed(v, new_size=model.patch_embed.grid_size, num_prefix_tokens=1, verbose=True)
        out[k] = v
    return out


def _create_lvvit(variant: str, pretrained: bool = False, **kwargs) -> LVViT:
    out_indices = kwargs.pop('out_indices', 3)
    return build_model_with_cfg(
        LVViT,
        variant,
        pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(out_indices=out_indices, feature_cls='getter'),
        **kwargs,
    )


def _cfg(**kwargs) -> dict:
    return {
        'url': '',
        'num_classes': 1000,
        'input_size': (3, 224, 224),
        'pool_size': None,
        'crop_pct': 0.9,
        'interpolation': 'bicubic',
        'fixed_input_size': True,
        'mean': IMAGENET_DEFAULT_MEAN,
        'std': IMAGENET_DEFAULT_STD,
        'first_conv': 'patch_embed.conv1',
        'classifier': ('head', 'aux_head'),
        'paper_ids': 'arXiv:2104.10858',
        'paper_name': 'All Tokens Matter: Token Labeling for Training Better Vision Transformers',
        'origin_url': 'https://github.com/zihangJiang/TokenLabeling',
        'license': 'apache-2.0',
        **kwargs,
    }


default_cfgs = generate_default_cfgs(
    {
        'lvvit_t': _cfg(),
        'lvvit_s': _cfg(),
        'lvvit_m': _cfg(crop_pct=1.0),
        'lvvit_l': _cfg(input_size=(3, 288, 288), crop_pct=1.0),
    }
)


@register_model
def lvvit_t(pretrained: bool = False, **kwargs) -> LVViT:
    """LV-ViT-T: 12 blocks, dim 240, 4 heads, MLP ratio 3 (Table 1: 8.5M)."""
    args = dict(embed_dim=240, depth=12, num_heads=4, mlp_ratio=3.0, skip_lam=1.0)  # the public lvvit_t: 1.0
    return _create_lvvit('lvvit_t', pretrained=pretrained, **dict(args, **kwargs))


@register_model
def lvvit_s(pretrained: bool = False, **kwargs) -> LVViT:
    """LV-ViT-S: 16 blocks, dim 384, 6 heads, MLP ratio 3 (Table 1: 26M)."""
    args = dict(embed_dim=384, depth=16, num_heads=6, mlp_ratio=3.0, skip_lam=2.0)
    return _create_lvvit('lvvit_s', pretrained=pretrained, **dict(args, **kwargs))


@register_model
def lvvit_m(pretrained: bool = False, **kwargs) -> LVViT:
    """LV-ViT-M: 20 blocks, dim 512, 8 heads, MLP ratio 3 (Table 1: 56M)."""
    args = dict(embed_dim=512, depth=20, num_heads=8, mlp_ratio=3.0, skip_lam=2.0)
    return _create_lvvit('lvvit_m', pretrained=pretrained, **dict(args, **kwargs))


@register_model
def lvvit_l(pretrained: bool = False, **kwargs) -> LVViT:
    """LV-ViT-L: 24 blocks, dim 768, 12 heads, MLP ratio 3, 128-channel stem, 288 px (Table 1: 150M); residual
    scale 1/3 (supplement Table 4's other setting), as the public code's ``lvvit_l``."""
    args = dict(img_size=288, embed_dim=768, depth=24, num_heads=12, mlp_ratio=3.0, skip_lam=3.0, stem_chans=128)
    return _create_lvvit('lvvit_l', pretrained=pretrained, **dict(args, **kwargs))
