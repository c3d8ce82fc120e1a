"""Real ``tokenaug-train`` runs (timm's loaders, optimizer, scheduler, saver) on the tiny world."""
import json
import subprocess

import pytest
import timm
import torch
import yaml

from timm_plugin.train import run
from .conftest import REPO

CONFIG = str(REPO / 'configs' / 'timm' / 'world_vit-tiny.yaml')


@pytest.mark.slow
@pytest.mark.parametrize('mixup_type', ['tokenmix_block', 'cutmix', 'tl_align', 'transmix'])
def test_one_epoch_and_checkpoint_loads_in_timm(tiny_world, tmp_path, mixup_type):
    metrics = run(['-c', CONFIG, '--data-dir', str(tiny_world / 'imagenet'), '--epochs', '1', '-b', '8',
                   '--mixup-type', mixup_type, '--workers', '0', '--output', str(tmp_path), '--experiment', 'run'])
    assert set(metrics) == {'loss', 'top1', 'top5'} and 0 <= metrics['top1'] <= 100
    out = tmp_path / 'run'
    results = json.loads((out / 'results.json').read_text())
    assert results['final']['top1'] == metrics['top1']
    args = yaml.safe_load((out / 'args.yaml').read_text())
    assert args['mixup_type'] == mixup_type and args['num_classes'] == 10
    ckpt = torch.load(out / 'last.pth.tar', map_location='cpu', weights_only=True)
    model = timm.create_model('vit_tiny_patch16_224', pretrained=True, img_size=112, num_classes=10,
                              pretrained_cfg_overlay=dict(file=str(out / 'last.pth.tar'), num_classes=10))
    for k, v in model.state_dict().items():
        assert torch.equal(v, ckpt['state_dict'][k]), k


@pytest.mark.slow
def test_console_script_without_prefetcher_and_resume(tiny_world, tmp_path, run_env):
    cmd = ['tokenaug-train', '-c', CONFIG, '--data-dir', str(tiny_world / 'imagenet'), '-b', '8', '--workers', '0',
           '--no-prefetcher', '--mixup-type', 'tokenmix_random', '--output', str(tmp_path), '--experiment', 'a']
    res = subprocess.run(cmd + ['--epochs', '1'], env=run_env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert 'Mixing: tokenmix_random' in res.stderr and 'Acc@1' in res.stderr
    res = subprocess.run(cmd[:-1] + ['b', '--epochs', '2', '--resume', str(tmp_path / 'a' / 'last.pth.tar')],
                         env=run_env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert 'Train: 1 [' in res.stderr and 'Train: 0 [' not in res.stderr  # resumed after epoch 0


def test_bad_config_key_is_named(tmp_path):
    cfg = tmp_path / 'bad.yaml'
    cfg.write_text('mixup_typ: cutmix\n')
    with pytest.raises(ValueError, match=r"unknown keys \['mixup_typ'\]"):
        run(['-c', str(cfg), '--data-dir', str(tmp_path)])


@pytest.mark.slow
def test_torchrun_ddp_two_processes(tiny_world, tmp_path, run_env):
    """DDP through torchrun (gloo on CPU): both ranks train, rank 0 evaluates and saves."""
    cmd = ['torchrun', '--nproc_per_node', '2', '--master_port', '29611', '-m', 'timm_plugin.train', '-c', CONFIG,
           '--data-dir', str(tiny_world / 'imagenet'), '--epochs', '1', '-b', '4', '--workers', '0',
           '--mixup-type', 'tokenmix_block', '--output', str(tmp_path), '--experiment', 'ddp']
    res = subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-4000:]
    assert 'process 0, total 2' in log and 'process 1, total 2' in log
    assert (tmp_path / 'ddp' / 'last.pth.tar').exists()


@pytest.mark.slow
def test_args_yaml_is_a_valid_config(tiny_world, tmp_path):
    """The args.yaml a run writes feeds back through -c (run-time keys left out), with the chosen kind."""
    run(['-c', CONFIG, '--data-dir', str(tiny_world / 'imagenet'), '--epochs', '1', '-b', '8', '--workers', '0',
         '--output', str(tmp_path), '--experiment', 'first'])
    args = yaml.safe_load((tmp_path / 'first' / 'args.yaml').read_text())
    assert args['mixup_type'] == 'cutmix' and 'rank' not in args and 'config' not in args
    metrics = run(['-c', str(tmp_path / 'first' / 'args.yaml'), '--experiment', 'again'])
    assert set(metrics) == {'loss', 'top1', 'top5'}
    assert json.loads((tmp_path / 'again' / 'results.json').read_text())['mixup_type'] == 'cutmix'


@pytest.mark.slow
def test_tl_align_over_token_masks_with_ablation_flags(tiny_world, tmp_path):
    """--mixup-type tl_align over another Table 7 kind, aligned at chosen layers, residual off (Table 8)."""
    metrics = run(['-c', CONFIG, '--data-dir', str(tiny_world / 'imagenet'), '--epochs', '1', '-b', '8',
                   '--workers', '0', '--mixup-type', 'tl_align', '--method-mix', 'tokenmix_random',
                   '--tl-align-layers', '2', '4', '--tl-align-no-residual', '--no-prefetcher', '--drop-path', '0.1',
                   '--output', str(tmp_path), '--experiment', 'abl'])
    assert set(metrics) == {'loss', 'top1', 'top5'}
    args = yaml.safe_load((tmp_path / 'abl' / 'args.yaml').read_text())
    assert args['tl_align_layers'] == [2, 4] and args['tl_align_no_residual'] is True
