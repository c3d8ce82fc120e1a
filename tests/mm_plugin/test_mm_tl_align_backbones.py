"""TL-Align on MMPretrain's DeiT3, Swin V2, ConvNeXt V2 and PoolFormer, each against an explicit reference (materialised
attention, window and stencil loops), in training mode with stochastic depth dropping samples; RevViT and HiViT
refused by name."""

import pytest
import torch
from mmpretrain.registry import MODELS

import mm_plugin  # noqa: F401
from shared_core.mixing import MixSampler, mix_images, one_hot
from shared_core.tl_align import compact_labels

from ..helpers.processes import check_generated_page, mmpretrain_train
from ..timm_plugin.tl_align_checks import mean_abs_stencil, stencil_loops, window_mix
from .test_mm_tl_align import samples_with_mix

C = 6


def build(backbone, neck, in_channels, head='LinearClsHead'):
    torch.manual_seed(0)
    model = MODELS.build(
        dict(
            type='TLAlignClassifier',
            backbone=backbone,
            neck=neck,
            head=dict(type=head, num_classes=C, in_channels=in_channels),
        )
    ).train()
    with torch.no_grad():  # weights away from their init, so that a wrong stencil or attention shows
        for name, p in model.backbone.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    return model


def kept(module, keeps):
    """A hook on a drop path: the samples it kept (a dropped sample's output is all zeros)."""
    return module.register_forward_hook(lambda m, i, o: keeps.append(o.detach().flatten(1).abs().sum(1) > 0))


def residual(Y, branch, keep):
    """Eq. 11 for the kept samples, the labels unchanged for the dropped."""
    shape = (-1,) + (1,) * (Y.dim() - 1)
    return torch.where(keep.view(shape), (Y + branch) / 2, Y)


def run(model, size, patch, seed=3):
    mix = MixSampler('cutmix', mixup_alpha=0.0, cutmix_alpha=1.0, mode='elem', patch_size=patch).sample(
        4, size, torch.Generator().manual_seed(seed)
    )
    y = torch.tensor([0, 1, 2, 3])
    x = mix_images(torch.randn(4, 3, size, size, generator=torch.Generator().manual_seed(seed + 1)), mix)
    torch.manual_seed(seed + 2)  # stochastic depth's draws
    _, aligned = model.extract_feat_aligned(x, samples_with_mix(y, mix))
    return mix, y, aligned


def target(share, y, mix):
    return (1 - share)[:, None] * one_hot(y, C) + share[:, None] * one_hot(y[mix.partner], C)


def test_deit3_is_the_materialised_attention_reference():
    """DeiT3 (layer scale, its FFN's own drop path): Eq. 9 with each layer's softmax(q kᵀ/√d) materialised from its
    qkv projection, mean over heads, Eq. 11 for the samples the attention's drop path kept; the class token read."""
    model = build(
        dict(
            type='DeiT3',
            arch=dict(embed_dims=48, num_layers=3, num_heads=3, feedforward_channels=96),
            img_size=32,
            patch_size=8,
            drop_path_rate=0.6,
        ),
        None,
        48,
        'VisionTransformerClsHead',
    )
    qkvs, keeps = [], []
    hooks = []
    for layer in model.backbone.layers:
        hooks.append(layer.attn.qkv.register_forward_hook(lambda m, i, o: qkvs.append(o.detach())))
        hooks.append(kept(layer.attn.out_drop, keeps))
    mix, y, aligned = run(model, 32, 8)
    for h in hooks:
        h.remove()
    assert any(not k.all() for k in keeps) and any(k.any() for k in keeps)  # samples dropped and kept
    Y = compact_labels(mix, 1).double()
    for qkv, keep in zip(qkvs, keeps):
        B, T, _ = qkv.shape
        q, k, _ = qkv.double().view(B, T, 3, 3, 16).permute(2, 0, 3, 1, 4)
        A = torch.softmax(q @ k.transpose(-1, -2) / 16**0.5, -1).mean(1)
        Y = residual(Y, A @ Y, keep)
    expected = target(Y[:, 0, 0].float(), y, mix)
    assert (aligned - expected).abs().max() < 1e-6
    assert not torch.allclose(aligned, target(1 - mix.lam.float(), y, mix), atol=1e-3)  # the labels moved


