"""LV-ViT as timm models (timm_plugin.lvvit) and through mmpretrain's TIMMBackbone."""

import subprocess
import sys

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.models.vision_transformer import Block

import timm_plugin  # noqa: F401  (registers lvvit_*)
from timm_plugin.lvvit import AUX_WEIGHT, ConvPatchEmbed, LVBlock, LVViT
from timm_plugin.token_grid import token_stride


def _randomise_bn(model):
    """Non-trivial BatchNorm statistics, so eval-mode stems are really compared."""
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)


# paper Table 1: #Params with the 1000-class heads (both counted)
@pytest.mark.parametrize(
    'name, depth, dim, heads, img, stem, params, digits',
    [
        ('lvvit_t', 12, 240, 4, 224, 64, 8.5, 1),
        ('lvvit_s', 16, 384, 6, 224, 64, 26, 0),
        ('lvvit_m', 20, 512, 8, 224, 64, 56, 0),
        ('lvvit_l', 24, 768, 12, 288, 128, 150, 0),
    ],
)
def test_sizes_and_parameter_counts_match_table_1(name, depth, dim, heads, img, stem, params, digits):
    model = timm.create_model(name, num_classes=1000, device='meta')  # shapes only: no memory, no init time
    assert isinstance(model, LVViT) and model.aux_head.weight.device.type == 'meta'
    n = sum(p.numel() for p in model.parameters())
    assert round(n / 1e6, digits) == params, n
    assert len(model.blocks) == depth and model.embed_dim == dim and model.blocks[0].attn.num_heads == heads
    assert model.patch_embed.img_size == (img, img) and model.patch_embed.conv1.out_channels == stem
    blk = model.blocks[0]
    assert blk.mlp.fc1.out_features == 3 * dim and blk.attn.qkv.bias is None
    # the public code's residual scales (zihangJiang/TokenLabeling, models/lvvit.py: lvvit_t skip_lam=1.0,
    # lvvit_s / lvvit_m 2.0, lvvit_l 3.0); the mmseg backbone's archs carry the same values
    public = {'lvvit_t': 1.0, 'lvvit_s': 2.0, 'lvvit_m': 2.0, 'lvvit_l': 3.0}[name]
    assert blk.skip_lam == model.skip_lam == public
    from mm_plugin.lvvit import _resolve_arch

    assert _resolve_arch(name[-1])['skip_lam'] == public
    assert model.pretrained_cfg['classifier'] == ('head', 'aux_head')
    assert model.pretrained_cfg['first_conv'] == 'patch_embed.conv1'


def test_conv_patch_embedding_layout_and_token_grid():
    model = timm.create_model('lvvit_s', num_classes=10)
    pe = model.patch_embed
    assert isinstance(pe, ConvPatchEmbed)
    keys = sorted(k[len('patch_embed.') :] for k in model.state_dict() if k.startswith('patch_embed.'))
    assert keys == sorted(
        [f'{c}.weight' for c in ('conv1', 'conv2', 'conv3')]
        + ['proj.weight', 'proj.bias']
        + [
            f'bn{i}.{p}'
            for i in (1, 2, 3)
            for p in ('weight', 'bias', 'running_mean', 'running_var', 'num_batches_tracked')
        ]
    )
    # supplement Table 3 row [7,3,3,8] / [2,1,1,8]
    convs = [pe.conv1, pe.conv2, pe.conv3, pe.proj]
    assert [c.kernel_size for c in convs] == [(7, 7), (3, 3), (3, 3), (8, 8)]
    assert [c.stride for c in convs] == [(2, 2), (1, 1), (1, 1), (8, 8)]
    assert [c.padding for c in convs] == [(3, 3), (1, 1), (1, 1), (0, 0)]
    assert [c.bias is None for c in convs] == [True, True, True, False]
    assert pe.patch_size == pe.token_stride == (16, 16) and pe.grid_size == (14, 14) and pe.num_patches == 196
    assert token_stride(model) == (16, 16)  # not proj.stride (8)
    assert model.num_prefix_tokens == 1
    x = torch.randn(2, 3, 224, 224)
    assert pe(x).shape == (2, 196, 384)
    assert model.forward_features(x).shape == (2, 197, 384)
    assert {'aux_head.weight', 'aux_head.bias'} <= set(model.state_dict())


