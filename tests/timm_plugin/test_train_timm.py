"""Real ``tokenaug-train`` runs (timm's loaders, optimizer, scheduler, saver) on the tiny world."""

import json
import subprocess

import numpy as np
import pytest
import timm
import torch
import yaml

from timm_plugin.train import run

from ..conftest import REPO
from ..helpers.data import write_store

CONFIG = str(REPO / 'configs' / 'timm' / 'world_vit-tiny.yaml')


@pytest.mark.slow
@pytest.mark.parametrize('mixup_type', ['tokenmix_block', 'cutmix', 'tl_align', 'transmix'])
def test_one_epoch_and_checkpoint_loads_in_timm(tiny_world, tmp_path, mixup_type):
    method = mixup_type in ('tl_align', 'transmix')  # a target method over the config's MixUp/CutMix
    metrics = run(
        [
            '-c',
            CONFIG,
            '--data-dir',
            str(tiny_world / 'imagenet'),
            '--epochs',
            '1',
            '-b',
            '8',
            '--method' if method else '--mixup-type',
            mixup_type,
            '--workers',
            '0',
            '--output',
            str(tmp_path),
            '--experiment',
            'run',
        ]
    )
    assert set(metrics) == {'loss', 'top1', 'top5'} and 0 <= metrics['top1'] <= 100
    out = tmp_path / 'run'
    results = json.loads((out / 'results.json').read_text())
    assert results['final']['top1'] == metrics['top1']
    args = yaml.safe_load((out / 'args.yaml').read_text())
    assert (args['method'], args['mixup_type']) == ((mixup_type, 'cutmix') if method else (None, mixup_type))
    assert results['method'] == args['method'] and args['num_classes'] == 10
    ckpt = torch.load(out / 'last.pth.tar', map_location='cpu', weights_only=True)
    model = timm.create_model(
        'vit_tiny_patch16_224',
        pretrained=True,
        img_size=112,
        num_classes=10,
        pretrained_cfg_overlay=dict(file=str(out / 'last.pth.tar'), num_classes=10),
    )
    for k, v in model.state_dict().items():
        assert torch.equal(v, ckpt['state_dict'][k]), k