def test_swin_v2_is_the_window_loop_reference():
    """Swin V2: post-norm blocks, cosine attention with log-CPB read at its softmax, window loops with the shift
    (4x4 windows on 16x16, then on 8x8 after the merging that opens stage 1), Eq. 11 where kept, the mean label."""
    model = build(
        dict(
            type='SwinTransformerV2',
            arch=dict(embed_dims=16, depths=[2, 2], num_heads=[2, 2], extra_norm_every_n_blocks=0),
            img_size=32,
            patch_size=2,
            window_size=[4, 4],
            out_indices=(1,),
            drop_path_rate=0.6,
        ),
        dict(type='GlobalAveragePooling'),
        32,
    )
    attns, keeps, hooks = [], [], []
    blocks = [b for s in model.backbone.stages for b in s.blocks]
    for b in blocks:
        hooks.append(b.attn.w_msa.softmax.register_forward_hook(lambda m, i, o: attns.append(o.detach().mean(1))))
        hooks.append(kept(b.attn.drop, keeps))
    mix, y, aligned = run(model, 32, 2)
    for h in hooks:
        h.remove()
    assert any(not k.all() for k in keeps) and any(k.any() for k in keeps)
    Y = mix.token_share.double().unsqueeze(-1)  # (B, 16, 16, 1)
    for idx, (A, keep) in enumerate(zip(attns, keeps)):
        if idx == 2:  # mm's V2 merges at the START of stage 1
            Y = (Y[:, 0::2, 0::2] + Y[:, 1::2, 0::2] + Y[:, 0::2, 1::2] + Y[:, 1::2, 1::2]) / 4
        Y = residual(Y, window_mix(Y, A.double(), 4, [0, 2, 0, 2][idx]), keep)
    expected = target(Y.flatten(1, 2).mean(1)[:, 0].float(), y, mix)
    assert (aligned - expected).abs().max() < 1e-6


def test_convnext_v2_is_the_stencil_loop_reference():
    """ConvNeXt V2 (GRN: a channel gate, labels unchanged): each depthwise 7x7 conv as the stencil mean |K| over
    its channels by loops (padding cells no tokens), Eq. 11 where kept, the 2x2 stride-2 downsampling as the mean of
    each window, the mean label (pooled before the final norm)."""
    model = build(
        dict(
            type='ConvNeXt',
            arch=dict(depths=[2, 1], channels=[16, 32]),
            use_grn=True,
            layer_scale_init_value=0.0,
            drop_path_rate=0.6,
            out_indices=(1,),
        ),
        None,
        32,
    )
    keeps = []
    blocks = [b for s in model.backbone.stages for b in s]
    hooks = [kept(b.drop_path, keeps) for b in blocks]
    mix, y, aligned = run(model, 64, 4)
    for h in hooks:
        h.remove()
    assert any(not k.all() for k in keeps) and any(k.any() for k in keeps)
    Y = mix.token_share.double().unsqueeze(-1)  # (B, 16, 16, 1)
    for idx, (b, keep) in enumerate(zip(blocks, keeps)):
        if idx == 2:
            Y = stencil_loops(Y, torch.ones(2, 2, dtype=torch.float64), (0, 0, 0, 0), stride=2)
        Y = residual(Y, stencil_loops(Y, mean_abs_stencil(b.depthwise_conv.weight), (3, 3, 3, 3)), keep)
    expected = target(Y.flatten(1, 2).mean(1)[:, 0].float(), y, mix)
    assert (aligned - expected).abs().max() < 1e-6


