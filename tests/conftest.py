"""Shared fixtures: one tiny synthetic world (tokenaug-data) for the end-to-end runs, quadrant images."""

import os
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

# Triton's interpreter runs the label-attention kernel (shared_core.label_kernel) on CPU tensors where no GPU is;
# it must be chosen before Triton is imported (timm imports it through torch._dynamo)
if not torch.cuda.is_available():
    os.environ.setdefault('TRITON_INTERPRET', '1')

# under pytest-xdist, each process (and every tool it starts: they inherit the environment) takes its share of the
# cores instead of all of them: two processes of two threads on two cores spent a fifth of the time contending
# (docs/development.md, "Test time"); a test that needs other threads sets them itself
_workers = int(os.environ.get('PYTEST_XDIST_WORKER_COUNT', '1'))
if _workers > 1 and 'OMP_NUM_THREADS' not in os.environ:
    _threads = max(1, len(os.sched_getaffinity(0)) // _workers)
    os.environ['OMP_NUM_THREADS'] = str(_threads)
    torch.set_num_threads(_threads)

from shared_core.tools.world import generate_world  # noqa: E402

from .helpers import REPO  # noqa: E402
from .helpers.data import write_quadrant_data  # noqa: E402

VENV_BIN = Path(sys.executable).parent


@pytest.fixture(scope='session')
def tiny_world(tmp_path_factory):
    """10 classes at 112 px (the world configs' size), 2 train / 1 val scenes per class."""
    out = tmp_path_factory.mktemp('world')
    generate_world(out, seed=0, num_classes=10, image_size=112, train_per_class=2, val_per_class=1)
    return out


@pytest.fixture
def run_env():
    """Environment for subprocesses: the venv first on PATH, the repo importable."""
    env = dict(os.environ)
    env['PATH'] = f'{VENV_BIN}{os.pathsep}{env.get("PATH", "")}'
    env['PYTHONPATH'] = f'{REPO}{os.pathsep}{env.get("PYTHONPATH", "")}'
    return env


@pytest.fixture(scope='module')
def quadrant_data(tmp_path_factory):
    """6 non-square quadrant images (ImageFolder layout under train/) and a store of their 8x8 maps (maps/)."""
    return write_quadrant_data(tmp_path_factory.mktemp('quad'))


def pytest_collection_modifyitems(config, items):
    """The files with the most end-to-end runs (tests marked slow) first, each file's tests in their order: under
    pytest-xdist (``make test``: ``--dist loadfile --no-loadscope-reorder``) the longest files start first and the
    processes finish together (xdist's own order, most tests first, started the two-minute files last)."""
    slow = Counter(item.path for item in items if item.get_closest_marker('slow'))
    order = {path: i for i, path in enumerate(dict.fromkeys(item.path for item in items))}
    items.sort(key=lambda item: (-slow[item.path], order[item.path]))
