"""Token labeling + MixToken on MMPretrain: maps through the real MMEngine pipeline (quadrant images, token by
token), the loss against timm_plugin's, un-mixing with token-independent backbones, the inference rule, a run
of mmpretrain's own tools/train.py, and the errors."""

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from mmpretrain.datasets import CustomDataset
from mmpretrain.registry import MODELS, TRANSFORMS
from mmpretrain.structures import DataSample
from PIL import Image

import mm_plugin  # noqa: F401
from mm_plugin.token_label_transforms import GEOMETRIC_RAND_POLICIES, TokenLabelRandAugment
from mm_plugin.token_labeling import TokenLabelingHead
from shared_core.label_maps import CropMaps
from shared_core.map_format import MissingLabelMapError
from shared_core.map_store import LabelMapStore
from timm_plugin.token_label_data import TokenLabelTarget
from timm_plugin.token_labeling import TokenLabelingLoss, TokenLabelingOutput

from ..helpers.data import COLOURS, quadrant_image, write_store
from ..helpers.processes import mmpretrain_train  # quadrant_data: conftest.py

C = 5


# ----------------------------------------------------------------------------------------------- helpers
def tl_pipeline(
    root,
    flip=dict(type='RandomFlip', prob=0.5, direction='horizontal'),
    pack='PackTokenLabelInputs',
    aug=(),
    scale=64,
    order='timm',
):
    """crop -> flip -> aug (timm's order), or flip -> aug -> crop (``order='public'``, the public code's)."""
    load = [
        dict(type='LoadImageFromFile'),
        dict(type='LoadTokenLabelMap', store=str(root / 'maps'), split_root=str(root / 'train')),
    ]
    crop = [
        dict(type='TokenLabelRandomResizedCrop', scale=scale, crop_ratio_range=(0.08, 1.0), interpolation='nearest')
    ]
    moves = ([flip] if flip else []) + list(aug)
    return load + (crop + moves if order == 'timm' else moves + crop) + [dict(type=pack)]


def dataset(root, pipeline):
    return CustomDataset(data_root=str(root), data_prefix='train', pipeline=pipeline)


FILL = len(COLOURS)  # black pixels: the geometric policies' fill (pad_val=0)


def pixel_classes(x):
    """Class of each pixel of (B, 3, H, W) uint8 BGR images (as mmcv loads them): nearest quadrant colour, or
    FILL for black."""
    cols = torch.tensor(np.concatenate([COLOURS[:, ::-1], [[0, 0, 0]]]), dtype=torch.float32)
    d = ((x.float().permute(0, 2, 3, 1)[..., None, :] - cols) ** 2).sum(-1)
    return d.argmin(-1)


def random_rows(B, num_classes=C, k=2, h=4, w=4, seed=0):
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(num_classes), size=(B, h, w))
    order = np.argsort(-p, -1)[..., :k]
    values = np.take_along_axis(p, order, -1).astype(np.float16).transpose(0, 3, 1, 2)
    return np.ascontiguousarray(values), np.ascontiguousarray(order.transpose(0, 3, 1, 2).astype(np.int64))


def random_world_maps(world, out):
    """A store of random top-3 7x7 maps for every image of the world's train split (keyed as tokenaug-maps
    keys them: relative to <world>/imagenet/train); returns ``out``."""
    split = Path(world) / 'imagenet' / 'train'
    paths = sorted(str(p.relative_to(split)) for p in split.rglob('*') if p.is_file())
    values, indices = random_rows(len(paths), num_classes=10, k=3, h=7, w=7, seed=5)
    return write_store(out, paths, values, indices, num_classes=10, annotator='random', input_size=(112, 112))


def packed_samples(labels, values, indices, crops, flips):
    """Data samples as PackTokenLabelInputs leaves them."""
    out = []
    for i, y in enumerate(labels.tolist()):
        s = DataSample().set_gt_label(y)
        s.set_field(values[i], 'token_label_values')
        s.set_field(indices[i], 'token_label_indices')
        s.set_field(tuple(crops[i].tolist()), 'crop_box')
        s.set_metainfo(
            dict(img_path=f'img{i}.png', flip=bool(flips[i]), flip_direction='horizontal' if flips[i] else None)
        )
        out.append(s)
    return out


def batch(B=4, seed=0):
    values, indices = random_rows(B, seed=seed)
    crops = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.5, 0.0, 1.0, 0.5], [0.0, 0.25, 0.75, 1.0], [0.1, 0.2, 0.6, 0.9]])[:B]
    flips = torch.tensor([False, True, False, True])[:B]
    labels = torch.arange(B) % C
    return labels, values, indices, crops, flips


