"""Checkpoints users bring from timm's own ``train.py``: its ``CheckpointSaver`` stores ``args`` as an
``argparse.Namespace``, the one global timm's loader allows. Every entry point that reads a classification
checkpoint reads it with :func:`shared_core.checkpoint_io.load_checkpoint_file` (``weights_only=True`` plus that
global): the converter, the annotator of ``tokenaug-maps generate`` / ``tokenaug-occlusion``, and
``tokenaug-train``'s ``--initial-checkpoint`` / ``--pretrained-path`` / ``--resume``. A file with any other
global is refused without running it."""

import argparse
import os

import pytest
import timm
import torch
from timm.optim import create_optimizer_v2
from timm.utils import CheckpointSaver, ModelEmaV3

from .test_faults import train_cmd

KW = dict(img_size=112, depth=2, num_classes=10)  # tests/test_faults.py's FAST model of the world config


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
    bare = timm.create_model('vit_tiny_patch16_224', **KW)
    plain = create_optimizer_v2(bare, 'sgd', lr=0.1)  # one parameter group: not this run's optimizer
    other = tmp_path / 'other.pth.tar'
    torch.save(dict(epoch=0, state_dict=bare.state_dict(), optimizer=plain.state_dict()), other)
    with pytest.raises(ValueError, match=r'--resume: .*other.pth.tar holds an optimizer state .*--no-resume-opt'):
        run(train_cmd(data, tmp_path, 'other', '--epochs', '2', '--resume', str(other)))
    assert run(train_cmd(data, tmp_path, 'other', '--epochs', '2', '--resume', str(other), '--no-resume-opt'))
