"""TL-Align on MMPretrain: parity with timm on converted weights, Swin against explicit geometry, a real run."""

import pytest
import torch
from mmpretrain.registry import MODELS
from mmpretrain.structures import DataSample
from timm.models.vision_transformer import VisionTransformer as TimmViT

import mm_plugin  # noqa: F401
from mm_plugin import TLAlignClassifier, TransMixClassifier
from mm_plugin.convert import timm_vit_to_mmpretrain
from shared_core.mixing import MixSampler, mix_images, mix_target, one_hot
from timm_plugin import MixTarget
from timm_plugin.tl_align import TLAlign, TransMix

from ..helpers.processes import mmpretrain_train
from ..timm_plugin.tl_align_checks import window_mix

C = 6


def samples_with_mix(labels, mix):
    """Data samples as TokenAugDataPreprocessor leaves them."""
    out = []
    for i, y in enumerate(labels.tolist()):
        s = DataSample().set_gt_label(y)
        s.set_field(mix, 'batch_mix', field_type='metainfo')
        s.set_field(i, 'mix_index', field_type='metainfo')
        out.append(s)
    return out


def mm_vit(**kw):
    cfg = dict(
        type='TLAlignClassifier',
        backbone=dict(type='VisionTransformer', arch='deit-tiny', img_size=32, patch_size=8, **kw),
        neck=None,
        head=dict(type='VisionTransformerClsHead', num_classes=C, in_channels=192),
    )
    return MODELS.build(cfg)


@pytest.mark.parametrize('kind', ['cutmix', 'mixup', 'tokenmix_block'])
def test_timm_and_mmpretrain_give_the_same_aligned_target(kind):
    """The same DeiT-Tiny weights (converted key by key), the same input and mix: the same logits and the
    same aligned target from timm_plugin.TLAlign and mm_plugin.TLAlignClassifier."""
    torch.manual_seed(0)
    timm_model = TimmViT(img_size=32, patch_size=8, embed_dim=192, depth=12, num_heads=3, num_classes=C).train()
    with torch.no_grad():  # peaked attention, so that a wrong readout or rule shows
        for blk in timm_model.blocks:
            blk.attn.qkv.weight.normal_(0, 0.15)
    mm_model = mm_vit().train()
    mm_model.load_state_dict(timm_vit_to_mmpretrain(timm_model.state_dict()), strict=True)
    g = torch.Generator().manual_seed(1)
    kw = dict(mixup_alpha=1.0) if kind == 'mixup' else dict(mixup_alpha=0.0, cutmix_alpha=1.0)
    mix = MixSampler(kind, mode='elem', patch_size=8, **kw).sample(4, 32, g)
    y = torch.tensor([0, 1, 2, 3])
    x = mix_images(torch.randn(4, 3, 32, 32, generator=g), mix)
    target = MixTarget.wrap(mix_target(y, mix, C), mix, y, C, 0.0)
    timm_logits, timm_target = TLAlign(timm_model)(x, target)
    feats, mm_target = mm_model.extract_feat_aligned(x, samples_with_mix(y, mix))
    assert torch.allclose(mm_model.head(feats), timm_logits, atol=1e-4)
    assert torch.allclose(mm_target, timm_target, atol=1e-5)
    assert not torch.allclose(mm_target, target.as_tensor(), atol=1e-3) or kind == 'mixup'


