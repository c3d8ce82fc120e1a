"""Running what a user runs: a console command's function in the test's process (:func:`call_main`), an upstream
OpenMMLab tool as ``__main__`` with what a fresh interpreter has, or in one (:func:`upstream_tool`,
:func:`mmpretrain_train`), and a subprocess whose failure shows its output (:func:`run_tool`)."""

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

from . import REPO


def run_tool(cmd, env, timeout=600, cwd=None):
    """Run ``cmd``; assert it exits 0 (the failure shows the log's tail); its stdout + stderr."""
    res = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-4000:]
    return log


# the world configs cut to 2 iterations of batch 4 and a 10-image validation, no worker processes
MM_WORLD_OPTS = [
    'train_dataloader.batch_size=4',
    'train_dataloader.dataset.indices=8',
    'train_dataloader.num_workers=0',
    'val_dataloader.num_workers=0',
    'val_dataloader.batch_size=10',
]


def _manager_classes():
    """MMEngine's named-instance classes (``ManagerMixin``: the default scope, loggers, message hubs, visualizers)."""
    from mmengine.utils import ManagerMixin

    todo, seen = [ManagerMixin], {}
    while todo:
        cls = todo.pop()
        seen[cls] = None  # once, though a class may derive from two of them
        todo.extend(cls.__subclasses__())
    return [c for c in seen if isinstance(getattr(c, '_instance_dict', None), dict)]


@contextlib.contextmanager
def _as_a_fresh_process(argv, env, cwd, out):
    """What a fresh ``python SCRIPT ARGV`` would have, for the duration: ``sys.argv``, exactly ``env`` as the
    environment, ``cwd``, stdout and stderr into ``out`` (logging's and MMEngine's loggers, made during the run, too),
    a fresh interpreter's warning filters with each warning printed there, none of MMEngine's named instances (an
    earlier Runner's visualizer would be reused, with its folder); afterwards everything the upstream tools set for
    their process is put back: the environment (tools/train.py sets ``LOCAL_RANK``), the folder, MMEngine's named
    instances (the Runner's default scope becomes the current one; its logger keeps its log file open: closed),
    the random states (the Runner seeds them), torch's threads and deterministic switch, multiprocessing's start method
    and OpenCV's threads (the Runner's ``env_cfg``)."""
    import logging
    import multiprocessing
    import random
    import warnings

    import cv2
    import numpy as np
    import torch

    saved_env, saved_cwd, saved_argv = dict(os.environ), os.getcwd(), sys.argv
    managers = {cls: dict(cls._instance_dict) for cls in _manager_classes()}
    for cls in managers:
        cls._instance_dict.clear()
    rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    knobs = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(), cv2.getNumThreads())
    start_method = multiprocessing.get_start_method(allow_none=True)
    handlers, logging.root.handlers = logging.root.handlers, []
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = [str(a) for a in argv]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), warnings.catch_warnings():
            warnings.resetwarnings()  # a fresh interpreter's filters (python -W default less its ignore list)
            warnings.simplefilter('default')
            for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.filterwarnings('ignore', category=category)
            warnings.showwarning = lambda m, c, f, n, file=None, line=None: out.write(
                warnings.formatwarning(m, c, f, n, line)
            )
            yield
    finally:
        for cls in _manager_classes():  # with the classes the run imported; every instance now is the run's
            for instance in cls._instance_dict.values():
                for handler in getattr(instance, 'handlers', []):
                    handler.close()
            cls._instance_dict.clear()
            cls._instance_dict.update(managers.get(cls, {}))
        logging.root.handlers = handlers
        sys.argv = saved_argv
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.set_rng_state(rng[2])
        torch.set_num_threads(knobs[0])
        torch.use_deterministic_algorithms(knobs[1])
        cv2.setNumThreads(knobs[2])
        if multiprocessing.get_start_method(allow_none=True) != start_method:
            multiprocessing.set_start_method(start_method, force=True)


def upstream_tool(script, args, env, cwd, fresh_process=False, timeout=600):
    """An upstream script shipped in an mm wheel (``<pkg>/.mim/tools/train.py``, ``test.py``) on ``args``, run in
    ``cwd`` with the environment ``env``; asserts it succeeds, returns its stdout + stderr. By default it runs as
    ``__main__`` in this process (:func:`_as_a_fresh_process`: 5 s of imports less a run); ``fresh_process`` runs
    ``python SCRIPT`` where a new interpreter is what the test checks (the config's ``custom_imports`` registering our
    modules, the safe loading of a resumed checkpoint)."""
    import runpy

    argv = [str(script), *map(str, args)]
    if fresh_process:
        return run_tool(['python', *argv], env, timeout=timeout, cwd=cwd)
    out = io.StringIO()
    try:
        with _as_a_fresh_process(argv, env, cwd, out):
            runpy.run_path(str(script), run_name='__main__')
    except SystemExit as e:
        assert e.code in (None, 0), f'{script} exited with {e.code}\n{out.getvalue()[-4000:]}'
    except Exception as e:
        raise AssertionError(f'{script} failed\n{out.getvalue()[-4000:]}') from e
    return out.getvalue()