MM_VIT = dict(
    type='VisionTransformer',
    img_size=64,
    patch_size=16,
    out_type='raw',
    arch=dict(embed_dims=64, num_layers=2, num_heads=2, feedforward_channels=128),
)
TIMM_VIT0 = dict(type='TIMMBackbone', model_name='vit_tiny_patch16_224', img_size=64, depth=0)


def tl_model(backbone=MM_VIT, dim=None, **head):
    torch.manual_seed(0)
    dim = dim or (192 if backbone['type'] == 'TIMMBackbone' else backbone['arch']['embed_dims'])
    return MODELS.build(
        dict(
            type='TokenLabelingClassifier',
            backbone=backbone,
            neck=None,
            head=dict(type='TokenLabelingHead', num_classes=C, in_channels=dim, **head),
        )
    )


def token_independent_mm_vit():
    """mmpretrain's VisionTransformer with one layer whose attention output is zero: token i's output
    depends on token i only (residual + FFN + norms), as for a 0-layer model (mm refuses num_layers=0)."""
    model = tl_model(dict(MM_VIT, arch=dict(embed_dims=32, num_layers=1, num_heads=2, feedforward_channels=64)))
    with torch.no_grad():
        model.backbone.layers[0].attn.proj.weight.zero_()
        model.backbone.layers[0].attn.proj.bias.zero_()
    return model


# ------------------------------------------------------------------------------------- (a) orientation
@pytest.mark.parametrize('order', ['timm', 'public'])
def test_token_targets_follow_crops_and_flips_through_the_mm_pipeline(quadrant_data, order):
    """LoadImageFromFile -> LoadTokenLabelMap -> TokenLabelRandomResizedCrop -> RandomFlip -> PackTokenLabelInputs
    on quadrant images: the classifier's dense targets equal the pixels' classes on every pure token; and with the
    flip before the crop (the public order: the mirrored crop)."""
    ds = dataset(quadrant_data, tl_pipeline(quadrant_data, order=order))
    head = TokenLabelingHead(num_classes=4, in_channels=8, label_smoothing=0.0)
    np.random.seed(0)
    checked = flipped = 0
    crops = set()
    for _ in range(8):
        items = [ds[i] for i in range(len(ds))]
        x = torch.stack([it['inputs'] for it in items])
        samples = [it['data_samples'] for it in items]
        flipped += sum(bool(s.flip) for s in samples)
        crops |= {tuple(s.crop_box) for s in samples}
        y_cls, dense = head.targets(samples, None, (4, 4))
        dense = dense.dense()  # (B, 16, 4)
        torch.testing.assert_close(dense.sum(-1), torch.ones(len(x), 16))
        pix = pixel_classes(x)  # (B, 64, 64)
        tok = pix.view(-1, 4, 16, 4, 16).permute(0, 1, 3, 2, 4).reshape(len(x), 16, 256)
        pure = (tok == tok[..., :1]).all(-1)
        assert pure.any()
        assert torch.equal(dense.argmax(-1)[pure], tok[..., 0][pure])
        checked += int(pure.sum())
    assert checked > 300 and 0 < flipped < 48 and len(crops) > 40
    # the samples carry the store's class count: a head of another count is refused, naming both (the indices
    # alone would pass: a 4-class store's classes are all below 10)
    assert {int(s.token_label_classes) for s in samples} == {4}
    with pytest.raises(ValueError, match=r'the label maps are for 4 classes, the head for num_classes=10'):
        TokenLabelingHead(num_classes=10, in_channels=8).targets(samples, None, (4, 4))


GEOMETRIC_POLICIES = {
    'rotate': dict(type='Rotate', magnitude_range=(0, 30)),
    'shear-h': dict(type='Shear', magnitude_range=(0, 0.3), direction='horizontal'),
    'shear-v': dict(type='Shear', magnitude_range=(0, 0.3), direction='vertical'),
    'translate-h': dict(type='Translate', magnitude_range=(0, 0.45), direction='horizontal'),
    'translate-v': dict(type='Translate', magnitude_range=(0, 0.45), direction='vertical'),
}


def forced(policy, geometric='follow'):
    """TokenLabelRandAugment with one policy that always runs at magnitude 9 (its sign random), nearest
    resampling, black fill."""
    return dict(
        type='TokenLabelRandAugment',
        policies=[dict(policy, prob=1.0)],
        num_policies=1,
        magnitude_level=9,
        geometric=geometric,
        hparams=dict(pad_val=0, interpolation='nearest'),
    )


