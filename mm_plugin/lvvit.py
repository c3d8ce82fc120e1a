"""LV-ViT as an MMSegmentation backbone (``type='LVViT'``, registered in mmseg's ``MODELS`` by ``import mm_plugin``).

The Token Labeling paper (Sec. 4.4, Table 7) transfers LV-ViT to ADE20K with
FCN and UperNet heads. The backbone is the timm model of :mod:`timm_plugin.lvvit` without its heads: the
same modules (:class:`~timm_plugin.lvvit.ConvPatchEmbed`, :class:`~timm_plugin.lvvit.LVBlock`) under the
same key names (``patch_embed.conv1 ... proj``, ``cls_token``, ``pos_embed``, ``blocks.{i}``, ``norm``),
so a timm / ``tokenaug-train`` checkpoint needs no renaming, only its heads dropped
(``tokenaug-convert --model lvvit_s --to mmseg``).

Like mmseg's ``VisionTransformer``: ``out_indices`` picks blocks whose patch tokens are returned as
``(B, C, H/16, W/16)`` maps, ``final_norm`` applies the final LayerNorm after the last block, the
position embedding is resampled when the input grid differs from ``img_size``'s (timm's
``resample_abs_pos_embed``, as timm's ViT with ``dynamic_img_size``), and
``init_cfg=dict(type='Pretrained', checkpoint=...)`` loads bare backbone keys (``state_dict`` entry or the
whole file), resampling ``pos_embed`` from the checkpoint's square grid, with ``strict=False`` and a
logged list of unexpected / missing keys (mmengine's ``load_state_dict``).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Sequence, Tuple, Union

import torch
import torch.nn as nn
from mmengine.model import BaseModule
from mmengine.runner.checkpoint import CheckpointLoader, load_state_dict
from mmseg.registry import MODELS
from timm.layers import LayerNorm, calculate_drop_path_rates, resample_abs_pos_embed, to_2tuple, trunc_normal_

__all__ = ['LVViT', 'ARCHS']

#: paper Table 1 (and the public code's stems); ``arch`` may also be a dict with these keys
ARCHS = {
    't': dict(embed_dims=240, num_layers=12, num_heads=4, stem_channels=64, skip_lam=1.0),  # as timm lvvit_t
    's': dict(embed_dims=384, num_layers=16, num_heads=6, stem_channels=64),
    'm': dict(embed_dims=512, num_layers=20, num_heads=8, stem_channels=64),
    'l': dict(embed_dims=768, num_layers=24, num_heads=12, stem_channels=128, skip_lam=3.0),  # as timm lvvit_l
}
_ARCH_DEFAULTS = dict(mlp_ratio=3.0, qkv_bias=False, skip_lam=2.0, stem_channels=64, norm_eps=1e-5)


def _resolve_arch(arch: Union[str, dict]) -> dict:
    if isinstance(arch, str):
        if arch.lower() not in ARCHS:
            raise ValueError(f'arch: expected one of {sorted(ARCHS)} or a dict, got {arch!r}')
        arch = ARCHS[arch.lower()]
    need = {'embed_dims', 'num_layers', 'num_heads'}
    if not isinstance(arch, dict) or not need <= set(arch):
        raise ValueError(f'arch: a dict needs {sorted(need)}, got {arch!r}')
    unknown = set(arch) - need - set(_ARCH_DEFAULTS)
    if unknown:
        raise ValueError(f'arch: unknown keys {sorted(unknown)} (known: {sorted(need | set(_ARCH_DEFAULTS))})')
    return dict(_ARCH_DEFAULTS, **arch)


@MODELS.register_module()
class LVViT(BaseModule):
    """LV-ViT backbone for mmseg: multi-level ``(B, C, H/16, W/16)`` features from chosen blocks.

    Args:
        arch: ``'t'``, ``'s'``, ``'m'``, ``'l'`` (paper Table 1) or a dict with ``embed_dims``,
            ``num_layers``, ``num_heads`` and optionally ``mlp_ratio`` (3), ``qkv_bias`` (False),
            ``skip_lam`` (2), ``stem_channels`` (64), ``norm_eps`` (1e-5).
        img_size: the size the position embedding is built for (checkpoints are resampled to it at load;
            other input sizes resample it on the fly).
        patch_size: token stride in pixels (16); the stem halves the image, ``proj`` steps half of it.
        in_channels: image channels.
        out_indices: blocks whose outputs are returned (``-1``: the last).
        drop_rate / attn_drop_rate / drop_path_rate: dropout after the position embedding, attention
            dropout, stochastic depth (linear over the blocks, as timm).
        final_norm: apply the final LayerNorm to the last block's output.
        norm_eval: keep the stem's BatchNorms in eval mode (frozen statistics) while training.
        pretrained: deprecated alias of ``init_cfg=dict(type='Pretrained', checkpoint=pretrained)``.
        init_cfg: ``dict(type='Pretrained', checkpoint=PATH)`` for a ``tokenaug-convert`` output.
    """

    def __init__(
        self,
        arch: Union[str, dict] = 's',
        img_size: Union[int, Tuple[int, int]] = 224,
        patch_size: int = 16,
        in_channels: int = 3,
        out_indices: Union[int, Sequence[int]] = -1,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        final_norm: bool = False,
        norm_eval: bool = False,
        pretrained: str = None,
        init_cfg=None,
    ):
        if pretrained is not None:
            if init_cfg is not None:
                raise ValueError('pretrained: give either pretrained or init_cfg, not both')
            init_cfg = dict(type='Pretrained', checkpoint=pretrained)
        super().__init__(init_cfg=init_cfg)
        self.arch = _resolve_arch(arch)
        dims, depth = self.arch['embed_dims'], self.arch['num_layers']
        self.img_size = to_2tuple(img_size)
        self.embed_dims = dims
        self.out_indices = self._out_indices(out_indices, depth)
        self.final_norm = final_norm
        self.norm_eval = norm_eval
        # any size: mmseg pads to the crop, slide / whole inference may not; pad to the token stride as mmseg's ViT
        # the timm modules, imported when an LV-ViT is built: `import mm_plugin` does not load timm_plugin
        from timm_plugin.lvvit import ConvPatchEmbed, LVBlock

        self.patch_embed = ConvPatchEmbed(
            img_size=self.img_size,
            patch_size=patch_size,
            in_chans=in_channels,
            embed_dim=dims,
            stem_chans=self.arch['stem_channels'],
            strict_img_size=False,
            dynamic_img_pad=True,
        )
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dims))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.num_patches + 1, dims))
        self.drop_after_pos = nn.Dropout(p=drop_rate)
        norm_layer = partial(LayerNorm, eps=self.arch['norm_eps'])
        dpr = calculate_drop_path_rates(drop_path_rate, depth)
        self.blocks = nn.Sequential(
            *[
                LVBlock(
                    dim=dims,
                    num_heads=self.arch['num_heads'],
                    mlp_ratio=self.arch['mlp_ratio'],
                    qkv_bias=self.arch['qkv_bias'],
                    attn_drop=attn_drop_rate,
                    drop_path=dpr[i],
                    norm_layer=norm_layer,
                    skip_lam=self.arch['skip_lam'],
                )
                for i in range(depth)
            ]
        )
        self.norm = norm_layer(dims) if final_norm else None

    @staticmethod
    def _out_indices(out_indices, depth: int) -> Tuple[int, ...]:
        idx = (out_indices,) if isinstance(out_indices, int) else tuple(out_indices)
        bad = [i for i in idx if not -depth <= i < depth]
        if not idx or bad:
            raise ValueError(f'out_indices: block indices in [-{depth}, {depth}) expected, got {out_indices}')
        return tuple(sorted({i % depth for i in idx}))

    # -- weights --------------------------------------------------------------------------------------

    def init_weights(self):
        """``Pretrained``: load bare backbone keys (``pos_embed`` resampled), else timm's ViT init."""
        if isinstance(self.init_cfg, dict) and self.init_cfg.get('type') == 'Pretrained':
            ckpt = CheckpointLoader.load_checkpoint(self.init_cfg['checkpoint'], logger=None, map_location='cpu')
            state_dict = dict(ckpt.get('state_dict', ckpt))
            if 'pos_embed' in state_dict:
                state_dict['pos_embed'] = self._fit_pos_embed(state_dict['pos_embed'])
            load_state_dict(self, state_dict, strict=False, logger=None)  # mmseg's ViT does the same
        elif self.init_cfg is not None:
            super().init_weights()
        else:
            trunc_normal_(self.pos_embed, std=0.02)
            nn.init.normal_(self.cls_token, std=1e-6)
            for m in self.modules():
                if isinstance(m, nn.Linear):
                    trunc_normal_(m.weight, std=0.02)
                    if m.bias is not None:
                        nn.init.zeros_(m.bias)

    def _fit_pos_embed(self, pos_embed: torch.Tensor) -> torch.Tensor:
        if pos_embed.shape == self.pos_embed.shape:
            return pos_embed
        side = math.isqrt(pos_embed.shape[1] - 1)
        if pos_embed.ndim != 3 or side * side != pos_embed.shape[1] - 1 or pos_embed.shape[2] != self.embed_dims:
            raise ValueError(
                f'init_cfg: pos_embed of shape {tuple(pos_embed.shape)} is not a class token plus a '
                f'square grid of {self.embed_dims}-d embeddings'
            )
        return resample_abs_pos_embed(
            pos_embed, new_size=self.patch_embed.grid_size, old_size=(side, side), num_prefix_tokens=1, verbose=True
        )

    def train(self, mode: bool = True):
        super().train(mode)
        if mode and self.norm_eval:
            for m in self.patch_embed.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.eval()
        return self

    # -- forward --------------------------------------------------------------------------------------

    def _pos_embed(self, x: torch.Tensor, grid: Tuple[int, int]) -> torch.Tensor:
        pos = self.pos_embed
        if tuple(grid) != tuple(self.patch_embed.grid_size):
            pos = resample_abs_pos_embed(pos, new_size=grid, old_size=self.patch_embed.grid_size, num_prefix_tokens=1)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.drop_after_pos(x + pos)

    def forward(self, inputs: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        B = inputs.shape[0]
        grid = self.patch_embed.dynamic_feat_size(inputs.shape[-2:])
        x = self._pos_embed(self.patch_embed(inputs), grid)
        outs = []
        last = len(self.blocks) - 1
        for i, blk in enumerate(self.blocks):
            x = blk(x)
            if i == last and self.norm is not None:
                x = self.norm(x)
            if i in self.out_indices:
                outs.append(x[:, 1:].reshape(B, grid[0], grid[1], -1).permute(0, 3, 1, 2).contiguous())
        return tuple(outs)
