"""Fault injection: each case reproduces a way a user could
lose data or get silently wrong results, and checks the fix."""

import copy
import hashlib
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import timm
import torch

from mm_plugin.convert_cli import convert_checkpoint
from shared_core.checkpoint_io import CheckpointError, atomic_output, load_checkpoint_file, save_checkpoint_file
from tokenaug import commands

from ..helpers.processes import call_main


def sha(path):
    return hashlib.sha256(open(path, 'rb').read()).hexdigest()


def convert_cmd(src, dst, *extra):
    return [
        '--src', str(src), '--dst', str(dst), '--to', 'mmseg',
        '--model', 'deit_tiny_patch16_224', '--model-kwargs', 'img_size=32', 'patch_size=8', *extra,
    ]  # fmt: skip


@pytest.fixture
def train_ckpt(tmp_path):
    """A tokenaug-train-like checkpoint: model, optimizer, epoch, EMA."""
    torch.manual_seed(0)
    vit = timm.create_model('deit_tiny_patch16_224', img_size=32, patch_size=8, num_classes=10)
    opt = torch.optim.AdamW(vit.parameters())
    path = tmp_path / 'ck.pth.tar'
    torch.save(
        dict(epoch=3, state_dict=vit.state_dict(), optimizer=opt.state_dict(), state_dict_ema=vit.state_dict()), path
    )
    return path


# 1. data lost: tokenaug-convert onto its own source, or over an existing file -------------------------------
def test_convert_refuses_its_own_source_and_existing_files(train_ckpt, tmp_path, capsys):
    before = sha(train_ckpt)
    code, _, err = call_main(commands.convert, convert_cmd(train_ckpt, train_ckpt), capsys)
    assert code == 2 and 'is the src file' in err and 'Traceback' not in err
    link = tmp_path / 'link.pth.tar'
    os.symlink(train_ckpt, link)  # the same file under another name
    with pytest.raises(CheckpointError, match='is the src file'):
        convert_checkpoint(
            train_ckpt, link, 'mmseg', 'deit_tiny_patch16_224', model_kwargs=dict(img_size=32, patch_size=8)
        )
    assert sha(train_ckpt) == before and set(torch.load(train_ckpt, weights_only=True)) >= {'optimizer', 'epoch'}
    out = tmp_path / 'out.pth'
    out.write_bytes(b'an older conversion')
    code, _, err = call_main(commands.convert, convert_cmd(train_ckpt, out), capsys)
    assert code == 2 and 'exists; pass --force' in err
    assert out.read_bytes() == b'an older conversion'
    code, _, err = call_main(commands.convert, convert_cmd(train_ckpt, out, '--force'), capsys)
    assert code == 0, err[-2000:]
    assert set(torch.load(out, weights_only=True)) == {'state_dict', 'meta'}
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith('.tmp')] == []
    assert sha(train_ckpt) == before
    # a conversion killed mid-write left its temporary beside out: the rerun removes it (and only its own)
    (tmp_path / '.out.pth.vhnrgo2u.tmp').write_bytes(b'half a checkpoint')
    (tmp_path / '.other.pth.abcdefgh.tmp').write_bytes(b'another writer')
    convert_checkpoint(
        train_ckpt, out, 'mmseg', 'deit_tiny_patch16_224', model_kwargs=dict(img_size=32, patch_size=8), force=True
    )
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith('.tmp')) == ['.other.pth.abcdefgh.tmp']


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    dst = tmp_path / 'x.pth'
    dst.write_bytes(b'old')
    with pytest.raises(RuntimeError, match='boom'):
        with atomic_output(dst) as tmp:
            open(tmp, 'wb').write(b'half a new file')
            raise RuntimeError('boom')
    assert dst.read_bytes() == b'old' and sorted(p.name for p in tmp_path.iterdir()) == ['x.pth']
    save_checkpoint_file({'a': torch.ones(3)}, dst)
    assert torch.equal(load_checkpoint_file(dst)['a'], torch.ones(3))


def test_a_full_disk_is_reported_as_such_and_replaces_nothing(tmp_path):
    """A real EFBIG (RLIMIT_FSIZE in a child process, SIGXFSZ ignored): the message says the disk is full or a
    size limit was hit; the old file stays and no temporary is left."""
    dst = tmp_path / 'last.pth.tar'
    torch.save({'epoch': 0}, dst)
    before = sha(dst)
    code = textwrap.dedent(
        f"""
        import resource, signal, torch
        from shared_core.checkpoint_io import CheckpointError, save_checkpoint_file
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
        try:
            save_checkpoint_file({{'w': torch.zeros(1_000_000)}}, {str(dst)!r})
        except CheckpointError as e:
            print('REFUSED', e)
        """
    )
    res = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120, cwd=os.getcwd())
    assert 'REFUSED' in res.stdout and 'disk is full or the file exceeds a size limit' in res.stdout, res.stderr[-2000:]
    assert sha(dst) == before and sorted(p.name for p in tmp_path.iterdir()) == ['last.pth.tar']


