"""Reading images from timm's ``ImageDataset`` so that a sample and what belongs to it cannot drift apart.

timm's ``ImageDataset`` skips an unreadable image by returning the *next* one, without saying which file
failed and without telling the caller which index it returned: a wrapper that looks up something per image
(a label map, an activation map, a row of a store) by the index it asked for then pairs one image with
another's data. :func:`read_image` decodes the whole image inside its error handling (a truncated JPEG is
caught like an unreadable one), converts it to the dataset's mode, names every file it skips, and returns the
index it actually read. :class:`CheckedImageDataset` is timm's dataset with that reading, for the training
and validation sets of ``tokenaug-train``.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
from typing import Iterator, Tuple

import numpy as np
import torch
from PIL import Image

__all__ = [
    'UnreadableImageError',
    'read_image',
    'readable',
    'CheckedImageDataset',
    'MAX_SKIPS',
    'MAX_SKIP_SHARE',
    'SKIP_WINDOW',
    'class_names',
    'check_repeated_folders',
    'check_class_lists',
    'read_sample',
    'no_images_named',
]

_logger = logging.getLogger(__name__)


@contextlib.contextmanager
def no_images_named(flag: str) -> Iterator[None]:
    """timm's ``RuntimeError: Found 0 images in subfolders of ROOT`` (an empty dataset folder) raised inside the
    block becomes a ``FileNotFoundError`` naming ``flag``, which the tools print as their one-line error."""
    try:
        yield
    except RuntimeError as e:
        if not str(e).startswith('Found 0 images'):
            raise
        raise FileNotFoundError(f'{flag}: {str(e).splitlines()[0]}') from None


#: consecutive unreadable images skipped before giving up (timm's ``_ERROR_RETRY``)
MAX_SKIPS = 50
#: :class:`CheckedImageDataset` stops when more than this share of the last :data:`SKIP_WINDOW` images it tried to
#: read (in one process: a DataLoader worker reads whole batches) could not be read: the data is broken, not one file
MAX_SKIP_SHARE = 0.5
#: the window of reads over which MAX_SKIP_SHARE is counted
SKIP_WINDOW = 64


class UnreadableImageError(OSError):
    """An image that cannot be opened or decoded, named."""


#: errors of opening or decoding one image file (PIL: UnidentifiedImageError, truncated data, bad headers, an
#: image over its decompression-bomb limit; the OS: a dangling link, a file removed mid-run, EIO / ESTALE)
DECODE_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)
#: PIL modes of 16-bit grayscale (PNG): PIL's RGB conversion clips them to white; they are scaled to 8 bits
_SIXTEEN_BIT = ('I;16', 'I;16L', 'I;16B', 'I;16N')


def _wide_to_8bit(a: np.ndarray, mode: str) -> np.ndarray:
    """A 32-bit integer (``'I'``) or float (``'F'``) grayscale image as 8 bits: integers in [0, 255] as they are,
    in [0, 65535] as 16-bit data (the top 8 bits); floats in [0, 1] scaled by 255, others clipped to [0, 255]."""
    if mode == 'F':
        a = np.nan_to_num(a.astype(np.float64))
        if a.size and a.min() >= 0.0 and a.max() <= 1.0:
            a = a * 255.0
        return np.clip(np.rint(a), 0, 255).astype(np.uint8)
    a = a.astype(np.int64)
    if a.size and a.min() >= 0 and a.max() > 255 and a.max() <= 65535:
        a = a >> 8
    return np.clip(a, 0, 255).astype(np.uint8)


def _decode(src, mode) -> Image.Image:
    img = Image.open(src)
    try:
        img.load()  # the whole decode here: a truncated file fails now, not later in a transform
        if img.mode in _SIXTEEN_BIT:
            img = Image.fromarray((np.asarray(img, dtype=np.uint16) >> 8).astype(np.uint8), 'L')
        elif img.mode in ('I', 'F'):  # 32-bit integer or float grayscale (TIFF): PIL's conversion clips them
            img = Image.fromarray(_wide_to_8bit(np.asarray(img), img.mode), 'L')
        return img.convert(mode) if mode else img
    finally:
        fp = getattr(src, 'close', None)
        if fp is not None:
            fp()


def readable(dataset) -> bool:
    """Whether :func:`read_image` can read ``dataset``: a timm ``ImageDataset`` over files (folder or tar
    reader, ``load_bytes=False``)."""
    from timm.data.dataset import ImageDataset
    from timm.data.readers.reader_image_folder import ReaderImageFolder
    from timm.data.readers.reader_image_in_tar import ReaderImageInTar

    if isinstance(dataset, CheckedImageDataset):
        return True
    return (
        isinstance(dataset, ImageDataset)
        and not dataset.load_bytes
        and isinstance(dataset.reader, (ReaderImageFolder, ReaderImageInTar))
    )


def read_image(dataset, index: int, skip: bool = True, mode=None, on_skip=None) -> Tuple[Image.Image, object, int]:
    """``(image, target, index_read)`` from a timm ``ImageDataset`` (its ``reader``): the image decoded and
    converted to ``mode`` (default the dataset's ``input_img_mode``; 16-bit grayscale scaled to 8 bits). An image
    that cannot be opened or decoded is skipped for the next (with a warning naming the file, and ``on_skip(name)``;
    at most :data:`MAX_SKIPS` in a row), or with ``skip=False`` raises :class:`UnreadableImageError` naming it."""
    reader = dataset.reader
    mode = getattr(dataset, 'input_img_mode', None) if mode is None else mode
    n = len(reader)
    for attempt in range(MAX_SKIPS if skip else 1):
        i = (index + attempt) % n
        try:
            src, target, *_ = reader[i]  # opens the file: a dangling link or a removed file fails here
            return _decode(src, mode), target, i
        except DECODE_ERRORS as e:
            name = reader.filename(i)
            if not skip:
                raise UnreadableImageError(f'image {name} (index {i}) cannot be read: {e}') from None
            _logger.warning(f'Skipped unreadable image {name} (index {i}): {e}')
            if on_skip is not None:
                on_skip(name)
    raise UnreadableImageError(
        f'{MAX_SKIPS} consecutive unreadable images from index {index} ({reader.filename(index)})'
    )


def read_sample(dataset, index: int, skip: bool = False, on_skip=None):
    """``dataset[index]`` (image through the dataset's ``transform``, target). By default for a tool that needs
    the image *of that index* (a store row, a seeded mask): a timm image dataset is read with :func:`read_image`
    without skipping, so an unreadable image raises :class:`UnreadableImageError` naming the file (``skip``:
    skip it for the next, named); other datasets are indexed as they are."""
    if not readable(dataset):
        return dataset[index]
    base = dataset.dataset if isinstance(dataset, CheckedImageDataset) else dataset
    img, target, _ = read_image(base, index, skip=skip, on_skip=on_skip)
    if dataset.transform is not None:
        img = dataset.transform(img)
    if target is None:
        target = -1
    elif getattr(dataset, 'target_transform', None) is not None:
        target = dataset.target_transform(target)
    return img, target


class CheckedImageDataset(torch.utils.data.Dataset):
    """timm's ``ImageDataset`` read through :func:`read_image` (skips name the file; truncated images are
    skipped like unreadable ones). ``transform`` / ``target_transform`` as timm's (``create_loader`` sets the
    transform on this wrapper); ``filename``/``filenames``/``reader`` are the dataset's."""

    def __init__(self, dataset, max_skip_share: float = MAX_SKIP_SHARE):
        if not readable(dataset):
            raise ValueError(
                f'dataset: expected a timm ImageDataset reading images (a reader, load_bytes=False), '
                f'got {type(dataset).__name__}'
            )
        if not 0.0 <= max_skip_share <= 1.0:
            raise ValueError(f'max_skip_share: expected a share in [0, 1], got {max_skip_share}')
        self.dataset, self.max_skip_share = dataset, float(max_skip_share)
        self.transform, self.target_transform = dataset.transform, dataset.target_transform
        dataset.transform = dataset.target_transform = None
        self._tries = collections.deque(maxlen=SKIP_WINDOW)  # this process's last reads: (file, skipped)

    @property
    def reader(self):
        return self.dataset.reader

    @property
    def input_img_mode(self):
        return self.dataset.input_img_mode

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        sample = read_sample(self, index, skip=True, on_skip=self._skipped)
        self._tries.append((None, False))
        return sample

    def _skipped(self, name: str) -> None:
        self._tries.append((name, True))
        bad = [n for n, skipped in self._tries if skipped]
        if len(self._tries) == SKIP_WINDOW and len(bad) > self.max_skip_share * SKIP_WINDOW:
            raise UnreadableImageError(
                f'{len(bad)} of the last {SKIP_WINDOW} images read could not be read (more than '
                f'{self.max_skip_share:.0%}; e.g. {bad[-3:]}): the data is broken, not one file'
            )

    def filename(self, index: int, basename: bool = False, absolute: bool = False):
        return self.dataset.filename(index, basename, absolute)

    def filenames(self, basename: bool = False, absolute: bool = False):
        return self.dataset.filenames(basename, absolute)


