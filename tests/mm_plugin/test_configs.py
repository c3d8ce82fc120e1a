"""Every shipped config loads with its upstream tooling and builds what it names."""

import pytest
from mmengine.config import Config
from mmpretrain.registry import MODELS

import mm_plugin  # noqa: F401
from mm_plugin import TokenAugDataPreprocessor
from timm_plugin.train import parse_args

from ..conftest import REPO

MM_CONFIGS = sorted(
    p for p in (REPO / 'configs' / 'mmpretrain').glob('*.py') if 'token-labeling' not in p.name and 'cct' not in p.name
)
TL_CONFIGS = sorted((REPO / 'configs' / 'mmpretrain').glob('*token-labeling*.py'))  # MixToken in the model
TIMM_CONFIGS = sorted((REPO / 'configs' / 'timm').glob('*.yaml'))


@pytest.mark.parametrize('path', MM_CONFIGS, ids=lambda p: p.name)
def test_mmpretrain_config_builds_our_preprocessor(path):
    cfg = Config.fromfile(str(path))
    assert 'mm_plugin' in cfg.custom_imports['imports']
    model_cfg = cfg.model
    model_cfg.data_preprocessor = cfg.data_preprocessor  # what the Runner does
    model = MODELS.build(model_cfg)
    pre = model.data_preprocessor
    assert isinstance(pre, TokenAugDataPreprocessor) and pre.batch_augments is not None
    if type(model.backbone).__name__ == 'TIMMBackbone':  # a timm CNN: the grid its label state starts on
        from timm_plugin.token_grid import tl_align_stride

        assert pre.patch_size == tl_align_stride(model.backbone.timm_model)
    else:  # the backbone's token grid: its patch embedding's (ConvNeXt's stem, PoolFormer's first embedding)
        stems = {'ConvNeXt': lambda b: b.downsample_layers[0][0], 'PoolFormer': lambda b: b.patch_embed.proj}
        stem = stems.get(type(model.backbone).__name__, lambda b: b.patch_embed.projection)(model.backbone)
        assert pre.patch_size == tuple(stem.stride)
    assert all(a.sampler.patch_size == pre.patch_size for a in pre.batch_augments.augments if a is not None)


@pytest.mark.parametrize('path', TL_CONFIGS, ids=lambda p: p.name)
def test_token_labeling_config_builds_its_model_and_pipeline(path):
    from mm_plugin import TokenLabelingClassifier

    cfg = Config.fromfile(str(path))
    assert 'mm_plugin' in cfg.custom_imports['imports']
    model_cfg = cfg.model
    model_cfg.data_preprocessor = cfg.data_preprocessor
    model = MODELS.build(model_cfg)
    assert isinstance(model, TokenLabelingClassifier) and model.data_preprocessor.batch_augments is None
    assert model.sampler.mode == 'batch' and model.sampler.cutmix_alpha == 1.0 and model.head.dense_weight == 0.5
    assert model.head.cls_target == 'gt' and model.head.head_rule == 'cls+aux'
    steps = [t['type'] for t in cfg.train_dataloader.dataset.pipeline]
    assert steps[:4] == ['LoadImageFromFile', 'LoadTokenLabelMap', 'TokenLabelRandomResizedCrop', 'RandomFlip']
    assert steps[-1] == 'PackTokenLabelInputs' and 'RandAugment' not in steps and 'TokenLabelRandAugment' in steps
    assert cfg.train_dataloader.drop_last
    if 'in1k' in path.name:  # the paper's recipe (token-labeling.md Sec. 4.1)
        opt = cfg.optim_wrapper.optimizer
        assert opt.type == 'AdamW' and opt.weight_decay == 0.05
        assert abs(opt.lr - 1e-3 * cfg.auto_scale_lr.base_batch_size / 640) < 1e-12
        assert cfg.train_cfg.max_epochs == 300 and cfg.param_scheduler[0].end == 5
        assert cfg.model.backbone.drop_path_rate == 0.1
        ra = cfg.train_dataloader.dataset.pipeline[steps.index('TokenLabelRandAugment')]
        assert ra.magnitude_level == 9 and ra.magnitude_std == 0.5
        assert cfg.train_dataloader.dataset.pipeline[steps.index('RandomErasing')].erase_prob == 0.25
    if 'mixer' in path.name or 'resnest' in path.name:  # Token Labeling Table 5's families via TIMMBackbone
        assert cfg.model.backbone.type == 'TIMMBackbone' and cfg.model.backbone.model_name in (
            'mixer_s16_224',
            'resnest50d',
        )
        if 'in1k' in path.name:  # Table 5: Mixer-S/16 18M, ResNeSt-50 27M with their classifier (not the aux head)
            expected = {'mixer_s16_224': 18, 'resnest50d': 27}[cfg.model.backbone.model_name]
            aux = sum(p.numel() for p in model.head.aux_head.parameters())
            assert int((sum(p.numel() for p in model.parameters()) - aux) / 1e6) == expected
    if 'lvvit' in path.name:
        assert cfg.model.backbone.model_name == 'lvvit_s' and 'timm_plugin' in cfg.custom_imports['imports']
        assert round(sum(p.numel() for p in model.parameters()) / 1e6) == 26  # Table 1: LV-ViT-S 26M