@pytest.mark.parametrize('kind', ['garbage', 'truncated', 'empty', 'pickle'])
def test_unreadable_checkpoints_are_named_without_unsafe_advice(kind, train_ckpt, tmp_path, capsys):
    bad = tmp_path / f'{kind}.pth'
    if kind == 'garbage':
        bad.write_bytes(b'junk' + random.Random(0).randbytes(5000))  # neither zip nor pickle
    elif kind == 'truncated':
        data = train_ckpt.read_bytes()
        bad.write_bytes(data[: len(data) // 2])
    elif kind == 'empty':
        bad.write_bytes(b'')
    else:

        class Evil:
            def __reduce__(self):
                return (os.system, (f'touch {tmp_path / "PWNED"}',))

        torch.save({'state_dict': Evil()}, bad)
    expect = {
        'garbage': 'not a PyTorch checkpoint',
        'truncated': 'truncated or corrupt',
        'empty': 'is empty',
        'pickle': 'Python objects beyond tensors',
    }[kind]
    with pytest.raises(CheckpointError, match=expect):
        load_checkpoint_file(bad, 'src')
    code, _, err = call_main(commands.convert, convert_cmd(bad, tmp_path / 'o.pth'), capsys)
    assert code == 2 and expect in err and 'weights_only=False' not in err, err[-2000:]
    assert 'Traceback' not in err and not (tmp_path / 'PWNED').exists()


def test_convert_names_an_unknown_model(train_ckpt, tmp_path, capsys):
    cmd = convert_cmd(train_ckpt, tmp_path / 'o.pth')
    cmd[cmd.index('deit_tiny_patch16_224')] = 'vit_tiny_patch16_224x'
    code, _, err = call_main(commands.convert, cmd, capsys)
    assert code == 2 and "model: 'vit_tiny_patch16_224x' is not a timm model name" in err


# tokenaug-train on the tiny world ----------------------------------------------------------------------------
CONFIG = os.path.join(os.path.dirname(__file__), '..', '..', 'configs', 'timm', 'world_vit-tiny.yaml')
FAST = ['--model-kwargs', 'img_size=112', 'depth=2', '-b', '8', '--workers', '0', '--log-interval', '50']


def train_cmd(data, out, exp, *extra):
    return ['-c', CONFIG, '--data-dir', str(data), '--output', str(out), '--experiment', exp, *FAST, *extra]


def copy_world(world, dst):
    import shutil

    shutil.copytree(world / 'imagenet', dst)
    return dst


# 2. grayscale, CMYK and truncated JPEGs (ImageNet has them) -------------------------------------------------
@pytest.mark.slow
def test_grayscale_cmyk_and_truncated_jpegs_do_not_kill_a_run(tiny_world, tmp_path, caplog):
    from PIL import Image

    from timm_plugin.train import run

    data = copy_world(tiny_world, tmp_path / 'data')
    files = sorted((data / 'train').rglob('*.jpg'))
    Image.open(files[0]).convert('L').save(files[0])
    Image.open(files[1]).convert('CMYK').save(files[1])
    raw = files[2].read_bytes()
    files[2].write_bytes(raw[: len(raw) // 2])  # a truncated JPEG
    os.symlink(data / 'gone.jpg', files[3].parent / 'zz_dangling.jpg')  # a file that cannot be opened at all
    metrics = run(train_cmd(data, tmp_path, 'x', '--epochs', '1'))
    assert 0 <= metrics['top1'] <= 100
    skipped = [r.getMessage() for r in caplog.records if 'Skipped unreadable image' in r.getMessage()]
    assert any('zz_dangling.jpg' in m for m in skipped) and any(files[2].name in m for m in skipped), skipped
    assert all(files[2].name in m or 'zz_dangling.jpg' in m for m in skipped), skipped


# 3. a skipped image must not take the map of another --------------------------------------------------------
def test_token_label_samples_carry_the_map_of_the_image_actually_read(tiny_world, tmp_path):
    import numpy as np
    from timm.data import create_dataset
    from torchvision import transforms as T

    from shared_core.map_store import LabelMapStore
    from timm_plugin.token_label_data import TokenLabelDataset

    from ..helpers.data import write_store

    data = copy_world(tiny_world, tmp_path / 'data')
    paths = sorted(str(p.relative_to(data / 'train')) for p in (data / 'train').rglob('*.jpg'))
    rng = np.random.default_rng(0)
    values = rng.dirichlet(np.ones(3), size=(len(paths), 2, 2)).transpose(0, 3, 1, 2).astype(np.float16) * 0.9
    indices = np.stack([np.argsort(rng.random((10, 2, 2)), 0)[:3] for _ in paths])
    store = LabelMapStore.open(write_store(tmp_path / 'maps', paths, values, indices, 10, 'random', (112, 112)))
    (data / 'train' / paths[0]).write_bytes(os.urandom(3000))  # unreadable: timm moves on to the next file
    ds = TokenLabelDataset(create_dataset('', root=str(data), split='train', is_training=True), store)
    ds.transform = T.Compose([T.RandomResizedCrop(32, scale=(1.0, 1.0)), T.PILToTensor()])
    img, (label, v, i, box, flip, affines) = ds[0]
    v1, i1 = store.lookup(paths[1])  # the image read is file 1: its map, and its label
    assert np.array_equal(v, v1) and np.array_equal(i, i1)
    assert label == ds.dataset.reader[1][1]


# 4. an empty class folder would shift every later class ------------------------------------------------------
def test_an_empty_train_class_folder_is_refused_naming_it(tiny_world, tmp_path):
    from timm_plugin.train import run

    data = copy_world(tiny_world, tmp_path / 'data')
    empty = sorted((data / 'train').iterdir())[3]
    for f in empty.iterdir():
        f.unlink()
    with pytest.raises(ValueError, match=rf"only in val: \['{empty.name}'\]"):
        run(train_cmd(data, tmp_path, 'x', '--epochs', '1'))
    with pytest.raises(ValueError, match=r'--num-classes: the model has 12 classes, the train split 10'):
        run(train_cmd(tiny_world / 'imagenet', tmp_path, 'y', '--epochs', '1', '--num-classes', '12'))


# 5. a resumed run ends exactly where an uninterrupted one does -----------------------------------------------
def run_files(out):
    """What a run leaves: the file names, the checkpoints' tensors and bookkeeping, summary and results."""
    files = sorted(p.name for p in out.iterdir() if p.name != 'args.yaml')
    ckpts = {}
    for name in files:
        if name.endswith('.pth.tar'):
            ck = torch.load(out / name, weights_only=True)
            ckpts[name] = {k: ck[k] for k in ('epoch', 'metric', 'state_dict', 'optimizer', 'saver') if k in ck}
    results = __import__('json').loads((out / 'results.json').read_text())
    results.pop('output_dir')
    return files, ckpts, (out / 'summary.csv').read_text(), results


def assert_same_run(a, b):
    fa, ca, sa, ra = run_files(a)
    fb, cb, sb, rb = run_files(b)
    assert fa == fb and sa == sb and ra == rb
    for name in ca:
        assert ca[name].pop('saver', None) == cb[name].pop('saver', None), name  # best / history bookkeeping
        torch.testing.assert_close(ca[name], cb[name], rtol=0, atol=0, msg=name)  # bit for bit


MIXED = ['--epochs', '3', '--mixup-type', 'cutmix', '--lr', '3e-3']


@pytest.mark.slow
def test_two_epochs_and_a_resume_equal_three_epochs(tiny_world, tmp_path):
    from timm_plugin.train import run

    data = tiny_world / 'imagenet'
    run(train_cmd(data, tmp_path, 'whole', *MIXED))
    run(train_cmd(data, tmp_path, 'split', *MIXED, '--stop-epoch', '2'))
    assert (tmp_path / 'split' / 'summary.csv').read_text().count('\n') == 3  # header + epochs 0, 1
    run(train_cmd(data, tmp_path, 'split', *MIXED, '--resume', str(tmp_path / 'split' / 'last.pth.tar')))
    assert_same_run(tmp_path / 'whole', tmp_path / 'split')
    # resuming the finished run (killed after its last epoch, before its caller noted it) trains nothing and
    # keeps its results (results.json's final metrics were once overwritten with nothing)
    final = run(train_cmd(data, tmp_path, 'split', *MIXED, '--resume', str(tmp_path / 'split' / 'last.pth.tar')))
    assert final == json.loads((tmp_path / 'whole' / 'results.json').read_text())['final'] and final['top1'] >= 0
    assert_same_run(tmp_path / 'whole', tmp_path / 'split')


@pytest.mark.slow
def test_kill_9_then_resume_equals_an_uninterrupted_run(tiny_world, tmp_path, run_env):
    import signal

    data = tiny_world / 'imagenet'
    base = ['tokenaug-train'] + train_cmd(data, tmp_path, 'killed', *MIXED)
    subprocess.run(
        ['tokenaug-train'] + train_cmd(data, tmp_path, 'whole', *MIXED), env=run_env, check=True, capture_output=True
    )
    proc = subprocess.Popen(base, env=run_env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    for line in proc.stderr:  # kill -9 in the middle of epoch 1 (epoch 0 saved)
        if 'Train: 1 [' in line:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=600)
    assert proc.returncode == -signal.SIGKILL
    assert torch.load(tmp_path / 'killed' / 'last.pth.tar', weights_only=True)['epoch'] == 0
    res = subprocess.run(
        base + ['--resume', str(tmp_path / 'killed' / 'last.pth.tar')], env=run_env, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert_same_run(tmp_path / 'whole', tmp_path / 'killed')


#: a sitecustomize for a killed run's process: its first save of the epoch $KILL_AT_SAVE writes half the file,
#: says so on stderr and waits to be killed (a kill -9 in the middle of a checkpoint's write)
_HALF_SAVE = """
import os, sys, time
import torch

_save = torch.save


def save(obj, f, *args, **kwargs):
    if isinstance(obj, dict) and obj.get('epoch') == int(os.environ['KILL_AT_SAVE']) and hasattr(f, 'write'):
        import io

        whole = io.BytesIO()
        _save(obj, whole, *args, **kwargs)
        f.write(whole.getvalue()[: len(whole.getvalue()) // 2])
        f.flush()
        print('TEST: half of the checkpoint written', file=sys.stderr, flush=True)
        time.sleep(600)
    return _save(obj, f, *args, **kwargs)


torch.save = save
"""


def _killed(cmd, env, marker):
    """Run ``cmd`` and kill -9 it at the first stderr line holding ``marker``."""
    import signal

    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    for line in proc.stderr:
        if marker in line:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=600)
    assert proc.returncode == -signal.SIGKILL, f'not killed: no {marker!r} line'


@pytest.mark.slow
@pytest.mark.parametrize(
    'method', [['--mixup-type', 'tl_align'], ['--tokenmixup-htm-layers', '1']], ids=['tl_align', 'htm']
)
def test_kill_9_mid_epoch_and_mid_checkpoint_then_resume_equals_an_uninterrupted_run(
    method, tiny_world, tmp_path, run_env
):
    """TL-Align and TokenMixup's HTM (their label paths and ScoreNets live in the model's forward and state):
    ``tokenaug-train`` killed with -9 in the middle of epoch 1, resumed and killed again while its checkpoint of
    epoch 1 is half written, then resumed to the end, gives the uninterrupted run's weights, optimizer, EMA-free
    saver state and summary bit for bit; the half-written temporary is gone and ``last.pth.tar`` was never
    anything but a whole checkpoint."""
    from timm_plugin.train import run

    data = tiny_world / 'imagenet'
    run(train_cmd(data, tmp_path, 'whole', *MIXED, *method))
    killed = ['tokenaug-train'] + train_cmd(data, tmp_path, 'killed', *MIXED, *method)
    last = tmp_path / 'killed' / 'last.pth.tar'
    _killed(killed, run_env, 'Train: 1 [')  # mid-epoch 1 (epoch 0 saved)
    assert torch.load(last, weights_only=True)['epoch'] == 0
    hook = tmp_path / 'hook'
    hook.mkdir()
    (hook / 'sitecustomize.py').write_text(_HALF_SAVE)
    env = {**run_env, 'PYTHONPATH': f'{hook}{os.pathsep}{run_env["PYTHONPATH"]}', 'KILL_AT_SAVE': '1'}
    _killed(killed + ['--resume', str(last)], env, 'TEST: half of the checkpoint written')  # mid-checkpoint
    assert torch.load(last, weights_only=True)['epoch'] == 0  # still epoch 0's, whole
    half = [p for p in (tmp_path / 'killed').iterdir() if p.name.endswith('.tmp')]
    assert half, 'the half-written temporary'
    res = subprocess.run(killed + ['--resume', str(last)], env=run_env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert not any(p.exists() for p in half)
    assert_same_run(tmp_path / 'whole', tmp_path / 'killed')


# 10. command-line errors without tracebacks ---------------------------------------------------------------------
@pytest.mark.parametrize('case', ['no-data-dir', 'unknown-model', 'garbage-resume'])
def test_train_cli_errors_are_named_without_a_traceback(case, tiny_world, tmp_path, capsys):
    cmd = train_cmd(tiny_world / 'imagenet', tmp_path, 'x', '--epochs', '1')
    if case == 'no-data-dir':
        cmd[cmd.index('--data-dir') + 1] = str(tmp_path / 'nope')
        expect = 'is not a directory'
    elif case == 'unknown-model':
        cmd += ['--model', 'vit_tiny_patch16_224x']
        expect = "--model: 'vit_tiny_patch16_224x' is not a timm model name"
    else:
        (tmp_path / 'junk.pth.tar').write_bytes(b'junk' + random.Random(0).randbytes(5000))  # not zip, not pickle
        cmd += ['--resume', str(tmp_path / 'junk.pth.tar')]
        expect = '--resume: ' + str(tmp_path / 'junk.pth.tar') + ' is not a PyTorch checkpoint'
    code, _, err = call_main(commands.train, cmd, capsys)
    assert code == 2 and expect in err and 'Traceback' not in err, err[-2000:]


# 7. non-finite and mistyped numbers ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    'kwargs, match',
    [
        (dict(mixup_alpha=float('inf')), 'mixup_alpha: expected a finite number'),
        (dict(mixup_alpha=float('nan')), 'mixup_alpha: expected a finite number'),
        (dict(cutmix_alpha=float('nan')), 'cutmix_alpha: expected a finite number'),
        (dict(prob=float('nan')), 'prob: expected a finite number'),
        (dict(label_smoothing=float('inf')), 'label_smoothing: expected a finite number'),
        (dict(mixup_alpha='0.8'), r"mixup_alpha: expected a number, got '0.8' \(str\)"),
        (dict(tokenmix_lam=float('nan'), kind='tokenmix_block'), 'tokenmix_lam: expected a finite number'),
        (dict(tokenmix_min_tokens=0, kind='tokenmix_block'), 'tokenmix_min_tokens: expected an integer >= 1'),
    ],
)
def test_mixer_numbers_must_be_finite_and_numbers(kwargs, match):
    from timm_plugin import create_mixer

    kwargs = dict(kwargs)
    kind = kwargs.pop('kind', 'cutmix')
    args = dict(mixup_alpha=0.8, cutmix_alpha=1.0, num_classes=10, patch_size=16)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        create_mixer(kind, **args)


def test_mm_batch_augment_numbers_are_checked_at_build():
    from mmpretrain.registry import BATCH_AUGMENTS

    import mm_plugin  # noqa: F401 (registers the augments)

    with pytest.raises(ValueError, match=r"alpha: expected a number, got '1.0' \(str\)"):
        BATCH_AUGMENTS.build(dict(type='TATokenMix', alpha='1.0'))
    with pytest.raises(ValueError, match='min_tokens: expected an integer >= 1, got 0'):
        BATCH_AUGMENTS.build(dict(type='TATokenMix', alpha=1.0, min_tokens=0))
    with pytest.raises(ValueError, match='alpha: expected a finite number'):
        BATCH_AUGMENTS.build(dict(type='TAMixup', alpha=float('inf')))


def test_train_refuses_an_infinite_mixup_alpha(tiny_world, tmp_path, capsys):
    cmd = train_cmd(tiny_world / 'imagenet', tmp_path, 'x', '--epochs', '1', '--mixup', 'inf', '--cutmix', '0')
    cmd += ['--mixup-type', 'mixup']
    code, _, err = call_main(commands.train, cmd, capsys)
    assert code == 2 and 'mixup_alpha: expected a finite number' in err, err[-2000:]
    assert not (tmp_path / 'x' / 'model_best.pth.tar').exists()


@pytest.mark.slow
def test_ddp_epoch_train_loss_is_the_mean_over_ranks(tiny_world, tmp_path, run_env):
    """One step over all 20 images, no augmentation or mixing: the train loss of 2 gloo ranks x 10 equals the
    single process's over 20 (the review: rank 0's half only, 2.3411 vs 2.3495)."""
    import csv

    import yaml

    cfg = yaml.safe_load(open(CONFIG))
    for key in ('mixup_type', 'mixup', 'cutmix', 'mixup_switch_prob'):
        cfg.pop(key)
    cfg.update(no_aug=True, warmup_epochs=0, epochs=1, model_kwargs=dict(img_size=112, depth=2), workers=0)
    (tmp_path / 'plain.yaml').write_text(yaml.safe_dump(cfg))
    common = ['-c', str(tmp_path / 'plain.yaml'), '--data-dir', str(tiny_world / 'imagenet'), '--output', str(tmp_path)]
    single = subprocess.run(
        ['tokenaug-train', *common, '-b', '20', '--experiment', 'single'], env=run_env, capture_output=True, text=True
    )
    assert single.returncode == 0, single.stderr[-3000:]
    ddp = subprocess.run(
        ['torchrun', '--nproc_per_node', '2', '--master_port', '29623', '-m', 'timm_plugin.train', *common]
        + ['-b', '10', '--experiment', 'ddp'],
        env={**run_env, 'OMP_NUM_THREADS': '1'},
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert ddp.returncode == 0, ddp.stderr[-3000:]

    def train_loss(name):
        return float(next(csv.DictReader(open(tmp_path / name / 'summary.csv')))['train_loss'])

    assert abs(train_loss('single') - train_loss('ddp')) < 1e-4, (train_loss('single'), train_loss('ddp'))


@pytest.mark.slow
def test_a_full_disk_during_a_checkpoint_save_is_named_and_keeps_the_last_one(tiny_world, tmp_path, run_env):
    """Epoch 0 saved; the resumed run's save hits a file-size limit (a real EFBIG): the CLI says so (exit 2, no
    traceback), last.pth.tar is still epoch 0's and no partial file is left."""
    import resource
    import signal

    base = ['tokenaug-train'] + train_cmd(tiny_world / 'imagenet', tmp_path, 'full', '--epochs', '2')
    subprocess.run(base + ['--stop-epoch', '1'], env=run_env, check=True, capture_output=True, timeout=600)
    last = tmp_path / 'full' / 'last.pth.tar'
    before = sha(last)

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(last) // 2,) * 2)

    res = subprocess.run(
        base + ['--resume', str(last)], env=run_env, capture_output=True, text=True, timeout=600, preexec_fn=limit
    )
    assert res.returncode == 2 and 'the disk is full or the file exceeds a size limit' in res.stderr
    assert 'Traceback' not in res.stderr, res.stderr[-2000:]
    assert sha(last) == before and not [p for p in (tmp_path / 'full').iterdir() if 'tmp' in p.name]
    # epoch 1's summary row was written before its checkpoint failed; a kill -9 mid-write would also leave the
    # temporary behind: the next resume drops the row of the epoch it redoes and removes the temporary
    summary = (tmp_path / 'full' / 'summary.csv').read_text().splitlines()
    assert [r.split(',')[0] for r in summary] == ['epoch', '0', '1']
    stale = tmp_path / 'full' / '.last.pth.tar.k1ll3d_x.tmp'
    stale.write_bytes(os.urandom(1000))
    res = subprocess.run(base + ['--resume', str(last)], env=run_env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    summary = (tmp_path / 'full' / 'summary.csv').read_text().splitlines()
    assert [r.split(',')[0] for r in summary] == ['epoch', '0', '1'] and not stale.exists()


# 6. mmseg / mmdet must not train from a random backbone ------------------------------------------------------
SWIN_MINI = dict(embed_dim=32, depths=(2, 2, 2, 2), num_heads=(1, 2, 4, 8))


@pytest.fixture
def own_scope():
    """An mm Runner makes its default scope (mmseg, mmdet) the process's current one: restore the previous one
    afterwards, so later tests build from their own registries."""
    from mmengine.registry import DefaultScope

    with DefaultScope.overwrite_default_scope('mmengine'):
        yield


@pytest.fixture(scope='module')
def ade_world(tmp_path_factory):
    from shared_core.tools.world import generate_world

    world = tmp_path_factory.mktemp('ade')
    generate_world(
        world, seed=0, num_classes=10, image_size=112, train_per_class=1, val_per_class=1, formats=('ade20k',)
    )
    return world


def mmseg_runner(config, backbone, world, work, monkeypatch, options=None):
    from mmengine.config import Config
    from mmengine.runner import Runner

    monkeypatch.setenv('TOKENAUG_WORLD', str(world))
    monkeypatch.setenv('TOKENAUG_BACKBONE', str(backbone))
    cfg = Config.fromfile(os.path.join(os.path.dirname(__file__), '..', '..', 'configs', 'mmseg', config))
    cfg.merge_from_dict(options or {})  # as --cfg-options
    cfg.work_dir = str(work)
    # mmseg's runtime config names its visualizer 'visualizer', and MMEngine reuses an instance of that name with
    # the folder of the runner that made it (a previous test's, deleted by now): a name of this run's own
    cfg.visualizer.name = f'{Path(work).parent.name}-{Path(work).name}'
    cfg.train_cfg.max_iters = 1
    cfg.train_dataloader.num_workers = cfg.val_dataloader.num_workers = 0
    cfg.train_dataloader.persistent_workers = cfg.val_dataloader.persistent_workers = False
    return Runner.from_cfg(cfg)


def timm_checkpoint(path, model, **kw):
    torch.manual_seed(0)
    torch.save({'state_dict': timm.create_model(model, num_classes=10, **kw).state_dict()}, path)
    return path


@pytest.mark.slow
def test_mmseg_refuses_backbones_that_would_not_load(ade_world, tmp_path, monkeypatch, own_scope):
    vit = 'upernet_vit-tiny_world.py'
    runner = mmseg_runner(vit, tmp_path / 'nowhere.pth', ade_world, tmp_path / 'w0', monkeypatch)
    with pytest.raises(FileNotFoundError, match=r'nowhere.pth does not exist; set \$TOKENAUG_BACKBONE'):
        runner.train()
    # the unconverted tokenaug-train / timm checkpoint
    raw = timm_checkpoint(tmp_path / 'raw.pth', 'vit_tiny_patch16_224', img_size=112)
    runner = mmseg_runner(vit, raw, ade_world, tmp_path / 'w1', monkeypatch)
    with pytest.raises(ValueError, match='convert the checkpoint first'):
        runner.train()
    # a conversion for another depth: layers 2-11 would stay random
    shallow = timm_checkpoint(tmp_path / 'shallow.pth', 'vit_tiny_patch16_224', img_size=112, depth=2)
    convert_checkpoint(
        shallow, tmp_path / 'shallow_seg.pth', 'mmseg', 'vit_tiny_patch16_224', model_kwargs=dict(img_size=112, depth=2)
    )
    runner = mmseg_runner(vit, tmp_path / 'shallow_seg.pth', ade_world, tmp_path / 'w2', monkeypatch)
    with pytest.raises(ValueError, match=r"missing 120 \['layers\.1"):
        runner.train()
    # the mmdet (backbone.-prefixed) conversion of a Swin: mmseg's Swin strips the prefix, so it loads and trains
    swin = timm_checkpoint(tmp_path / 'swin.pth', 'swin_tiny_patch4_window7_224', **SWIN_MINI)
    convert_checkpoint(swin, tmp_path / 'det.pth', 'mmdet', 'swin_tiny_patch4_window7_224', model_kwargs=SWIN_MINI)
    mmseg_runner('upernet_swin-mini_world.py', tmp_path / 'det.pth', ade_world, tmp_path / 'w3', monkeypatch).train()


@pytest.mark.slow
def test_mmsegs_own_model_pretrained_route_loads_and_is_checked(ade_world, tmp_path, monkeypatch, own_scope):
    """``--cfg-options model.pretrained=PATH`` (mmseg's ViT configs' route) with our config, whose backbone names
    its file in init_cfg: the stock EncoderDecoder stops at mmseg's assert; ours loads PATH (it wins over
    $TOKENAUG_BACKBONE) and checks it the same way."""
    from mmengine.config import Config
    from mmseg.registry import MODELS

    import mm_plugin  # noqa: F401  (registers PretrainedEncoderDecoder)

    vit = 'upernet_vit-tiny_world.py'
    raw = timm_checkpoint(tmp_path / 'raw.pth', 'vit_tiny_patch16_224', img_size=112)
    seg = tmp_path / 'seg.pth'
    convert_checkpoint(raw, seg, 'mmseg', 'vit_tiny_patch16_224', model_kwargs=dict(img_size=112))
    monkeypatch.setenv('TOKENAUG_WORLD', str(ade_world))
    monkeypatch.setenv('TOKENAUG_BACKBONE', str(tmp_path / 'nowhere.pth'))
    cfg = Config.fromfile(os.path.join(os.path.dirname(__file__), '..', '..', 'configs', 'mmseg', vit))
    assert cfg.model.type == 'PretrainedEncoderDecoder'
    with pytest.raises(AssertionError, match='init_cfg and pretrained cannot be set at the same time'):
        MODELS.build(dict(copy.deepcopy(cfg.model), type='EncoderDecoder', pretrained=str(seg)))  # (it edits cfg)
    model = MODELS.build(dict(cfg.model, pretrained=str(seg)))
    assert model.backbone.init_cfg == dict(type='Pretrained', checkpoint=str(seg))
    options = {'model.pretrained': str(seg)}
    mmseg_runner(vit, tmp_path / 'nowhere.pth', ade_world, tmp_path / 'w0', monkeypatch, options).train()
    runner = mmseg_runner(vit, seg, ade_world, tmp_path / 'w1', monkeypatch, {'model.pretrained': str(raw)})
    with pytest.raises(ValueError, match='convert the checkpoint first'):  # the route's file is checked too
        runner.train()


@pytest.mark.slow
def test_mmdet_refuses_an_mmseg_conversion(tmp_path, monkeypatch, own_scope):
    """mmdet's Swin reads only 'backbone.' keys: the bare mmseg file would leave every weight random."""
    from mmengine.config import Config
    from mmengine.runner import Runner

    from shared_core.tools.world import generate_world

    generate_world(
        tmp_path / 'w', seed=0, num_classes=10, image_size=112, train_per_class=1, val_per_class=1, formats=('coco',)
    )
    swin = timm_checkpoint(tmp_path / 'swin.pth', 'swin_tiny_patch4_window7_224', **SWIN_MINI)
    convert_checkpoint(swin, tmp_path / 'seg.pth', 'mmseg', 'swin_tiny_patch4_window7_224', model_kwargs=SWIN_MINI)
    monkeypatch.setenv('TOKENAUG_WORLD', str(tmp_path / 'w'))
    monkeypatch.setenv('TOKENAUG_BACKBONE', str(tmp_path / 'seg.pth'))
    cfg = Config.fromfile(
        os.path.join(os.path.dirname(__file__), '..', '..', 'configs', 'mmdet', 'cascade-mask-rcnn_swin-mini_world.py')
    )
    cfg.work_dir = str(tmp_path / 'work')
    cfg.train_cfg.max_epochs = 1
    cfg.train_dataloader.num_workers = cfg.val_dataloader.num_workers = 0
    cfg.train_dataloader.persistent_workers = cfg.val_dataloader.persistent_workers = False
    with pytest.raises(
        ValueError, match="The file's keys are bare .an mmseg conversion.; mmdet reads 'backbone.' keys"
    ):
        Runner.from_cfg(cfg).train()


# 8. stores ------------------------------------------------------------------------------------------------------
def small_store(tmp_path, n=4):
    import numpy as np

    from ..helpers.data import write_store

    rng = np.random.default_rng(0)
    values = (rng.dirichlet(np.ones(3), size=(n, 2, 2)).transpose(0, 3, 1, 2) * 0.9).astype(np.float16)
    indices = np.stack([np.argsort(rng.random((10, 2, 2)), 0)[:3] for _ in range(n)])
    paths = [f'c{i % 2}/img{i}.png' for i in range(n)]
    return write_store(tmp_path / 'store', paths, values, indices, 10, 'random', (64, 64)), paths


@pytest.mark.parametrize('damage', ['truncated', 'pickle'])
def test_maps_info_opens_the_arrays_as_training_does(damage, tmp_path, capsys):
    import numpy as np

    from timm_plugin.tools import maps_cli

    store, _ = small_store(tmp_path)
    values = store / 'values.npy'
    if damage == 'truncated':
        values.write_bytes(values.read_bytes()[: values.stat().st_size // 2])
    else:
        np.save(values, np.array([{'x': 1}, None], dtype=object), allow_pickle=True)
    assert maps_cli.main(['info', str(store)]) == 0
    out = capsys.readouterr().out
    assert 'complete: False' in out and 'problem: ' in out and 'values.npy' in out, out


def test_maps_resume_of_a_random_annotator_is_refused(tmp_path):
    from shared_core.map_format import LabelMapError
    from timm_plugin.tools import maps_cli

    args = maps_cli.parse_args(
        ['generate', '--data-dir', str(tmp_path), '--model', 'resnet18', '--out', str(tmp_path / 'm')]
    )
    args.resume = True
    with pytest.raises(LabelMapError, match='--resume: the annotator has random weights'):
        maps_cli.generate(args)


def test_a_corrupt_row_is_named_with_its_image_and_row(tmp_path):
    import numpy as np
    from PIL import Image
    from timm.data import create_dataset
    from torchvision import transforms as T

    from shared_core.map_store import LabelMapStore
    from timm_plugin.token_label_data import TokenLabelDataset

    store, paths = small_store(tmp_path)
    for p in paths:
        (tmp_path / 'data' / 'train' / p).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.zeros((64, 64, 3), np.uint8)).save(tmp_path / 'data' / 'train' / p)
    v = np.load(store / 'values.npy', mmap_mode='r+')
    v[2, 0, 0, 0] = np.nan
    v.flush()
    del v
    ds = TokenLabelDataset(create_dataset('', root=str(tmp_path / 'data'), split='train'), LabelMapStore.open(store))
    ds.transform = T.Compose([T.RandomResizedCrop(32), T.PILToTensor()])
    bad = next(i for i in range(len(ds)) if ds.filename(i) == paths[2])  # the image of row 2
    with pytest.raises(ValueError, match=rf"label map of '{paths[2]}' \(row 2 of .*\): values must be probabilities"):
        ds[bad]


# 9. TL-Align edges ------------------------------------------------------------------------------------------------
def tiny_vit(**kw):
    torch.manual_seed(0)
    return timm.create_model('vit_tiny_patch16_224', img_size=32, patch_size=8, depth=2, num_classes=10, **kw)


def mixed_batch(B=4):
    from timm_plugin import create_mixer

    mixer = create_mixer('cutmix', method='tl_align', mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=10, patch_size=8)
    g = torch.Generator().manual_seed(0)
    return mixer(torch.randn(B, 3, 32, 32, generator=g), torch.arange(B))


class TokenRoll(torch.nn.Module):
    """Mixes tokens (rolls the sequence): the label path cannot follow it."""

    def forward(self, x):
        return x.roll(1, dims=1)


def test_tl_align_refuses_parts_that_would_mix_tokens():
    from timm_plugin.tl_align import TLAlign

    m = tiny_vit()
    m.blocks[1].mlp = torch.nn.Sequential(m.blocks[1].mlp, TokenRoll())
    with pytest.raises(ValueError, match=r'block 1.mlp is a torch.nn.modules.container.Sequential'):
        TLAlign(m)
    m = tiny_vit()
    m.blocks[0].norm1 = TokenRoll()
    with pytest.raises(ValueError, match=r'block 0.norm1 is a .*TokenRoll'):
        TLAlign(m)


def test_tl_align_names_a_replaced_attention_forward():
    from timm_plugin.tl_align import TLAlign

    m = tiny_vit()
    attn = m.blocks[1].attn

    def plain_attention(x, **kwargs):  # skips q_norm / k_norm
        B, N, C = x.shape
        q, k, v = attn.qkv(x).reshape(B, N, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return attn.proj(out.transpose(1, 2).reshape(B, N, C))

    attn.forward = plain_attention
    x, t = mixed_batch()
    with pytest.raises(ValueError, match='block 1 left no q/k for the label path: its attention did not run q_norm'):
        TLAlign(m).train()(x, t)


def test_tl_align_returns_logits_and_target_in_eval_too_and_checks_the_batch():
    from timm_plugin.tl_align import TLAlign

    w = TLAlign(tiny_vit())
    x, t = mixed_batch(2)
    w.eval()
    logits, target = w(x, t)
    assert logits.shape == (2, 10) and target.shape == (2, 10)
    torch.testing.assert_close(target.sum(1), torch.ones(2))
    torch.testing.assert_close(logits, w(x))
    x4, _ = mixed_batch(4)
    with pytest.raises(ValueError, match='x: a batch of 4 images for a target .mix. of 2'):
        w.train()(x4, t)


def test_tl_align_of_a_compiled_model_says_to_compile_the_wrapper():
    from timm_plugin.tl_align import TLAlign

    with pytest.raises(ValueError, match=r'wrap the plain model first and compile the wrapper'):
        TLAlign(torch.compile(tiny_vit()))


def test_maps_and_occlusion_name_a_garbage_checkpoint(tmp_path, tiny_world, capsys):
    from timm_plugin.tools import maps_cli, occlusion_cli

    junk = tmp_path / 'junk.pth'
    junk.write_bytes(b'junk' + random.Random(1).randbytes(4000))
    data = str(tiny_world / 'imagenet')
    argv = [
        'generate',
        '--data-dir',
        data,
        '--model',
        'resnet18',
        '--checkpoint',
        str(junk),
        '--out',
        str(tmp_path / 'm'),
    ]
    assert maps_cli.main(argv + ['--device', 'cpu']) == 2
    assert '--checkpoint: ' + str(junk) + ' is not a PyTorch checkpoint' in capsys.readouterr().err
    argv = ['--data-dir', data, '--model', 'resnet18', '--checkpoint', str(junk), '--out', str(tmp_path / 'o')]
    assert occlusion_cli.main(argv) == 2
    assert 'is not a PyTorch checkpoint' in capsys.readouterr().err
