"""tokenaug-convert: converted backbones compute the source's features through the targets' own loaders."""

import pytest
import timm
import torch
from mmengine.config import ConfigDict
from mmpretrain.registry import MODELS as PRETRAIN_MODELS

import mm_plugin  # noqa: F401
from mm_plugin.convert_cli import _timm_arch, build_backbone, convert_checkpoint
from tokenaug import commands

from ..helpers.processes import call_main


def _loaded(to, model, dst, final_norm=False, **model_kwargs):
    arch, hp = _timm_arch(model, model_kwargs)
    bb = build_backbone(to, arch, hp, final_norm, init_cfg=ConfigDict(type='Pretrained', checkpoint=str(dst)))
    bb.init_weights()  # the target's own (strict=False) loading path
    bb.eval()
    return bb


def _cli(capsys, src, dst, model, *model_kwargs):
    """``tokenaug-convert --to mmseg`` of ``src`` as ``model`` (``--model-kwargs``), in this process: (exit
    status, stdout, stderr)."""
    argv = ['--src', src, '--dst', dst, '--to', 'mmseg', '--model', model, '--model-kwargs', *model_kwargs]
    return call_main(commands.convert, argv, capsys)


def test_deit_to_mmseg_vit_same_features(tmp_path):
    torch.manual_seed(0)
    src = timm.create_model('deit_tiny_patch16_224', img_size=32, patch_size=8, num_classes=10).eval()
    torch.save({'state_dict': src.state_dict(), 'epoch': 1}, tmp_path / 'src.pth')
    report = convert_checkpoint(
        tmp_path / 'src.pth',
        tmp_path / 'seg.pth',
        'mmseg',
        'deit_tiny_patch16_224',
        model_kwargs=dict(img_size=32, patch_size=8),
        final_norm=True,
    )
    assert report['dropped'] == ['head.bias', 'head.weight'] and report['not_in_source'] == []
    seg = _loaded('mmseg', 'deit_tiny_patch16_224', tmp_path / 'seg.pth', final_norm=True, img_size=32, patch_size=8)
    x = torch.randn(2, 3, 32, 32)
    expected = src.forward_features(x)[:, 1:].transpose(1, 2).reshape(2, 192, 4, 4)
    assert torch.allclose(seg(x)[-1], expected, atol=1e-5)


@pytest.mark.parametrize('to', ['mmseg', 'mmdet'])
def test_swin_t_to_mmseg_and_mmdet_same_features(tmp_path, to):
    """Swin-T: downsample moved from the start of a stage (timm) to the end of the previous one, its 4C
    channels reordered for nn.Unfold. Compared at 448 px, where every stage is larger than the 7x7
    window: at 224 px timm drops the cyclic shift on the 7x7 last stage and mmseg/mmdet keep it, so
    the same weights compute different features there (an upstream difference, not the converter's)."""
    torch.manual_seed(0)
    kw = dict(img_size=448)
    src = timm.create_model('swin_tiny_patch4_window7_224', num_classes=10, **kw).eval()
    torch.save({'state_dict': src.state_dict()}, tmp_path / 'src.pth')
    report = convert_checkpoint(
        tmp_path / 'src.pth', tmp_path / 'dst.pth', to, 'swin_tiny_patch4_window7_224', model_kwargs=kw
    )
    assert report['not_in_source'] == [f'norm{i}.{p}' for i in range(3) for p in ('bias', 'weight')]
    if to == 'mmdet':
        keys = torch.load(tmp_path / 'dst.pth', weights_only=True)['state_dict']
        assert all(k.startswith('backbone.') for k in keys)
    dst = _loaded(to, 'swin_tiny_patch4_window7_224', tmp_path / 'dst.pth', **kw)
    x = torch.randn(1, 3, 448, 448)
    expected = src.forward_features(x).permute(0, 3, 1, 2)
    assert torch.allclose(dst(x)[-1], expected, atol=1e-4)


def test_mmpretrain_vit_to_mmseg(tmp_path):
    torch.manual_seed(0)
    cls = PRETRAIN_MODELS.build(
        dict(
            type='ImageClassifier',
            backbone=dict(type='VisionTransformer', arch='deit-tiny', img_size=32, patch_size=8, out_type='featmap'),
            neck=None,
            head=dict(type='LinearClsHead', num_classes=10, in_channels=192),
        )
    ).eval()
    torch.save(
        {'state_dict': cls.state_dict(), 'meta': {'epoch': 1, 'dataset_meta': {'classes': ('a', 'b')}}},
        tmp_path / 'mmpretrain.pth',
    )
    convert_checkpoint(
        tmp_path / 'mmpretrain.pth',
        tmp_path / 'seg.pth',
        'mmseg',
        'deit_tiny_patch16_224',
        source='mmpretrain',
        model_kwargs=dict(img_size=32, patch_size=8),
        final_norm=True,
    )
    seg = _loaded('mmseg', 'deit_tiny_patch16_224', tmp_path / 'seg.pth', final_norm=True, img_size=32, patch_size=8)
    x = torch.randn(2, 3, 32, 32)
    assert torch.allclose(seg(x)[-1], cls.backbone(x)[-1], atol=1e-5)


