"""Compact Convolutional Transformers (CCT; Hassani et al., "Escaping the Big Data Paradigm with Compact
Transformers") as timm models: TokenMixup's CIFAR model (the TokenMixup paper, Table 1: CCT-7/3x1, 3.78M parameters).
timm has no CCT; ``import timm_plugin`` registers ``cct_7_3x1_32`` (100 classes, the CIFAR-100 model) and
``cct_7_3x1_32_sine`` (10 classes, the CIFAR-10 model). Both have a *learnable* positional embedding, as the public
code trained them: its ``_cct()`` takes ``positional_embedding`` and never passes it on, so the public ``_sine``
models learn theirs too (the paper's CIFAR-10 rows and the released checkpoints are that model).
``positional='sine'`` gives CCT's fixed sinusoid (a buffer: 65,536 parameters fewer).

- Tokenizer: one 3x3 convolution (stride 1, padding 1, no bias) to the embedding width, ReLU, 3x3 max pooling
  (stride 2, padding 1): a 32 px image becomes 16x16 = 256 tokens (token stride 2).
- 7 pre-norm transformer blocks, 4 heads, embedding 256, MLP ratio 2, attention dropout 0.1, stochastic depth
  0.1, no class token. Every LayerNorm has torch's eps 1e-5, as the public code's ``nn.LayerNorm`` (timm's
  ``Block`` defaults to 1e-6). CCT renormalises the residual stream after the attention residual
  (``x = norm1(x + attn(pre_norm(x)))``, then ``x + mlp(x)``): :class:`CCTBlock` is a timm ``Block`` whose
  ``norm1`` is that pre-norm and ``norm2`` the stream's norm.
- SeqPool: ``softmax(Linear(D, 1)(x))ᵀ x`` over the tokens after the final norm, then the linear head.
"""

from __future__ import annotations

import logging
import math
import re
from functools import partial
from typing import Optional

import torch
import torch.nn as nn
from timm.layers import trunc_normal_
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models.vision_transformer import Block

from shared_core.state_dict_maps import fuse_qkv

__all__ = ['CCT', 'CCTBlock', 'ConvTokenizer', 'checkpoint_filter_fn']

_logger = logging.getLogger(__name__)

#: the public CCT's LayerNorm (``torch.nn.LayerNorm``'s default eps), in the blocks and the final norm
LAYER_NORM_EPS = 1e-5
CIFAR_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR_STD = (0.2673, 0.2564, 0.2762)


class ConvTokenizer(nn.Module):
    """``n`` (conv 3x3 → ReLU → max pool 3/2) stages; ``token_stride`` is the pixels per token."""

    def __init__(
        self, in_chans: int = 3, embed_dim: int = 256, kernel_size: int = 3, num_layers: int = 1, hidden_dim: int = 64
    ):
        super().__init__()
        dims = [in_chans] + [hidden_dim] * (num_layers - 1) + [embed_dim]
        layers = []
        for i in range(num_layers):
            layers += [
                nn.Conv2d(dims[i], dims[i + 1], kernel_size, stride=1, padding=kernel_size // 2, bias=False),
                nn.ReLU(),
                nn.MaxPool2d(3, stride=2, padding=1),
            ]
        self.proj = nn.Sequential(*layers)
        self.token_stride = (2**num_layers, 2**num_layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class CCTBlock(Block):
    """timm's ``Block`` with CCT's order: ``x = norm2(x + attn(norm1(x)))``, then ``x + mlp(x)``."""

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), attn_mask=attn_mask)))
        x = self.norm2(x)  # CCT renormalises the residual stream
        return x + self.drop_path2(self.ls2(self.mlp(x)))


