"""tokenaug as a pip user gets it: the install page's install block and first-run block run as written (extracted from
docs/install.md, not retyped), in a temporary folder outside the repo that holds the checkout as ``./tokenaug``; mmcv
comes from the cache ``make install`` filled.

Checked there: the installed package and its metadata (``pip show``); the console scripts; the configs inherited
from the user's own config (``tokenaug-config copy``/``path``); mmseg / mmdet configs building with mmpretrain
unimportable; an mmpretrain config; the first-run block (``tokenaug-data``, ``tokenaug-train -c tokenaug::...``,
``tokenaug-mim train mmpretrain ...``). About 4 minutes (the installs)."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shared_core.tools.mmcv_wheel import default_cache, find_cached_wheel

from ..conftest import REPO
from ..snippets import run_by

pytestmark = pytest.mark.slow


def install_blocks() -> list[str]:
    """The documentation's shell snippets marked as run by this test, in order: [install, first run, openmim]."""
    blocks = run_by('tests/end_to_end/test_wheel.py')
    pages = [('docs/guides/mmpretrain.md', 'bash'), ('docs/install.md', 'bash'), ('docs/install.md', 'bash')]
    assert [(b.page, b.lang) for b in blocks] == pages, blocks
    return [b.code for b in blocks[1:]] + [blocks[0].code]


def _run(cmd, cwd, env, timeout=1200):
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f'{cmd}\n{res.stdout[-3000:]}\n{res.stderr[-4000:]}'
    return res.stdout


def _bash(script, cwd, env):
    """``script`` in bash with the install page's environment activated first (when it exists), stopping at a
    failure."""
    activate = '. venv/bin/activate\n' if (Path(cwd) / 'venv').is_dir() else ''
    return _run(['bash', '-c', 'set -eo pipefail\n' + activate + script], cwd, env)


@pytest.fixture(scope='module')
def user(tmp_path_factory):
    """(venv bin folder, the user's folder outside the repo, env) after the install page's install block."""
    if find_cached_wheel(default_cache()) is None:  # make install puts it there: a test run always has it
        pytest.fail(f'no cached mmcv 2.1.0 wheel in {default_cache()} (make install builds it)')
    root = tmp_path_factory.mktemp('pip_user')
    (root / 'tokenaug').symlink_to(REPO, target_is_directory=True)  # "the folder that holds your checkout"
    shim = root / 'shim'  # `python` on PATH is the interpreter the tests run on (a venv's base, not the venv)
    shim.mkdir()
    (shim / 'python').symlink_to(getattr(sys, '_base_executable', sys.executable))
    drop = ('PYTHONPATH', 'VIRTUAL_ENV', 'PIP_CONSTRAINT', 'PIP_REQUIRE_VIRTUALENV')
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(PYTHONNOUSERSITE='1', PATH=f'{shim}{os.pathsep}{env.get("PATH", "")}')
    _bash(install_blocks()[0], root, env)
    bin_ = root / 'venv' / 'bin'
    env['PATH'] = f'{bin_}{os.pathsep}{env["PATH"]}'
    env['PIP_CONSTRAINT'] = str(REPO / 'constraints.txt')  # as the block exported it
    (wheel,) = (root / 'dist').glob('tokenaug-*.whl')
    yield bin_, root, env, wheel
    shutil.rmtree(root / 'venv', ignore_errors=True)  # 6 GB (torch): not kept for a later look


def _py(user, code):
    bin_, work, env, _ = user
    return _run([str(bin_ / 'python'), '-c', textwrap.dedent(code)], work, env)


def test_installed_from_the_wheel_not_the_checkout(user):
    bin_, _, _, _ = user
    out = _py(
        user,
        """
        import sys, shared_core, timm_plugin, mm_plugin, torch, mmcv, mmpretrain, matplotlib
        print(shared_core.__file__, shared_core.__version__)
        print(sys.prefix, torch.__version__, mmcv.__version__, mmpretrain.__version__)
        """,
    )
    first, second = out.splitlines()[:2]
    assert 'site-packages' in first and str(REPO) not in first
    assert second.startswith(str(bin_.parent)) and ' 2.1.0 1.2.0' in second  # the install page's venv; mmcv, mmpretrain


