"""Shared fixtures: one tiny synthetic world (tokenaug-data) for the end-to-end runs, quadrant images."""

import os
import sys
from pathlib import Path

import pytest
import torch

# Triton's interpreter runs the label-attention kernel (shared_core.label_kernel) on CPU tensors where no GPU is;
# it must be chosen before Triton is imported (timm imports it through torch._dynamo)
if not torch.cuda.is_available():
    os.environ.setdefault('TRITON_INTERPRET', '1')

from shared_core.tools.world import generate_world  # noqa: E402

from .helpers import REPO, write_quadrant_data  # noqa: E402

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
