"""MMPretrain adapter: real data preprocessor, real ImageClassifier, real upstream tools/train.py."""

import pytest
import torch
from mmengine.config import Config
from mmpretrain.models import ClsDataPreprocessor
from mmpretrain.registry import BATCH_AUGMENTS, MODELS
from mmpretrain.structures import DataSample

import mm_plugin  # noqa: F401  (registers the modules)
from mm_plugin import TokenAugDataPreprocessor, mix_from_samples
from shared_core.mixing import mix_images

from ..conftest import REPO
from ..helpers.processes import mmpretrain_train

CONFIGS = REPO / 'configs' / 'mmpretrain'


def _batch(n=4, size=32, num_classes=5):
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randint(0, 256, (3, size, size), generator=g, dtype=torch.uint8) for _ in range(n)]
    samples = [DataSample().set_gt_label(i % num_classes) for i in range(n)]
    return dict(inputs=inputs, data_samples=samples)


@pytest.mark.parametrize(
    'aug',
    [
        dict(type='TAMixup', alpha=0.8),
        dict(type='TACutMix', alpha=1.0),
        dict(type='TAMixToken', alpha=1.0),
        dict(type='TATokenMix', alpha=1.0, mask='block'),
        dict(type='TATokenMix', alpha=1.0, mask='random', lam=0.5),
    ],
)
def test_preprocessor_carries_the_mix(aug):
    pre = MODELS.build(
        dict(
            type='TokenAugDataPreprocessor',
            num_classes=5,
            patch_size=8,
            mean=[0.0] * 3,
            std=[255.0] * 3,
            batch_augments=dict(augments=[aug]),
        )
    )
    plain = ClsDataPreprocessor(num_classes=5, mean=[0.0] * 3, std=[255.0] * 3)
    data = _batch()
    ref = plain(_batch(), training=False)['inputs']
    out = pre(data, training=True)
    mix = mix_from_samples(out['data_samples'])
    assert mix is not None and mix.kind == {'TAMixup': 'mixup', 'TACutMix': 'cutmix', 'TAMixToken': 'token_box'}.get(
        aug['type'], f'tokenmix_{aug.get("mask")}'
    )
    assert torch.allclose(out['inputs'], mix_images(ref, mix))
    scores = torch.stack([s.gt_score for s in out['data_samples']])
    assert torch.allclose(scores.sum(1), torch.ones(4))
    for i, s in enumerate(out['data_samples']):
        lam = float(mix.lam[i])
        own, partner = i % 5, int(mix.partner[i]) % 5
        expected = torch.zeros(5)
        expected[own] += lam
        expected[partner] += 1 - lam
        assert torch.allclose(s.gt_score, expected, atol=1e-6)
    # evaluation: nothing mixed, no mix
    out = pre(_batch(), training=False)
    assert torch.allclose(out['inputs'], ref) and mix_from_samples(out['data_samples']) is None


def test_unmixed_batches_get_the_identity_mix():
    pre = TokenAugDataPreprocessor(
        num_classes=5, patch_size=8, batch_augments=dict(augments=[dict(type='TATokenMix', alpha=1.0)], probs=[0.0])
    )
    out = pre(_batch(), training=True)
    mix = mix_from_samples(out['data_samples'])
    assert mix.kind == 'none' and torch.all(mix.lam == 1)


def test_stock_contract_with_stock_preprocessor():
    aug = BATCH_AUGMENTS.build(dict(type='TATokenMix', alpha=1.0, patch_size=8))
    assert aug.sampler.patch_size == (8, 8)
    x = torch.randn(4, 3, 32, 32)
    score = torch.eye(4)
    xm, s = aug(x, score)
    assert xm.shape == x.shape and torch.allclose(s.sum(1), torch.ones(4))
    pre = ClsDataPreprocessor(num_classes=5, batch_augments=dict(augments=[dict(type='TACutMix', alpha=1.0)]))
    out = pre(_batch(), training=True)
    assert torch.allclose(torch.stack([d.gt_score for d in out['data_samples']]).sum(1), torch.ones(4))


def test_real_classifier_train_step():
    cfg = Config.fromfile(str(CONFIGS / 'deit-tiny_world_tokenmix-block.py'))
    model_cfg = cfg.model
    model_cfg.data_preprocessor = dict(cfg.data_preprocessor, num_classes=10)
    model_cfg.data_preprocessor.patch_size = 8
    model_cfg.backbone.update(img_size=32, patch_size=8)
    model = MODELS.build(model_cfg)
    assert isinstance(model.data_preprocessor, TokenAugDataPreprocessor)
    from mmengine.optim import OptimWrapper

    optim = OptimWrapper(torch.optim.AdamW(model.parameters(), lr=1e-3))
    losses = model.train_step(_batch(num_classes=10), optim)
    assert torch.isfinite(losses['loss'])


