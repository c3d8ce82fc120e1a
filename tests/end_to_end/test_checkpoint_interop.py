"""Checkpoints users bring from timm's own ``train.py``: its ``CheckpointSaver`` stores ``args`` as an
``argparse.Namespace``, the one global timm's loader allows. Every entry point that reads a classification
checkpoint reads it with :func:`shared_core.checkpoint_io.load_checkpoint_file` (``weights_only=True`` plus that
global): the converter, the annotator of ``tokenaug-maps generate`` / ``tokenaug-occlusion``, ``tokenaug-viz``,
and ``tokenaug-train``'s ``--initial-checkpoint`` / ``--pretrained-path`` / ``--resume``. A file with any other
global is refused without running it.

And from mmpretrain's own ``tools/train.py`` (MMEngine's Runner): the converter and the mm configs read it (with
MMEngine's own types allowed, ``mm_plugin.allow_mmengine_checkpoints``); the timm entry points name it as an
MMEngine checkpoint and the route, ``tokenaug-convert --from mmpretrain --to timm``, whose output they take with
the mmpretrain model's logits."""

import argparse
import os
import re
import subprocess
import sys

import pytest
import timm
import torch
from timm.optim import create_optimizer_v2
from timm.utils import CheckpointSaver, ModelEmaV3

from ..conftest import REPO, VENV_BIN
from ..end_to_end.test_faults import train_cmd
from ..helpers.processes import mmpretrain_train

KW = dict(img_size=112, depth=2, num_classes=10)  # tests/end_to_end/test_faults.py's FAST model of the world config


@pytest.fixture(scope='module')
def timm_checkpoint(tmp_path_factory):
    """``last.pth.tar`` as timm's train.py writes it: model, optimizer, EMA, args as a Namespace, the saver's
    bookkeeping; written by timm's own CheckpointSaver."""
    out = tmp_path_factory.mktemp('timm_run')
    torch.manual_seed(0)
    model = timm.create_model('vit_tiny_patch16_224', **KW)
    opt = create_optimizer_v2(model, 'adamw', lr=1e-3, weight_decay=0.05)  # as train.py, the config's
    args = argparse.Namespace(model='vit_tiny_patch16_224', lr=1e-3, epochs=2, seed=0)
    saver = CheckpointSaver(model, opt, args=args, model_ema=ModelEmaV3(model), checkpoint_dir=str(out))
    saver.save_checkpoint(epoch=0, metric=12.5)
    path = out / 'last.pth.tar'
    with pytest.raises(Exception, match='Namespace'):  # what a stricter weights-only reader refuses
        torch.load(path, weights_only=True)
    return path, model


def test_the_reader_loads_it_and_refuses_other_globals(timm_checkpoint, tmp_path):
    from shared_core.checkpoint_io import CheckpointError, load_checkpoint_file

    path, model = timm_checkpoint
    ckpt = load_checkpoint_file(path, '--checkpoint')
    assert isinstance(ckpt['args'], argparse.Namespace) and ckpt['epoch'] == 0
    for k, v in model.state_dict().items():
        assert torch.equal(ckpt['state_dict'][k], v), k
    evil = tmp_path / 'evil.pth.tar'
    torch.save({'args': argparse.Namespace(a=1), 'state_dict': {}, 'x': os.system}, evil)
    with pytest.raises(CheckpointError, match=r'--checkpoint: .*evil.pth.tar holds Python objects .*\(posix.system\)'):
        load_checkpoint_file(evil, '--checkpoint')


def test_the_converter_and_the_annotator_take_it(timm_checkpoint, tmp_path):
    from mm_plugin.convert_cli import convert_checkpoint
    from timm_plugin.annotator import create_annotator

    path, model = timm_checkpoint
    report = convert_checkpoint(
        str(path), str(tmp_path / 'mmseg.pth'), 'mmseg', 'vit_tiny_patch16_224', model_kwargs=dict(KW)
    )
    assert report and (tmp_path / 'mmseg.pth').is_file()
    annotator = create_annotator(
        'vit_tiny_patch16_224', checkpoint=str(path), num_classes=10, model_kwargs=dict(img_size=112, depth=2)
    )
    x = torch.randn(2, 3, 112, 112)
    with torch.no_grad():
        assert torch.equal(annotator(x), model.eval()(x))