def test_wrong_checkpoints_are_refused_with_the_keys_named(tmp_path, capsys):
    torch.manual_seed(0)
    vit = timm.create_model('deit_tiny_patch16_224', img_size=32, patch_size=8, num_classes=10)
    sd = vit.state_dict()
    truncated = {k: v for k, v in sd.items() if not k.startswith('blocks.11.')}
    torch.save({'state_dict': truncated}, tmp_path / 'truncated.pth')
    with pytest.raises(ValueError, match=r"missing \['layers.11.attn.attn.in_proj_bias'"):
        convert_checkpoint(
            tmp_path / 'truncated.pth',
            tmp_path / 'x.pth',
            'mmseg',
            'deit_tiny_patch16_224',
            model_kwargs=dict(img_size=32, patch_size=8),
        )
    swin = timm.create_model('swin_tiny_patch4_window7_224', num_classes=10)
    torch.save({'state_dict': swin.state_dict()}, tmp_path / 'swin.pth')
    # a Swin checkpoint declared as a DeiT: its keys have no ViT mapping
    with pytest.raises(ValueError, match=r"keys have no mapping: \['patch_embed.norm.weight'"):
        convert_checkpoint(tmp_path / 'swin.pth', tmp_path / 'x.pth', 'mmseg', 'deit_tiny_patch16_224')
    # the CLI: exit code 2 and the reason
    code, out, err = _cli(
        capsys, tmp_path / 'truncated.pth', tmp_path / 'x.pth', 'deit_tiny_patch16_224', 'img_size=32', 'patch_size=8'
    )
    assert code == 2 and 'does not fit a mmseg vit backbone' in err
    assert not (tmp_path / 'x.pth').exists()


def test_cli_report(tmp_path, capsys):
    torch.manual_seed(0)
    vit = timm.create_model('deit_tiny_patch16_224', img_size=32, patch_size=8, num_classes=10)
    torch.save({'state_dict': vit.state_dict()}, tmp_path / 'src.pth')
    code, out, err = _cli(
        capsys, tmp_path / 'src.pth', tmp_path / 'o.pth', 'deit_tiny_patch16_224', 'img_size=32', 'patch_size=8'
    )
    assert code == 0, err[-2000:]
    assert 'strict load and mmseg init_weights verified' in out
    assert "dropped (training-only): ['head.bias', 'head.weight', 'ln1.weight (final norm" in out


def test_mmpretrain_swin_to_mmdet_same_features(tmp_path):
    """An mmpretrain Swin checkpoint (merging already at the end of a stage) onto mmdet's Swin."""
    torch.manual_seed(0)
    cls = PRETRAIN_MODELS.build(
        dict(
            type='ImageClassifier',
            neck=dict(type='GlobalAveragePooling'),
            backbone=dict(
                type='SwinTransformer',
                arch=dict(embed_dims=32, depths=[2, 2, 2, 2], num_heads=[1, 2, 4, 8]),
                img_size=448,
                drop_path_rate=0.0,
            ),
            head=dict(type='LinearClsHead', num_classes=10, in_channels=256),
        )
    ).eval()
    torch.save({'state_dict': cls.state_dict(), 'meta': {'epoch': 1}}, tmp_path / 'mmpretrain.pth')
    kw = dict(img_size=448, embed_dim=32, depths=(2, 2, 2, 2), num_heads=(1, 2, 4, 8))
    report = convert_checkpoint(
        tmp_path / 'mmpretrain.pth',
        tmp_path / 'det.pth',
        'mmdet',
        'swin_tiny_patch4_window7_224',
        source='mmpretrain',
        model_kwargs=kw,
    )
    assert report['dropped'] == ['head.fc.bias', 'head.fc.weight']
    det = _loaded('mmdet', 'swin_tiny_patch4_window7_224', tmp_path / 'det.pth', **kw)
    x = torch.randn(1, 3, 448, 448)  # every stage larger than the 7x7 window: both keep the shift
    assert torch.allclose(det(x)[-1], cls.backbone(x)[-1], atol=1e-4)


# ---- LV-ViT (timm_plugin.lvvit) -> mm_plugin's mmseg LVViT --------------------------------------------