@pytest.mark.parametrize('path', TIMM_CONFIGS, ids=lambda p: p.name)
def test_timm_config_parses(path):
    args = parse_args(['-c', str(path)])
    tokenmixup = bool(args.tokenmixup_htm_layers or args.tokenmixup_vtm_layers)
    assert args.model and args.mixup_type in ('cutmix', 'tokenmix_block', 'mixtoken', 'tokenmix') + (
        (None,) if tokenmixup else ()
    )
    if tokenmixup and 'cifar100' in path.name:  # the public CCT configs (tokenmixup-reference §3)
        assert (args.model, args.num_classes, args.img_size, args.epochs, args.batch_size) == (
            'cct_7_3x1_32',
            100,
            32,
            1500,
            128,
        )
        assert (args.lr, args.weight_decay, args.warmup_lr, args.min_lr, args.smoothing) == (
            6e-4,
            0.06,
            1e-6,
            1e-5,
            0.1,
        )
        assert (args.mixup, args.cutmix, args.mixup_switch_prob, args.dataset) == (0.8, 1.0, 0.5, 'torch/cifar100')
        expected = {'htm': ([2], [], 3), 'vtm': ([], [2], 80), 'hvtm': ([3], [2], 3)}[path.stem.split('-')[-1]]
        assert (args.tokenmixup_htm_layers, args.tokenmixup_vtm_layers, args.tokenmixup_kappa) == expected
        if args.tokenmixup_htm_layers:
            assert (args.tokenmixup_tau, args.tokenmixup_rho, args.tokenmixup_scorenet_weight) == (0.2, 0.005, 0.001)
    if tokenmixup and 'cifar10_' in path.name:  # the public cct_cifar10_HTM.yaml, on the public model's name
        assert (args.model, args.num_classes, args.img_size, args.epochs, args.batch_size) == (
            'cct_7_3x1_32_sine',
            10,
            32,
            1500,
            128,
        )
        assert (args.lr, args.weight_decay, args.warmup_lr, args.min_lr, args.smoothing) == (
            5e-4,
            0.05,
            1e-5,
            1e-5,
            0.1,
        )
        assert (args.mean, args.std, args.dataset) == (
            [0.4914, 0.4822, 0.4465],
            [0.247, 0.2435, 0.2616],
            'torch/cifar10',
        )
        assert (args.tokenmixup_htm_layers, args.tokenmixup_tau, args.tokenmixup_rho) == ([2], 0.1, 0.003)
        assert args.tokenmixup_scorenet_weight == 0.001
    if tokenmixup and 'in1k' in path.name:  # the public ViT-B/16 scripts: SGD 0.015, 30 epochs, no mixing
        assert (args.model, args.opt, args.lr, args.epochs, args.clip_grad, args.mixup, args.cutmix) == (
            'vit_base_patch16_224',
            'momentum',
            0.015,
            30,
            1.0,
            0.0,
            0.0,
        )
        expected = {'htm': ([3], []), 'vtm': ([], [3]), 'hvtm': ([3], [4])}[path.stem.split('-')[-1]]
        assert (args.tokenmixup_htm_layers, args.tokenmixup_vtm_layers) == expected
        if args.tokenmixup_htm_layers:
            assert (args.tokenmixup_tau, args.tokenmixup_rho, args.tokenmixup_scorenet_weight) == (0.1, 0.01, 1.0)
            assert args.tokenmixup_scorenet_stopgrad and args.tokenmixup_scorenet == 'cls'
    if args.activation_map_dir:  # tokenmix.md Sec. 4.2: switch with MixUp at 0.5, BCE (Table 11)
        assert args.mixup > 0 and args.mixup_switch_prob == 0.5
        # Table 11: BCE for TokenMix on ImageNet; Table 7 keeps CutMix's CE; the CPU world schedule uses CE
        assert args.bce_loss == ('in1k' in path.name and args.mixup_type != 'cutmix')
        if 'in1k' in path.name and 'tokenmix' in path.name:
            assert args.mixup_type == 'tokenmix' and args.tokenmix_lam == 0.5 and args.tokenmix_mask == 'block'
            assert (
                args.lr_base,
                args.lr_base_size,
                args.weight_decay,
                args.epochs,
                args.warmup_epochs,
                args.min_lr,
            ) == (1e-3, 1024, 0.05, 300, 5, 1e-6)
    if args.mixup_type == 'mixtoken':  # token-labeling.md Sec. 4.1 / supplement Table 1: no MixUp, β = 0.5
        assert args.token_label_dir and args.mixup == 0 and args.dense_weight == 0.5 and args.cls_target == 'gt'
        if 'in1k' in path.name:
            assert (
                args.lr_base,
                args.lr_base_size,
                args.weight_decay,
                args.epochs,
                args.warmup_epochs,
                args.drop_path,
                args.reprob,
            ) == (1e-3, 640, 0.05, 300, 5, 0.1, 0.25)