def test_enhanced_residual_against_an_explicit_block():
    """Supplement Table 4: x <- x + SA(LN(x)) / 2, then x <- x + FF(LN(x)) / 2, recomputed by hand."""
    torch.manual_seed(0)
    blk = LVBlock(dim=48, num_heads=4, mlp_ratio=3.0, qkv_bias=False, skip_lam=2.0).eval()
    for p in blk.parameters():  # non-trivial norms and biases
        p.data.add_(0.1 * torch.randn_like(p))
    x = torch.randn(2, 10, 48)
    B, N, C = x.shape
    h = F.layer_norm(x, (C,), blk.norm1.weight, blk.norm1.bias, blk.norm1.eps)
    q, k, v = (h @ blk.attn.qkv.weight.T).reshape(B, N, 3, 4, C // 4).permute(2, 0, 3, 1, 4)
    attn = ((q @ k.transpose(-2, -1)) * (C // 4) ** -0.5).softmax(-1)
    sa = (attn @ v).transpose(1, 2).reshape(B, N, C) @ blk.attn.proj.weight.T + blk.attn.proj.bias
    y = x + sa / 2
    h = F.layer_norm(y, (C,), blk.norm2.weight, blk.norm2.bias, blk.norm2.eps)
    ff = F.gelu(h @ blk.mlp.fc1.weight.T + blk.mlp.fc1.bias) @ blk.mlp.fc2.weight.T + blk.mlp.fc2.bias
    expected = y + ff / 2
    assert torch.allclose(blk(x), expected, atol=1e-5)
    # skip_lam=1 is timm's Block
    plain = Block(dim=48, num_heads=4, mlp_ratio=3.0, qkv_bias=False).eval()
    plain.load_state_dict(blk.state_dict())
    blk.skip_lam = 1.0
    assert torch.allclose(blk(x), plain(x), atol=1e-6)
    with pytest.raises(ValueError, match='skip_lam'):
        LVBlock(dim=48, num_heads=4, skip_lam=0.0)


def test_head_rule_cls_plus_aux_and_cls_only():
    torch.manual_seed(0)
    model = timm.create_model('lvvit_t', img_size=64, num_classes=7).eval()
    x = torch.randn(3, 3, 64, 64)
    with torch.no_grad():
        feats = model.forward_features(x)
        cls = model.head(feats[:, 0])
        aux = model.aux_head(feats[:, 1:]).max(dim=1).values
        assert model.head_rule == 'cls+aux' and AUX_WEIGHT == 0.5
        assert torch.allclose(model(x), cls + 0.5 * aux, atol=1e-6)
        assert torch.allclose(model.forward_head(feats, pre_logits=True), feats[:, 0])
        model.head_rule = 'cls'
        assert torch.allclose(model(x), cls, atol=1e-6)
    only_cls = timm.create_model('lvvit_t', img_size=64, num_classes=7, head_rule='cls')
    assert only_cls.head_rule == 'cls'
    with pytest.raises(ValueError, match='head_rule'):
        timm.create_model('lvvit_t', head_rule='max')


def test_reset_classifier_resets_both_heads():
    model = timm.create_model('lvvit_t', img_size=64, num_classes=7)
    model.reset_classifier(5)
    assert model.head.out_features == model.aux_head.out_features == 5 and model.num_classes == 5
    model.reset_classifier(0, '')
    assert isinstance(model.head, torch.nn.Identity) and isinstance(model.aux_head, torch.nn.Identity)
    x = torch.randn(2, 3, 64, 64)
    assert torch.equal(model(x), model.forward_features(x))  # timm's ViT after reset_classifier(0, '')


def test_pretrained_file_through_pretrained_cfg_overlay(tmp_path):
    torch.manual_seed(0)
    src = timm.create_model('lvvit_t', img_size=64, num_classes=10)
    _randomise_bn(src)
    torch.save({'state_dict': src.state_dict(), 'epoch': 3}, tmp_path / 'last.pth.tar')  # tokenaug-train layout
    overlay = dict(file=str(tmp_path / 'last.pth.tar'), num_classes=10)
    same = timm.create_model('lvvit_t', pretrained=True, img_size=64, num_classes=10, pretrained_cfg_overlay=overlay)
    for k, v in src.state_dict().items():
        assert torch.equal(same.state_dict()[k], v), k
    # another class count: both classifiers ('head', 'aux_head') are dropped, everything else loads
    other = timm.create_model('lvvit_t', pretrained=True, img_size=64, num_classes=5, pretrained_cfg_overlay=overlay)
    assert other.head.out_features == other.aux_head.out_features == 5
    assert all(torch.equal(other.state_dict()[k], v) for k, v in src.state_dict().items() if 'head' not in k)
    # another size: the position embedding is resampled (4x4 grid -> 6x6)
    big = timm.create_model('lvvit_t', pretrained=True, img_size=96, num_classes=10, pretrained_cfg_overlay=overlay)
    assert big.pos_embed.shape == (1, 37, 240)
    assert torch.equal(big.blocks[3].mlp.fc1.weight, src.blocks[3].mlp.fc1.weight)
    with pytest.raises(RuntimeError, match='No pretrained weights'):
        timm.create_model('lvvit_t', pretrained=True)  # no published weights


def test_image_sizes_as_timm_vit():
    for size in (112, 288):
        model = timm.create_model('lvvit_s', img_size=size, num_classes=10)
        assert model.patch_embed.grid_size == (size // 16, size // 16)
        assert model(torch.randn(1, 3, size, size)).shape == (1, 10)
    dyn = timm.create_model('lvvit_t', dynamic_img_size=True, num_classes=10).eval()
    for shape in ((112, 112), (96, 160), (288, 288)):
        assert dyn(torch.randn(1, 3, *shape)).shape == (1, 10)
    model = timm.create_model('lvvit_t', num_classes=10)
    model.set_input_size(img_size=(128, 128))
    assert model.pos_embed.shape == (1, 65, 240) and model(torch.randn(1, 3, 128, 128)).shape == (1, 10)
    with pytest.raises(ValueError, match='patch_size'):
        model.set_input_size(patch_size=8)
    with pytest.raises(ValueError, match='image size'):
        model(torch.randn(1, 3, 112, 112))  # fixed size, as timm's PatchEmbed
    feats = timm.create_model('lvvit_t', features_only=True, out_indices=(5, 11))(torch.randn(1, 3, 224, 224))
    assert [f.shape for f in feats] == [(1, 240, 14, 14)] * 2


_TIMM_BACKBONE_CONFIG = """
custom_imports = dict(imports=['timm_plugin'], allow_failed_imports=False)
model = dict(type='ImageClassifier',
             backbone=dict(type='TIMMBackbone', model_name='lvvit_t', img_size=64, num_classes=10,
                           checkpoint_path={ckpt!r}),
             neck=None, head=dict(type='LinearClsHead', num_classes=10, in_channels=240))
"""
_TIMM_BACKBONE_SCRIPT = """
import sys, torch
from mmengine.config import Config
from mmengine.registry import DefaultScope
cfg = Config.fromfile(sys.argv[1])  # custom_imports: timm_plugin registers lvvit_* with timm
from mmpretrain.registry import MODELS
with DefaultScope.overwrite_default_scope('mmpretrain'):
    model = MODELS.build(cfg.model).eval()
torch.save(model.backbone(torch.load(sys.argv[2], weights_only=True))[0], sys.argv[3])
"""


def test_mmpretrain_timm_backbone_builds_lvvit_from_custom_imports(tmp_path, run_env):
    """mmpretrain's own TIMMBackbone builds lvvit_* once ``custom_imports`` imports timm_plugin (a fresh
    process, no other import of ours) and loads a timm / tokenaug-train file through ``checkpoint_path``:
    no extra mmpretrain backbone is needed. Like every timm ViT under TIMMBackbone it resets both
    classifiers and returns the normed tokens (B, 1 + N, C)."""
    torch.manual_seed(0)
    src = timm.create_model('lvvit_t', img_size=64, num_classes=10).eval()
    _randomise_bn(src)
    torch.save({'state_dict': src.state_dict()}, tmp_path / 'cls.pth')
    (tmp_path / 'cfg.py').write_text(_TIMM_BACKBONE_CONFIG.format(ckpt=str(tmp_path / 'cls.pth')))
    x = torch.randn(2, 3, 64, 64)
    torch.save(x, tmp_path / 'x.pth')
    res = subprocess.run(
        [
            sys.executable,
            '-c',
            _TIMM_BACKBONE_SCRIPT,
            str(tmp_path / 'cfg.py'),
            str(tmp_path / 'x.pth'),
            str(tmp_path / 'out.pth'),
        ],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    with torch.no_grad():
        assert torch.allclose(torch.load(tmp_path / 'out.pth', weights_only=True), src.forward_features(x), atol=1e-5)


def test_mmpretrain_timm_backbone_features_only_trains_a_classifier():
    """TIMMBackbone with ``features_only=True``: timm's feature getter over LV-ViT's blocks gives
    (B, C, H/16, W/16) maps, which mmpretrain's stock GAP neck and linear head train on."""
    from mmengine.registry import DefaultScope
    from mmpretrain.registry import MODELS
    from mmpretrain.structures import DataSample

    with DefaultScope.overwrite_default_scope('mmpretrain'):
        model = MODELS.build(
            dict(
                type='ImageClassifier',
                neck=dict(type='GlobalAveragePooling'),
                backbone=dict(
                    type='TIMMBackbone', model_name='lvvit_t', img_size=64, features_only=True, out_indices=(11,)
                ),
                head=dict(type='LinearClsHead', num_classes=10, in_channels=240),
            )
        )
    x = torch.randn(2, 3, 64, 64)
    assert [f.shape for f in model.backbone(x)] == [(2, 240, 4, 4)]
    loss = model(x, [DataSample().set_gt_label(1), DataSample().set_gt_label(3)], mode='loss')['loss']
    loss.backward()
    assert torch.isfinite(loss) and model.backbone.timm_model.model.patch_embed.conv1.weight.grad is not None
