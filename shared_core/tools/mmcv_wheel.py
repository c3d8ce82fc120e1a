"""Get an installable mmcv 2.1.0 wheel for this interpreter: from a cache, or built once from the patched sdist.

mmdet 3.3.0 and mmsegmentation 1.2.2 (``tokenaug[mm]``) need mmcv 2.1.0, which has no wheel for today's torch,
and its sdist's ``setup.py`` hard-codes ``-std=c++17`` while torch >= 2.10 headers need C++20. This tool
(console script ``tokenaug-mmcv-wheel``; also runs as a plain script from a checkout,
``python shared_core/tools/mmcv_wheel.py``, before tokenaug is installed) does what ``make install`` does:

1. look in the cache folder (``--cache``; default ``$TOKENAUG_WHEEL_CACHE``, else
   ``${XDG_CACHE_HOME:-~/.cache}/tokenaug/wheels``) for ``mmcv-2.1.0-*.whl`` whose tags fit the running
   interpreter (``cpXY``, its ABI and platform); if there is one (and no ``--rebuild``), that is the wheel;
2. otherwise check that torch and ``pkg_resources`` (setuptools < 81) import (mmcv's ``setup.py`` imports both),
   ``python -m pip download --no-deps --no-binary :all: --no-build-isolation mmcv==2.1.0`` (``-c`` the
   ``--constraints`` file) into a temporary folder, extract it (members that would land outside the folder are
   refused), replace ``-std=c++17`` by ``-std=c++20`` in ``setup.py`` (:func:`patch_setup_py`; an sdist without
   the flag is an error, never built unpatched), and build it with ``pip wheel -v --no-deps --no-build-isolation``
   under ``MMCV_WITH_OPS=1``, ``FORCE_CUDA`` unset, ``MAX_JOBS`` = the usable cores (unless set) and ``CFLAGS``
   ``-O3 -DNDEBUG -fwrapv -g0`` (unless set): CPU ops, or CPU and CUDA ops where torch sees a GPU. The wheel is
   moved into the cache only once complete; the build takes 5-12 minutes on 2 cores;
3. with ``--install``, ``python -m pip install --no-deps`` it into the running interpreter.

The wheel's path is the only line on stdout (progress and pip's output go to stderr), so
``WHEEL=$(python shared_core/tools/mmcv_wheel.py)`` works. ``--dry-run`` (alias ``--print-path-only``) prints the
path the wheel has (or will have) and says on stderr what would be done, without downloading or building.

The cached wheel's name does not record the torch it was compiled against: after changing torch's version,
pass ``--rebuild``. Bad arguments are argparse usage errors (exit status 2); a failed step exits with status 1.

Command line::

    tokenaug-mmcv-wheel [--cache DIR] [--constraints FILE] [--install] [--rebuild]
                        [--dry-run]

Standard library only (it runs before anything else is installed).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from pathlib import Path

MMCV_VERSION = '2.1.0'
CXX17, CXX20 = '-std=c++17', '-std=c++20'
#: the compiler flags of the mmcv build where ``$CFLAGS`` is not set
DEFAULT_CFLAGS = '-O3 -DNDEBUG -fwrapv -g0'
PROG = 'tokenaug-mmcv-wheel'


class MmcvWheelError(RuntimeError):
    """A step failed (its message says which and what to do)."""


def default_cache() -> Path:
    """``$TOKENAUG_WHEEL_CACHE``, else ``${XDG_CACHE_HOME:-~/.cache}/tokenaug/wheels`` (as scripts/install.sh)."""
    if os.environ.get('TOKENAUG_WHEEL_CACHE'):
        return Path(os.environ['TOKENAUG_WHEEL_CACHE'])
    base = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
    return Path(base) / 'tokenaug' / 'wheels'


def _log(msg: str) -> None:
    print(f'{PROG}: {msg}', file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------------
# the patch


def patch_setup_py(text: str) -> str:
    """mmcv's ``setup.py`` text with every ``-std=c++17`` replaced by ``-std=c++20`` (torch >= 2.10 headers need
    C++20). Raises :class:`MmcvWheelError` when the text has no ``-std=c++17``: a changed sdist must not be built
    unpatched (or patched somewhere else) without anyone noticing."""
    if CXX17 not in text:
        raise MmcvWheelError(
            f'mmcv setup.py: expected the compiler flag {CXX17!r} (mmcv {MMCV_VERSION} hard-codes it; torch >= 2.10 '
            f'needs {CXX20!r}) but it is not there: this is not the sdist this patch was written for; '
            'check its setup.py by hand'
        )
    return text.replace(CXX17, CXX20)


# ---------------------------------------------------------------------------------------------------------------
# the cache


def interpreter_tags() -> tuple[str, str, str]:
    """(python tag, ABI tag, platform tag) of a wheel built by and for the running interpreter, e.g.
    ``('cp311', 'cp311', 'linux_x86_64')``."""
    major, minor = sys.version_info[:2]
    if sys.implementation.name == 'cpython':
        py = f'cp{major}{minor}'
        soabi = sysconfig.get_config_var('SOABI') or ''
        parts = soabi.split('-')
        abi = f'cp{parts[1]}' if len(parts) > 1 and parts[0] == 'cpython' else py  # cp311, cp313t, cp311d
    else:  # a binary wheel is only ever built for CPython here; other implementations get their own tags
        py = f'{sys.implementation.name}{major}{minor}'
        abi = (sysconfig.get_config_var('SOABI') or py).replace('-', '_').replace('.', '_')
    plat = sysconfig.get_platform().replace('-', '_').replace('.', '_')
    return py, abi, plat


def _platform_fits(plat: str, local: str) -> bool:
    if plat == local:
        return True
    # a wheel repaired by auditwheel carries manylinux tags for the same architecture
    if local.startswith('linux_'):
        arch = local[len('linux_') :]
        return re.fullmatch(rf'manylinux(1|2010|2014|_\d+_\d+)_{re.escape(arch)}', plat) is not None
    return False


def wheel_fits(filename: str, version: str = MMCV_VERSION, tags: tuple[str, str, str] | None = None) -> bool:
    """Whether ``filename`` is an mmcv ``version`` wheel installable by an interpreter of ``tags``
    (default: the running one's, :func:`interpreter_tags`)."""
    if not filename.endswith('.whl'):
        return False
    parts = filename[: -len('.whl')].split('-')
    if len(parts) not in (5, 6):  # name-version[-build]-python-abi-platform
        return False
    name, ver, pys, abis, plats = parts[0], parts[1], parts[-3], parts[-2], parts[-1]
    if re.sub(r'[-_.]+', '_', name).lower() != 'mmcv' or ver != version:
        return False
    py, abi, plat = tags or interpreter_tags()
    return (
        py in pys.split('.')
        and any(a in (abi, 'abi3', 'none') for a in abis.split('.'))
        and any(_platform_fits(p, plat) for p in plats.split('.'))
    )


def find_cached_wheel(cache: Path, version: str = MMCV_VERSION, tags: tuple[str, str, str] | None = None):
    """The path of a wheel in ``cache`` that :func:`wheel_fits` (the first by name if several), or None."""
    cache = Path(cache)
    if not cache.is_dir():
        return None
    hits = sorted(p for p in cache.iterdir() if p.is_file() and wheel_fits(p.name, version, tags))
    return hits[0] if hits else None


def other_cached_tags(cache: Path, version: str = MMCV_VERSION) -> list[str]:
    """The python tags (``cp311``, ...) of the mmcv ``version`` wheels in ``cache`` that the running interpreter
    cannot install (another Python's): a wheel cached for one Python is not one for another."""
    if not cache.is_dir():
        return []
    found = set()
    for p in cache.iterdir():
        parts = p.name[: -len('.whl')].split('-') if p.name.endswith('.whl') else []
        if p.is_file() and len(parts) in (5, 6) and parts[0] == 'mmcv' and parts[1] == version:
            if not wheel_fits(p.name, version):
                found.add(parts[-3])
    return sorted(found)


def _no_wheel_for_this_python(cache: Path) -> str:
    """Why the cache has no wheel for this interpreter, where it holds another Python's ('' otherwise)."""
    others = other_cached_tags(cache)
    if not others:
        return ''
    return (
        f'; the cache holds mmcv {MMCV_VERSION} wheels for {", ".join(others)} only, and this is Python '
        f'{sys.version_info[0]}.{sys.version_info[1]} ({interpreter_tags()[0]}): a wheel is built for it'
    )


def expected_wheel_path(cache: Path) -> Path:
    """Where a wheel built here lands: ``cache/mmcv-2.1.0-<python>-<abi>-<platform>.whl``."""
    return Path(cache) / ('mmcv-{}-{}-{}-{}.whl'.format(MMCV_VERSION, *interpreter_tags()))


# ---------------------------------------------------------------------------------------------------------------
# download, extract, build


def safe_extract(archive: Path, dest: Path) -> None:
    """Extract the tar ``archive`` into ``dest``, refusing (:class:`MmcvWheelError`, nothing extracted) an archive
    with a member that would land outside ``dest`` (absolute or ``..`` paths, links pointing out) or is not a plain
    file, folder or link."""
    dest = Path(dest).resolve()
    with tarfile.open(archive) as tf:
        members = tf.getmembers()
        for m in members:
            target = (dest / m.name).resolve()
            where = None
            if not target.is_relative_to(dest):
                where = 'a path outside the extraction folder'
            elif m.issym() and not (target.parent / m.linkname).resolve().is_relative_to(dest):
                where = f'a symlink to {m.linkname!r}, outside the extraction folder'
            elif m.islnk() and not (dest / m.linkname).resolve().is_relative_to(dest):
                where = f'a hard link to {m.linkname!r}, outside the extraction folder'
            elif not (m.isfile() or m.isdir() or m.issym() or m.islnk()):
                where = 'a device, fifo or other special file'
            if where:
                raise MmcvWheelError(f'{archive}: refusing to extract member {m.name!r}: {where}')
        if hasattr(tarfile, 'data_filter'):  # Python >= 3.10.12 / 3.11.4: the same checks once more, by tarfile
            tf.extractall(dest, members, filter='data')
        else:  # pragma: no cover
            tf.extractall(dest, members)


def _run(cmd: list[str], what: str, env: dict | None = None) -> None:
    """Run ``cmd`` with its stdout on our stderr (our stdout carries only the wheel's path)."""
    _log(f'{what}: {" ".join(cmd)}')
    rc = subprocess.run(cmd, stdout=sys.stderr, env=env).returncode
    if rc != 0:
        raise MmcvWheelError(f'{what} failed (exit status {rc}; its output is above)')


def check_build_requirements() -> str:
    """torch's version if torch and ``pkg_resources`` import in the running interpreter (mmcv's ``setup.py``
    imports both, already for ``pip download``), else :class:`MmcvWheelError` saying how to install them."""
    probe = (
        'import importlib, sys\n'
        'bad = []\n'
        "for m in ('torch', 'pkg_resources'):\n"
        '    try:\n'
        '        importlib.import_module(m)\n'
        '    except Exception as e:\n'
        "        bad.append(f'{m} ({type(e).__name__}: {e})')\n"
        "sys.exit('; '.join(bad)) if bad else print(sys.modules['torch'].__version__)\n"
    )
    res = subprocess.run([sys.executable, '-c', probe], capture_output=True, text=True)
    if res.returncode == 0:
        return res.stdout.strip().splitlines()[-1]
    failed = (res.stderr.strip().splitlines() or ['?'])[-1]
    raise MmcvWheelError(
        f'building mmcv {MMCV_VERSION} needs torch and pkg_resources importable in {sys.executable} '
        f"(mmcv's setup.py imports both), but these failed: {failed}. Install them first, e.g. "
        f'`{sys.executable} -m pip install torch torchvision "setuptools<81" ninja` '
        '(from a checkout add `-c constraints.txt` for the pinned torch)'
    )


def build_env() -> dict:
    """The build's environment: ours with ``MMCV_WITH_OPS=1``, no ``FORCE_CUDA``, ``MAX_JOBS`` and ``CFLAGS``
    defaulted (to the usable cores and :data:`DEFAULT_CFLAGS`)."""
    env = dict(os.environ)
    env.pop('FORCE_CUDA', None)
    env['MMCV_WITH_OPS'] = '1'
    cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else (os.cpu_count() or 1)
    env.setdefault('MAX_JOBS', str(cores))
    env.setdefault('CFLAGS', DEFAULT_CFLAGS)
    return env


def download_sdist(dest: Path, constraints: Path | None = None) -> Path:
    """``pip download`` mmcv's sdist into ``dest`` (needs torch: pip runs its ``setup.py`` for the metadata);
    returns the archive's path."""
    cons = ['-c', str(constraints)] if constraints else []
    _run(
        [sys.executable, '-m', 'pip', 'download', *cons, '--no-deps', '--no-binary', ':all:', '--no-build-isolation']
        + [f'mmcv=={MMCV_VERSION}', '-d', str(dest)],
        'downloading the mmcv sdist',
    )
    archives = sorted(Path(dest).glob('*.tar.gz'))
    if len(archives) != 1:
        raise MmcvWheelError(f'expected one mmcv-{MMCV_VERSION}.tar.gz from pip download in {dest}, got {archives}')
    return archives[0]


def unpack_and_patch(archive: Path, dest: Path) -> Path:
    """Extract the sdist ``archive`` into ``dest`` (:func:`safe_extract`) and patch its ``setup.py``
    (:func:`patch_setup_py`); returns the source folder."""
    Path(dest).mkdir(parents=True, exist_ok=True)
    safe_extract(archive, dest)
    roots = [p for p in Path(dest).iterdir() if (p / 'setup.py').is_file()]
    if len(roots) != 1:
        raise MmcvWheelError(f'{Path(archive).name}: expected one top folder with a setup.py, got {roots}')
    setup_py = roots[0] / 'setup.py'
    setup_py.write_text(patch_setup_py(setup_py.read_text()))
    _log(f'patched {setup_py}: {CXX17} -> {CXX20}')
    return roots[0]


def build_wheel(cache: Path, constraints: Path | None = None) -> Path:
    """Download mmcv's sdist, patch and build it; the wheel is moved into ``cache`` once complete. Returns its
    path there."""
    torch_version = check_build_requirements()
    _log(f'building mmcv {MMCV_VERSION} against torch {torch_version} (5-12 minutes on 2 cores)')
    with tempfile.TemporaryDirectory(prefix='tokenaug-mmcv-') as tmp:
        tmp = Path(tmp)
        src = unpack_and_patch(download_sdist(tmp / 'download', constraints), tmp / 'src')
        out = tmp / 'wheels'
        _run(
            [sys.executable, '-m', 'pip', 'wheel', '-v', '--no-deps', '--no-build-isolation', '-w', str(out), str(src)],
            'building the mmcv wheel',
            env=build_env(),
        )
        built = [p for p in out.glob('*.whl') if wheel_fits(p.name)]
        if len(built) != 1:
            raise MmcvWheelError(
                f'expected one mmcv-{MMCV_VERSION} wheel for {"-".join(interpreter_tags())} from pip wheel, '
                f'got {sorted(p.name for p in out.iterdir())}'
            )
        cache.mkdir(parents=True, exist_ok=True)
        final = cache / built[0].name
        partial = cache / f'.{built[0].name}.partial'
        shutil.copy2(built[0], partial)
        os.replace(partial, final)
    return final


# ---------------------------------------------------------------------------------------------------------------
# command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description=f'Print the path of an mmcv {MMCV_VERSION} wheel for this interpreter ({sys.executable}): '
        'from the cache, else downloaded as sdist, patched for C++20 and built (with CPU ops) into the cache. '
        'Only the path goes to stdout.',
    )
    p.add_argument(
        '--cache',
        type=Path,
        default=None,
        metavar='DIR',
        help=f'wheel cache folder (default: $TOKENAUG_WHEEL_CACHE, else {default_cache()})',
    )
    p.add_argument(
        '--constraints', type=Path, default=None, metavar='FILE', help='pip constraints file for the sdist download'
    )
    p.add_argument('--install', action='store_true', help='pip install --no-deps the wheel into this interpreter')
    p.add_argument('--rebuild', action='store_true', help='build even if the cache has a wheel (e.g. a new torch)')
    p.add_argument(
        '--dry-run',
        '--print-path-only',
        dest='dry_run',
        action='store_true',
        help='print the wheel path it has or would build and say what it would do; download, build, install nothing',
    )
    return p


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    cache = Path(os.path.abspath((args.cache if args.cache is not None else default_cache()).expanduser()))
    if cache.exists() and not cache.is_dir():
        parser.error(f'--cache {cache}: expected a folder (it is created if missing), got a file')
    constraints = args.constraints.expanduser().resolve() if args.constraints is not None else None
    if constraints is not None and not constraints.is_file():
        parser.error(f'--constraints {args.constraints}: expected an existing pip constraints file')

    wheel = None if args.rebuild else find_cached_wheel(cache)
    if args.dry_run:
        if wheel is not None:
            _log(f'cached wheel: {wheel}' + (' (--install would pip install it)' if args.install else ''))
        else:
            _log(
                f'would download the mmcv {MMCV_VERSION} sdist (pip download'
                + (f' -c {constraints}' if constraints else '')
                + f'), patch {CXX17} -> {CXX20} in setup.py and build the wheel into {cache} '
                '(5-12 minutes on 2 cores)'
                + (', then pip install it' if args.install else '')
                + ('' if args.rebuild else _no_wheel_for_this_python(cache))
            )
            wheel = expected_wheel_path(cache)
        print(wheel, flush=True)
        return 0
    try:
        if wheel is None:
            if not args.rebuild:
                _log(
                    f'no mmcv {MMCV_VERSION} wheel for {"-".join(interpreter_tags())} in {cache}'
                    + _no_wheel_for_this_python(cache)
                    + ' (5-12 minutes on 2 cores)'
                )
            wheel = build_wheel(cache, constraints)
        else:
            _log(f'cached wheel: {wheel}')
        if args.install:
            cons = ['-c', str(constraints)] if constraints else []
            _run([sys.executable, '-m', 'pip', 'install', *cons, '--no-deps', str(wheel)], 'installing mmcv')
    except (MmcvWheelError, OSError) as e:  # OSError: e.g. the cache folder cannot be written
        _log(f'error: {e}')
        return 1
    print(wheel, flush=True)
    return 0


if __name__ == '__main__':  # pragma: no cover
    sys.exit(main())