def check_generated_page(script: str, env) -> None:
    """``scripts/<script> --check``: the page it generates is what it gives now (it cannot drift)."""
    out = subprocess.run(
        [sys.executable, str(REPO / 'scripts' / script), '--check'], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


def mmpretrain_train(config, work_dir, env, cwd, *args, max_epochs=1, fresh_process=False):
    """mmpretrain's shipped tools/train.py (:func:`upstream_tool`), run in ``cwd``, on configs/mmpretrain/``config``
    (``args``: more flags, before the --cfg-options) for ``max_epochs`` with MM_WORLD_OPTS; asserts it succeeds,
    returns its log."""
    import mmpretrain

    train_py = Path(mmpretrain.__file__).parent / '.mim' / 'tools' / 'train.py'
    return upstream_tool(
        train_py,
        [
            REPO / 'configs' / 'mmpretrain' / config,
            '--work-dir',
            work_dir,
            *args,
            '--cfg-options',
            *MM_WORLD_OPTS,
            f'train_cfg.max_epochs={max_epochs}',
        ],
        env,
        cwd,
        fresh_process=fresh_process,
    )


def call_main(command, argv, capsys):
    """A console command (``tokenaug.commands.<name>``, what its console script calls) run on ``argv`` in this
    process: (exit status, stdout, stderr). It checks what a subprocess would, less an interpreter start-up (5 s of
    imports): an exception that escaped the command, a traceback for its user, fails the calling test here."""
    import logging

    capsys.readouterr()
    # the handlers an earlier run in this process added write to streams of tests that ended: the command adds
    # its own, on this test's stderr, as in a fresh process
    handlers, logging.root.handlers = logging.root.handlers, []
    try:
        code = command([str(a) for a in argv]) or 0
    except SystemExit as e:
        code = e.code
    finally:
        logging.root.handlers = handlers
    out, err = capsys.readouterr()
    return code, out, err


def run_in_process(cmd, log):
    """``tokenaug-study``'s runner for the tests (``main(argv, runner=run_in_process)``): ``tokenaug-train`` or
    ``tokenaug-maps`` run in this process as a fresh process would run them (:func:`_as_a_fresh_process`), the
    command line and then its output appended to ``log``; ``(exit status, CPU seconds)``, as the product's
    :func:`timm_plugin.tools.study_cli.run_logged` gives for its subprocess, less an interpreter start-up (3-5 s of
    imports a training). The product's own runner keeps its subprocess tests (a killed study, a failed run, jobs
    then collect: tests/timm_plugin/test_study_cli.py)."""
    import shlex
    import time
    import traceback

    from tokenaug import commands

    cmd = [str(c) for c in cmd]
    command = {'tokenaug-train': commands.train, 'tokenaug-maps': commands.maps}[Path(cmd[0]).name]
    with open(log, 'a') as f:
        f.write(f'$ {shlex.join(cmd)}\n')
        f.flush()
        cpu = time.process_time()
        with _as_a_fresh_process(cmd, dict(os.environ), os.getcwd(), f):
            try:
                code = command(cmd[1:]) or 0
            except SystemExit as e:  # as the interpreter ends on it: a message is printed, with status 1
                code = e.code or 0
                if not isinstance(code, int):
                    print(code, file=sys.stderr)
                    code = 1
            except Exception:
                traceback.print_exc()
                code = 1
    return code, round(time.process_time() - cpu, 1)


def children(pid: int) -> list:
    """The live child processes of ``pid`` (Linux's /proc): ``(pid, command line)`` each."""
    found = []
    for entry in Path('/proc').iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / 'stat').read_text()
            cmdline = (entry / 'cmdline').read_bytes().decode(errors='replace').split('\0')
        except OSError:  # ended meanwhile
            continue
        fields = stat.rsplit(')', 1)[1].split()  # after the command name, which may hold spaces and brackets
        if int(fields[1]) == pid and fields[0] != 'Z':
            found.append((int(entry.name), [c for c in cmdline if c]))
    return found
