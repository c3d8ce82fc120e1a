"""timm's own ``train.py`` with the timm guide's diffs (``docs/timm_train/*.diff``), run as a timm user runs it: the
diff applied with ``git apply`` to timm's script (``tests/data/timm_train.py``, timm 1.0.29.dev0's, unchanged),
then one epoch on the synthetic world against the installed timm. TL-Align: the mixer that carries the mix and
``TLAlignTask``; token labeling: the label-map data path, the aux head and ``TokenLabelingTask``."""

import shutil
import subprocess
import sys

import pytest

from ..conftest import REPO, VENV_BIN

TRAIN = REPO / 'tests' / 'data' / 'timm_train.py'
COMMON = ['--model', 'vit_tiny_patch16_224', '--model-kwargs', 'img_size=112', 'depth=2', '--img-size', '112']
COMMON += ['--num-classes', '10', '-b', '4', '--epochs', '1', '--workers', '0', '--device', 'cpu']
COMMON += ['--train-split', 'train', '--val-split', 'val', '--log-interval', '50']


def patched(method: str, tmp_path):
    """timm's train.py in ``tmp_path`` with ``docs/timm_train/<method>.diff`` applied by ``git apply``."""
    shutil.copy(TRAIN, tmp_path / 'train.py')
    diff = REPO / 'docs' / 'timm_train' / f'{method}.diff'
    subprocess.run(['git', 'apply', '--check', str(diff)], cwd=tmp_path, check=True)
    subprocess.run(['git', 'apply', str(diff)], cwd=tmp_path, check=True)
    return tmp_path / 'train.py'


def run(script, tmp_path, *args):
    env = {'PYTHONPATH': str(REPO), 'PATH': f'{VENV_BIN}', 'HOME': str(tmp_path)}
    done = subprocess.run(
        [sys.executable, str(script), *COMMON, '--output', str(tmp_path / 'out'), '--experiment', 'run', *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


def test_the_timm_guide_states_each_diffs_size_and_shows_both():
    """The guide's "+A / −R lines" of each diff are the files' own counts, and the page includes both files."""
    import re

    guide = (REPO / 'docs' / 'guides' / 'timm.md').read_text()
    for name, method in (('TL-Align', 'tl_align'), ('Token Labeling', 'token_labeling')):
        lines = (REPO / 'docs' / 'timm_train' / f'{method}.diff').read_text().splitlines()
        added = sum(line.startswith('+') and not line.startswith('+++') for line in lines)
        removed = sum(line.startswith('-') and not line.startswith('---') for line in lines)
        stated = re.search(rf'^- {name}: \+(\d+) / −(\d+) lines', guide, re.M)
        assert stated and (int(stated[1]), int(stated[2])) == (added, removed), (name, added, removed)
        assert f'{{literalinclude}} ../timm_train/{method}.diff' in guide
    page = (REPO / 'docs' / 'methods' / 'token_labeling.md').read_text()
    assert '{literalinclude} ../timm_train/token_labeling.diff' in page


@pytest.mark.slow
def test_tl_align_diff_on_timms_train_py(tiny_world, tmp_path):
    log = run(
        patched('tl_align', tmp_path),
        tmp_path,
        '--data-dir',
        str(tiny_world / 'imagenet'),
        '--mixup',
        '0.8',
        '--cutmix',
        '1.0',
    )
    assert 'TLAlignTask: criterion=SoftTargetCrossEntropy' in log and '*** Best metric' in log


@pytest.mark.slow
def test_token_labeling_diff_on_timms_train_py(tiny_world, tmp_path):
    from shared_core.checkpoint_io import load_checkpoint_file
    from timm_plugin.tools import maps_cli

    store = tmp_path / 'maps'
    data = tiny_world / 'imagenet'
    argv = ['generate', '--data-dir', str(data), '--split', 'train', '--model', 'resnet18', '--num-classes', '10']
    assert maps_cli.main([*argv, '--input-size', '112', '--device', 'cpu', '--out', str(store), '--no-progress']) == 0
    log = run(
        patched('token_labeling', tmp_path),
        tmp_path,
        '--data-dir',
        str(data),
        '--token-label-dir',
        str(store),
        '--mixup',
        '0',
        '--cutmix',
        '0',
    )
    assert 'TokenLabelingTask' in log and '*** Best metric' in log
    state = load_checkpoint_file(tmp_path / 'out' / 'run' / 'last.pth.tar')  # timm's CheckpointSaver file
    assert {'aux_head.weight', 'aux_head.bias'} <= set(state['state_dict'])  # the aux head trained and saved