@pytest.mark.slow
def test_console_script_without_prefetcher_and_resume(tiny_world, tmp_path, run_env):
    cmd = [
        'tokenaug-train',
        '-c',
        CONFIG,
        '--data-dir',
        str(tiny_world / 'imagenet'),
        '-b',
        '8',
        '--workers',
        '0',
        '--no-prefetcher',
        '--mixup-type',
        'tokenmix_random',
        '--output',
        str(tmp_path),
        '--experiment',
        'a',
    ]
    res = subprocess.run(cmd + ['--epochs', '1'], env=run_env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert 'Mixing: tokenmix_random' in res.stderr and 'Acc@1' in res.stderr
    res = subprocess.run(
        cmd[:-1] + ['b', '--epochs', '2', '--resume', str(tmp_path / 'a' / 'last.pth.tar')],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert 'Train: 1 [' in res.stderr and 'Train: 0 [' not in res.stderr  # resumed after epoch 0


@pytest.mark.slow
def test_torchrun_ddp_two_processes(tiny_world, tmp_path, run_env):
    """DDP through torchrun (gloo on CPU): both ranks train, rank 0 evaluates and saves."""
    cmd = [
        'torchrun',
        '--nproc_per_node',
        '2',
        '--master_port',
        '29611',
        '-m',
        'timm_plugin.train',
        '-c',
        CONFIG,
        '--data-dir',
        str(tiny_world / 'imagenet'),
        '--epochs',
        '1',
        '-b',
        '4',
        '--workers',
        '0',
        '--mixup-type',
        'tokenmix_block',
        '--output',
        str(tmp_path),
        '--experiment',
        'ddp',
    ]
    res = subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-4000:]
    assert 'process 0, total 2' in log and 'process 1, total 2' in log
    assert (tmp_path / 'ddp' / 'last.pth.tar').exists()


@pytest.mark.slow
def test_args_yaml_is_a_valid_config(tiny_world, tmp_path):
    """The args.yaml a run writes feeds back through -c (run-time keys left out), with the chosen kind."""
    run(
        [
            '-c',
            CONFIG,
            '--data-dir',
            str(tiny_world / 'imagenet'),
            '--epochs',
            '1',
            '-b',
            '8',
            '--workers',
            '0',
            '--output',
            str(tmp_path),
            '--experiment',
            'first',
        ]
    )
    args = yaml.safe_load((tmp_path / 'first' / 'args.yaml').read_text())
    assert args['mixup_type'] == 'cutmix' and 'rank' not in args and 'config' not in args
    metrics = run(['-c', str(tmp_path / 'first' / 'args.yaml'), '--experiment', 'again'])
    assert set(metrics) == {'loss', 'top1', 'top5'}
    assert json.loads((tmp_path / 'again' / 'results.json').read_text())['mixup_type'] == 'cutmix'


@pytest.mark.slow
def test_tl_align_over_token_masks_with_ablation_flags(tiny_world, tmp_path):
    """--method tl_align over another Table 7 kind, aligned at chosen layers, residual off (Table 8)."""
    metrics = run(
        [
            '-c',
            CONFIG,
            '--data-dir',
            str(tiny_world / 'imagenet'),
            '--epochs',
            '1',
            '-b',
            '8',
            '--workers',
            '0',
            '--method',
            'tl_align',
            '--mixup-type',
            'tokenmix_random',
            '--tl-align-layers',
            '2',
            '4',
            '--tl-align-no-residual',
            '--no-prefetcher',
            '--drop-path',
            '0.1',
            '--output',
            str(tmp_path),
            '--experiment',
            'abl',
        ]
    )
    assert set(metrics) == {'loss', 'top1', 'top5'}
    args = yaml.safe_load((tmp_path / 'abl' / 'args.yaml').read_text())
    assert args['tl_align_layers'] == [2, 4] and args['tl_align_no_residual'] is True


@pytest.mark.slow
def test_token_labeling_end_to_end_annotator_maps_then_lvvit_with_mixtoken(tiny_world, tmp_path, run_env):
    """tokenaug-train (annotator) -> tokenaug-maps generate -> tokenaug-train --mixup-type mixtoken on LV-ViT-T,
    through the console scripts; the LV-ViT checkpoint keeps both heads and loads in timm."""
    data = str(tiny_world / 'imagenet')
    res = subprocess.run(
        [
            'tokenaug-train',
            '-c',
            CONFIG,
            '--data-dir',
            data,
            '--epochs',
            '1',
            '-b',
            '8',
            '--workers',
            '0',
            '--gp',
            'avg',
            '--output',
            str(tmp_path),
            '--experiment',
            'annotator',
        ],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    res = subprocess.run(
        [
            'tokenaug-maps',
            'generate',
            '--data-dir',
            data,
            '--split',
            'train',
            '--model',
            'vit_tiny_patch16_224',
            '--model-kwargs',
            'img_size=112',
            'global_pool=avg',
            '--checkpoint',
            str(tmp_path / 'annotator' / 'last.pth.tar'),
            '--input-size',
            '112',
            '--topk',
            '3',
            '-j',
            '0',
            '--device',
            'cpu',
            '--out',
            str(tmp_path / 'maps'),
        ],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    from shared_core.map_store import LabelMapStore

    store = LabelMapStore.open(tmp_path / 'maps')
    assert store.grid == (7, 7) and store.k == 3 and store.num_classes == 10 and len(store) == 20
    cmd = [
        'tokenaug-train',
        '-c',
        str(REPO / 'configs' / 'timm' / 'world_vit-tiny_token-labeling.yaml'),
        '--data-dir',
        data,
        '--token-label-dir',
        str(tmp_path / 'maps'),
        '--model',
        'lvvit_t',
        '--model-kwargs',
        'img_size=112',
        '--epochs',
        '1',
        '-b',
        '8',
        '--workers',
        '0',
        '--cls-target',
        'mix',
        '--model-ema',
        '--output',
        str(tmp_path),
        '--experiment',
        'lvvit',
    ]
    res = subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert 'Acc@1' in res.stderr and 'Test (EMA)' in res.stderr
    args = yaml.safe_load((tmp_path / 'lvvit' / 'args.yaml').read_text())
    assert args['mixup_type'] == 'mixtoken' and args['token_label_dir'] == str(tmp_path / 'maps')
    ckpt = torch.load(tmp_path / 'lvvit' / 'last.pth.tar', map_location='cpu', weights_only=True)
    assert 'aux_head.weight' in ckpt['state_dict']
    import timm_plugin  # noqa: F401  (registers lvvit_*)

    model = timm.create_model(
        'lvvit_t',
        pretrained=True,
        img_size=112,
        num_classes=10,
        pretrained_cfg_overlay=dict(file=str(tmp_path / 'lvvit' / 'last.pth.tar'), num_classes=10),
    )
    # timm's file loading prefers the EMA weights (--model-ema): they hold both heads too
    assert torch.equal(model.head.weight, ckpt['state_dict_ema']['head.weight'])
    assert torch.equal(model.aux_head.weight, ckpt['state_dict_ema']['aux_head.weight'])


def _random_top2_store(tiny_world, out):
    """A label-map store for the world's training split: 4x4 maps, two random classes at 0.4 per cell."""
    from timm.data import create_dataset

    ds = create_dataset('', root=str(tiny_world / 'imagenet'), split='train')
    paths = [ds.filename(i) for i in range(len(ds))]
    rng = np.random.default_rng(0)
    idx = np.stack([rng.permutation(10)[:2] for _ in range(len(paths) * 16)]).reshape(len(paths), 4, 4, 2)
    write_store(
        out,
        paths,
        np.full((len(paths), 2, 4, 4), 0.4, np.float16),
        idx.transpose(0, 3, 1, 2),
        num_classes=10,
        annotator='test',
        input_size=(64, 64),
    )


@pytest.mark.slow
def test_mixtoken_on_a_plain_vit_adds_an_aux_head_that_timm_loads_non_strict(tiny_world, tmp_path):
    """A DeiT/ViT trained with token labeling gains `aux_head` (in the optimizer, EMA and checkpoint);
    timm loads the checkpoint into the plain model with pretrained_strict=False."""
    _random_top2_store(tiny_world, tmp_path / 'maps')
    metrics = run(
        [
            '-c',
            str(REPO / 'configs' / 'timm' / 'world_vit-tiny_token-labeling.yaml'),
            '--data-dir',
            str(tiny_world / 'imagenet'),
            '--token-label-dir',
            str(tmp_path / 'maps'),
            '--epochs',
            '1',
            '-b',
            '8',
            '--workers',
            '0',
            '--no-prefetcher',
            '--output',
            str(tmp_path),
            '--experiment',
            'vit',
        ]
    )
    assert set(metrics) == {'loss', 'top1', 'top5'}
    ckpt = torch.load(tmp_path / 'vit' / 'last.pth.tar', map_location='cpu', weights_only=True)
    assert ckpt['state_dict']['aux_head.weight'].shape == (10, 192)
    model = timm.create_model(
        'vit_tiny_patch16_224',
        pretrained=True,
        img_size=112,
        num_classes=10,
        pretrained_strict=False,
        pretrained_cfg_overlay=dict(file=str(tmp_path / 'vit' / 'last.pth.tar'), num_classes=10),
    )
    assert torch.equal(model.head.weight, ckpt['state_dict']['head.weight'])
    with pytest.raises(ValueError, match='--mixup'):
        run(
            [
                '-c',
                str(REPO / 'configs' / 'timm' / 'world_vit-tiny_token-labeling.yaml'),
                '--data-dir',
                str(tiny_world / 'imagenet'),
                '--token-label-dir',
                str(tmp_path / 'maps'),
                '--mixup',
                '0.8',
            ]
        )


@pytest.mark.parametrize(
    'flags, match',
    [
        (['--token-label-dir', 'x', '--cutmix', '1'], '--cutmix'),
        (['--method', 'tl_align', '--token-label-dir', 'x'], '--method tl_align'),
        (['--mixup-type', 'mixtoken', '--bce-loss'], '--bce-loss'),
        (['--mixup-type', 'mixtoken', '--mixup', '0.8'], '--mixup: MixUp'),
        (['--relabel'], '--relabel needs --token-label-dir'),
        (
            ['--mixup-type', 'cutmix', '--cutmix', '1', '--activation-map-dir', 'x', '--token-label-dir', 'x'],
            '--mixup-type cutmix',
        ),
    ],
)
def test_token_labeling_refuses_flags_it_would_ignore(tiny_world, tmp_path, flags, match):
    cfg = yaml.safe_load((REPO / 'configs' / 'timm' / 'world_vit-tiny.yaml').read_text())
    for key in ('mixup_type', 'mixup', 'cutmix'):  # no mixing unless the flags ask for it
        cfg.pop(key)
    (tmp_path / 'plain.yaml').write_text(yaml.safe_dump(cfg))
    with pytest.raises(ValueError, match=match):
        run(
            ['-c', str(tmp_path / 'plain.yaml'), '--data-dir', str(tiny_world / 'imagenet'), '--output', str(tmp_path)]
            + flags
        )


@pytest.mark.slow
def test_torchrun_mixtoken_on_lvvit_without_maps(tiny_world, tmp_path, run_env):
    """MixToken with ImageNet labels only (token-labeling.md Table 2, 'MixToken | ImageNet Label') on LV-ViT under
    DDP: the idle aux head is frozen (DDP would wait for its gradients) and the class head alone predicts."""
    cmd = [
        'torchrun',
        '--nproc_per_node',
        '2',
        '--master_port',
        '29613',
        '-m',
        'timm_plugin.train',
        '-c',
        str(REPO / 'configs' / 'timm' / 'world_vit-tiny_token-labeling.yaml'),
        '--token-label-dir',
        '',
        '--data-dir',
        str(tiny_world / 'imagenet'),
        '--model',
        'lvvit_t',
        '--model-kwargs',
        'img_size=112',
        '--epochs',
        '1',
        '-b',
        '4',
        '--workers',
        '0',
        '--output',
        str(tmp_path),
        '--experiment',
        'ddp',
    ]
    res = subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-4000:]
    assert 'Train: 0 [   1/2' in log and 'Acc@1' in log and 'process 1, total 2' in log


@pytest.mark.slow
def test_mixtoken_token_labeling_on_an_mlp_mixer(tiny_world, tmp_path, caplog):
    """Token Labeling Table 5's MLP-Mixer: ``--mixup-type mixtoken --token-label-dir`` on ``mixer_s16_224`` at
    112 px (MixToken after the PatchEmbed stem, the aux head on its 7x7 tokens; the loader builds their targets),
    with the public code's augmentation order (``--aa-order public``: flip and RandAugment, then the crop)."""
    caplog.set_level('INFO')
    _random_top2_store(tiny_world, tmp_path / 'maps')
    metrics = run(
        ['-c', str(REPO / 'configs' / 'timm' / 'world_vit-tiny_token-labeling.yaml')]
        + ['--data-dir', str(tiny_world / 'imagenet'), '--token-label-dir', str(tmp_path / 'maps')]
        + ['--model', 'mixer_s16_224', '--epochs', '1', '-b', '8', '--workers', '0']
        + ['--aa', 'rand-m9-mstd0.5-inc1', '--aa-order', 'public']
        + ['--output', str(tmp_path), '--experiment', 'mixer']
    )
    assert set(metrics) == {'loss', 'top1', 'top5'}
    assert yaml.safe_load((tmp_path / 'mixer' / 'args.yaml').read_text())['aa_order'] == 'public'
    assert 'the loader builds the token targets (16x16 px tokens)' in caplog.text
    ckpt = torch.load(tmp_path / 'mixer' / 'last.pth.tar', map_location='cpu', weights_only=True)
    assert ckpt['state_dict']['aux_head.weight'].shape == (10, 512)
    plain = timm.create_model('mixer_s16_224', img_size=112, num_classes=10)
    missing, unexpected = plain.load_state_dict(ckpt['state_dict'], strict=False)
    assert not missing and unexpected == ['aux_head.weight', 'aux_head.bias']


@pytest.mark.slow
@pytest.mark.parametrize('model, where', [('resnest14d', 'loader'), ('convnext_atto', 'step')])
def test_mixtoken_token_labeling_on_a_cnn(tiny_world, tmp_path, caplog, model, where):
    """Token Labeling Table 5's CNNs (ResNeSt; ConvNeXt): MixToken pastes a box of whole 32-px cells in the images,
    the aux head reads the final 4x4 map at 128 px (its targets on those cells, built by the loader or, with
    ``--token-targets step``, in the step); the checkpoint holds aux_head and loads into the plain model."""
    caplog.set_level('INFO')
    _random_top2_store(tiny_world, tmp_path / 'maps')
    metrics = run(
        ['-c', str(REPO / 'configs' / 'timm' / 'world_vit-tiny_token-labeling.yaml')]
        + ['--data-dir', str(tiny_world / 'imagenet'), '--token-label-dir', str(tmp_path / 'maps')]
        + ['--model', model, '--model-kwargs', '--input-size', '3', '128', '128', '--drop-path', '0.1']
        + ['--epochs', '1', '-b', '8', '--workers', '0', '--output', str(tmp_path), '--experiment', 'cnn']
        + ['--token-targets', where]
    )
    assert set(metrics) == {'loss', 'top1', 'top5'}
    assert ('the loader builds the token targets (32x32 px tokens)' in caplog.text) == (where == 'loader')
    ckpt = torch.load(tmp_path / 'cnn' / 'last.pth.tar', map_location='cpu', weights_only=True)
    plain = timm.create_model(model, num_classes=10)
    assert ckpt['state_dict']['aux_head.weight'].shape == (10, plain.num_features)
    missing, unexpected = plain.load_state_dict(ckpt['state_dict'], strict=False)
    assert not missing and unexpected == ['aux_head.weight', 'aux_head.bias']


@pytest.mark.slow
@pytest.mark.parametrize('mixup_type, model, grid', [('tokenmix_block', 'resnet50', 16), ('tl_align', 'resnet18', 4)])
def test_resnet_tokenmix_blocks_and_tl_align(tiny_world, tmp_path, caplog, mixup_type, model, grid):
    """TokenMix Table 8's ResNet-50 row at world scale: block masks in image space on a 16-px grid (DeiT's 14x14 at
    224); TL-Align's generalised rules on a ResNet, whose mix is drawn on the first stage's 4-px grid."""
    caplog.set_level('INFO')
    metrics = run(
        ['-c', CONFIG, '--data-dir', str(tiny_world / 'imagenet'), '--model', model, '--model-kwargs']
        + [
            '--epochs',
            '1',
            '-b',
            '8',
            '--workers',
            '0',
            '--method' if mixup_type == 'tl_align' else '--mixup-type',
            mixup_type,
        ]
        + ['--output', str(tmp_path), '--experiment', 'run']
    )
    assert set(metrics) == {'loss', 'top1', 'top5'} and 0 <= metrics['top1'] <= 100
    assert f'on a {grid}x{grid}-px token grid' in caplog.text