def test_pip_show_metadata(user):
    """What a package index and ``pip show`` display: summary, author, licence, the extras, the reference code."""
    bin_, work, env, _ = user
    shown = _run([str(bin_ / 'python'), '-m', 'pip', 'show', '--verbose', 'tokenaug'], work, env)
    fields = dict(line.split(': ', 1) for line in shown.splitlines() if ': ' in line and not line.startswith(' '))
    assert fields['Name'] == 'tokenaug' and fields['Author'] == 'The tokenaug developers'
    assert fields['Summary'].startswith('Token-aware mixing and targets for vision transformers')
    assert 'Intended Audience :: Science/Research' in shown  # Classifiers (--verbose)
    assert {'torch', 'timm', 'torchvision'} <= {r.strip() for r in fields['Requires'].split(',')}
    assert 'TL-Align reference code, https://github.com/Euphoria16/TL-Align' in shown  # Project-URLs
    # the licence is a metadata 2.4 License-Expression, which the venv's pip (23.2) does not print
    meta = _py(
        user,
        """
        from importlib.metadata import metadata
        m = metadata('tokenaug')
        print(m['License-Expression'], sorted(m.get_all('Provides-Extra')), m['Requires-Python'])
        """,
    )
    assert meta.split() == ['Apache-2.0', "['docs',", "'examples',", "'mm',", "'test',", "'viz']", '>=3.10'], meta


@pytest.mark.parametrize(
    'script',
    [
        'tokenaug-train',
        'tokenaug-data',
        'tokenaug-convert',
        'tokenaug-maps',
        'tokenaug-occlusion',
        'tokenaug-config',
        'tokenaug-mim',
        'tokenaug-mmcv-wheel',
        'tokenaug-viz',
    ],
)
def test_console_scripts(user, script):
    bin_, work, env, _ = user
    assert 'usage' in _run([str(bin_ / script), '--help'], work, env).lower()


def test_seg_and_det_configs_inherited_without_mmpretrain(user):
    """The user's own configs inherit ours: copied (relative ``_base_``) and by the installed path; mmseg and
    mmdet need no mmpretrain (a transfer-only user): it is made unimportable in the process that builds them."""
    bin_, work, env, _ = user
    cfg = str(bin_ / 'tokenaug-config')
    _run([cfg, 'copy', 'mmseg/upernet_vit-tiny_world.py', 'configs'], work, env)
    _run([cfg, 'copy', 'mmdet/cascade-mask-rcnn_swin-mini_world.py', 'configs'], work, env)
    installed = _run([cfg, 'path', 'mmseg/fcn_lvvit-tiny_world.py'], work, env).strip()
    assert 'site-packages' in installed and str(REPO) not in installed
    (work / 'my_seg.py').write_text(
        "_base_ = ['./configs/mmseg/upernet_vit-tiny_world.py']\nmodel = dict(auxiliary_head=None)\n"
    )
    (work / 'my_fcn.py').write_text(f'_base_ = [{installed!r}]\n')
    (work / 'my_det.py').write_text("_base_ = ['./configs/mmdet/cascade-mask-rcnn_swin-mini_world.py']\n")
    out = _py(
        user,
        """
        import sys
        sys.modules['mmpretrain'] = None  # `import mmpretrain` raises ImportError, as when it is not installed
        from mmengine.config import Config
        from mmseg.registry import MODELS as SEG
        from mmseg.utils import register_all_modules as seg_modules
        from mmdet.registry import MODELS as DET
        from mmdet.utils import register_all_modules as det_modules
        seg_modules()
        for name in ('my_seg.py', 'my_fcn.py'):
            cfg = Config.fromfile(name)
            print(name, type(SEG.build(cfg.model)).__name__, cfg.model.get('auxiliary_head'))
        det_modules()
        print('my_det.py', type(DET.build(Config.fromfile('my_det.py').model)).__name__)
        print('mmpretrain loaded:', any(k.startswith('mmpretrain') and sys.modules[k] for k in sys.modules))
        """,
    )
    assert 'my_seg.py PretrainedEncoderDecoder None' in out and 'my_fcn.py PretrainedEncoderDecoder' in out
    assert 'my_det.py CascadeRCNN' in out and 'mmpretrain loaded: False' in out


