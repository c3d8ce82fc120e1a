"""shared_core/tools/mmcv_wheel.py (``tokenaug-mmcv-wheel``): the setup.py patch, the cache lookup, safe extraction,
the command line as a plain stdlib-only script, and the build's orchestration with pip faked (nothing is built)."""

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from shared_core.tools import mmcv_wheel as mw

from ..helpers import REPO

SCRIPT = REPO / 'shared_core' / 'tools' / 'mmcv_wheel.py'
TAGS = mw.interpreter_tags()
RIGHT = 'mmcv-2.1.0-{}-{}-{}.whl'.format(*TAGS)
SETUP_SNIPPET = """
        if platform.system() != 'Windows':
            if parse_version(torch.__version__) <= parse_version('1.12.1'):
                extra_compile_args['cxx'] = ['-std=c++14']
            else:
                extra_compile_args['cxx'] = ['-std=c++17']
        ...
            extra_compile_args['cxx'] = ['-Wall', '-std=c++17']
"""


def run_script(*args, cwd):
    """The module as a plain script under ``python -I -S``: no site-packages (so neither tokenaug nor any third-party
    library is importable), no PYTHONPATH, no cwd or script folder on sys.path; pip may not reach any index."""
    env = dict(os.environ, PIP_NO_INDEX='1', PIP_FIND_LINKS='')
    env.pop('TOKENAUG_WHEEL_CACHE', None)
    cmd = [sys.executable, '-I', '-S', str(SCRIPT), *map(str, args)]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


# -- patch ------------------------------------------------------------------------------------------------------


def test_patch_setup_py_replaces_every_cxx17_flag():
    out = mw.patch_setup_py(SETUP_SNIPPET)
    assert '-std=c++17' not in out
    assert out.count('-std=c++20') == 2
    assert "['-std=c++14']" in out  # the old-torch branch is left alone
    assert out == SETUP_SNIPPET.replace('-std=c++17', '-std=c++20')


def test_patch_setup_py_without_the_flag_is_an_error():
    with pytest.raises(mw.MmcvWheelError, match=r"'-std=c\+\+17'.*not there"):
        mw.patch_setup_py(SETUP_SNIPPET.replace('-std=c++17', '-std=c++20'))


# -- cache lookup -----------------------------------------------------------------------------------------------


def other_python_tag():
    py = TAGS[0]
    return 'cp310' if py != 'cp310' else 'cp312'


def test_find_cached_wheel_picks_the_fitting_file(tmp_path):
    wrong_py = other_python_tag()
    fakes = [
        'mmcv-2.0.1-{}-{}-{}.whl'.format(*TAGS),  # wrong version
        'mmcv-2.1.0rc1-{}-{}-{}.whl'.format(*TAGS),  # wrong version
        f'mmcv-2.1.0-{wrong_py}-{wrong_py}-{TAGS[2]}.whl',  # wrong python tag
        'mmcv-2.1.0-{}-{}-win_amd64.whl'.format(*TAGS[:2]),  # wrong platform
        'mmcv_full-2.1.0-{}-{}-{}.whl'.format(*TAGS),  # another project
        'mmcv-2.1.0.tar.gz',
        'mmcv-2.1.0-{}-{}-{}.whl.partial'.format(*TAGS),
    ]
    for name in fakes:
        (tmp_path / name).write_bytes(b'')
    assert mw.find_cached_wheel(tmp_path) is None
    (tmp_path / RIGHT).write_bytes(b'')
    assert mw.find_cached_wheel(tmp_path) == tmp_path / RIGHT
    assert mw.find_cached_wheel(tmp_path / 'missing') is None


def test_wheel_fits_tags():
    tags = ('cp311', 'cp311', 'linux_x86_64')
    assert mw.wheel_fits('mmcv-2.1.0-cp311-cp311-linux_x86_64.whl', tags=tags)
    assert mw.wheel_fits('mmcv-2.1.0-1-cp311-cp311-manylinux_2_28_x86_64.whl', tags=tags)  # build tag, auditwheel
    assert mw.wheel_fits('mmcv-2.1.0-cp311-cp311-manylinux2014_x86_64.manylinux_2_17_x86_64.whl', tags=tags)
    assert not mw.wheel_fits('mmcv-2.1.0-cp311-cp311-manylinux_2_28_aarch64.whl', tags=tags)
    assert not mw.wheel_fits('mmcv-2.1.0-cp312-cp312-linux_x86_64.whl', tags=tags)
    assert not mw.wheel_fits('mmcv-2.1.0-cp311-cp311t-linux_x86_64.whl', tags=tags)
    assert not mw.wheel_fits('mmcv-2.1.0-cp311-cp311-linux_x86_64.zip', tags=tags)
    assert mw.expected_wheel_path('/c').name == RIGHT


# -- safe extraction --------------------------------------------------------------------------------------------


def write_tar(path, members):
    """A .tar.gz of ``members``: (name, bytes) files, or (name, '->', target) symlinks."""
    with tarfile.open(path, 'w:gz') as tf:
        for m in members:
            info = tarfile.TarInfo(m[0])
            if len(m) == 3:
                info.type, info.linkname = tarfile.SYMTYPE, m[2]
                tf.addfile(info)
            else:
                info.size = len(m[1])
                tf.addfile(info, io.BytesIO(m[1]))
    return path