def test_poolformer_is_the_pool_loop_reference():
    """PoolFormer: each token mixer ``pool(x) − x`` as its 3x3 average pool (the in-grid cells of each window) by
    loops, Eq. 11 where kept, the 3x3 stride-2 patch embedding between stages as the mean of each in-grid window,
    the mean label of the neck's pooling."""
    model = build(
        dict(
            type='PoolFormer',
            arch=dict(layers=[2, 1], embed_dims=[16, 32], mlp_ratios=[2, 2], layer_scale_init_value=1e-5),
            out_indices=(2,),
            drop_path_rate=0.6,
        ),
        dict(type='GlobalAveragePooling'),
        32,
    )
    keeps = []
    blocks = [b for part in model.backbone.network if isinstance(part, torch.nn.Sequential) for b in part]
    hooks = [kept(b.drop_path, keeps) for b in blocks]
    mix, y, aligned = run(model, 64, 4)
    for h in hooks:
        h.remove()
    keeps = keeps[0::2]  # a block's one drop path runs for its token mixer, then its MLP: the first call counts
    assert any(not k.all() for k in keeps) and any(k.any() for k in keeps)
    ones = torch.ones(3, 3, dtype=torch.float64)
    Y = mix.token_share.double().unsqueeze(-1)  # (B, 16, 16, 1): the 7x7 stride-4 stem's grid
    for idx, keep in enumerate(keeps):
        if idx == 2:
            Y = stencil_loops(Y, ones, (1, 1, 1, 1), stride=2)
        Y = residual(Y, stencil_loops(Y, ones, (1, 1, 1, 1)), keep)
    expected = target(Y.flatten(1, 2).mean(1)[:, 0].float(), y, mix)
    assert (aligned - expected).abs().max() < 1e-6


def test_the_rest_is_refused_by_name():
    """RevViT and HiViT refused with the reason; a conv backbone's neck and output checked; TransMix refuses what
    does not attend."""
    head = dict(type='LinearClsHead', num_classes=C, in_channels=192)
    for backbone, why in [
        (dict(type='RevVisionTransformer', arch='deit-tiny', img_size=32, patch_size=8), 'two streams'),
        (dict(type='HiViT', arch='tiny', img_size=224), 'sub-patches'),
    ]:
        with pytest.raises(ValueError, match=f'backbone: TL-Align has no rule for {backbone["type"]}: .*{why}'):
            MODELS.build(dict(type='TLAlignClassifier', backbone=backbone, neck=None, head=head))
    pool = dict(type='PoolFormer', arch='s12')
    with pytest.raises(ValueError, match='neck: TL-Align reads the mean label .*got NoneType'):
        MODELS.build(dict(type='TLAlignClassifier', backbone=pool, neck=None, head=head))
    with pytest.raises(ValueError, match=r'backbone: TL-Align needs the classification output \(out_indices=\(3,\)\)'):
        MODELS.build(dict(type='TLAlignClassifier', backbone=dict(type='ConvNeXt', out_indices=(2, 3)), head=head))
    with pytest.raises(ValueError, match='backbone: TransMix .*pooling'):
        MODELS.build(dict(type='TransMixClassifier', backbone=pool, neck=dict(type='GlobalAveragePooling'), head=head))


@pytest.mark.slow
@pytest.mark.parametrize(
    'config',
    [
        'deit3-tiny_world_tl-align.py',
        'swinv2-tiny_world_tl-align.py',
        'convnextv2-atto_world_tl-align.py',
        'poolformer-s12_world_tl-align.py',
    ],
)
def test_upstream_train_py_runs_each_new_familys_config(tiny_world, tmp_path, run_env, config):
    run_env['TOKENAUG_WORLD'] = str(tiny_world)
    log = mmpretrain_train(config, tmp_path, run_env, tmp_path)
    assert 'Epoch(train) [1][2/2]' in log and 'accuracy/top1' in log
    assert "type='TLAlignClassifier'" in (tmp_path / config).read_text()


def test_the_mmpretrain_zoo_page_is_what_mmpretrain_gives_now(run_env):
    """docs/methods/tl_align_zoo_mmpretrain.md is scripts/tl_align_zoo_mmpretrain.py's output (it cannot drift)."""
    from ..helpers import REPO

    check_generated_page('tl_align_zoo_mmpretrain.py', run_env)
    page = (REPO / 'docs' / 'methods' / 'tl_align_zoo_mmpretrain.md').read_text()
    for name in ('DeiT3', 'SwinTransformerV2', 'ConvNeXt', 'PoolFormer'):
        assert f'| {name} | traced |' in page
    for name in ('RevVisionTransformer', 'HiViT'):
        assert f'| {name} | refused |' in page