def test_an_inherited_mmpretrain_config_builds(user):
    """An mmpretrain config of ours inherited from the user's config builds (model and preprocessor)."""
    bin_, work, env, _ = user
    _run([str(bin_ / 'tokenaug-config'), 'copy', 'mmpretrain/deit-tiny_world_tl-align.py', 'configs'], work, env)
    (work / 'my_cls.py').write_text(
        "_base_ = ['./configs/mmpretrain/deit-tiny_world_tl-align.py']\ntrain_cfg = dict(max_epochs=1)\n"
    )
    out = _py(
        user,
        """
        from mmengine.config import Config
        from mmpretrain.registry import MODELS
        from mmpretrain.utils import register_all_modules
        register_all_modules()
        cfg = Config.fromfile('my_cls.py')
        model, pre = MODELS.build(cfg.model), MODELS.build(cfg.data_preprocessor)  # the Runner joins them
        print(type(model).__name__, type(pre).__name__, cfg.train_cfg.max_epochs)
        """,
    )
    assert 'TLAlignClassifier TokenAugDataPreprocessor 1' in out, out


def test_the_install_pages_first_run(user):
    """The install page's first-run block as written: the world in data/world (the configs' default), an epoch of
    ``tokenaug-train -c tokenaug::timm/...`` and one of mmpretrain's own tools/train.py through ``tokenaug-mim``."""
    _, work, env, _ = user
    _bash(install_blocks()[1], work, env)
    assert (work / 'data' / 'world' / 'imagenet' / 'train').is_dir()
    assert len(list((work / 'runs').glob('*/last.pth.tar'))) == 1  # timm's saver, one experiment folder
    assert (work / 'work_dirs' / 'tl_align' / 'epoch_1.pth').is_file()  # saved by mmpretrain's train.py


def test_openmim_installs_under_the_pins_and_mim_train_runs_our_config(user):
    """The MMPretrain guide's openmim block as written, in the install page's environment (its PIP_CONSTRAINT
    exported): the install only adds packages (no installed version changes), ``pip check`` is clean, and
    ``mim train mmpretrain`` trains our config for an epoch."""
    bin_, work, env, _ = user

    def freeze() -> dict:
        out = _run([str(bin_ / 'python'), '-m', 'pip', 'freeze', '--all'], work, env)
        return dict(line.split('==', 1) for line in out.splitlines() if '==' in line)

    before = freeze()
    _bash(install_blocks()[2], work, env)
    after = freeze()
    assert {k: v for k, v in before.items() if after.get(k) != v} == {}  # nothing up- or downgraded, nothing removed
    assert 'openmim' in after and 'openmim' not in before
    assert 'No broken requirements' in _run([str(bin_ / 'python'), '-m', 'pip', 'check'], work, env)
    assert (work / 'work_dirs' / 'mim' / 'epoch_1.pth').is_file()  # saved by mmpretrain's train.py, run by mim


def test_the_wheel_holds_the_configs_and_typing_marker(user):
    import zipfile

    names = zipfile.ZipFile(user[3]).namelist()
    assert 'tokenaug_configs/mmpretrain/_base_/world_deit-tiny.py' in names
    assert 'tokenaug_configs/timm/world_vit-tiny.yaml' in names
    assert {'shared_core/py.typed', 'timm_plugin/py.typed', 'mm_plugin/py.typed'} <= set(names)
    assert any(n.endswith('licenses/LICENSE') for n in names)
    assert not any(n.startswith(('tests/', 'scripts/', 'bench/')) for n in names)
