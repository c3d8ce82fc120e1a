"""tokenaug-convert: converted backbones compute the source's features through the targets' own loaders."""
import subprocess

import pytest
import timm
import torch
from mmengine.config import ConfigDict
from mmpretrain.registry import MODELS as PRETRAIN_MODELS

import mm_plugin  # noqa: F401
from mm_plugin.convert_cli import build_backbone, convert_checkpoint, _timm_arch


def _loaded(to, model, dst, final_norm=False, **model_kwargs):
    arch, hp = _timm_arch(model, model_kwargs)
    bb = build_backbone(to, arch, hp, final_norm, init_cfg=ConfigDict(type='Pretrained', checkpoint=str(dst)))
    bb.init_weights()  # the target's own (strict=False) loading path
    bb.eval()
    return bb


def test_deit_to_mmseg_vit_same_features(tmp_path):
    torch.manual_seed(0)
    src = timm.create_model('deit_tiny_patch16_224', img_size=32, patch_size=8, num_classes=10).eval()
    torch.save({'state_dict': src.state_dict(), 'epoch': 1}, tmp_path / 'src.pth')
    report = convert_checkpoint(tmp_path / 'src.pth', tmp_path / 'seg.pth', 'mmseg', 'deit_tiny_patch16_224',
                                model_kwargs=dict(img_size=32, patch_size=8), final_norm=True)
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
    report = convert_checkpoint(tmp_path / 'src.pth', tmp_path / 'dst.pth', to, 'swin_tiny_patch4_window7_224',
                                model_kwargs=kw)
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
    cls = PRETRAIN_MODELS.build(dict(type='ImageClassifier', backbone=dict(
        type='VisionTransformer', arch='deit-tiny', img_size=32, patch_size=8, out_type='featmap'), neck=None,
        head=dict(type='LinearClsHead', num_classes=10, in_channels=192))).eval()
    torch.save({'state_dict': cls.state_dict(), 'meta': {'epoch': 1, 'dataset_meta': {'classes': ('a', 'b')}}},
               tmp_path / 'mmpretrain.pth')
    convert_checkpoint(tmp_path / 'mmpretrain.pth', tmp_path / 'seg.pth', 'mmseg', 'deit_tiny_patch16_224',
                       source='mmpretrain', model_kwargs=dict(img_size=32, patch_size=8), final_norm=True)
    seg = _loaded('mmseg', 'deit_tiny_patch16_224', tmp_path / 'seg.pth', final_norm=True, img_size=32, patch_size=8)
    x = torch.randn(2, 3, 32, 32)
    assert torch.allclose(seg(x)[-1], cls.backbone(x)[-1], atol=1e-5)


def test_wrong_checkpoints_are_refused_with_the_keys_named(tmp_path, run_env):
    torch.manual_seed(0)
    vit = timm.create_model('deit_tiny_patch16_224', img_size=32, patch_size=8, num_classes=10)
    sd = vit.state_dict()
    truncated = {k: v for k, v in sd.items() if not k.startswith('blocks.11.')}
    torch.save({'state_dict': truncated}, tmp_path / 'truncated.pth')
    with pytest.raises(ValueError, match=r"missing \['layers.11.attn.attn.in_proj_bias'"):
        convert_checkpoint(tmp_path / 'truncated.pth', tmp_path / 'x.pth', 'mmseg', 'deit_tiny_patch16_224',
                           model_kwargs=dict(img_size=32, patch_size=8))
    swin = timm.create_model('swin_tiny_patch4_window7_224', num_classes=10)
    torch.save({'state_dict': swin.state_dict()}, tmp_path / 'swin.pth')
    # a Swin checkpoint declared as a DeiT: its keys have no ViT mapping
    with pytest.raises(ValueError, match=r"keys have no mapping: \['patch_embed.norm.weight'"):
        convert_checkpoint(tmp_path / 'swin.pth', tmp_path / 'x.pth', 'mmseg', 'deit_tiny_patch16_224')
    # the CLI: exit code 2 and the reason
    res = subprocess.run(['tokenaug-convert', '--src', str(tmp_path / 'truncated.pth'), '--dst', str(tmp_path / 'x.pth'),
                          '--to', 'mmseg', '--model', 'deit_tiny_patch16_224', '--model-kwargs', 'img_size=32',
                          'patch_size=8'], env=run_env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and 'does not fit a mmseg vit backbone' in res.stderr
    assert not (tmp_path / 'x.pth').exists()


def test_cli_report(tmp_path, run_env):
    torch.manual_seed(0)
    vit = timm.create_model('deit_tiny_patch16_224', img_size=32, patch_size=8, num_classes=10)
    torch.save({'state_dict': vit.state_dict()}, tmp_path / 'src.pth')
    res = subprocess.run(['tokenaug-convert', '--src', str(tmp_path / 'src.pth'), '--dst', str(tmp_path / 'o.pth'),
                          '--to', 'mmseg', '--model', 'deit_tiny_patch16_224', '--model-kwargs', 'img_size=32',
                          'patch_size=8'], env=run_env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert 'strict load and mmseg init_weights verified' in res.stdout
    assert "dropped (training-only): ['head.bias', 'head.weight', 'ln1.weight (final norm" in res.stdout


def test_mmpretrain_swin_to_mmdet_same_features(tmp_path):
    """An mmpretrain Swin checkpoint (merging already at the end of a stage) onto mmdet's Swin."""
    torch.manual_seed(0)
    cls = PRETRAIN_MODELS.build(dict(
        type='ImageClassifier', neck=dict(type='GlobalAveragePooling'),
        backbone=dict(type='SwinTransformer', arch=dict(embed_dims=32, depths=[2, 2, 2, 2], num_heads=[1, 2, 4, 8]),
                      img_size=448, drop_path_rate=0.),
        head=dict(type='LinearClsHead', num_classes=10, in_channels=256))).eval()
    torch.save({'state_dict': cls.state_dict(), 'meta': {'epoch': 1}}, tmp_path / 'mmpretrain.pth')
    kw = dict(img_size=448, embed_dim=32, depths=(2, 2, 2, 2), num_heads=(1, 2, 4, 8))
    report = convert_checkpoint(tmp_path / 'mmpretrain.pth', tmp_path / 'det.pth', 'mmdet',
                                'swin_tiny_patch4_window7_224', source='mmpretrain', model_kwargs=kw)
    assert report['dropped'] == ['head.fc.bias', 'head.fc.weight']
    det = _loaded('mmdet', 'swin_tiny_patch4_window7_224', tmp_path / 'det.pth', **kw)
    x = torch.randn(1, 3, 448, 448)  # every stage larger than the 7x7 window: both keep the shift
    assert torch.allclose(det(x)[-1], cls.backbone(x)[-1], atol=1e-4)