@pytest.mark.parametrize('mode', ['paper', 'average'])
@pytest.mark.parametrize('pool', ['cls_token', 'avg_featmap'])
def test_timm_and_mmpretrain_give_the_same_transmix_target(mode, pool):
    """TransMix through the shared rule (shared_core.tl_align.transmix_share) from both adapters: converted
    weights, the same input and CutMix boxes give the same target (class-token rule, and our extension for
    average pooling)."""
    torch.manual_seed(0)
    gp = 'token' if pool == 'cls_token' else 'avg'
    timm_model = TimmViT(
        img_size=32, patch_size=8, embed_dim=192, depth=12, num_heads=3, num_classes=C, global_pool=gp, fc_norm=False
    ).train()
    with torch.no_grad():
        for blk in timm_model.blocks:
            blk.attn.qkv.weight.normal_(0, 0.15)
    mm_model = MODELS.build(
        dict(
            type='TransMixClassifier',
            transmix=dict(mode=mode),
            backbone=dict(type='VisionTransformer', arch='deit-tiny', img_size=32, patch_size=8, out_type=pool),
            neck=None,
            head=dict(type='VisionTransformerClsHead', num_classes=C, in_channels=192),
        )
    ).train()
    missing, unexpected = mm_model.load_state_dict(timm_vit_to_mmpretrain(timm_model.state_dict()), strict=False)
    # mm's average pooling adds a norm after the pooling (ln2), which timm's has not: it changes the logits,
    # not the attention the target is read from
    assert not unexpected and set(missing) <= {'backbone.ln2.weight', 'backbone.ln2.bias'}
    g = torch.Generator().manual_seed(2)
    mix = MixSampler('cutmix', mixup_alpha=0.0, cutmix_alpha=1.0, mode='elem', patch_size=8).sample(4, 32, g)
    y = torch.tensor([0, 1, 2, 3])
    x = mix_images(torch.randn(4, 3, 32, 32, generator=g), mix)
    target = MixTarget.wrap(mix_target(y, mix, C), mix, y, C, 0.0)
    _, timm_target = TransMix(timm_model, mode=mode)(x, target)
    _, mm_target = mm_model.extract_feat_aligned(x, samples_with_mix(y, mix))
    assert isinstance(mm_model, TransMixClassifier)
    assert torch.allclose(mm_target, timm_target, atol=1e-5)
    assert not torch.allclose(mm_target, target.as_tensor(), atol=1e-3)  # not the area target
    if mode == 'paper' and pool == 'cls_token':  # the rule itself, from materialised attention
        caps = {}
        last = timm_model.blocks[-1]
        h = last.norm1.register_forward_hook(lambda m, i, o: caps.__setitem__('x', o))
        timm_model(x)
        h.remove()
        B, T, _ = caps['x'].shape
        qkv = last.attn.qkv(caps['x']).reshape(B, T, 3, 3, 64).permute(2, 0, 3, 1, 4)
        A = (qkv[0] @ qkv[1].transpose(-2, -1) * 64**-0.5).softmax(-1).mean(1)[:, 0, 1:]  # (B, N)
        share = (A * mix.token_share_flat()).sum(1) / A.sum(1)
        expected = (1 - share)[:, None] * one_hot(y, C) + share[:, None] * one_hot(y.flip(0), C)
        assert torch.allclose(timm_target, expected, atol=1e-5)


def test_loss_uses_the_aligned_target_and_predict_is_stock():
    model = mm_vit()
    mix = MixSampler('cutmix', mixup_alpha=0.0, cutmix_alpha=1.0, mode='elem', patch_size=8).sample(
        4, 32, torch.Generator().manual_seed(3)
    )
    y = torch.tensor([0, 1, 2, 3])
    x = torch.randn(4, 3, 32, 32)
    samples = samples_with_mix(y, mix)
    losses = model.loss(x, samples)
    _, aligned = model.extract_feat_aligned(x, samples_with_mix(y, mix))
    assert torch.allclose(torch.stack([s.gt_score for s in samples]), aligned)
    assert torch.isfinite(losses['loss'])
    plain = [DataSample().set_gt_label(i) for i in range(4)]  # no mix: the stock classifier
    assert torch.isfinite(model.loss(x, plain)['loss'])
    model.eval()
    preds = model.predict(x)
    assert len(preds) == 4 and preds[0].pred_score.shape == (C,)