def sinusoidal_embedding(num_tokens: int, dim: int) -> torch.Tensor:
    """CCT's fixed sine positional embedding ``(1, N, D)``."""
    pe = torch.tensor([[p / (10000 ** (2 * (i // 2) / dim)) for i in range(dim)] for p in range(num_tokens)])
    pe[:, 0::2] = torch.sin(pe[:, 0::2])
    pe[:, 1::2] = torch.cos(pe[:, 1::2])
    return pe.unsqueeze(0)


class CCT(nn.Module):
    """CCT classifier (module docstring). timm conventions: ``patch_embed`` (with ``token_stride``), ``blocks``,
    ``norm``, ``forward_features`` / ``forward_head`` / ``head``, ``num_prefix_tokens = 0``."""

    def __init__(
        self,
        img_size: int = 32,
        in_chans: int = 3,
        num_classes: int = 100,
        embed_dim: int = 256,
        depth: int = 7,
        num_heads: int = 4,
        mlp_ratio: float = 2.0,
        kernel_size: int = 3,
        num_conv_layers: int = 1,
        positional: str = 'learnable',
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.1,
        drop_path_rate: float = 0.1,
        **kwargs,
    ):
        super().__init__()
        kwargs.pop('pretrained_cfg', None), kwargs.pop('pretrained_cfg_overlay', None)
        if kwargs:
            raise ValueError(f'CCT: unknown arguments {sorted(kwargs)}')
        if positional not in ('learnable', 'sine'):
            raise ValueError(f"positional: expected 'learnable' or 'sine', got {positional!r}")
        self.num_classes, self.embed_dim, self.num_features = num_classes, embed_dim, embed_dim
        self.num_prefix_tokens, self.cls_token, self.global_pool = 0, None, 'seqpool'
        self.patch_embed = ConvTokenizer(in_chans, embed_dim, kernel_size, num_conv_layers)
        side = img_size // self.patch_embed.token_stride[0]
        num_tokens = side * side
        if positional == 'learnable':
            self.pos_embed = nn.Parameter(torch.zeros(1, num_tokens, embed_dim))
            trunc_normal_(self.pos_embed, std=0.2)
        else:
            self.register_buffer('pos_embed', sinusoidal_embedding(num_tokens, embed_dim), persistent=False)
        self.pos_drop = nn.Dropout(drop_rate)
        dpr = [x.item() for x in torch.linspace(0, drop_path_rate, depth, device='cpu')]  # (a meta build too)
        self.blocks = nn.Sequential(
            *[
                CCTBlock(
                    embed_dim,
                    num_heads,
                    mlp_ratio,
                    qkv_bias=False,
                    proj_drop=drop_rate,
                    attn_drop=attn_drop_rate,
                    drop_path=dpr[i],
                    norm_layer=partial(nn.LayerNorm, eps=LAYER_NORM_EPS),
                )
                for i in range(depth)
            ]
        )
        self.norm = nn.LayerNorm(embed_dim, eps=LAYER_NORM_EPS)
        self.attention_pool = nn.Linear(embed_dim, 1)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.grad_checkpointing = False
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight)

    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        self.num_classes = num_classes
        self.head = nn.Linear(self.embed_dim, num_classes) if num_classes > 0 else nn.Identity()

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        if x.shape[1] != self.pos_embed.shape[1]:
            raise ValueError(
                f'x: {x.shape[1]} tokens for a positional embedding of {self.pos_embed.shape[1]} '
                f'(img_size {int(math.sqrt(self.pos_embed.shape[1])) * self.patch_embed.token_stride[0]})'
            )
        x = self.pos_drop(x + self.pos_embed)
        return self.norm(self.blocks(x))

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = (self.attention_pool(x).softmax(1).transpose(1, 2) @ x).squeeze(1)  # SeqPool
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def _cfg(**kwargs) -> dict:
    return {
        'url': '',
        'num_classes': 100,
        'input_size': (3, 32, 32),
        'pool_size': None,
        'crop_pct': 1.0,
        'interpolation': 'bicubic',
        'fixed_input_size': True,
        'mean': CIFAR_MEAN,
        'std': CIFAR_STD,
        'first_conv': 'patch_embed.proj.0',
        'classifier': 'head',
        'paper_ids': 'arXiv:2104.05704',
        'paper_name': 'Escaping the Big Data Paradigm with Compact Transformers',
        'origin_url': 'https://github.com/SHI-Labs/Compact-Transformers',
        **kwargs,
    }


default_cfgs = generate_default_cfgs({'cct_7_3x1_32': _cfg(), 'cct_7_3x1_32_sine': _cfg(num_classes=10)})


#: the public CCT's (SHI-Labs, and mlvlab's TokenMixup copy) state-dict names -> ours, as regular expressions
_PUBLIC_NAMES = (
    (r'^tokenizer\.conv_layers\.0\.0\.', 'patch_embed.proj.0.'),
    (r'^classifier\.positional_emb$', 'pos_embed'),
    (r'^classifier\.(attention_pool|norm)\.', r'\1.'),
    (r'^classifier\.fc\.', 'head.'),
    (r'^classifier\.blocks\.(\d+)\.pre_norm\.', r'blocks.\1.norm1.'),
    (r'^classifier\.blocks\.(\d+)\.self_attn\.', r'blocks.\1.attn.'),
    (r'^classifier\.blocks\.(\d+)\.norm1\.', r'blocks.\1.norm2.'),
    (r'^classifier\.blocks\.(\d+)\.linear1\.', r'blocks.\1.mlp.fc1.'),
    (r'^classifier\.blocks\.(\d+)\.linear2\.', r'blocks.\1.mlp.fc2.'),
    # TokenMixup's ScoreNet of an HTM block (attention pooling, then a linear layer): ours is tokenmixup_scorenet
    (r'^classifier\.blocks\.(\d+)\.small_h_attention_pool\.', r'tokenmixup_scorenet.\1.attn.'),
    (r'^classifier\.blocks\.(\d+)\.small_h_fc\.', r'tokenmixup_scorenet.\1.fc.'),
)


def checkpoint_filter_fn(state_dict: dict, model: nn.Module) -> dict:
    """A checkpoint of the public CCT code (``{'state_dict': ...}`` or the bare state dict, SHI-Labs' names or
    mlvlab TokenMixup's) in our names, so that ``timm.create_model('cct_7_3x1_32', pretrained=True,
    pretrained_cfg_overlay=dict(file=PATH))`` (``tokenaug-train --pretrained-path PATH``) loads it; our own
    checkpoints pass unchanged. A fixed sinusoid (``positional='sine'``) has no ``pos_embed`` to load: a public
    ``positional_emb`` is dropped for it. TokenMixup's ScoreNets become ``tokenmixup_scorenet.*``: they load into a
    model that has them (``attach_scorenets`` first); for a plain model (evaluation) they are dropped, with a log
    line naming them."""
    state_dict = state_dict.get('state_dict', state_dict)
    out = {}
    for key, value in state_dict.items():
        key = key[7:] if key.startswith('module.') else key
        for pattern, repl in _PUBLIC_NAMES:
            new = re.sub(pattern, repl, key)
            if new != key:
                key = new
                break
        out[key] = value
    out = fuse_qkv(out)  # a VTM block's Attention_Vertical saves query / key / value (mlvlab TokenMixup)
    if 'pos_embed' in out and not isinstance(getattr(model, 'pos_embed', None), nn.Parameter):
        del out['pos_embed']  # the model's fixed sinusoid is a buffer, not saved
    if getattr(model, 'tokenmixup_scorenet', None) is None:  # training-only: a plain model (evaluation) has none
        dropped = sorted({'.'.join(k.split('.')[:2]) for k in out if k.startswith('tokenmixup_scorenet.')})
        if dropped:
            out = {k: v for k, v in out.items() if not k.startswith('tokenmixup_scorenet.')}
            _logger.info(
                f'CCT checkpoint: dropped the training-only TokenMixup ScoreNet(s) {", ".join(dropped)} '
                '(attach_scorenets first to load them)'
            )
    return out


def _create(variant: str, pretrained: bool = False, **kwargs) -> CCT:
    return build_model_with_cfg(
        CCT,
        variant,
        pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(flatten_sequential=True),
        **kwargs,
    )


@register_model
def cct_7_3x1_32(pretrained: bool = False, **kwargs) -> CCT:
    """CCT-7/3x1 for 32 px (CIFAR-100 in TokenMixup): 7 blocks, dim 256, 4 heads, MLP ratio 2, learnable positions."""
    args = dict(img_size=32, embed_dim=256, depth=7, num_heads=4, mlp_ratio=2.0, kernel_size=3, num_conv_layers=1)
    return _create('cct_7_3x1_32', pretrained=pretrained, **dict(args, **kwargs))


@register_model
def cct_7_3x1_32_sine(pretrained: bool = False, **kwargs) -> CCT:
    """CCT-7/3x1 for 32 px, 10 classes (CIFAR-10 in TokenMixup), as the public code builds it under this name: a
    *learnable* positional embedding (the module docstring says why); ``positional='sine'`` for the fixed
    sinusoid the name promises."""
    args = dict(
        img_size=32,
        embed_dim=256,
        depth=7,
        num_heads=4,
        mlp_ratio=2.0,
        kernel_size=3,
        num_conv_layers=1,
        positional='learnable',
    )
    return _create('cct_7_3x1_32_sine', pretrained=pretrained, **dict(args, **kwargs))
