"""``tokenaug-convert``: a pretrained classification checkpoint -> the backbone checkpoint mmseg / mmdet load.

Usage::

    tokenaug-convert --src CKPT --dst OUT --to {mmseg,mmdet} --model TIMM_MODEL_NAME
                     [--from {timm,mmpretrain}] [--model-kwargs img_size=112 ...]
                     [--use-ema] [--final-norm] [--force]
    tokenaug-convert --src MMPRETRAIN_CKPT --dst OUT --to timm --from mmpretrain
                     --model TIMM_MODEL_NAME [--plain]

``--to timm``: an mmpretrain classifier (ViT/DeiT with mmpretrain's ``VisionTransformer``, LV-ViT through
``TIMMBackbone``; its classifier, token labeling's aux head and TokenMixup's ScoreNets kept) as the timm model's
checkpoint ``{'state_dict': ...}``, loaded strictly into ``--model`` before it is written: what the timm entry
points (``tokenaug-train --initial-checkpoint``, ``tokenaug-maps generate --checkpoint``, ``tokenaug-occlusion``,
``tokenaug-viz``) read; they attach the aux head and the ScoreNets before loading. ``--from tokenmixup --to timm``:
the ViT-B/16 checkpoints of mlvlab/TokenMixup (a bare state dict in jeonsworld/ViT-pytorch's names; its HTM
ScoreNet kept as ``tokenmixup_scorenet.L``), likewise. ``--plain`` leaves the aux head and the ScoreNets out: the
timm model's own weights, which timm's own loaders (``pretrained_cfg_overlay=dict(file=...)``, timm's
``train.py``) take strictly.

``CKPT`` is a ``tokenaug-train`` checkpoint or a plain timm state dict (``--from timm``), or an
mmpretrain/MMEngine checkpoint (``--from mmpretrain``). ``--model`` names the timm architecture the
weights belong to (its hyper-parameters size the target backbone): a ViT/DeiT, a Swin, or an LV-ViT
(``lvvit_t/s/m/l``, :mod:`timm_plugin.lvvit`; mmseg only, onto :class:`mm_plugin.lvvit.LVViT`; from
mmpretrain: its ``TIMMBackbone``). Training-only parts (classifier, distillation head, aux heads) are
dropped. The output is what the target's standard ``init_cfg=dict(type='Pretrained', checkpoint=OUT)``
reads: ``{'state_dict': ...}`` with bare keys for mmseg (its ViT reads no prefix) and
``backbone.``-prefixed keys for mmdet (its Swin keeps only those).

Verification (every run): the target backbone is built and loaded strictly — zero unexpected keys and
no missing keys except those the source cannot have (Swin's intermediate output norms, derived index
buffers), listed by name — and then built again with ``init_cfg`` pointing at ``OUT`` through the
target's own ``init_weights`` (which loads with ``strict=False``), checking that every converted tensor
arrived. Anything else is an error naming the keys; a wrong checkpoint never "loads" silently.
"""

from __future__ import annotations

import ast
import os
import re
import sys
from typing import Dict, List, Tuple

import torch

from shared_core.checkpoint_io import (
    check_input_file,
    check_output_file,
    load_checkpoint_file,
    remove_stale_temporaries,
    save_checkpoint_file,
)
from shared_core.state_dict_maps import tokenmixup_vit_to_timm
from tokenaug.tool_args import convert_parser

from .convert import mmpretrain_to_timm, to_dense_backbone
from .mmengine_safe_load import allow_mmengine_checkpoints

__all__ = ['convert_checkpoint', 'main', 'build_backbone']