@pytest.mark.parametrize('scale', [64, (48, 64)])
@pytest.mark.parametrize('op', sorted(GEOMETRIC_POLICIES))
@pytest.mark.parametrize('order', ['timm', 'public'])
def test_token_targets_follow_each_geometric_policy_through_the_mm_pipeline(quadrant_data, op, scale, order):
    """... -> RandomFlip -> TokenLabelRandAugment (one geometric policy, forced) -> PackTokenLabelInputs: every
    token that is one quadrant has that class as its target's argmax, every all-fill token a uniform target,
    square and non-square crops (mmcv's warps, OpenCV pixel centres); and in the public order (RandomFlip ->
    TokenLabelRandAugment on the whole image -> TokenLabelRandomResizedCrop)."""
    gh, gw = (4, 4) if scale == 64 else (3, 4)
    H, W = 16 * gh, 16 * gw
    aug = [forced(GEOMETRIC_POLICIES[op])]
    ds = dataset(quadrant_data, tl_pipeline(quadrant_data, aug=aug, scale=scale, order=order))
    L = 1 if order == 'timm' else 2  # public: the op, then the crop (crop_after_ops)
    head = TokenLabelingHead(num_classes=4, in_channels=8, label_smoothing=0.0)
    np.random.seed(0)
    quad = fill = 0
    for _ in range(10):
        items = [ds[i] for i in range(len(ds))]
        x = torch.stack([it['inputs'] for it in items])
        samples = [it['data_samples'] for it in items]
        assert x.shape[-2:] == (H, W) and all(s.token_affines.shape == (L, 2, 3) for s in samples)
        _, dense = head.targets(samples, None, (gh, gw))
        dense = dense.dense()  # (B, N, 4)
        torch.testing.assert_close(dense.sum(-1), torch.ones(len(x), gh * gw))
        tok = pixel_classes(x).view(-1, gh, 16, gw, 16).permute(0, 1, 3, 2, 4).reshape(len(x), gh * gw, 256)
        pure = (tok == tok[..., :1]).all(-1)
        q, f = pure & (tok[..., 0] != FILL), pure & (tok[..., 0] == FILL)
        assert torch.equal(dense.argmax(-1)[q], tok[..., 0][q])
        torch.testing.assert_close(dense[f], torch.full_like(dense[f], 0.25), atol=1e-6, rtol=0)
        quad, fill = quad + int(q.sum()), fill + int(f.sum())
    assert quad > 60, quad
    if op.startswith('translate'):
        assert fill > 0


def test_the_public_order_is_the_stock_pipeline_in_that_order_and_has_its_fill_share(quadrant_data):
    """The public order through our transforms gives, draw for draw, the images of mmpretrain's stock transforms in
    that order (RandomFlip -> RandAugment -> RandomResizedCrop: recording changes no pixel), and a rotation of the
    whole image leaves less fill in a crop than the same rotation of the crop (timm's order)."""
    aug = forced(GEOMETRIC_POLICIES['rotate'])
    stock_aug = dict(aug, type='RandAugment')
    stock_aug.pop('geometric')
    stock = [
        dict(type='LoadImageFromFile'),
        dict(type='RandomFlip', prob=0.5, direction='horizontal'),
        stock_aug,
        dict(type='RandomResizedCrop', scale=(48, 64), crop_ratio_range=(0.08, 1.0), interpolation='nearest'),
        dict(type='PackInputs'),
    ]
    shares = {}
    for order in ('public', 'timm'):
        ours = dataset(quadrant_data, tl_pipeline(quadrant_data, aug=[aug], scale=(48, 64), order=order))
        plain = dataset(quadrant_data, stock)
        fills = []
        for draw in range(20):
            for i in range(len(ours)):
                np.random.seed(draw)
                x = ours[i]['inputs']
                if order == 'public':
                    np.random.seed(draw)
                    assert torch.equal(x, plain[i]['inputs']), (draw, i)
                fills.append(float((pixel_classes(x[None]) == FILL).float().mean()))
        shares[order] = float(np.mean(fills))
    assert shares['public'] < shares['timm'], shares


def test_geometric_policies_must_follow_the_flip(quadrant_data):
    aug = forced(GEOMETRIC_POLICIES['rotate'])
    steps = tl_pipeline(quadrant_data, flip=None)
    steps = steps[:-1] + [aug, dict(type='RandomFlip', prob=0.5, direction='horizontal'), steps[-1]]
    with pytest.raises(ValueError, match='flipped after TokenLabelRandAugment'):
        dataset(quadrant_data, steps)[0]


def test_map_store_key_is_the_path_under_the_split_root(quadrant_data):
    t = TRANSFORMS.build(
        dict(type='LoadTokenLabelMap', store=str(quadrant_data / 'maps'), split_root=str(quadrant_data / 'train'))
    )
    out = t({'img_path': str(quadrant_data / 'train' / 'c1' / 'img3.png')})
    v, i = LabelMapStore.open(quadrant_data / 'maps').lookup('c1/img3.png')
    assert np.array_equal(out['token_label_values'], v) and np.array_equal(out['token_label_indices'], i)
    import pickle

    assert len(pickle.dumps(t)) < 2000  # the store pickles small; workers reopen its memory maps


