"""Every shipped config loads with its upstream tooling and builds what it names."""
import pytest
from mmengine.config import Config
from mmpretrain.registry import MODELS

import mm_plugin  # noqa: F401
from mm_plugin import TokenAugDataPreprocessor
from timm_plugin.train import parse_args
from .conftest import REPO

MM_CONFIGS = sorted(p for p in (REPO / 'configs' / 'mmpretrain').glob('*.py'))
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
    assert pre.patch_size == tuple(model.backbone.patch_embed.projection.stride)  # the backbone's token grid
    assert all(a.sampler.patch_size == pre.patch_size for a in pre.batch_augments.augments if a is not None)


@pytest.mark.parametrize('path', TIMM_CONFIGS, ids=lambda p: p.name)
def test_timm_config_parses(path):
    args = parse_args(['-c', str(path)])
    assert args.model and args.mixup_type in ('cutmix', 'tokenmix_block')


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
    with DefaultScope.overwrite_default_scope('mmseg'):
        model = SEG_MODELS.build(cfg.model)
    assert type(model.backbone).__name__ in ('VisionTransformer', 'SwinTransformer')


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
