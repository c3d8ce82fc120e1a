"""Checkpoint files read and written without surprises: loads that name what is wrong with a file, outputs
that never replace their source or an existing file unasked, and writes that leave either the complete new
file or the old one (a temporary file in the same folder, renamed into place; removed on any failure).

Every load is ``torch.load(..., weights_only=True)`` with exactly the one extra global timm's own loader allows
(``argparse.Namespace``: timm's ``CheckpointSaver`` stores ``args`` as one, ``timm.models._helpers._torch_load``):
a file holding any other Python object is refused, never unpickled.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import pickle
import re
import tempfile
import zipfile
from typing import Iterable, Iterator, Optional

import torch

__all__ = [
    'SAFE_GLOBALS',
    'CheckpointError',
    'check_input_file',
    'check_output_file',
    'load_checkpoint_file',
    'atomic_output',
    'remove_stale_temporaries',
    'save_checkpoint_file',
]


#: the globals a weights-only load allows besides tensors and plain containers: timm's loader's one
SAFE_GLOBALS = [argparse.Namespace]


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read (or written) as asked; the message names the argument and file."""


def check_input_file(path, name: str = 'checkpoint') -> str:
    """``path`` as a string, if it is an existing regular file; else :class:`FileNotFoundError` naming ``name``."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f'{name}: no such file: {path}')
    if not os.path.isfile(path):
        raise CheckpointError(f'{name}: {path} is not a file')
    return path


def load_checkpoint_file(
    path, name: str = 'checkpoint', map_location='cpu', mmap: bool = False, mmengine: bool = False
):
    """``torch.load(path, weights_only=True)`` whose errors say what is wrong with the file: missing, empty,
    truncated or corrupt, not a PyTorch checkpoint, or holding Python objects a weights-only load refuses.
    ``mmap``: memory-map the tensors (a cheap check of a large file; zip checkpoints only). ``mmengine``: the
    caller reads MMEngine's checkpoints (the converter, the mm configs: they allow MMEngine's types first); else
    an MMEngine checkpoint is named as one with the route to a timm one, whatever this process allowed before."""
    path = check_input_file(path, name)
    if os.path.getsize(path) == 0:
        raise CheckpointError(f'{name}: {path} is empty (0 bytes)')
    try:
        mmap = mmap and zipfile.is_zipfile(path)
        with _allowing(SAFE_GLOBALS):
            ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as e:
        _checkpoint_error(e, path, name)
    if not mmengine and isinstance(ckpt, dict) and 'message_hub' in ckpt and 'meta' in ckpt:
        raise CheckpointError(_mmengine_route(name, path, ' (meta, message_hub)'))
    return ckpt


def _mmengine_route(name: str, path, what: str) -> str:
    return (
        f'{name}: {path} is an MMEngine (mmpretrain) checkpoint{what}; this entry point reads timm checkpoints '
        '(tokenaug-train, timm train.py). Convert it: tokenaug-convert --from mmpretrain --to timm --model '
        'TIMM_NAME --src FILE --dst OUT (mmseg / mmdet backbones: --to mmseg / --to mmdet)'
    )


def _allowing(extra):
    """torch's ``safe_globals`` for the ``extra`` globals not allowed already (its exit removes what it added,
    so it must not take back one that the process allowed for good)."""
    missing = [g for g in extra if g not in torch.serialization.get_safe_globals()]
    return torch.serialization.safe_globals(missing) if missing else contextlib.nullcontext()


def _looks_like_checkpoint(path) -> bool:
    """A zip archive, whole or not (torch.save), or a pickle stream of protocol >= 2 (legacy torch.save)."""
    with open(path, 'rb') as f:
        head = f.read(2)
    return head == b'PK' or head.startswith(b'\x80')


def _checkpoint_error(e: Exception, path, name):
    """Re-raise a failed load's error as what it says about the file (or as is, when it is not the file's)."""
    text = str(e)
    if isinstance(e, RuntimeError) and not ('zip archive' in text or 'PytorchStreamReader' in text):
        raise e  # e.g. out of memory, a device error: not the file's fault
    if not _looks_like_checkpoint(path):  # random bytes fail in many ways (unpickler stack errors, ...)
        raise CheckpointError(f'{name}: {path} is not a PyTorch checkpoint (unrecognised content)') from None
    if isinstance(e, pickle.UnpicklingError):  # the weights-only unpickler met a global it does not allow
        found = re.search(r'GLOBAL ([\w.]+)', text)
        what = f' ({found.group(1)})' if found else ''
        if found and found.group(1).startswith('mmengine.'):  # an OpenMMLab Runner's checkpoint at a timm entry point
            raise CheckpointError(_mmengine_route(name, path, what)) from None
        raise CheckpointError(
            f'{name}: {path} holds Python objects beyond tensors and plain containers{what}; a weights-only '
            'load refuses them and nothing was unpickled (checkpoints written by tokenaug-train and timm train.py '
            'load here; MMEngine ones through tokenaug-convert and the mm configs)'
        ) from None
    first = (text.splitlines() or [''])[0]
    raise CheckpointError(f'{name}: {path} is truncated or corrupt ({type(e).__name__}: {first})') from None


def check_output_file(dst, src=None, force: bool = False, name: str = 'dst', src_name: str = 'src') -> str:
    """``dst`` as a string, if it can be written: not the ``src`` file (the same path or a link to it), not an
    existing file unless ``force``, not a directory, in an existing folder."""
    dst = os.fspath(dst)
    if src is not None and os.path.exists(dst):
        if os.path.samefile(dst, os.fspath(src)):
            raise CheckpointError(f'{name}: {dst} is the {src_name} file; write the output to another file')
    if os.path.isdir(dst):
        raise CheckpointError(f'{name}: {dst} is a directory; give a file name')
    if os.path.exists(dst) and not force:
        raise CheckpointError(f'{name}: {dst} exists; pass --force to overwrite it')
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise CheckpointError(f'{name}: the folder {parent} does not exist')
    return dst


_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


@contextlib.contextmanager
def atomic_output(dst, name: str = 'dst') -> Iterator[str]:
    """Yields a temporary path next to ``dst``; when the block succeeds it is renamed to ``dst`` (atomic on
    POSIX), else removed, so ``dst`` holds either its old content or the complete new file. A full disk or a
    file-size limit is reported as such."""
    dst = os.fspath(dst)
    fd, tmp = tempfile.mkstemp(
        prefix=f'.{os.path.basename(dst)}.', suffix='.tmp', dir=os.path.dirname(os.path.abspath(dst))
    )
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, dst)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if _disk_full(e):
            raise CheckpointError(
                f'{name}: could not write {dst}: the disk is full or the file exceeds a size limit; '
                f'nothing was replaced ({e})'
            ) from e
        raise


#: the temporaries :func:`atomic_output` makes: ``.<file name>.<8 random characters>.tmp``
_TEMPORARY = re.compile(r'^\.(?P<name>.+)\.[a-z0-9_]{8}\.tmp$')


def remove_stale_temporaries(folder, names: Optional[Iterable[str]] = None) -> list:
    """Remove what a killed :func:`atomic_output` left in ``folder``: hidden temporaries next to the files it was
    writing (of the files ``names``, or any). Call it where no other process writes into ``folder``. Returns the
    removed paths."""
    names = None if names is None else set(names)
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(folder):
            m = _TEMPORARY.match(entry.name)
            if m and entry.is_file(follow_symlinks=False) and (names is None or m.group('name') in names):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(entry.path)
                    removed.append(entry.path)
    return removed


def _disk_full(e: BaseException) -> bool:
    """An OSError of a full disk / size limit, or torch's writer failing mid-file (it reports a bare
    ``unexpected pos`` when the OS refused the rest)."""
    if isinstance(e, OSError) and e.errno in _FULL:
        return True
    return isinstance(e, RuntimeError) and 'unexpected pos' in str(e)


def save_checkpoint_file(obj, dst, name: str = 'dst', check: Optional[callable] = None) -> None:
    """``torch.save(obj, dst)`` through :func:`atomic_output`; ``check(tmp_path)`` runs on the written file
    before it replaces ``dst`` (an exception there leaves ``dst`` as it was)."""
    with atomic_output(dst, name) as tmp:
        with open(tmp, 'wb') as f:  # a file object: the zip records are named 'archive/', not after the temp name
            torch.save(obj, f)
        if check is not None:
            check(tmp)