@pytest.mark.parametrize('window,shifts', [(4, [0, 2, 0, 2]), (8, [0, 4, 0, 0])])
def test_mm_swin_matches_explicit_geometry(window, shifts):
    """mmpretrain's Swin: merging at the END of a stage; the shift dropped where the map equals the window
    (window 8: the second stage is 8x8), kept where it is larger."""
    torch.manual_seed(0)
    model = MODELS.build(
        dict(
            type='TLAlignClassifier',
            backbone=dict(
                type='SwinTransformer',
                arch=dict(embed_dims=16, depths=[2, 2], num_heads=[2, 2]),
                img_size=32,
                patch_size=2,
                window_size=window,
                drop_path_rate=0.0,
                out_indices=(1,),
            ),
            neck=dict(type='GlobalAveragePooling'),
            head=dict(type='LinearClsHead', num_classes=C, in_channels=32),
        )
    ).eval()
    with torch.no_grad():
        for m in model.backbone.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.normal_(0, 0.3)
    attns = []
    blocks = [b for s in model.backbone.stages for b in s.blocks]
    hooks = [
        b.attn.w_msa.softmax.register_forward_hook(lambda m, i, o: attns.append(o.detach().mean(1))) for b in blocks
    ]
    mix = MixSampler('cutmix', mixup_alpha=0.0, cutmix_alpha=1.0, mode='elem', patch_size=2).sample(
        2, 32, torch.Generator().manual_seed(5)
    )
    y = torch.tensor([1, 4])
    x = torch.randn(2, 3, 32, 32)
    feats, aligned = model.extract_feat_aligned(x, samples_with_mix(y, mix))
    for h in hooks:
        h.remove()
    Y = mix.token_share.float().unsqueeze(-1)  # (B, 16, 16, 1)
    for idx, A in enumerate(attns):
        if idx == 2:  # mm's PatchMerging closed stage 0
            Y = (Y[:, 0::2, 0::2] + Y[:, 1::2, 0::2] + Y[:, 0::2, 1::2] + Y[:, 1::2, 1::2]) / 4
        Y = (Y + window_mix(Y, A, window, shifts[idx])) / 2
    share = Y.flatten(1, 2).mean(1)[:, 0]
    expected = (1 - share)[:, None] * one_hot(y, C) + share[:, None] * one_hot(y[mix.partner], C)
    assert torch.allclose(aligned, expected, atol=1e-6)


def test_bad_backbone_and_config():
    with pytest.raises(
        ValueError, match='backbone: TL-Align has no tracer for .*ResNet; supported: .*VisionTransformer'
    ):
        MODELS.build(
            dict(
                type='TLAlignClassifier',
                backbone=dict(type='ResNet', depth=18),
                neck=None,
                head=dict(type='LinearClsHead', num_classes=C, in_channels=512),
            )
        )
    assert isinstance(mm_vit(), TLAlignClassifier)
    with pytest.raises(ValueError, match=r'tl_align: unknown keys \[.layer.\]'):
        MODELS.build(
            dict(
                type='TLAlignClassifier',
                tl_align=dict(layer=3),
                backbone=dict(type='VisionTransformer', arch='deit-tiny', img_size=32, patch_size=8),
                neck=None,
                head=dict(type='VisionTransformerClsHead', num_classes=C, in_channels=192),
            )
        )
    with pytest.raises(ValueError, match='tl_align.layers'):
        MODELS.build(
            dict(
                type='TLAlignClassifier',
                tl_align=dict(layers=[12]),
                backbone=dict(type='VisionTransformer', arch='deit-tiny', img_size=32, patch_size=8),
                neck=None,
                head=dict(type='VisionTransformerClsHead', num_classes=C, in_channels=192),
            )
        )
    with pytest.raises(ValueError, match=r"tl_align.drop_path: expected one of \('kept', 'public'\)"):
        MODELS.build(
            dict(
                type='TLAlignClassifier',
                tl_align=dict(drop_path='dropped'),
                backbone=dict(type='VisionTransformer', arch='deit-tiny', img_size=32, patch_size=8),
                neck=None,
                head=dict(type='VisionTransformerClsHead', num_classes=C, in_channels=192),
            )
        )


@pytest.mark.slow
@pytest.mark.parametrize(
    'config, cls',
    [
        ('deit-tiny_world_tl-align.py', 'TLAlignClassifier'),
        ('deit-tiny_world_transmix.py', 'TransMixClassifier'),
        ('convnext-atto_world_tl-align.py', 'TLAlignClassifier'),  # TL-Align Appendix A via TIMMBackbone
        ('eva02-tiny_world_tl-align.py', 'TLAlignClassifier'),  # EVA-02: the attention read at its softmax
        ('beit-tiny_world_tl-align.py', 'TLAlignClassifier'),  # BEiT: with its relative position bias
    ],
)
def test_upstream_train_py_runs_the_tl_align_config(tiny_world, tmp_path, run_env, config, cls):
    run_env['TOKENAUG_WORLD'] = str(tiny_world)
    log = mmpretrain_train(config, tmp_path, run_env, tmp_path)
    assert 'Epoch(train) [1][2/2]' in log and 'accuracy/top1' in log
    assert f"type='{cls}'" in (tmp_path / config).read_text()