@pytest.mark.slow
def test_tokenaug_train_takes_it_as_initial_pretrained_and_resumed_checkpoint(timm_checkpoint, tiny_world, tmp_path):
    from timm_plugin.train import run

    path, _ = timm_checkpoint
    data = tiny_world / 'imagenet'
    for i, extra in enumerate((['--initial-checkpoint', str(path)], ['--pretrained-path', str(path)])):
        metrics = run(train_cmd(data, tmp_path, f'init{i}', '--epochs', '1', *extra))
        assert 0 <= metrics['top1'] <= 100
    metrics = run(train_cmd(data, tmp_path, 'resumed', '--epochs', '2', '--resume', str(path)))
    assert 0 <= metrics['top1'] <= 100
    assert (tmp_path / 'resumed' / 'summary.csv').read_text().splitlines()[1].split(',')[0] == '1'  # epoch 1 only
    # tokenaug-train's own checkpoint through the converter and the annotator (maps generate, occlusion)
    from mm_plugin.convert_cli import convert_checkpoint
    from timm_plugin.annotator import create_annotator

    ours = tmp_path / 'resumed' / 'last.pth.tar'
    assert convert_checkpoint(str(ours), str(tmp_path / 'seg.pth'), 'mmseg', 'vit_tiny_patch16_224', model_kwargs=KW)
    annotator = create_annotator('vit_tiny_patch16_224', checkpoint=str(ours), model_kwargs=dict(img_size=112, depth=2))
    assert annotator.num_classes == 10
    bare = timm.create_model('vit_tiny_patch16_224', **KW)
    plain = create_optimizer_v2(bare, 'sgd', lr=0.1)  # one parameter group: not this run's optimizer
    other = tmp_path / 'other.pth.tar'
    torch.save(dict(epoch=0, state_dict=bare.state_dict(), optimizer=plain.state_dict()), other)
    with pytest.raises(ValueError, match=r'--resume: .*other.pth.tar holds an optimizer state .*--no-resume-opt'):
        run(train_cmd(data, tmp_path, 'other', '--epochs', '2', '--resume', str(other)))
    assert run(train_cmd(data, tmp_path, 'other', '--epochs', '2', '--resume', str(other), '--no-resume-opt'))


def test_viz_and_occlusion_take_it(timm_checkpoint, tiny_world, tmp_path):
    from timm_plugin.tools import occlusion_cli, viz_cli

    path, _ = timm_checkpoint
    data = str(tiny_world / 'imagenet')
    common = ['-c', str(REPO / 'configs' / 'timm' / 'world_vit-tiny.yaml'), '--data-dir', data, '--count', '2']
    common += ['--mixup', '0', '--cutmix', '1.0', '--model-kwargs', 'img_size=112', 'depth=2']
    out = tmp_path / 'viz'
    assert viz_cli.main(['tl-align', *common, '--initial-checkpoint', str(path), '--viz-dir', str(out)]) == 0
    assert (out / 'meta.json').is_file()
    argv = ['--data-dir', data, '--out', str(tmp_path / 'occ'), '-b', '4', '-j', '0', '--device', 'cpu']
    argv += ['--no-progress', '--model', 'vit_tiny_patch16_224', '--model-kwargs', 'img_size=112', 'depth=2']
    assert occlusion_cli.main([*argv, '--checkpoint', str(path), '--ratios', '0', '0.5']) == 0
    assert (tmp_path / 'occ' / 'occlusion.csv').is_file()


@pytest.fixture(scope='module')
def mmpretrain_checkpoint(tiny_world, tmp_path_factory):
    """``epoch_1.pth`` as mmpretrain's own tools/train.py writes it (MMEngine's Runner and CheckpointHook: meta,
    message hub, optimizer, schedulers) for our DeiT-Tiny world config, one epoch of 2 iterations."""
    work = tmp_path_factory.mktemp('mmpretrain_run')
    env = dict(os.environ, TOKENAUG_WORLD=str(tiny_world))
    env['PATH'] = f'{VENV_BIN}{os.pathsep}{env.get("PATH", "")}'
    env['PYTHONPATH'] = f'{REPO}{os.pathsep}{env.get("PYTHONPATH", "")}'
    mmpretrain_train('deit-tiny_world_cutmix.py', work, env, work)
    return work / 'epoch_1.pth'