def check_repeated_folders(dataset, name: str = '--data-dir') -> None:
    """Refuse a folder dataset that lists one folder under several paths: a symlink loop (``c0/loop -> c0``: timm
    follows links, so ``c0/loop/loop/...`` repeats ``c0``'s images dozens of times) or a link to another class
    folder. Checks the distinct folders of the samples (a few thousand ``realpath`` calls for ImageNet)."""
    samples = getattr(getattr(dataset, 'reader', None), 'samples', None)
    if not samples:
        return
    seen = {}
    for folder in sorted({os.path.dirname(s[0]) for s in samples}):
        seen.setdefault(os.path.realpath(folder), []).append(folder)
    repeated = {real: folders for real, folders in seen.items() if len(folders) > 1}
    if repeated:
        real, folders = next(iter(repeated.items()))
        raise ValueError(
            f'{name}: the folder {real} is listed {len(folders)} times (as {folders[:2]}...): a symlink loop, or a '
            'link to another folder of the dataset; its images would count once per path'
        )


def class_names(dataset):
    """The class names of a timm dataset in label order (its reader's ``class_to_idx``), or ``None``."""
    reader = getattr(dataset, 'reader', None)
    mapping = getattr(reader, 'class_to_idx', None)
    if not mapping:
        return None
    return [name for name, _ in sorted(mapping.items(), key=lambda kv: kv[1])]


def check_class_lists(train, val, num_classes=None) -> None:
    """Refuse splits that number their classes differently (timm's ImageFolder numbers the class folders that
    hold images: an empty train folder shifts every later class by one) or whose class count is not
    ``num_classes``; the message names the classes that differ."""
    ct, cv = class_names(train), class_names(val)
    if ct is not None and cv is not None and ct != cv:
        only_train, only_val = sorted(set(ct) - set(cv)), sorted(set(cv) - set(ct))
        first = next((i for i, (a, b) in enumerate(zip(ct, cv)) if a != b), min(len(ct), len(cv)))
        raise ValueError(
            f'--data-dir: the train split has {len(ct)} classes and the validation split {len(cv)}, numbered '
            f'differently from label {first} on (train {ct[first : first + 1]}, val {cv[first : first + 1]}); '
            f'classes with images only in train: {only_train}, only in val: {only_val} (an empty class folder, '
            'or one without image files, drops out of the numbering)'
        )
    if ct is not None and num_classes is not None and len(ct) != num_classes:
        raise ValueError(
            f'--num-classes: the model has {num_classes} classes, the train split {len(ct)} '
            f'({ct[:3]}{" ..." if len(ct) > 3 else ""}); set --num-classes {len(ct)} or fix the data'
        )
