"""What the CLI tools share: ``--model-kwargs`` parsing, the split's dataset, the device, and a loader whose
workers' errors reach the user as one line (their flags: :mod:`tokenaug.tool_args`)."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch
import yaml
from timm.data import create_dataset
from torch.utils.data import DataLoader, Dataset, default_collate

from ..image_data import no_images_named

__all__ = ['parse_model_kwargs', 'split_dataset', 'resolve_device', 'batches_raising_plainly', 'shared_memory_error']


def parse_model_kwargs(items: Sequence[str] | None) -> dict[str, Any]:
    """``['img_size=64', 'global_pool=avg']`` -> ``{'img_size': 64, 'global_pool': 'avg'}`` (YAML values)."""
    out: dict[str, Any] = {}
    for item in items or ():
        key, sep, value = item.partition('=')
        if not sep or not key.strip():
            raise ValueError(f'--model-kwargs expects key=value items, got {item!r}')
        out[key.strip()] = yaml.safe_load(value)
    return out


def split_dataset(data_dir: str, split: str, transform=None):
    """``(dataset, split_root)``: timm's ImageFolder dataset of ``DIR/SPLIT/<class>/<image>`` (``split=''``: DIR
    itself); a clear error when the folder does not exist."""
    split_root = Path(data_dir) / split if split else Path(data_dir)
    if not split_root.is_dir():
        raise FileNotFoundError(
            f'--data-dir {data_dir} / --split {split!r}: {split_root} is not a directory '
            '(expected the ImageFolder layout DIR/SPLIT/<class>/<image>)'
        )
    with no_images_named(f'--data-dir {data_dir} / --split {split!r}'):
        dataset = create_dataset('', root=data_dir, split=split, search_split=bool(split), transform=transform)
    return dataset, split_root


def resolve_device(name: Optional[str], local_rank: Optional[int] = None) -> torch.device:
    """``--device`` (default: cuda when available); a bare ``cuda`` is this process's GPU (``local_rank`` under
    torchrun, else the current one)."""
    name = name or ('cuda' if torch.cuda.is_available() else 'cpu')
    if name.startswith('cuda'):
        if not torch.cuda.is_available():
            raise ValueError(f'--device {name}: CUDA is not available')
        device = torch.device(name)
        if device.index is None:
            device = torch.device('cuda', local_rank if local_rank is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
        return device
    return torch.device(name)


class _Raised:
    """An item's error, handed from a DataLoader worker to the main process as a value."""

    def __init__(self, error: BaseException):
        self.error = error


class _Catching(Dataset):
    def __init__(self, dataset: Dataset, errors: tuple[type[BaseException], ...]):
        self.dataset, self.errors = dataset, errors

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i):
        try:
            return self.dataset[i]
        except self.errors as e:
            return _Raised(e)


#: torch's error where a worker cannot put its batch into shared memory (its message ends in ``strerror (errno)``)
_SHM_FAILED = re.compile(
    r'unable to (?:allocate shared memory|resize file|write to file|open shared memory object|mmap)\b.*\((\d+)\)'
)


def shared_memory_error(error: BaseException) -> Optional[OSError]:
    """``error`` as an ``OSError`` naming the cause where it is torch's failure to put a DataLoader worker's batch
    into shared memory (``/dev/shm`` full, a file-size limit), else ``None``."""
    found = _SHM_FAILED.search(str(error)) if isinstance(error, RuntimeError) else None
    if found is None:
        return None
    code = int(found[1])
    fix = 'raise the file-size limit (ulimit -f)' if code == errno.EFBIG else 'free space in /dev/shm'
    return OSError(
        code,
        f'a DataLoader worker could not hand its batch over through shared memory ({os.strerror(code)}); {fix}, '
        'or pass --workers 0',
    )


def _collate_or_raised(items: list):
    raised = next((item for item in items if isinstance(item, _Raised)), None)
    if raised is not None:
        return raised
    try:
        return default_collate(items)
    except RuntimeError as e:  # in a worker: the batch's shared memory could not be allocated
        plain = shared_memory_error(e)
        if plain is None:
            raise
        return _Raised(plain)


class _RaisingPlainly:
    def __init__(self, loader: DataLoader):
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            if isinstance(batch, _Raised):
                raise batch.error
            yield batch


def batches_raising_plainly(dataset: Dataset, errors: tuple[type[BaseException], ...], **loader_kwargs):
    """The batches of ``DataLoader(dataset, **loader_kwargs)`` (an iterable with its length); an error of a type in
    ``errors`` raised by an item is raised as itself, one line as without workers, where DataLoader would wrap it in
    "Caught X in DataLoader worker process N ... Original Traceback" (the worker hands it over as a value). So is
    a worker's failure to allocate its batch's shared memory, as an ``OSError`` (:func:`shared_memory_error`)."""
    return _RaisingPlainly(DataLoader(_Catching(dataset, errors), collate_fn=_collate_or_raised, **loader_kwargs))