def test_timm_entry_points_name_an_mmpretrain_checkpoint_and_the_route(mmpretrain_checkpoint, tiny_world, tmp_path):
    import mm_plugin
    from shared_core.checkpoint_io import CheckpointError, load_checkpoint_file
    from timm_plugin.annotator import create_annotator
    from timm_plugin.train import run

    path = str(mmpretrain_checkpoint)
    route = r'is an MMEngine \(mmpretrain\) checkpoint \(.*tokenaug-convert --from mmpretrain --to timm'
    # a fresh process, MMEngine's types not allowed: refused as it is unpickled, the global named
    code = f'from shared_core.checkpoint_io import load_checkpoint_file as f; f({path!r}, "--checkpoint")'
    done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 1 and re.search(route.replace(r'\(.*', r'\(mmengine\..*'), done.stderr), done.stderr
    mm_plugin.allow_mmengine_checkpoints()  # as an mm config or the converter does in a process: named still
    with pytest.raises(CheckpointError, match='--checkpoint: .*epoch_1.pth ' + route):
        load_checkpoint_file(path, '--checkpoint')
    with pytest.raises(CheckpointError, match=route):
        create_annotator('deit_tiny_patch16_224', checkpoint=path, model_kwargs=dict(img_size=112))
    with pytest.raises(CheckpointError, match='--initial-checkpoint: .*' + route):
        run(train_cmd(tiny_world / 'imagenet', tmp_path, 'mm', '--epochs', '1', '--initial-checkpoint', path))


def test_an_mmpretrain_checkpoint_converts_to_timm_with_equal_logits(mmpretrain_checkpoint, tmp_path):
    from mmengine.config import Config
    from mmengine.runner import load_checkpoint
    from mmpretrain.registry import MODELS
    from mmpretrain.utils import register_all_modules

    import mm_plugin
    from mm_plugin.convert_cli import convert_checkpoint, main
    from shared_core.checkpoint_io import load_checkpoint_file
    from timm_plugin.annotator import create_annotator

    register_all_modules(init_default_scope=False)  # no process-wide default scope: later tests build mmseg models
    mm_plugin.allow_mmengine_checkpoints()
    cfg = Config.fromfile(str(REPO / 'configs' / 'mmpretrain' / 'deit-tiny_world_cutmix.py'))
    mm_model = MODELS.build(cfg.model)
    load_checkpoint(mm_model, str(mmpretrain_checkpoint), map_location='cpu', strict=True)
    dst = tmp_path / 'timm.pth'
    argv = ['--src', str(mmpretrain_checkpoint), '--dst', str(dst), '--to', 'timm', '--from', 'mmpretrain']
    assert main([*argv, '--model', 'deit_tiny_patch16_224', '--model-kwargs', 'img_size=112']) == 0
    assert set(load_checkpoint_file(dst, 'dst')) == {'state_dict', 'meta'}
    timm_model = create_annotator('deit_tiny_patch16_224', checkpoint=str(dst), model_kwargs=dict(img_size=112))
    x = torch.randn(3, 3, 112, 112, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = timm_model(x), mm_model.eval()(x, mode='tensor')
    assert ours.shape == (3, 10) and torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()
    # the same Runner file onto mmseg directly, and the wrong direction named
    report = convert_checkpoint(
        str(mmpretrain_checkpoint),
        str(tmp_path / 'seg.pth'),
        'mmseg',
        'deit_tiny_patch16_224',
        'mmpretrain',
        model_kwargs=dict(img_size=112),
    )
    assert report['converted'] > 0
    with pytest.raises(ValueError, match='to: --to timm converts an mmpretrain checkpoint'):
        convert_checkpoint(str(dst), str(tmp_path / 'again.pth'), 'timm', 'deit_tiny_patch16_224', 'timm')


def test_an_mmpretrain_lvvit_with_its_aux_head_converts_to_timm_with_equal_logits(tmp_path):
    """Our LV-ViT token labeling config (mmpretrain's TIMMBackbone around lvvit_s, the aux head in the head) onto
    timm's lvvit_s: the same inference rule (class head + 0.5 x the aux head's max over tokens) gives equal logits."""
    from mmengine.config import Config
    from mmpretrain.registry import MODELS
    from mmpretrain.utils import register_all_modules

    from mm_plugin.convert_cli import convert_checkpoint
    from timm_plugin.annotator import create_annotator

    register_all_modules(init_default_scope=False)  # no process-wide default scope: later tests build mmseg models
    torch.manual_seed(0)
    cfg = Config.fromfile(str(REPO / 'configs' / 'mmpretrain' / 'lvvit-s_in1k_token-labeling.py'))
    mm_model = MODELS.build(cfg.model).eval()
    src = tmp_path / 'mm.pth'
    torch.save({'meta': {'epoch': 1}, 'state_dict': mm_model.state_dict()}, src)
    report = convert_checkpoint(str(src), str(tmp_path / 'timm.pth'), 'timm', 'lvvit_s', 'mmpretrain')
    assert report['arch'] == 'lvvit'
    timm_model = create_annotator('lvvit_s', checkpoint=str(tmp_path / 'timm.pth'))
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = timm_model(x), mm_model(x, mode='tensor')
    assert ours.shape == (2, 1000) and torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()
