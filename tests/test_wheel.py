"""tokenaug as a pip user gets it: the wheel built from this tree, installed into a fresh virtual environment the
way the README says (torch, then ``tokenaug``, then ``tokenaug-mmcv-wheel --install`` from the cached mmcv
wheel, then the OpenMMLab packages), every command run from a folder outside the repo.

Checked there: the console scripts; the configs inherited from the user's own config (``tokenaug-config
copy``/``path``) and ``tokenaug-train -c tokenaug::...``; mmseg / mmdet configs building with mmpretrain not
installed; then ``tokenaug[mm]`` (with mmpretrain) and an mmpretrain config. About 3 minutes (the installs)."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from shared_core.tools.mmcv_wheel import default_cache, find_cached_wheel

from .conftest import REPO

CONSTRAINTS = str(REPO / 'constraints.txt')
pytestmark = pytest.mark.slow


def _run(cmd, cwd, env, timeout=900):
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f'{cmd}\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}'
    return res.stdout


@pytest.fixture(scope='module')
def user(tmp_path_factory):
    """(venv bin folder, a working folder outside the repo, env) with tokenaug installed from its wheel,
    mmcv from the cache, mmengine / mmseg / mmdet, and no mmpretrain."""
    if find_cached_wheel(default_cache()) is None:  # make install puts it there: a test run always has it
        pytest.fail(f'no cached mmcv 2.1.0 wheel in {default_cache()} (make install builds it)')
    root = tmp_path_factory.mktemp('pip_user')
    work = root / 'work'
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ('PYTHONPATH', 'VIRTUAL_ENV')}
    env['PYTHONNOUSERSITE'] = '1'
    _run(
        [sys.executable, '-m', 'pip', 'wheel', '--no-deps', '--no-build-isolation', '-w', str(root), str(REPO)],
        root,
        env,
    )
    (wheel,) = root.glob('tokenaug-*.whl')
    _run([sys.executable, '-m', 'venv', str(root / 'venv')], root, env)
    bin_ = root / 'venv' / 'bin'
    env['PATH'] = f'{bin_}{os.pathsep}{env.get("PATH", "")}'
    pip = [str(bin_ / 'python'), '-m', 'pip', 'install', '-q', '-c', CONSTRAINTS]
    _run([*pip, 'torch==2.14.1', 'torchvision==0.29.1', 'setuptools<81'], work, env)  # mmcv's setup.py needs both
    _run([*pip, str(wheel)], work, env)  # no extras: brings tokenaug-mmcv-wheel
    printed = _run([str(bin_ / 'tokenaug-mmcv-wheel'), '--install', '--cache', str(default_cache())], work, env)
    assert printed.strip().endswith('.whl')
    _run([*pip, 'mmengine==0.10.7', 'mmsegmentation==1.2.2', 'mmdet==3.3.0', 'ftfy', 'regex'], work, env)
    yield bin_, work, env, wheel
    shutil.rmtree(root / 'venv', ignore_errors=True)  # 6 GB (torch): not kept for a later look


def _py(user, code):
    bin_, work, env, _ = user
    return _run([str(bin_ / 'python'), '-c', textwrap.dedent(code)], work, env)


def test_installed_from_the_wheel_not_the_checkout(user):
    out = _py(
        user,
        """
        import importlib.util, shared_core, timm_plugin, mm_plugin
        print(shared_core.__file__, shared_core.__version__)
        print('mmpretrain', importlib.util.find_spec('mmpretrain'))
        """,
    )
    first = out.splitlines()[0]
    assert 'site-packages' in first and str(REPO) not in first
    assert 'mmpretrain None' in out


@pytest.mark.parametrize(
    'script',
    [
        'tokenaug-train',
        'tokenaug-data',
        'tokenaug-convert',
        'tokenaug-maps',
        'tokenaug-occlusion',
        'tokenaug-config',
        'tokenaug-mmcv-wheel',
        'tokenaug-viz',
    ],
)
def test_console_scripts(user, script):
    bin_, work, env, _ = user
    assert 'usage' in _run([str(bin_ / script), '--help'], work, env).lower()


def test_seg_and_det_configs_inherited_without_mmpretrain(user):
    """The user's own configs inherit ours: copied (relative ``_base_``) and by the installed path."""
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
        import sys
        print('mmpretrain loaded:', any(k.startswith('mmpretrain') for k in sys.modules))
        """,
    )
    assert 'my_seg.py PretrainedEncoderDecoder None' in out and 'my_fcn.py PretrainedEncoderDecoder' in out
    assert 'my_det.py CascadeRCNN' in out and 'mmpretrain loaded: False' in out


def test_tokenaug_train_with_an_installed_timm_config(user):
    bin_, work, env, _ = user
    _run([str(bin_ / 'tokenaug-data'), '--out', 'world', '--train-per-class', '1', '--val-per-class', '1'], work, env)
    _run(
        [str(bin_ / 'tokenaug-train'), '-c', 'tokenaug::timm/world_vit-tiny.yaml', '--data-dir', 'world/imagenet']
        + ['--epochs', '1', '-b', '4', '--workers', '0', '--model-kwargs', 'img_size=112', 'depth=1']
        + ['--mixup-type', 'tl_align', '--output', 'out', '--experiment', 'run'],
        work,
        env,
    )
    assert (work / 'out' / 'run' / 'last.pth.tar').is_file()


def test_mm_extra_and_an_mmpretrain_config(user):
    """``pip install tokenaug[mm]`` resolves with the mmcv the script installed; an mmpretrain config of ours
    inherited from the user's config builds (last: it installs mmpretrain into the environment)."""
    bin_, work, env, wheel = user
    _run([str(bin_ / 'python'), '-m', 'pip', 'install', '-q', '-c', CONSTRAINTS, f'{wheel}[mm]'], work, env)
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
    # mmpretrain's own tools/train.py from the pip install, as `mim train mmpretrain CONFIG` runs it
    world = ['--out', 'mimworld', '--train-per-class', '1', '--val-per-class', '1']
    _run([str(bin_ / 'tokenaug-data'), *world], work, env)
    opts = ['train_dataloader.batch_size=4', 'train_dataloader.num_workers=0', 'val_dataloader.num_workers=0']
    _run(
        [str(bin_ / 'tokenaug-mim'), 'train', 'mmpretrain', 'my_cls.py', '--work-dir', 'mim_run', '--cfg-options']
        + opts,
        work,
        dict(env, TOKENAUG_WORLD=str(work / 'mimworld')),
    )
    assert (work / 'mim_run' / 'epoch_1.pth').is_file()  # one epoch trained and saved by mmpretrain's train.py


def test_the_wheel_holds_the_configs_and_typing_marker(user):
    import zipfile

    names = zipfile.ZipFile(user[3]).namelist()
    assert 'tokenaug_configs/mmpretrain/_base_/world_deit-tiny.py' in names
    assert 'tokenaug_configs/timm/world_vit-tiny.yaml' in names
    assert {'shared_core/py.typed', 'timm_plugin/py.typed', 'mm_plugin/py.typed'} <= set(names)
    assert any(n.endswith('licenses/LICENSE') for n in names)
    assert not any(n.startswith(('tests/', 'scripts/', 'bench/')) for n in names)