SEG_CONFIGS = sorted((REPO / 'configs' / 'mmseg').glob('*.py'))


@pytest.mark.parametrize('path', SEG_CONFIGS, ids=lambda p: p.name)
def test_mmseg_config_builds_with_a_pretrained_backbone(path):
    from mmengine.registry import DefaultScope
    from mmseg.registry import MODELS as SEG_MODELS
    from mmseg.utils import register_all_modules

    register_all_modules(init_default_scope=False)  # a global default scope would leak into other tests
    cfg = Config.fromfile(str(path))
    assert 'mm_plugin' in cfg.custom_imports['imports']
    assert cfg.model.backbone.init_cfg['type'] == 'Pretrained' and cfg.model.get('pretrained') is None
    if 'world' not in path.name:  # the ADE20K recipes: 160k iterations, AdamW 6e-5, wd 0.01, batch 2 x 8 GPUs
        assert cfg.train_cfg.max_iters == 160000 and cfg.train_dataloader.batch_size == 2
        assert cfg.optim_wrapper.optimizer.lr == 6e-5 and cfg.optim_wrapper.optimizer.weight_decay == 0.01
    if 'lvvit' in path.name and 'world' not in path.name:  # Token Labeling Sec. 4.4: linear decay to 5e-6
        warmup, decay = cfg.param_scheduler
        assert warmup.type == 'LinearLR' and (warmup.begin, warmup.end) == (0, 1500)
        assert decay.type == 'PolyLR' and decay.power == 1.0 and decay.eta_min == 5e-6
        assert (decay.begin, decay.end) == (1500, 160000)
        assert cfg.model.backbone.type == 'LVViT' and cfg.model.backbone.img_size == (512, 512)
    with DefaultScope.overwrite_default_scope('mmseg'):
        model = SEG_MODELS.build(cfg.model)
    assert type(model.backbone).__name__ in ('VisionTransformer', 'SwinTransformer', 'LVViT')
    if 'lvvit-s' in path.name:  # Token Labeling Table 7: LV-ViT-S + FCN 30M, + UperNet 44M (all heads counted)
        params = sum(p.numel() for p in model.parameters()) / 1e6
        assert round(params) == (30 if path.name.startswith('fcn') else 44), params


DET_CONFIGS = sorted((REPO / 'configs' / 'mmdet').glob('*.py'))


@pytest.mark.parametrize('path', DET_CONFIGS, ids=lambda p: p.name)
def test_mmdet_cascade_config_builds(path):
    from mmdet.registry import MODELS as DET_MODELS
    from mmdet.utils import register_all_modules
    from mmengine.registry import DefaultScope

    register_all_modules(init_default_scope=False)
    cfg = Config.fromfile(str(path))
    assert cfg.model.type == 'CascadeRCNN' and cfg.model.backbone.type == 'SwinTransformer'
    heads = cfg.model.roi_head.bbox_head
    assert [h.type for h in heads] == ['Shared4Conv1FCBBoxHead'] * 3 and heads[0].loss_bbox.type == 'GIoULoss'
    if 'world' not in path.name:  # the Swin detection 3x recipe
        assert cfg.train_cfg.max_epochs == 36 and cfg.param_scheduler[1].milestones == [27, 33]
        assert cfg.optim_wrapper.optimizer.lr == 1e-4 and cfg.optim_wrapper.optimizer.weight_decay == 0.05
    with DefaultScope.overwrite_default_scope('mmdet'):
        DET_MODELS.build(cfg.model)