@pytest.mark.parametrize(
    'bad',
    [('../evil.txt', b'x'), ('pkg/../../evil.txt', b'x'), ('/tmp/tokenaug-evil.txt', b'x'), ('pkg/ln', '->', '../..')],
    ids=['dotdot', 'nested-dotdot', 'absolute', 'symlink-out'],
)
def test_safe_extract_refuses_members_escaping_the_folder(tmp_path, bad):
    archive = write_tar(tmp_path / 'a.tar.gz', [('pkg/setup.py', b'ok'), bad])
    dest = tmp_path / 'out'
    dest.mkdir()
    with pytest.raises(mw.MmcvWheelError, match='refusing to extract member'):
        mw.safe_extract(archive, dest)
    assert list(dest.iterdir()) == []  # checked before anything is written
    assert not (tmp_path / 'evil.txt').exists()


def test_safe_extract_extracts_a_plain_archive(tmp_path):
    archive = write_tar(tmp_path / 'a.tar.gz', [('pkg/setup.py', b'ok'), ('pkg/sub/x.py', b'y'), ('pkg/l', '->', 'x')])
    mw.safe_extract(archive, tmp_path / 'out')
    assert (tmp_path / 'out' / 'pkg' / 'sub' / 'x.py').read_bytes() == b'y'


# -- command line, as a plain script ----------------------------------------------------------------------------