def _lvvit_source(tmp_path, num_classes=10, img_size=64):
    """A randomly initialised lvvit_t with non-trivial stem BatchNorm statistics, saved as tokenaug-train does."""
    torch.manual_seed(0)
    src = timm.create_model('lvvit_t', img_size=img_size, num_classes=num_classes).eval()
    g = torch.Generator().manual_seed(1)
    for m in src.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
    torch.save({'state_dict': src.state_dict(), 'epoch': 1}, tmp_path / 'src.pth')
    return src


def _seg_lvvit(dst, out_indices, img_size=64, final_norm=False):
    from mmseg.registry import MODELS as SEG_MODELS

    from mm_plugin.lvvit import LVViT

    bb = SEG_MODELS.build(
        dict(
            type='LVViT',
            arch='t',
            img_size=img_size,
            out_indices=out_indices,
            final_norm=final_norm,
            init_cfg=dict(type='Pretrained', checkpoint=str(dst)),
        )
    )
    assert isinstance(bb, LVViT)
    bb.init_weights()  # the backbone's own (strict=False) loading path, as mmseg's runner calls it
    return bb.eval()


def test_lvvit_to_mmseg_same_features_as_the_timm_blocks(tmp_path):
    src = _lvvit_source(tmp_path)
    report = convert_checkpoint(
        tmp_path / 'src.pth', tmp_path / 'seg.pth', 'mmseg', 'lvvit_t', model_kwargs=dict(img_size=64)
    )
    assert report['arch'] == 'lvvit' and report['not_in_source'] == []
    assert report['dropped'] == [
        'aux_head.bias',
        'aux_head.weight',
        'head.bias',
        'head.weight',
        'norm.weight (final norm; the target is built with final_norm=False)',
        'norm.bias (final norm; the target is built with final_norm=False)',
    ]
    assert report['hyper_parameters']['arch'] == dict(
        embed_dims=240,
        num_layers=12,
        num_heads=4,
        mlp_ratio=3.0,
        qkv_bias=False,
        skip_lam=1.0,  # LV-ViT-T's public residual scale
        stem_channels=64,
        norm_eps=1e-5,
    )
    seg = _seg_lvvit(tmp_path / 'seg.pth', out_indices=(3, 7, 11))
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected = src.forward_intermediates(x, indices=[3, 7, 11], intermediates_only=True)  # (B, C, 4, 4)
        got = seg(x)
    assert len(got) == 3 and all(torch.allclose(g, e, atol=1e-5) for g, e in zip(got, expected))


def test_lvvit_final_norm_and_other_input_sizes(tmp_path):
    """--final-norm keeps ``norm``: the last map is timm's forward_features; at 96 px both resample the
    64 px position embedding the same way (timm's dynamic_img_size vs the mmseg backbone)."""
    src = _lvvit_source(tmp_path)
    report = convert_checkpoint(
        tmp_path / 'src.pth', tmp_path / 'seg.pth', 'mmseg', 'lvvit_t', model_kwargs=dict(img_size=64), final_norm=True
    )
    assert report['dropped'] == ['aux_head.bias', 'aux_head.weight', 'head.bias', 'head.weight']
    seg = _seg_lvvit(tmp_path / 'seg.pth', out_indices=-1, final_norm=True)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.allclose(
            seg(x)[0], src.forward_features(x)[:, 1:].transpose(1, 2).reshape(2, 240, 4, 4), atol=1e-5
        )
        dyn = timm.create_model('lvvit_t', img_size=64, num_classes=10, dynamic_img_size=True).eval()
        dyn.load_state_dict(src.state_dict())
        x = torch.randn(1, 3, 96, 80)
        assert torch.allclose(
            seg(x)[0], dyn.forward_features(x)[:, 1:].transpose(1, 2).reshape(1, 240, 6, 5), atol=1e-5
        )
    # a 512 px segmentation backbone resamples the 64 px (4x4) position embedding at load
    big = _seg_lvvit(tmp_path / 'seg.pth', out_indices=-1, img_size=512, final_norm=True)
    assert big.pos_embed.shape == (1, 1 + 32 * 32, 240)
    assert torch.equal(big.blocks[5].attn.qkv.weight, src.blocks[5].attn.qkv.weight)