@pytest.mark.parametrize('name', ['resnet18', 'convnext_atto', 'efficientnet_b0'])
def test_timm_cnn_through_timm_backbone_gives_timm_plugins_aligned_target(name):
    """TL-Align Appendix A's rules on a timm CNN inside mmpretrain's TIMMBackbone (GlobalAveragePooling neck, linear
    head): the same weights, input and mix give timm_plugin.TLAlign's logits and aligned target (EfficientNet-B0:
    the graph route, its final map's mean label); TransMix (no attention) and a neck that does not average are
    refused."""
    import timm

    cfg = dict(
        type='TLAlignClassifier',
        backbone=dict(type='TIMMBackbone', model_name=name),
        neck=dict(type='GlobalAveragePooling'),
        head=dict(
            type='LinearClsHead', num_classes=C, in_channels={'resnet18': 512, 'convnext_atto': 320}.get(name, 1280)
        ),
    )
    torch.manual_seed(0)
    mm_model = MODELS.build(cfg).train()
    timm_model = timm.create_model(name, num_classes=C).train()
    timm_model.load_state_dict(mm_model.backbone.timm_model.state_dict(), strict=False)
    timm_model.get_classifier().load_state_dict(mm_model.head.fc.state_dict())
    g = torch.Generator().manual_seed(1)
    mix = MixSampler('cutmix', mixup_alpha=0.0, cutmix_alpha=1.0, mode='elem', patch_size=4).sample(4, 64, g)
    y = torch.tensor([0, 1, 2, 3])
    x = mix_images(torch.randn(4, 3, 64, 64, generator=g), mix)
    target = MixTarget.wrap(mix_target(y, mix, C), mix, y, C, 0.0)
    timm_logits, timm_target = TLAlign(timm_model)(x, target)
    feats, mm_target = mm_model.extract_feat_aligned(x, samples_with_mix(y, mix))
    assert torch.allclose(mm_target, timm_target, atol=1e-6)
    assert not torch.allclose(mm_target, target.as_tensor(), atol=1e-4)  # the labels moved
    if name != 'convnext_atto':  # same readout (ConvNeXt's timm head normalises after pooling, mm's map before it)
        assert torch.allclose(mm_model.head(feats), timm_logits, atol=1e-4)
    with pytest.raises(ValueError, match='neck: TL-Align on a TIMMBackbone .*GlobalAveragePooling'):
        MODELS.build(dict(cfg, neck=None))
    with pytest.raises(ValueError, match='backbone: TransMix .*has none'):
        MODELS.build(dict(cfg, type='TransMixClassifier'))
    with pytest.raises(ValueError, match='backbone: TL-Align has no tracer for .*VisionTransformer.*graph route'):
        MODELS.build(dict(cfg, backbone=dict(type='TIMMBackbone', model_name='vit_tiny_patch16_224')))


def test_fused_labels_runs_the_label_only_kernel_beside_mmpretrains_attention(monkeypatch):
    """``tl_align=dict(fused='labels')``: the label-only kernel (under Triton's interpreter here), once per layer,
    beside the backbone's own attention gives the transient softmax's targets."""
    from shared_core import label_kernel

    assert label_kernel.self_check('labels', 'cpu', torch.float32, 64) is None  # its own launch, before the count
    launches = []
    forward = label_kernel._label_only_forward
    monkeypatch.setattr(label_kernel, '_label_only_forward', lambda *a: launches.append(1) or forward(*a))
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    mix = MixSampler('cutmix', mode='elem', patch_size=8, mixup_alpha=0.0, cutmix_alpha=1.0).sample(4, 32, g)
    y = torch.tensor([0, 1, 2, 3])
    x = mix_images(torch.randn(4, 3, 32, 32, generator=g), mix)
    targets = {}
    for fused in ('labels', False):
        torch.manual_seed(0)
        model = MODELS.build(
            dict(
                type='TLAlignClassifier',
                backbone=dict(type='VisionTransformer', arch='deit-tiny', img_size=32, patch_size=8),
                neck=None,
                head=dict(type='VisionTransformerClsHead', num_classes=C, in_channels=192),
                tl_align=dict(fused=fused),
            )
        ).eval()
        _, targets[fused] = model.extract_feat_aligned(x, samples_with_mix(y, mix))
    assert len(launches) == 12  # deit-tiny's layers, in the 'labels' run only
    assert torch.allclose(targets['labels'], targets[False], atol=1e-5, rtol=0)