def test_bad_input():
    with pytest.raises(ValueError, match='batch_augments: .*Mixup'):
        TokenAugDataPreprocessor(num_classes=5, batch_augments=dict(augments=[dict(type='Mixup', alpha=1.0)]))
    with pytest.raises(ValueError, match='num_classes'):
        TokenAugDataPreprocessor(batch_augments=dict(augments=[dict(type='TAMixup', alpha=1.0)]))
    with pytest.raises(ValueError, match='patch_size: TATokenMix names'):
        TokenAugDataPreprocessor(
            num_classes=5,
            patch_size=8,
            batch_augments=dict(augments=[dict(type='TATokenMix', alpha=1.0, patch_size=16)]),
        )
    pre = TokenAugDataPreprocessor(
        num_classes=5, patch_size=8, batch_augments=dict(augments=[dict(type='TATokenMix', alpha=1.0)])
    )
    out = pre(_batch(n=3), training=True)  # any batch size, as mmpretrain: the middle sample partners itself
    assert out['inputs'].shape[0] == 3 and out['data_samples'][1].batch_mix.partner.tolist() == [2, 1, 0]
    with pytest.raises(ValueError, match='patch_size'):
        pre(_batch(size=36), training=True)
    with pytest.raises(ValueError, match=r'gt_label: .*num_classes=5'):
        data = _batch()
        data['data_samples'][0].set_gt_label(7)
        pre(data, training=True)
    with pytest.raises(ValueError, match='mask'):
        BATCH_AUGMENTS.build(dict(type='TATokenMix', mask='blocks'))


@pytest.mark.slow
@pytest.mark.parametrize('config', ['deit-tiny_world_tokenmix-block.py', 'deit-tiny_world_cutmix.py'])
def test_upstream_train_py_two_iterations_and_resume(tiny_world, tmp_path, run_env, config):
    """mmpretrain's shipped tools/train.py runs our config unchanged; the checkpoint it writes resumes
    under torch's default weights_only=True (mm_plugin.enable_safe_load in the config). The CutMix config runs in
    fresh interpreters, where nothing but the config's ``custom_imports`` registers our modules and makes the load
    safe."""
    run_env['TOKENAUG_WORLD'] = str(tiny_world)
    fresh = config == 'deit-tiny_world_cutmix.py'
    log = mmpretrain_train(config, tmp_path, run_env, tmp_path, fresh_process=fresh)
    assert 'Epoch(train) [1][2/2]' in log and 'accuracy/top1' in log
    assert 'TokenAugDataPreprocessor: mixes with' in log  # the runner built our preprocessor from the config
    assert (tmp_path / 'epoch_1.pth').exists()
    log = mmpretrain_train(config, tmp_path, run_env, tmp_path, '--resume', max_epochs=2, fresh_process=fresh)
    assert 'resumed epoch: 1, iter: 2' in log and 'Epoch(train) [2][2/2]' in log


@pytest.mark.parametrize('batch', [1, 3, 5])
@pytest.mark.parametrize(
    'aug',
    [
        dict(type='TAMixup', alpha=1.0),
        dict(type='TACutMix', alpha=1.0),
        dict(type='TAMixToken', alpha=1.0, mode='pair'),
        dict(type='TATokenMix', alpha=1.0, lam=0.5, mode='elem'),
    ],
)
def test_batch_augments_take_any_batch_size_as_mmpretrains(aug, batch):
    """mmpretrain's augments mix any batch size; ours pair sample i with B-1-i, so an odd batch's middle sample
    (and a batch of 1) is mixed with itself: image and score unchanged, the others mixed as usual."""
    from mmpretrain.registry import BATCH_AUGMENTS

    a = BATCH_AUGMENTS.build(aug)
    g = torch.Generator().manual_seed(0)
    x = torch.rand(batch, 3, 32, 32, generator=g)
    score = torch.nn.functional.one_hot(torch.arange(batch) % 10, 10).float()
    out, mixed = a(x.clone(), score.clone())
    mid = batch // 2
    torch.testing.assert_close(out[mid], x[mid])
    torch.testing.assert_close(mixed[mid], score[mid])
    torch.testing.assert_close(mixed.sum(1), torch.ones(batch))
    assert a.last_mix is None or a.last_mix.partner.tolist() == list(range(batch - 1, -1, -1))


def test_tokenmix_blocks_on_a_resnet_in_image_space():
    """TokenMix Table 8's ResNet-50 row on MMPretrain: ``TATokenMix`` block masks are pasted in the images on the data
    preprocessor's grid, so a CNN trains with them unchanged (here a timm ResNet-18 through TIMMBackbone and mm's own
    ResNet-18, 16-px masks on 32x32 images, one train step each)."""
    from mmengine.optim import OptimWrapper

    for backbone, width in (
        (dict(type='TIMMBackbone', model_name='resnet18'), 512),
        (dict(type='ResNet', depth=18), 512),
    ):
        model = MODELS.build(
            dict(
                type='ImageClassifier',
                backbone=backbone,
                neck=dict(type='GlobalAveragePooling'),
                head=dict(type='LinearClsHead', num_classes=10, in_channels=width, loss=dict(type='CrossEntropyLoss')),
                data_preprocessor=dict(
                    type='TokenAugDataPreprocessor',
                    num_classes=10,
                    patch_size=16,
                    batch_augments=dict(augments=[dict(type='TATokenMix', alpha=1.0, mask='block', lam=0.5)]),
                ),
            )
        )
        data = model.data_preprocessor(_batch(num_classes=10), training=True)
        mix = data['data_samples'][0].batch_mix
        assert mix.kind == 'tokenmix_block' and mix.grid_size == (2, 2) and mix.patch_size == (16, 16)
        optim = OptimWrapper(torch.optim.AdamW(model.parameters(), lr=1e-3))
        assert torch.isfinite(model.train_step(_batch(num_classes=10), optim)['loss'])