def test_mmpretrain_timm_backbone_lvvit_to_mmseg(tmp_path):
    """An mmpretrain ImageClassifier around TIMMBackbone(lvvit_t): ``backbone.timm_model.*`` onto mmseg."""
    torch.manual_seed(0)
    cls = PRETRAIN_MODELS.build(
        dict(
            type='ImageClassifier',
            neck=None,
            head=dict(type='LinearClsHead', num_classes=10, in_channels=240),
            backbone=dict(type='TIMMBackbone', model_name='lvvit_t', img_size=64),
        )
    ).eval()
    torch.save({'state_dict': cls.state_dict(), 'meta': {'epoch': 1}}, tmp_path / 'mmpretrain.pth')
    report = convert_checkpoint(
        tmp_path / 'mmpretrain.pth',
        tmp_path / 'seg.pth',
        'mmseg',
        'lvvit_t',
        source='mmpretrain',
        model_kwargs=dict(img_size=64),
        final_norm=True,
    )
    assert report['dropped'] == ['head.fc.bias', 'head.fc.weight']
    seg = _seg_lvvit(tmp_path / 'seg.pth', out_indices=-1, final_norm=True)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        tokens = cls.backbone(x)[0]  # TIMMBackbone: the normed tokens
        assert torch.allclose(seg(x)[0], tokens[:, 1:].transpose(1, 2).reshape(2, 240, 4, 4), atol=1e-5)


def test_wrong_lvvit_checkpoints_are_refused_with_the_keys_named(tmp_path, capsys):
    torch.manual_seed(0)
    # a DeiT-S state dict declared as lvvit_s: qkv biases unexpected, blocks 12-15 and the stem missing,
    # MLP ratio 4 instead of 3
    torch.save(
        {'state_dict': timm.create_model('deit_small_patch16_224', num_classes=10).state_dict()}, tmp_path / 'deit.pth'
    )
    with pytest.raises(
        ValueError,
        match=r"unexpected \['blocks.0.attn.qkv.bias'.*missing \['blocks.12.attn.proj.bias'"
        r".*wrong shape \[\('blocks.0.mlp.fc1.bias', \(1536,\), \(1152,\)\)",
    ):
        convert_checkpoint(tmp_path / 'deit.pth', tmp_path / 'x.pth', 'mmseg', 'lvvit_s')
    # truncated LV-ViTs: without the last block; without the first stem BatchNorm
    sd = timm.create_model('lvvit_t', img_size=64, num_classes=10).state_dict()
    for cut, missing in (('blocks.11.', 'blocks.11.attn.proj.bias'), ('patch_embed.bn1.', 'patch_embed.bn1.bias')):
        torch.save({'state_dict': {k: v for k, v in sd.items() if not k.startswith(cut)}}, tmp_path / 'truncated.pth')
        with pytest.raises(ValueError, match=rf"unexpected \[\], missing \['{missing}'"):
            convert_checkpoint(
                tmp_path / 'truncated.pth', tmp_path / 'x.pth', 'mmseg', 'lvvit_t', model_kwargs=dict(img_size=64)
            )
    # a Swin declared as LV-ViT: its keys have no LV-ViT mapping
    torch.save(
        {'state_dict': timm.create_model('swin_tiny_patch4_window7_224', num_classes=10).state_dict()},
        tmp_path / 'swin.pth',
    )
    with pytest.raises(ValueError, match=r"keys have no mapping: \['patch_embed.norm.weight'"):
        convert_checkpoint(tmp_path / 'swin.pth', tmp_path / 'x.pth', 'mmseg', 'lvvit_t')
    torch.save({'state_dict': sd}, tmp_path / 'lvvit.pth')
    with pytest.raises(ValueError, match=r'to: LV-ViT backbones are converted for mmseg only'):
        convert_checkpoint(
            tmp_path / 'lvvit.pth', tmp_path / 'x.pth', 'mmdet', 'lvvit_t', model_kwargs=dict(img_size=64)
        )
    assert not (tmp_path / 'x.pth').exists()
    # the CLI: exit code 2 and the reason
    code, out, err = _cli(capsys, tmp_path / 'truncated.pth', tmp_path / 'x.pth', 'lvvit_t', 'img_size=64')
    assert code == 2 and 'does not fit a mmseg lvvit backbone' in err
    assert not (tmp_path / 'x.pth').exists()


def test_tokenmixup_scorenets_are_dropped_and_listed():
    """A TokenMixup checkpoint (timm model or mmpretrain TokenMixupClassifier) carries its ScoreNets; transfer
    drops them by name."""
    from mm_plugin.convert import to_dense_backbone
    from timm_plugin.tokenmixup import attach_scorenets

    model = timm.create_model('vit_tiny_patch16_224', img_size=32, patch_size=8, depth=2, num_classes=4)
    attach_scorenets(model, [1])
    out, dropped = to_dense_backbone(model.state_dict(), 'vit')
    assert {'tokenmixup_scorenet.1.fc.weight', 'tokenmixup_scorenet.1.fc.bias'} <= set(dropped)
    assert not any('scorenet' in k for k in out)