def test_cli_prints_the_cached_wheel_without_downloading(tmp_path):
    """A copy (symlink) of the real cached wheel when this machine has one (``make install`` builds it), else a file
    of that name: the lookup only reads names."""
    cache = tmp_path / 'cache'
    cache.mkdir()
    real = mw.find_cached_wheel(mw.default_cache())
    if real is not None:
        (cache / real.name).symlink_to(real)
    else:
        (cache / RIGHT).write_bytes(b'')
    want = cache / (real.name if real is not None else RIGHT)
    (cache / 'mmcv-2.0.1-{}-{}-{}.whl'.format(*TAGS)).write_bytes(b'')
    res = run_script('--cache', cache, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout == f'{want}\n'
    assert 'cached wheel' in res.stderr and 'download' not in res.stderr


def test_cli_dry_run_with_an_empty_cache_says_it_would_build(tmp_path):
    cache = tmp_path / 'empty'
    res = run_script(
        '--cache', cache, '--constraints', REPO / 'constraints.txt', '--dry-run', '--install', cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout == f'{cache / RIGHT}\n'
    assert 'would download' in res.stderr and 'build the wheel into' in res.stderr and 'pip install' in res.stderr
    assert not cache.exists()  # nothing created, downloaded or built


def test_cli_dry_run_says_when_the_cache_holds_another_pythons_wheel(tmp_path):
    """A cache that holds the wheel of another Python only (the cp311 one ``make install`` builds, for a 3.12
    environment): ``--dry-run`` says so before the user commits to a 5-12 minute build."""
    other = 'cp310' if TAGS[0] != 'cp310' else 'cp312'
    (tmp_path / f'mmcv-2.1.0-{other}-{other}-{TAGS[2]}.whl').write_bytes(b'')
    (tmp_path / 'mmcv-2.0.1-{}-{}-{}.whl'.format(*TAGS)).write_bytes(b'')  # another version: not named
    res = run_script('--cache', tmp_path, '--dry-run', cwd=tmp_path)
    assert res.returncode == 0 and res.stdout == f'{tmp_path / RIGHT}\n', res.stderr
    py = f'{sys.version_info[0]}.{sys.version_info[1]}'
    assert f'the cache holds mmcv 2.1.0 wheels for {other} only, and this is Python {py} ({TAGS[0]})' in res.stderr
    assert 'would download' in res.stderr and '5-12 minutes' in res.stderr
    (tmp_path / RIGHT).write_bytes(b'')  # this Python's wheel too: taken, nothing said of the other
    res = run_script('--cache', tmp_path, '--dry-run', cwd=tmp_path)
    assert 'cached wheel' in res.stderr and other not in res.stderr, res.stderr


def test_cli_rebuild_dry_run_ignores_the_cache(tmp_path):
    (tmp_path / RIGHT).write_bytes(b'')
    res = run_script('--cache', tmp_path, '--rebuild', '--print-path-only', cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout == f'{tmp_path / RIGHT}\n' and 'would download' in res.stderr


def test_cli_bad_arguments_name_the_argument(tmp_path):
    res = run_script('--cache', tmp_path, '--constraints', tmp_path / 'nope.txt', cwd=tmp_path)
    assert res.returncode == 2 and '--constraints' in res.stderr and 'expected an existing' in res.stderr
    (tmp_path / 'f').write_text('')
    res = run_script('--cache', tmp_path / 'f', cwd=tmp_path)
    assert res.returncode == 2 and '--cache' in res.stderr and 'expected a folder' in res.stderr
    assert res.stdout == ''


# -- the build, pip faked ---------------------------------------------------------------------------------------


@pytest.fixture
def fake_pip(tmp_path, monkeypatch):
    """``mw._run`` faked: ``pip download`` writes a small sdist (its setup.py: ``calls['setup']``), ``pip wheel``
    records the patched setup.py and the env and writes a wheel named for this interpreter, ``pip install`` records
    its command."""
    calls = {'setup': SETUP_SNIPPET, 'cmds': []}

    def run(cmd, what, env=None):
        calls['cmds'].append(cmd)
        if 'download' in cmd:
            dest = cmd[cmd.index('-d') + 1]
            os.makedirs(dest)
            setup = calls['setup'].encode()
            write_tar(os.path.join(dest, 'mmcv-2.1.0.tar.gz'), [('mmcv-2.1.0/setup.py', setup)])
        elif 'wheel' in cmd:
            calls['patched'] = (Path(cmd[-1]) / 'setup.py').read_text()
            calls['env'] = env
            out = cmd[cmd.index('-w') + 1]
            os.makedirs(out)
            (Path(out) / RIGHT).write_bytes(b'wheel')

    monkeypatch.setattr(mw, '_run', run)
    monkeypatch.setattr(mw, 'check_build_requirements', lambda: '2.14.1')
    monkeypatch.setenv('FORCE_CUDA', '1')
    monkeypatch.delenv('MAX_JOBS', raising=False)
    return calls


def test_build_downloads_patches_builds_and_caches(tmp_path, fake_pip, capsys):
    cache, cons = tmp_path / 'cache', REPO / 'constraints.txt'
    assert mw.main(['--cache', str(cache), '--constraints', str(cons), '--install']) == 0
    assert capsys.readouterr().out == f'{cache / RIGHT}\n'
    assert (cache / RIGHT).read_bytes() == b'wheel' and sorted(os.listdir(cache)) == [RIGHT]  # no .partial left
    download, wheel, install = fake_pip['cmds']
    assert download[:4] == [sys.executable, '-m', 'pip', 'download'] and ['-c', str(cons)] == download[4:6]
    assert {'--no-deps', '--no-build-isolation', ':all:', 'mmcv==2.1.0'} <= set(download)
    assert wheel[:4] == [sys.executable, '-m', 'pip', 'wheel']
    assert {'-v', '--no-deps', '--no-build-isolation'} <= set(wheel)
    assert fake_pip['patched'] == mw.patch_setup_py(SETUP_SNIPPET)
    env = fake_pip['env']
    assert env['MMCV_WITH_OPS'] == '1' and 'FORCE_CUDA' not in env and int(env['MAX_JOBS']) >= 1
    assert install == [sys.executable, '-m', 'pip', 'install', '-c', str(cons), '--no-deps', str(cache / RIGHT)]

    # a second call finds the cached wheel: nothing downloaded or built, only installed
    fake_pip['cmds'].clear()
    assert mw.main(['--cache', str(cache), '--install']) == 0
    assert [c[3] for c in fake_pip['cmds']] == ['install']
    assert capsys.readouterr().out == f'{cache / RIGHT}\n'


def test_build_of_an_unknown_sdist_stops_before_building(tmp_path, fake_pip, capsys):
    fake_pip['setup'] = "extra_compile_args['cxx'] = ['-std=c++20']\n"
    assert mw.main(['--cache', str(tmp_path / 'cache')]) == 1
    out = capsys.readouterr()
    assert out.out == '' and "'-std=c++17'" in out.err
    assert [c[3] for c in fake_pip['cmds']] == ['download']  # no pip wheel
    assert not (tmp_path / 'cache').exists() or not os.listdir(tmp_path / 'cache')


def test_missing_torch_says_how_to_install_it(tmp_path, monkeypatch):
    """The probe runs in a subprocess of this interpreter; a ``torch`` package on PYTHONPATH that fails to import
    shadows the real one."""
    (tmp_path / 'torch').mkdir()
    (tmp_path / 'torch' / '__init__.py').write_text("raise ImportError('torch hidden by the test')\n")
    monkeypatch.setenv('PYTHONPATH', str(tmp_path))
    with pytest.raises(
        mw.MmcvWheelError, match=r'torch \(ImportError: torch hidden by the test\).*-m pip install torch'
    ):
        mw.check_build_requirements()
    monkeypatch.delenv('PYTHONPATH')
    assert mw.check_build_requirements()  # torch's version here (the venv has torch)


# -- the real sdist (network) -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_sdist_setup_py_takes_the_patch(tmp_path):
    """Downloads mmcv 2.1.0's sdist (needs torch in this interpreter and the package registry, which make install
    needs as well) and patches it; builds nothing."""
    archive = mw.download_sdist(tmp_path / 'dl', REPO / 'constraints.txt')
    src = mw.unpack_and_patch(archive, tmp_path / 'src')
    text = (src / 'setup.py').read_text()
    assert src.name == 'mmcv-2.1.0' and '-std=c++17' not in text and "['-std=c++17']" not in text
    assert "extra_compile_args['cxx'] = ['-std=c++20']" in text