# ---------------------------------------------------------------------------------- (b) loss and un-mixing
@pytest.mark.parametrize('cls_target', ['gt', 'annotator', 'mix'])
@pytest.mark.parametrize('backbone', ['mm', 'timm'])
def test_loss_equals_timm_token_labeling_loss(cls_target, backbone):
    model = tl_model(
        MM_VIT if backbone == 'mm' else dict(TIMM_VIT0, depth=2),
        cls_target=cls_target,
        cls_target_mix=0.3,
        label_smoothing=0.1,
    ).train()
    labels, values, indices, crops, flips = batch()
    x = torch.randn(4, 3, 64, 64)
    model.generator = torch.Generator().manual_seed(1)
    feats, mix, grid = model.extract_feat_mixed(x)
    assert mix is not None and grid == (4, 4) and 0 < mix.token_share.sum() < mix.token_share.numel()
    samples = packed_samples(labels, values, indices, crops, flips)
    losses = model.head.loss(feats, samples, mix=mix, grid=grid)
    assert set(losses) == {'loss_cls', 'loss_token'}
    cls, aux = model.head.logits(feats, mix)
    target = TokenLabelTarget.of(labels, CropMaps(torch.from_numpy(values), torch.from_numpy(indices), C, crops, flips))
    ref = TokenLabelingLoss(C, dense_weight=0.5, cls_target=cls_target, cls_target_mix=0.3, smoothing=0.1)(
        TokenLabelingOutput(cls, aux, mix, grid), target
    )
    torch.testing.assert_close(losses['loss_cls'] + losses['loss_token'], ref)
    # the classifier's loss() is the same computation (same MixToken draw)
    model.generator = torch.Generator().manual_seed(1)
    again = model.loss(x, packed_samples(labels, values, indices, crops, flips))
    torch.testing.assert_close(sum(again.values()), ref)
    sum(again.values()).backward()
    assert model.head.aux_head.weight.grad is not None
    embed = model.backbone.patch_embed.projection if backbone == 'mm' else model.backbone.timm_model.patch_embed.proj
    assert embed.weight.grad is not None


TIMM_BEYOND = {  # Token Labeling Table 5's families through TIMMBackbone: (backbone, width, pixels per output token)
    'resnet': (dict(type='TIMMBackbone', model_name='resnet18'), 512, 32),
    'resnest': (dict(type='TIMMBackbone', model_name='resnest14d'), 2048, 32),
    'mixer': (dict(type='TIMMBackbone', model_name='mixer_s16_224', img_size=64), 512, 16),
}


