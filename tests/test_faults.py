"""Fault injection (issue 14, ``../shared/reviews/reliability.md``): each case reproduces a way a user could
lose data or get silently wrong results, and checks the fix."""

import hashlib
import os
import subprocess
import sys
import textwrap

import pytest
import timm
import torch

from mm_plugin.convert_cli import convert_checkpoint
from shared_core.checkpoint_io import CheckpointError, atomic_output, load_checkpoint_file, save_checkpoint_file


def sha(path):
    return hashlib.sha256(open(path, 'rb').read()).hexdigest()


def convert_cmd(src, dst, *extra):
    return [
        'tokenaug-convert', '--src', str(src), '--dst', str(dst), '--to', 'mmseg',
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
def test_convert_refuses_its_own_source_and_existing_files(train_ckpt, tmp_path, run_env):
    before = sha(train_ckpt)
    res = subprocess.run(convert_cmd(train_ckpt, train_ckpt), env=run_env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and 'is the src file' in res.stderr and 'Traceback' not in res.stderr
    link = tmp_path / 'link.pth.tar'
    os.symlink(train_ckpt, link)  # the same file under another name
    with pytest.raises(CheckpointError, match='is the src file'):
        convert_checkpoint(
            train_ckpt, link, 'mmseg', 'deit_tiny_patch16_224', model_kwargs=dict(img_size=32, patch_size=8)
        )
    assert sha(train_ckpt) == before and set(torch.load(train_ckpt, weights_only=True)) >= {'optimizer', 'epoch'}
    out = tmp_path / 'out.pth'
    out.write_bytes(b'an older conversion')
    res = subprocess.run(convert_cmd(train_ckpt, out), env=run_env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and 'exists; pass --force' in res.stderr
    assert out.read_bytes() == b'an older conversion'
    res = subprocess.run(
        convert_cmd(train_ckpt, out, '--force'), env=run_env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert set(torch.load(out, weights_only=True)) == {'state_dict', 'meta'}
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith('.tmp')] == []
    assert sha(train_ckpt) == before


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
def test_unreadable_checkpoints_are_named_without_unsafe_advice(kind, train_ckpt, tmp_path, run_env):
    bad = tmp_path / f'{kind}.pth'
    if kind == 'garbage':
        bad.write_bytes(os.urandom(5000))
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
    res = subprocess.run(convert_cmd(bad, tmp_path / 'o.pth'), env=run_env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and expect in res.stderr and 'weights_only=False' not in res.stderr, res.stderr[-2000:]
    assert 'Traceback' not in res.stderr and not (tmp_path / 'PWNED').exists()


def test_convert_names_an_unknown_model(train_ckpt, tmp_path, run_env):
    cmd = convert_cmd(train_ckpt, tmp_path / 'o.pth')
    cmd[cmd.index('deit_tiny_patch16_224')] = 'vit_tiny_patch16_224x'
    res = subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "model: 'vit_tiny_patch16_224x' is not a timm model name" in res.stderr