def _timm_arch(model_name: str, model_kwargs: dict) -> Tuple[str, dict]:
    """The architecture kind and the hyper-parameters of a timm model, read off a randomly initialised one."""
    import timm
    from timm.models.swin_transformer import SwinTransformer
    from timm.models.vision_transformer import VisionTransformer

    from timm_plugin.lvvit import LVViT  # also registers lvvit_* with timm

    if not timm.is_model(model_name):
        raise ValueError(
            f'model: {model_name!r} is not a timm model name '
            '(e.g. vit_small_patch16_224, swin_tiny_patch4_window7_224, lvvit_s)'
        )
    try:
        model = timm.create_model(model_name, pretrained=False, **model_kwargs)
    except TypeError as e:
        raise ValueError(f'model-kwargs: timm.create_model({model_name!r}) refused {model_kwargs}: {e}') from None
    if isinstance(model, LVViT):  # before VisionTransformer: it is one
        return 'lvvit', _lvvit_hyper_parameters(model)
    if isinstance(model, SwinTransformer):
        blocks = [stage.blocks for stage in model.layers]
        first = blocks[0][0]
        return 'swin', dict(
            embed_dims=model.embed_dim if isinstance(model.embed_dim, int) else model.embed_dim[0],
            depths=[len(b) for b in blocks],
            num_heads=[b[0].attn.num_heads for b in blocks],
            window_size=int(model._ref_window_sizes[0][0])
            if hasattr(model, '_ref_window_sizes')
            else int(first.window_size[0]),
            patch_size=int(model.patch_embed.patch_size[0]),
            mlp_ratio=first.mlp.fc1.out_features // first.mlp.fc1.in_features,
            pretrain_img_size=tuple(model.patch_embed.img_size),
        )
    if isinstance(model, VisionTransformer):
        if model.num_prefix_tokens != 1 or not model.has_class_token:
            raise ValueError(
                f"model: {model_name} has {model.num_prefix_tokens} prefix tokens; OpenMMLab's ViT "
                f'backbones take exactly one class token'
            )
        blk = model.blocks[0]
        return 'vit', dict(
            img_size=tuple(model.patch_embed.img_size),
            patch_size=int(model.patch_embed.patch_size[0]),
            embed_dims=model.embed_dim,
            num_layers=len(model.blocks),
            num_heads=blk.attn.num_heads,
            mlp_ratio=blk.mlp.fc1.out_features // blk.mlp.fc1.in_features,
            qkv_bias=blk.attn.qkv.bias is not None,
        )
    raise ValueError(f'model: tokenaug-convert maps ViT/DeiT, Swin and LV-ViT; {model_name} is {type(model).__name__}')


def _lvvit_hyper_parameters(model) -> dict:
    """What :class:`mm_plugin.lvvit.LVViT` needs to rebuild this timm LV-ViT's backbone."""
    blk, pe = model.blocks[0], model.patch_embed
    return dict(
        img_size=tuple(pe.img_size),
        patch_size=int(pe.token_stride[0]),
        arch=dict(
            embed_dims=model.embed_dim,
            num_layers=len(model.blocks),
            num_heads=blk.attn.num_heads,
            mlp_ratio=blk.mlp.fc1.out_features / blk.mlp.fc1.in_features,
            qkv_bias=blk.attn.qkv.bias is not None,
            skip_lam=float(blk.skip_lam),
            stem_channels=pe.conv1.out_channels,
            norm_eps=float(model.norm.eps),
        ),
    )


def build_backbone(target: str, arch: str, hp: dict, final_norm: bool = False, init_cfg=None):
    """The mmseg / mmdet backbone for these hyper-parameters (all stages out, as the dense configs use)."""
    if arch == 'lvvit':
        if target != 'mmseg':
            raise ValueError(f'to: LV-ViT backbones are converted for mmseg only, got {target!r}')
        from .lvvit import LVViT

        return LVViT(
            arch=dict(hp['arch']),
            img_size=hp['img_size'],
            patch_size=hp['patch_size'],
            out_indices=(hp['arch']['num_layers'] - 1,),
            final_norm=final_norm,
            drop_path_rate=0.0,
            init_cfg=init_cfg,
        )
    if arch == 'vit':
        if target != 'mmseg':
            raise ValueError('to: ViT backbones are converted for mmseg only (mmdet configs here use Swin)')
        from mmseg.models.backbones import VisionTransformer

        return VisionTransformer(
            img_size=hp['img_size'],
            patch_size=hp['patch_size'],
            embed_dims=hp['embed_dims'],
            num_layers=hp['num_layers'],
            num_heads=hp['num_heads'],
            mlp_ratio=hp['mlp_ratio'],
            qkv_bias=hp['qkv_bias'],
            out_indices=(hp['num_layers'] - 1,),
            patch_bias=True,
            final_norm=final_norm,
            norm_cfg=dict(type='LN', eps=1e-6),
            drop_path_rate=0.0,
            init_cfg=init_cfg,
        )
    if target == 'mmseg':
        from mmseg.models.backbones import SwinTransformer
    elif target == 'mmdet':
        from mmdet.models.backbones import SwinTransformer
    else:
        raise ValueError(f"to: expected 'mmseg' or 'mmdet', got {target!r}")
    n = len(hp['depths'])
    return SwinTransformer(
        pretrain_img_size=hp['pretrain_img_size'],
        embed_dims=hp['embed_dims'],
        patch_size=hp['patch_size'],
        window_size=hp['window_size'],
        mlp_ratio=hp['mlp_ratio'],
        depths=hp['depths'],
        num_heads=hp['num_heads'],
        strides=(hp['patch_size'],) + (2,) * (n - 1),
        out_indices=tuple(range(n)),
        drop_path_rate=0.0,
        init_cfg=init_cfg,
    )