@pytest.mark.parametrize('family', sorted(TIMM_BEYOND))
def test_timm_cnn_and_mixer_backbones_match_the_timm_wrapper(family):
    """``TIMMBackbone`` around a timm CNN (MixToken pasted in the images on whole 32-px cells, one token per position
    of the final map) or an MLP-Mixer (MixToken after its stem, no class token): the mm classifier's class and
    un-mixed aux logits and loss equal timm_plugin's ``TokenLabeling`` on the same weights and MixToken draw (both
    read the tokens' mean for the class)."""
    import timm

    from timm_plugin.token_labeling import TokenLabeling, attach_aux_head

    backbone, dim, stride = TIMM_BEYOND[family]
    model = tl_model(backbone, dim).train()
    name = backbone['model_name']
    timm_model = timm.create_model(name, num_classes=C, **({'img_size': 64} if family == 'mixer' else {}))
    missing, _ = timm_model.load_state_dict(model.backbone.timm_model.state_dict(), strict=False)
    assert set(missing) <= {'fc.weight', 'fc.bias', 'head.weight', 'head.bias'}
    attach_aux_head(timm_model).get_classifier().load_state_dict(model.head.head.state_dict())
    timm_model.aux_head.load_state_dict(model.head.aux_head.state_dict())
    wrapper = TokenLabeling(timm_model.train(), generator=torch.Generator().manual_seed(1))
    assert model.label_stride == wrapper.label_stride == (stride, stride)
    x = torch.randn(4, 3, 64, 64)
    model.generator = torch.Generator().manual_seed(1)
    feats, mix, grid = model.extract_feat_mixed(x)
    out = wrapper(x)
    assert mix is not None and grid == out.grid == (64 // stride, 64 // stride)
    assert torch.equal(mix.token_share, out.mix.token_share)
    cls, aux = model.head.logits(feats, mix)
    torch.testing.assert_close(cls, out.cls, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(aux, out.aux, atol=1e-5, rtol=1e-4)
    labels, values, indices, crops, flips = batch()
    losses = model.head.loss(feats, packed_samples(labels, values, indices, crops, flips), mix=mix, grid=grid)
    target = TokenLabelTarget.of(labels, CropMaps(torch.from_numpy(values), torch.from_numpy(indices), C, crops, flips))
    ref = TokenLabelingLoss(C, dense_weight=0.5, smoothing=0.1)(out, target)
    torch.testing.assert_close(losses['loss_cls'] + losses['loss_token'], ref, atol=1e-5, rtol=1e-4)
    model.eval()
    with torch.no_grad():  # inference: cls + 0.5 max over the tokens
        torch.testing.assert_close(model.head(model.extract_feat(x)), wrapper.eval()(x), atol=1e-5, rtol=1e-4)


def test_relabel_is_the_annotators_pooled_class_target_without_dense_term():
    model = tl_model(relabel=True).train()
    assert model.head.aux_head is None and model.head.head_rule == 'cls'
    labels, values, indices, crops, flips = batch(seed=3)
    x = torch.randn(4, 3, 64, 64)
    model.generator = torch.Generator().manual_seed(2)
    feats, mix, grid = model.extract_feat_mixed(x)
    losses = model.head.loss(feats, packed_samples(labels, values, indices, crops, flips), mix=mix, grid=grid)
    assert set(losses) == {'loss_cls'}
    cls, _ = model.head.logits(feats)
    target = TokenLabelTarget.of(labels, CropMaps(torch.from_numpy(values), torch.from_numpy(indices), C, crops, flips))
    ref = TokenLabelingLoss(C, dense_weight=0.0, cls_target='annotator', smoothing=0.1)(
        TokenLabelingOutput(cls, None, mix, grid), target
    )
    torch.testing.assert_close(losses['loss_cls'], ref)


@pytest.mark.parametrize(
    'make', [lambda: tl_model(TIMM_VIT0), token_independent_mm_vit], ids=['timm-depth0', 'mm-1layer']
)
@pytest.mark.parametrize('mode', ['batch', 'pair'])
def test_unmixed_dense_outputs_are_each_samples_own(make, mode):
    """With a token-independent backbone, MixToken then un-mixing gives every sample its own per-token
    outputs, position by position; before un-mixing the box holds the partner's."""
    model = make().train()
    model.sampler.mode = mode
    x = torch.randn(6, 3, 64, 64)
    model.generator = torch.Generator().manual_seed(4)
    feats, mix, grid = model.extract_feat_mixed(x)
    assert mix is not None and 0 < mix.token_share.sum() < mix.token_share.numel()
    _, aux = model.head.logits(feats, mix)
    _, mixed = model.head.logits(feats)
    with torch.no_grad():
        _, plain = model.head.logits(model.extract_feat(x))
    torch.testing.assert_close(aux, plain, atol=1e-5, rtol=0)
    s = mix.token_share_flat().bool()[..., None]
    torch.testing.assert_close(mixed, torch.where(s, plain[mix.partner], plain), atol=1e-5, rtol=0)
    assert not torch.allclose(mixed, plain)


def test_mix_prob_zero_gives_the_stock_classifiers_loss():
    """MixToken on with probability 0, no dense term, ground-truth class target: the loss of mmpretrain's
    ImageClassifier + VisionTransformerClsHead + LabelSmoothLoss on the same weights."""
    model = MODELS.build(
        dict(
            type='TokenLabelingClassifier',
            mix_prob=0.0,
            backbone=dict(type='VisionTransformer', arch='deit-tiny', img_size=64, patch_size=16, out_type='raw'),
            neck=None,
            head=dict(type='TokenLabelingHead', num_classes=C, in_channels=192, dense_weight=0.0),
        )
    ).train()
    stock = MODELS.build(
        dict(
            type='ImageClassifier',
            backbone=dict(type='VisionTransformer', arch='deit-tiny', img_size=64, patch_size=16),
            neck=None,
            head=dict(
                type='VisionTransformerClsHead',
                num_classes=C,
                in_channels=192,
                loss=dict(type='LabelSmoothLoss', label_smooth_val=0.1, mode='original'),
            ),
        )
    ).train()
    sd = {k: v for k, v in model.state_dict().items() if not k.startswith('head.')}
    sd.update({'head.layers.head.weight': model.head.head.weight, 'head.layers.head.bias': model.head.head.bias})
    stock.load_state_dict(sd, strict=True)
    x, y = torch.randn(4, 3, 64, 64), torch.tensor([0, 1, 2, 3])
    plain = [DataSample().set_gt_label(int(i)) for i in y]  # no maps needed for this setting
    loss = model.loss(x, plain)
    assert set(loss) == {'loss_cls'}
    torch.testing.assert_close(loss['loss_cls'], stock.loss(x, [DataSample().set_gt_label(int(i)) for i in y])['loss'])


# ------------------------------------------------------------------------------------------ (c) predict
@pytest.mark.parametrize('backbone', ['mm', 'timm'])
def test_predict_rule_cls_plus_half_max_aux_or_cls(backbone):
    model = tl_model(MM_VIT if backbone == 'mm' else dict(TIMM_VIT0, depth=1)).eval()
    with torch.no_grad():  # a visible aux head
        model.head.aux_head.weight.normal_(0, 0.5)
    x = torch.randn(3, 3, 64, 64)
    with torch.no_grad():
        tokens = model.extract_feat(x)[-1]
        cls = model.head.head(tokens[:, 0])
        aux = model.head.aux_head(tokens[:, 1:])
        expected = cls + 0.5 * aux.max(1).values
        torch.testing.assert_close(model(x, mode='tensor'), expected)
        preds = model.predict(x)
        torch.testing.assert_close(torch.stack([p.pred_score for p in preds]), expected.softmax(1))
        assert [int(p.pred_label) for p in preds] == expected.argmax(1).tolist()
        model.head.head_rule = 'cls'
        torch.testing.assert_close(model(x, mode='tensor'), cls)
    assert not torch.allclose(cls, expected)


# ------------------------------------------------------------------------------------------- (e) errors
def test_pipeline_refuses_what_the_maps_cannot_follow(quadrant_data, tmp_path):
    img = str(quadrant_data / 'train' / 'c0' / 'img0.png')
    for flip in ('vertical', 'diagonal'):
        ds = dataset(quadrant_data, tl_pipeline(quadrant_data, flip=dict(type='RandomFlip', prob=1.0, direction=flip)))
        with pytest.raises(ValueError, match=f"flip_direction: .*img0.png.*flipped '{flip}'"):
            ds[0]
    resized = tl_pipeline(quadrant_data)
    resized.insert(2, dict(type='Resize', scale=(80, 80)))
    with pytest.raises(ValueError, match='resized or cropped before'):
        dataset(quadrant_data, resized)[0]
    flipped_twice = tl_pipeline(quadrant_data, flip=dict(type='RandomFlip', prob=0.0, direction='horizontal'))
    flipped_twice.insert(2, dict(type='RandomFlip', prob=1.0, direction='horizontal'))  # and before the crop
    with pytest.raises(ValueError, match='flipped before TokenLabelRandomResizedCrop and again after it'):
        dataset(quadrant_data, flipped_twice)[0]
    no_crop = [s for s in tl_pipeline(quadrant_data) if s['type'] != 'TokenLabelRandomResizedCrop']
    with pytest.raises(KeyError, match='crop box for image .*img0.png'):
        dataset(quadrant_data, no_crop)[0]
    no_map = [s for s in tl_pipeline(quadrant_data) if s['type'] != 'LoadTokenLabelMap']
    with pytest.raises(KeyError, match='no token-label map for image .*img0.png'):
        dataset(quadrant_data, no_map)[0]
    # an image the store does not know: the store's error names it
    root = tmp_path / 'data'
    shutil.copytree(quadrant_data / 'train', root / 'train')
    Image.fromarray(quadrant_image(64, 64, [[0, 1], [2, 3]])).save(root / 'train' / 'c0' / 'zz_new.png')
    os.symlink(quadrant_data / 'maps', root / 'maps')
    ds = dataset(root, tl_pipeline(root))
    with pytest.raises(MissingLabelMapError, match='c0/zz_new.png'):
        for i in range(len(ds)):
            ds[i]
    t = TRANSFORMS.build(dict(type='LoadTokenLabelMap', store=str(quadrant_data / 'maps'), split_root=str(tmp_path)))
    with pytest.raises(ValueError, match='split_root'):
        t({'img_path': img})


def test_randaugment_records_geometric_policies_or_drops_them():
    ra = TokenLabelRandAugment(policies='timm_increasing', num_policies=2, magnitude_level=9, magnitude_std=0.5)
    kinds = {p['type'] for p in ra.policies}
    assert {'TokenLabelRotate', 'TokenLabelShear', 'TokenLabelTranslate', 'Brightness', 'Equalize'} <= kinds
    assert not kinds & set(GEOMETRIC_RAND_POLICIES)  # each replaced by its recording subclass
    out = ra({'img': np.zeros((32, 48, 3), np.uint8)})
    assert out['img'].shape == (32, 48, 3) and out['token_affines'].shape[1:] == (2, 3)
    dropped = TokenLabelRandAugment(policies='timm_increasing', num_policies=2, magnitude_level=9, geometric='drop')
    kinds = {p['type'] for p in dropped.policies}
    assert kinds and not kinds & (set(GEOMETRIC_RAND_POLICIES) | {'TokenLabelRotate'}) and 'Equalize' in kinds
    assert dropped({'img': np.zeros((32, 48, 3), np.uint8)})['token_affines'].shape == (0, 2, 3)
    with pytest.raises(ValueError, match='policies: only geometric'):
        TokenLabelRandAugment(
            policies=[dict(type='Rotate', magnitude_range=(0, 30))], num_policies=1, magnitude_level=9, geometric='drop'
        )
    with pytest.raises(ValueError, match='geometric: expected one of'):
        TokenLabelRandAugment(policies='timm_increasing', num_policies=2, magnitude_level=9, geometric=True)


def test_model_errors_name_the_argument():
    vit = dict(type='VisionTransformer', arch='deit-tiny', img_size=64, patch_size=16, out_type='raw')
    head = dict(type='TokenLabelingHead', num_classes=C, in_channels=192)
    with pytest.raises(ValueError, match="out_type='raw'"):
        MODELS.build(dict(type='TokenLabelingClassifier', backbone=dict(vit, out_type='cls_token'), head=head))
    with pytest.raises(ValueError, match='backbone: token labeling supports .*TIMMBackbone around .*ResNet'):
        MODELS.build(
            dict(
                type='TokenLabelingClassifier', backbone=dict(type='ResNet', depth=18), head=dict(head, in_channels=512)
            )
        )
    with pytest.raises(ValueError, match='backbone: token labeling needs a timm ViT .*EfficientNet is neither'):
        MODELS.build(
            dict(
                type='TokenLabelingClassifier',
                backbone=dict(type='TIMMBackbone', model_name='efficientnet_b0'),
                head=dict(head, in_channels=1280),
            )
        )
    with pytest.raises(ValueError, match='train_cfg'):
        MODELS.build(
            dict(
                type='TokenLabelingClassifier',
                backbone=vit,
                head=head,
                train_cfg=dict(augments=[dict(type='CutMix', alpha=1.0)]),
            )
        )
    with pytest.raises(ValueError, match='head: token labeling needs a TokenLabelingHead'):
        MODELS.build(
            dict(
                type='TokenLabelingClassifier',
                backbone=vit,
                head=dict(type='VisionTransformerClsHead', num_classes=C, in_channels=192),
            )
        )
    with pytest.raises(ValueError, match='mix_mode'):
        MODELS.build(dict(type='TokenLabelingClassifier', backbone=vit, head=head, mix_mode='elem'))
    for kw, name in (
        (dict(relabel=True, dense_weight=0.5), 'dense_weight'),
        (dict(head_rule='max'), 'head_rule'),
        (dict(cls_target='teacher'), 'cls_target'),
        (dict(cls_target_pool='probabilities'), 'cls_target_pool'),
        (dict(relabel=True, cls_target='gt'), 'cls_target'),
        (dict(dense_weight=0.0, head_rule='cls+aux'), 'head_rule'),
    ):
        with pytest.raises(ValueError, match=name):
            TokenLabelingHead(num_classes=C, in_channels=8, **kw)
    model = tl_model().train()
    labels, values, indices, crops, flips = batch()
    with pytest.raises(ValueError, match='inputs: pairwise mixing .* got batch size 3'):
        model.loss(torch.randn(3, 3, 64, 64), packed_samples(labels, values, indices, crops, flips)[:3])
    with pytest.raises(ValueError, match='inputs: image size 72x64 is not divisible'):
        model.loss(torch.randn(4, 3, 72, 64), packed_samples(labels, values, indices, crops, flips))
    plain = [DataSample(metainfo=dict(img_path=f'p{i}.jpg')).set_gt_label(0) for i in range(4)]
    with pytest.raises(ValueError, match="data_samples: no token-label map .*'p0.jpg'"):
        model.loss(torch.randn(4, 3, 64, 64), plain)
    vertical = packed_samples(labels, values, indices, crops, flips)
    vertical[1].set_metainfo(dict(flip=True, flip_direction='vertical'))
    with pytest.raises(ValueError, match="flip_direction: .*img1.png.*'vertical'"):
        model.loss(torch.randn(4, 3, 64, 64), vertical)
    v7, i7 = random_rows(4, num_classes=7, seed=1)
    with pytest.raises(ValueError, match='token_label_indices: .* num_classes=5'):
        model.loss(torch.randn(4, 3, 64, 64), packed_samples(labels, v7, np.maximum(i7, 5), crops, flips))


# ----------------------------------------------------------------------------- (d) upstream tools/train.py
@pytest.mark.slow
def test_upstream_train_py_runs_the_token_labeling_config(tiny_world, tmp_path, run_env):
    run_env.update(TOKENAUG_WORLD=str(tiny_world), TOKENAUG_MAPS=str(random_world_maps(tiny_world, tmp_path / 'maps')))
    work = tmp_path / 'work'
    log = mmpretrain_train('deit-tiny_world_token-labeling.py', work, run_env, tmp_path)
    assert 'Epoch(train) [1][2/2]' in log and 'loss_token' in log and 'loss_cls' in log and 'accuracy/top1' in log
    dumped = (work / 'deit-tiny_world_token-labeling.py').read_text()
    assert "type='TokenLabelingClassifier'" in dumped and str(tmp_path / 'maps') in dumped


@pytest.mark.slow
def test_upstream_train_py_runs_the_mixer_token_labeling_config(tiny_world, tmp_path, run_env):
    """Token Labeling Table 5's MLP-Mixer through TIMMBackbone, by mmpretrain's own tools/train.py on the world."""
    run_env.update(TOKENAUG_WORLD=str(tiny_world), TOKENAUG_MAPS=str(random_world_maps(tiny_world, tmp_path / 'maps')))
    log = mmpretrain_train('mixer-s16_world_token-labeling.py', tmp_path / 'work', run_env, tmp_path)
    assert 'Epoch(train) [1][2/2]' in log and 'loss_token' in log and 'accuracy/top1' in log
    dumped = (tmp_path / 'work' / 'mixer-s16_world_token-labeling.py').read_text()
    assert "model_name='mixer_s16_224'" in dumped and "type='TIMMBackbone'" in dumped


# ----------------------------------------------------------------------------- TokenMix activation-map targets
def test_preprocessor_gives_tokenmix_activation_targets():
    """TATokenMix(activation_targets=...) under TokenAugDataPreprocessor: gt_score is Eq. 2's target from the
    packed maps, crops and flips of the batch, for the mix the preprocessor drew and applied."""
    from mmengine.registry import DefaultScope
    from mmpretrain.registry import MODELS as PRE_MODELS

    from mm_plugin import mix_from_samples
    from shared_core.label_maps import CropMaps
    from shared_core.mixing import mix_target
    from shared_core.tokenmix import activation_target

    labels, values, indices, crops, flips = batch()
    samples = packed_samples(labels, values, indices, crops, flips)
    with DefaultScope.overwrite_default_scope('mmpretrain'):
        pre = PRE_MODELS.build(
            dict(
                type='TokenAugDataPreprocessor',
                num_classes=C,
                patch_size=16,
                batch_augments=dict(
                    augments=[dict(type='TATokenMix', alpha=1.0, mask='block', activation_targets='true_class')]
                ),
            )
        )
    torch.manual_seed(0)
    out = pre(
        dict(inputs=[torch.randint(0, 255, (3, 64, 64), dtype=torch.uint8) for _ in range(4)], data_samples=samples),
        training=True,
    )
    mix = mix_from_samples(out['data_samples'])
    got = torch.stack([s.gt_score for s in out['data_samples']])
    want = activation_target(
        labels, mix, CropMaps(torch.from_numpy(values), torch.from_numpy(indices), C, crops, flips)
    )
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, mix_target(labels, mix, C))  # not the area target
    with pytest.raises(ValueError, match='activation_targets'):
        from mm_plugin import TATokenMix

        TATokenMix(activation_targets='logits')


@pytest.mark.slow
def test_upstream_train_py_runs_the_tokenmix_activation_config(tiny_world, tmp_path, run_env):
    run_env.update(TOKENAUG_WORLD=str(tiny_world), TOKENAUG_MAPS=str(random_world_maps(tiny_world, tmp_path / 'maps')))
    log = mmpretrain_train('deit-tiny_world_tokenmix.py', tmp_path / 'work', run_env, tmp_path)
    assert 'Epoch(train) [1][2/2]' in log and 'accuracy/top1' in log
    assert 'TATokenMix(tokenmix_block)' in log


def test_every_training_image_needs_a_map_before_training(quadrant_data, tmp_path):
    """TokenLabelStoreCheck (custom_hooks of our label-map configs): a store without the map of one training image
    is refused before the first iteration, naming it, not when the sample is first drawn."""
    from mmengine.config import Config

    from mm_plugin.token_label_transforms import check_dataset_maps

    from ..conftest import REPO

    assert check_dataset_maps(dataset(quadrant_data, tl_pipeline(quadrant_data))) == 6
    root = tmp_path / 'data'
    shutil.copytree(quadrant_data / 'train', root / 'train')
    os.symlink(quadrant_data / 'maps', root / 'maps')
    Image.fromarray(quadrant_image(64, 64, [[0, 1], [2, 3]])).save(root / 'train' / 'c0' / 'zz_new.png')
    with pytest.raises(MissingLabelMapError, match=r"'c0/zz_new.png'.*1 of the 7 training images have no map"):
        check_dataset_maps(dataset(root, tl_pipeline(root)))
    for name in ('deit-tiny_world_token-labeling.py', 'deit-tiny_world_tokenmix.py', 'deit-small_in1k_tokenmix.py'):
        cfg = Config.fromfile(str(REPO / 'configs' / 'mmpretrain' / name))
        assert dict(type='TokenLabelStoreCheck') in cfg.custom_hooks, name
