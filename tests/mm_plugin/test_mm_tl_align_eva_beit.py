"""TL-Align and TransMix on mmpretrain's EVA-02 (``ViTEVA02``: RoPE) and BEiT (``BEiTViT``: relative position
bias), whose attention computes its probabilities itself: the aligned target against an explicit reference that
records every softmax of a plain forward and applies ``Y ← (Y + mean_h A_h Y) / 2`` by loops over heads in
float64 from dense one-hot labels. (The upstream ``tools/train.py`` runs the EVA-02 config on the world in
test_mm_tl_align.py.)"""

import pytest
import torch
from mmpretrain.registry import MODELS

import mm_plugin  # noqa: F401
from shared_core.mixing import MixSampler, mix_images, one_hot

from ..mm_plugin.test_mm_tl_align import samples_with_mix
from ..timm_plugin.test_tl_align_mvitv2 import RecordSoftmax

C = 6
ARCH = dict(embed_dims=64, num_layers=3, num_heads=4, feedforward_channels=128)


def build(kind, backbone_type, out_type):
    torch.manual_seed(0)
    backbone = dict(type=backbone_type, arch=ARCH, img_size=32, patch_size=8, out_type=out_type)
    if backbone_type == 'BEiTViT':
        backbone.update(use_abs_pos_emb=False, use_rel_pos_bias=True, layer_scale_init_value=0.1)
    model = MODELS.build(
        dict(
            type=kind,
            backbone=backbone,
            neck=None,
            head=dict(type='VisionTransformerClsHead', num_classes=C, in_channels=64),
        )
    ).train()
    with torch.no_grad():  # peaked attention, so that a wrong rule shows
        for name, p in model.backbone.named_parameters():
            if name.endswith('qkv.weight'):
                p.normal_(0, 0.3)
    return model


def batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    mix = MixSampler('cutmix', mode='elem', patch_size=8, mixup_alpha=0.0, cutmix_alpha=1.0).sample(4, 32, g)
    y = torch.tensor([0, 1, 2, 3])
    return mix_images(torch.randn(4, 3, 32, 32, generator=g), mix), y, mix


@pytest.mark.parametrize('out_type', ['cls_token', 'avg_featmap'])
@pytest.mark.parametrize('backbone', ['ViTEVA02', 'BEiTViT'])
def test_the_aligned_target_is_the_explicit_reference(backbone, out_type):
    model = build('TLAlignClassifier', backbone, out_type)
    x, y, mix = batch()
    with RecordSoftmax() as rec, torch.no_grad():
        model.backbone(x)
    assert len(rec.outs) == 3  # one attention softmax per layer
    P = model.backbone.num_extra_tokens
    s = mix.token_share_flat()[..., None].double()
    own, partner = one_hot(y, C).double(), one_hot(y[mix.partner], C).double()
    Y = torch.cat([((1 - (1 - mix.lam)[:, None].double()) * own + (1 - mix.lam)[:, None].double() * partner)[:, None]
                   .expand(-1, P, -1), (1 - s) * own[:, None] + s * partner[:, None]], 1)  # fmt: skip
    for A in rec.outs:
        A = A.double()
        Y = (Y + sum(A[:, h] @ Y for h in range(A.shape[1])) / A.shape[1]) / 2
    label = Y[:, 0] if out_type == 'cls_token' else Y[:, P:].mean(1)
    torch.manual_seed(0)
    _, target = model.extract_feat_aligned(x, samples_with_mix(y, mix))
    assert (target.double() - label).abs().max() < 1e-6  # measured 1e-7
    assert not torch.allclose(target.double(), mix.lam[:, None].double() * own + (1 - mix.lam)[:, None] * partner)


@pytest.mark.parametrize('backbone', ['ViTEVA02', 'BEiTViT'])
def test_transmix_reads_the_class_token_probabilities(backbone):
    model = build('TransMixClassifier', backbone, 'cls_token')
    x, y, mix = batch(2)
    with RecordSoftmax() as rec, torch.no_grad():
        model.backbone(x)
    P = model.backbone.num_extra_tokens
    A = rec.outs[-1][:, :, 0, P:].double().mean(1)
    share = (A * mix.token_share_flat().double()).sum(1) / A.sum(1)
    _, target = model.extract_feat_aligned(x, samples_with_mix(y, mix))
    own, partner = one_hot(y, C).double(), one_hot(y[mix.partner], C).double()
    assert (target.double() - ((1 - share)[:, None] * own + share[:, None] * partner)).abs().max() < 1e-6