def _load_source(path: str, use_ema: bool) -> Dict[str, torch.Tensor]:
    allow_mmengine_checkpoints()
    ckpt = load_checkpoint_file(path, 'src', mmengine=True)
    if not isinstance(ckpt, dict):
        raise ValueError(f'src: {path} holds a {type(ckpt).__name__}, not a checkpoint dict')
    key = 'state_dict_ema' if use_ema else 'state_dict'
    if use_ema and key not in ckpt:
        raise ValueError(f'src: --use-ema but {path} has no state_dict_ema (keys: {sorted(ckpt)[:8]})')
    sd = ckpt.get(key, ckpt.get('model', ckpt))
    bad = [k for k, v in sd.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise ValueError(f'src: {path}: entries that are not tensors: {bad[:8]}')
    return {re.sub(r'^module\.', '', k): v for k, v in sd.items()}


def _to_timm(
    src: str, dst: str, model: str, source: str, model_kwargs: dict, use_ema: bool, plain: bool = False
) -> dict:
    """An mmpretrain classifier checkpoint as the timm model ``model``'s (classifier, aux head and ScoreNets kept),
    loaded strictly into that model before it is written, and read back through the checkpoint reader: what
    ``tokenaug-train --initial-checkpoint``, ``tokenaug-maps generate --checkpoint``, ``tokenaug-occlusion`` and
    ``tokenaug-viz`` take. ``plain``: the timm model's own weights only (the aux head and ScoreNets dropped, and
    listed in the report), which timm's own loaders take strictly (``pretrained_cfg_overlay=dict(file=...)``,
    timm's ``train.py``)."""
    import timm

    from timm_plugin.token_labeling import attach_aux_head
    from timm_plugin.tokenmixup import attach_scorenets

    if source not in ('mmpretrain', 'tokenmixup'):
        raise ValueError(
            "to: --to timm converts an mmpretrain checkpoint (--from mmpretrain) or TokenMixup's public ViT "
            '(--from tokenmixup); a timm one loads as is'
        )
    if 'num_classes' in model_kwargs:
        raise ValueError("model-kwargs: --to timm takes num_classes from the checkpoint's classifier")
    arch, _ = _timm_arch(model, model_kwargs)
    if source == 'tokenmixup':
        if arch != 'vit':
            raise ValueError(f"model: TokenMixup's public ViT converts onto a timm ViT, not {model} ({arch})")
        sd = tokenmixup_vit_to_timm(_load_source(src, use_ema))
    else:
        sd = mmpretrain_to_timm(_load_source(src, use_ema), arch)
    if 'head.weight' not in sd:
        raise ValueError(f'src: {src} has no classifier (head) to size a timm {model}')
    dropped = []
    if plain:
        dropped = sorted({'.'.join(k.split('.')[: 2 if k.startswith('tokenmixup_scorenet.') else 1]) for k in sd
                          if k.startswith(('aux_head.', 'tokenmixup_scorenet.'))})  # fmt: skip
        sd = {k: v for k, v in sd.items() if not k.startswith(('aux_head.', 'tokenmixup_scorenet.'))}
    net = timm.create_model(model, pretrained=False, num_classes=int(sd['head.weight'].shape[0]), **model_kwargs)
    if any(k.startswith('aux_head.') for k in sd):
        attach_aux_head(net)
    layers = sorted({int(k.split('.')[1]) for k in sd if k.startswith('tokenmixup_scorenet.')})
    if layers:
        attach_scorenets(net, layers)
    try:
        net.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise ValueError(f'src: {src} does not fit timm {model} {model_kwargs}: {e}') from None

    def verify(written: str) -> None:  # read back as every timm entry point reads it: all must arrive
        got = load_checkpoint_file(written, 'dst')['state_dict']
        if set(got) != set(sd) or any(not torch.equal(got[k], v) for k, v in sd.items()):
            raise ValueError(f'dst: {dst} does not read back as written')

    meta = dict(src=str(src), to='timm', model=model, source=source, arch=arch, dropped=dropped)
    save_checkpoint_file({'state_dict': sd, 'meta': {'tokenaug_convert': meta}}, dst, check=verify)
    return dict(
        arch=arch,
        hyper_parameters=model_kwargs,
        converted=len(sd),
        dropped=dropped,
        not_in_source=[],
        derived_from_target=[],
        dst=str(dst),
        prefix='',
    )


def convert_checkpoint(
    src: str,
    dst: str,
    to: str,
    model: str,
    source: str = 'timm',
    model_kwargs=None,
    use_ema: bool = False,
    final_norm: bool = False,
    force: bool = False,
    plain: bool = False,
) -> dict:
    """Convert, verify, write; returns the report (also printed by the CLI). ``plain`` (``--to timm`` only): the
    timm model's own weights, without the aux head and ScoreNets. ``dst`` must not be ``src`` and
    must not exist unless ``force``; it is written to a temporary file, verified from there, then renamed
    into place (a failure leaves no partial file and any old ``dst`` as it was)."""
    check_input_file(src, 'src')
    check_output_file(dst, src, force)
    # what a killed conversion to the same dst left (the write is atomic: a temporary beside dst, then a rename)
    remove_stale_temporaries(os.path.dirname(os.path.abspath(dst)), [os.path.basename(dst)])
    if to == 'timm':
        return _to_timm(src, dst, model, source, dict(model_kwargs or {}), use_ema, plain)
    if plain:
        raise ValueError(f'plain: --plain selects what a --to timm checkpoint keeps; --to {to} keeps the backbone only')
    arch, hp = _timm_arch(model, dict(model_kwargs or {}))
    sd, dropped = to_dense_backbone(_load_source(src, use_ema), arch, source)
    final_norm_prefix = {'vit': 'ln1.', 'lvvit': 'norm.'}.get(arch)
    if final_norm_prefix and not final_norm:
        norm = [k for k in sd if k.startswith(final_norm_prefix)]
        dropped += [f'{k} (final norm; the target is built with final_norm=False)' for k in norm]
        sd = {k: v for k, v in sd.items() if k not in norm}
    backbone = build_backbone(to, arch, hp, final_norm)
    target = backbone.state_dict()
    unexpected = sorted(set(sd) - set(target))
    shape = sorted(k for k in set(sd) & set(target) if sd[k].shape != target[k].shape and k != 'pos_embed')
    derived = sorted(k for k in set(target) - set(sd) if k.endswith('relative_position_index'))
    out_norms = sorted(k for k in set(target) - set(sd) if re.match(r'^norm\d+\.(weight|bias)$', k))
    missing = sorted(set(target) - set(sd) - set(derived) - set(out_norms))
    if unexpected or missing or shape:
        raise ValueError(
            f'src: {src} does not fit a {to} {arch} backbone for {model}: '
            f'unexpected {unexpected[:10]}, missing {missing[:10]}, wrong shape '
            f'{[(k, tuple(sd[k].shape), tuple(target[k].shape)) for k in shape[:5]]}'
        )
    for k in derived:  # index buffers are functions of the window size: the target's own
        sd[k] = target[k]
    prefix = 'backbone.' if to == 'mmdet' else ''

    def verify(written: str) -> None:  # through the target's own loader (strict=False there): all must arrive
        from mmengine.config import ConfigDict  # mmdet's Swin reads init_cfg by attribute

        loaded = build_backbone(to, arch, hp, final_norm, init_cfg=ConfigDict(type='Pretrained', checkpoint=written))
        loaded.init_weights()
        got = loaded.state_dict()
        stale = sorted(k for k, v in sd.items() if k in got and got[k].shape == v.shape and not torch.equal(got[k], v))
        if stale:
            raise ValueError(f"dst: {to}'s init_weights did not load {len(stale)} tensors from {dst}: {stale[:10]}")

    save_checkpoint_file(
        {
            'state_dict': {prefix + k: v.contiguous() for k, v in sd.items()},
            'meta': {
                'tokenaug_convert': dict(
                    src=str(src), to=to, model=model, source=source, arch=arch, dropped=dropped, not_in_source=out_norms
                )
            },
        },
        dst,
        check=verify,
    )
    return dict(
        arch=arch,
        hyper_parameters=hp,
        converted=len(sd),
        dropped=dropped,
        not_in_source=out_norms,
        derived_from_target=derived,
        dst=str(dst),
        prefix=prefix,
    )


def _kwargs(items: List[str]) -> dict:
    out = {}
    for item in items:
        if '=' not in item:
            raise ValueError(f'model-kwargs: expected K=V, got {item!r}')
        k, v = item.split('=', 1)
        try:
            out[k] = ast.literal_eval(v)  # 112, 0.5, (2, 2, 6, 2), True
        except (ValueError, SyntaxError):
            out[k] = v
    return out


def main(argv=None) -> int:
    args = convert_parser().parse_args(argv)
    try:
        report = convert_checkpoint(
            args.src,
            args.dst,
            args.to,
            args.model,
            args.source,
            _kwargs(args.model_kwargs),
            args.use_ema,
            args.final_norm,
            args.force,
            args.plain,
        )
    except (ValueError, FileNotFoundError) as e:
        print(f'tokenaug-convert: error: {e}', file=sys.stderr)
        return 2
    checked = (
        f'strict load into timm {args.model} and read-back verified'
        if args.to == 'timm'
        else f'strict load and {args.to} init_weights verified'
    )
    print(
        f'tokenaug-convert: {report["arch"]} -> {args.to}: {report["converted"]} tensors written to {report["dst"]}'
        f'{" (keys prefixed backbone.)" if report["prefix"] else ""}; {checked}'
    )
    print(f'  dropped (training-only): {report["dropped"] or "none"}')
    print(f'  not in the source (initialised by the target): {report["not_in_source"] or "none"}')
    print(f'  derived buffers taken from the target: {len(report["derived_from_target"])}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
