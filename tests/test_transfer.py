"""Transfer end to end: a converted tokenaug checkpoint trained and tested by the upstream mmseg tools."""
import subprocess
from pathlib import Path

import mmdet
import mmseg
import pytest
import timm
import torch

from shared_core.world import generate_world
from .conftest import REPO

SEG_TOOLS = Path(mmseg.__file__).parent / '.mim' / 'tools'


@pytest.mark.slow
def test_mmseg_train_and_test_from_a_converted_checkpoint(tmp_path, run_env):
    world = tmp_path / 'world'
    generate_world(world, seed=0, num_classes=10, image_size=112, train_per_class=2, val_per_class=1,
                   formats=('ade20k',))
    torch.manual_seed(0)
    torch.save({'state_dict': timm.create_model('vit_tiny_patch16_224', img_size=112, num_classes=10).state_dict()},
               tmp_path / 'cls.pth')
    res = subprocess.run(['tokenaug-convert', '--src', str(tmp_path / 'cls.pth'), '--dst', str(tmp_path / 'seg.pth'),
                          '--to', 'mmseg', '--model', 'vit_tiny_patch16_224', '--model-kwargs', 'img_size=112'],
                         env=run_env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    run_env.update(TOKENAUG_WORLD=str(world), TOKENAUG_BACKBONE=str(tmp_path / 'seg.pth'))
    config = str(REPO / 'configs' / 'mmseg' / 'upernet_vit-tiny_world.py')
    res = subprocess.run(['python', str(SEG_TOOLS / 'train.py'), config, '--work-dir', str(tmp_path / 'work'),
                          '--cfg-options', 'train_cfg.max_iters=2', 'train_cfg.val_interval=2',
                          'train_dataloader.num_workers=0', 'val_dataloader.num_workers=0',
                          'default_hooks.checkpoint.interval=2'],
                         env=run_env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-4000:]
    assert f'Loads checkpoint by local backend from path: {tmp_path / "seg.pth"}' in log
    assert 'unexpected key' not in log and 'missing keys' not in log
    res = subprocess.run(['python', str(SEG_TOOLS / 'test.py'), config, str(tmp_path / 'work' / 'iter_2.pth'),
                          '--work-dir', str(tmp_path / 'test'), '--cfg-options', 'test_dataloader.num_workers=0'],
                         env=run_env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-4000:]
    assert 'mIoU:' in log


@pytest.mark.slow
def test_mmseg_fcn_train_and_test_from_a_converted_lvvit(tmp_path, run_env):
    """LV-ViT-T (112 px) -> tokenaug-convert -> our FCN world config through mmseg's own tools."""
    world = tmp_path / 'world'
    generate_world(world, seed=0, num_classes=10, image_size=112, train_per_class=2, val_per_class=1,
                   formats=('ade20k',))
    import timm_plugin  # noqa: F401  (registers lvvit_*)
    torch.manual_seed(0)
    torch.save({'state_dict': timm.create_model('lvvit_t', img_size=112, num_classes=10).state_dict()},
               tmp_path / 'cls.pth')
    res = subprocess.run(['tokenaug-convert', '--src', str(tmp_path / 'cls.pth'), '--dst', str(tmp_path / 'seg.pth'),
                          '--to', 'mmseg', '--model', 'lvvit_t', '--model-kwargs', 'img_size=112'],
                         env=run_env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "dropped (training-only): ['aux_head.bias', 'aux_head.weight', 'head.bias', 'head.weight'" in res.stdout
    run_env.update(TOKENAUG_WORLD=str(world), TOKENAUG_BACKBONE=str(tmp_path / 'seg.pth'))
    config = str(REPO / 'configs' / 'mmseg' / 'fcn_lvvit-tiny_world.py')
    res = subprocess.run(['python', str(SEG_TOOLS / 'train.py'), config, '--work-dir', str(tmp_path / 'work'),
                          '--cfg-options', 'train_cfg.max_iters=2', 'train_cfg.val_interval=2',
                          'train_dataloader.num_workers=0', 'val_dataloader.num_workers=0',
                          'default_hooks.checkpoint.interval=2'],
                         env=run_env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-4000:]
    assert f'Loads checkpoint by local backend from path: {tmp_path / "seg.pth"}' in log
    assert 'unexpected key' not in log and 'missing keys' not in log
    res = subprocess.run(['python', str(SEG_TOOLS / 'test.py'), config, str(tmp_path / 'work' / 'iter_2.pth'),
                          '--work-dir', str(tmp_path / 'test'), '--cfg-options', 'test_dataloader.num_workers=0'],
                         env=run_env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-4000:]
    assert 'mIoU:' in log


@pytest.mark.slow
def test_mmdet_cascade_train_and_test_from_a_converted_swin(tmp_path, run_env):
    """Our Cascade Mask R-CNN Swin-T config (world variant) through mmdet's own tools: 2 iterations, then
    test.py reports box and mask AP (2 validation images, to keep CPU time down)."""
    world = tmp_path / 'world'
    generate_world(world, seed=0, num_classes=10, image_size=112, train_per_class=2, val_per_class=1,
                   formats=('coco',))
    torch.manual_seed(0)
    torch.save({'state_dict': timm.create_model('swin_tiny_patch4_window7_224', num_classes=10).state_dict()},
               tmp_path / 'cls.pth')
    res = subprocess.run(['tokenaug-convert', '--src', str(tmp_path / 'cls.pth'), '--dst', str(tmp_path / 'det.pth'),
                          '--to', 'mmdet', '--model', 'swin_tiny_patch4_window7_224'],
                         env=run_env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    run_env.update(TOKENAUG_WORLD=str(world), TOKENAUG_BACKBONE=str(tmp_path / 'det.pth'))
    tools = Path(mmdet.__file__).parent / '.mim' / 'tools'
    config = str(REPO / 'configs' / 'mmdet' / 'cascade-mask-rcnn_swin-t_world.py')
    small = ['train_dataloader.num_workers=0', 'val_dataloader.num_workers=0', 'test_dataloader.num_workers=0',
             'val_dataloader.dataset.indices=2', 'test_dataloader.dataset.indices=2']
    res = subprocess.run(['python', str(tools / 'train.py'), config, '--work-dir', str(tmp_path / 'work'),
                          '--cfg-options', 'train_dataloader.dataset.indices=4', 'train_cfg.max_epochs=1',
                          'train_cfg.val_interval=2', *small],
                         env=run_env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-4000:]
    assert 'Epoch(train) [1][2/2]' in log and 'unexpected key' not in log and 'missing keys' not in log
    res = subprocess.run(['python', str(tools / 'test.py'), config, str(tmp_path / 'work' / 'epoch_1.pth'),
                          '--work-dir', str(tmp_path / 'test'), '--cfg-options', *small],
                         env=run_env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-4000:]
    assert 'coco/bbox_mAP' in log and 'coco/segm_mAP' in log
