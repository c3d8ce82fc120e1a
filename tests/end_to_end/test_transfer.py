"""Transfer end to end: a converted tokenaug checkpoint trained and tested by the upstream mmseg tools."""

from pathlib import Path

import mmdet
import mmseg
import pytest
import timm
import torch

from shared_core.tools.world import generate_world
from tokenaug import commands

from ..conftest import REPO
from ..helpers.processes import call_main, upstream_tool

SEG_TOOLS = Path(mmseg.__file__).parent / '.mim' / 'tools'
DET_TOOLS = Path(mmdet.__file__).parent / '.mim' / 'tools'


def convert(tmp_path, capsys, model, to, dst, img_size=None):
    """A freshly initialised (seed 0) 10-class timm ``model`` saved as tmp_path/cls.pth and converted by
    tokenaug-convert (its main, in this process) to
    tmp_path/``dst`` for ``to``; tokenaug-convert's stdout."""
    size = {} if img_size is None else dict(img_size=img_size)
    torch.manual_seed(0)
    torch.save({'state_dict': timm.create_model(model, **size, num_classes=10).state_dict()}, tmp_path / 'cls.pth')
    argv = ['--src', tmp_path / 'cls.pth', '--dst', tmp_path / dst, '--to', to, '--model', model]
    argv += ['--model-kwargs', f'img_size={img_size}'] if size else []
    code, out, err = call_main(commands.convert, argv, capsys)
    assert code == 0, err[-2000:]
    return out


def train_and_test(tools, config, checkpoint, tmp_path, env, train_opts, test_opts):
    """The upstream ``tools``' train.py (work dir tmp_path/work) then test.py on the ``checkpoint`` it wrote
    (work dir tmp_path/test), both run in tmp_path (in this process: :func:`upstream_tool`); their logs."""
    train_log = upstream_tool(
        tools / 'train.py', [config, '--work-dir', tmp_path / 'work', '--cfg-options', *train_opts], env, tmp_path
    )
    test_log = upstream_tool(
        tools / 'test.py',
        [config, tmp_path / 'work' / checkpoint, '--work-dir', tmp_path / 'test', '--cfg-options', *test_opts],
        env,
        tmp_path,
    )
    return train_log, test_log


def mmseg_world_transfer(tmp_path, capsys, env, model, config):
    """A 112 px ``model`` converted for mmseg, then our world ``config`` (configs/mmseg) through mmseg's own
    train.py (2 iterations, from the converted backbone) and test.py; tokenaug-convert's stdout."""
    world = tmp_path / 'world'
    generate_world(
        world, seed=0, num_classes=10, image_size=112, train_per_class=2, val_per_class=1, formats=('ade20k',)
    )
    converted = convert(tmp_path, capsys, model, 'mmseg', 'seg.pth', img_size=112)
    env.update(TOKENAUG_WORLD=str(world), TOKENAUG_BACKBONE=str(tmp_path / 'seg.pth'))
    train_log, test_log = train_and_test(
        SEG_TOOLS,
        REPO / 'configs' / 'mmseg' / config,
        'iter_2.pth',
        tmp_path,
        env,
        train_opts=[
            'train_cfg.max_iters=2',
            'train_cfg.val_interval=2',
            'train_dataloader.num_workers=0',
            'val_dataloader.num_workers=0',
            'default_hooks.checkpoint.interval=2',
        ],
        test_opts=['test_dataloader.num_workers=0'],
    )
    assert f'Loads checkpoint by local backend from path: {tmp_path / "seg.pth"}' in train_log
    assert 'unexpected key' not in train_log and 'missing keys' not in train_log
    assert 'mIoU:' in test_log
    return converted


@pytest.mark.slow
def test_mmseg_train_and_test_from_a_converted_checkpoint(tmp_path, capsys, run_env):
    mmseg_world_transfer(tmp_path, capsys, run_env, 'vit_tiny_patch16_224', 'upernet_vit-tiny_world.py')


@pytest.mark.slow
def test_mmseg_fcn_train_and_test_from_a_converted_lvvit(tmp_path, capsys, run_env):
    """LV-ViT-T (112 px) -> tokenaug-convert -> our FCN world config through mmseg's own tools."""
    import timm_plugin  # noqa: F401  (registers lvvit_*)

    converted = mmseg_world_transfer(tmp_path, capsys, run_env, 'lvvit_t', 'fcn_lvvit-tiny_world.py')
    assert "dropped (training-only): ['aux_head.bias', 'aux_head.weight', 'head.bias', 'head.weight'" in converted


@pytest.mark.slow
def test_mmdet_cascade_train_and_test_from_a_converted_swin(tmp_path, capsys, run_env):
    """Our Cascade Mask R-CNN Swin-T config (world variant) through mmdet's own tools: 2 iterations, then
    test.py reports box and mask AP (2 validation images, to keep CPU time down)."""
    world = tmp_path / 'world'
    generate_world(world, seed=0, num_classes=10, image_size=112, train_per_class=2, val_per_class=1, formats=('coco',))
    convert(tmp_path, capsys, 'swin_tiny_patch4_window7_224', 'mmdet', 'det.pth')
    run_env.update(TOKENAUG_WORLD=str(world), TOKENAUG_BACKBONE=str(tmp_path / 'det.pth'))
    small = [
        'train_dataloader.num_workers=0',
        'val_dataloader.num_workers=0',
        'test_dataloader.num_workers=0',
        'val_dataloader.dataset.indices=2',
        'test_dataloader.dataset.indices=2',
    ]
    train_log, test_log = train_and_test(
        DET_TOOLS,
        REPO / 'configs' / 'mmdet' / 'cascade-mask-rcnn_swin-t_world.py',
        'epoch_1.pth',
        tmp_path,
        run_env,
        train_opts=['train_dataloader.dataset.indices=4', 'train_cfg.max_epochs=1', 'train_cfg.val_interval=2', *small],
        test_opts=small,
    )
    assert 'Epoch(train) [1][2/2]' in train_log
    assert 'unexpected key' not in train_log and 'missing keys' not in train_log
    assert 'coco/bbox_mAP' in test_log and 'coco/segm_mAP' in test_log
