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

import logging
from typing import Tuple

import torch
from PIL import Image

__all__ = [
    'UnreadableImageError',
    'read_image',
    'readable',
    'CheckedImageDataset',
    'MAX_SKIPS',
    'class_names',
    'check_class_lists',
    'read_sample',
]

_logger = logging.getLogger(__name__)

#: consecutive unreadable images skipped before giving up (timm's ``_ERROR_RETRY``)
MAX_SKIPS = 50


class UnreadableImageError(OSError):
    """An image that cannot be decoded, named."""


def _decode(src, mode) -> Image.Image:
    img = Image.open(src)
    try:
        img.load()  # the whole decode here: a truncated file fails now, not later in a transform
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


def read_image(dataset, index: int, skip: bool = True, mode=None) -> Tuple[Image.Image, object, int]:
    """``(image, target, index_read)`` from a timm ``ImageDataset`` (its ``reader``): the image decoded and
    converted to ``mode`` (default the dataset's ``input_img_mode``). An image that cannot be decoded is
    skipped for the next (with a warning naming the file; at most :data:`MAX_SKIPS` in a row), or with
    ``skip=False`` raises :class:`UnreadableImageError` naming it."""
    reader = dataset.reader
    mode = getattr(dataset, 'input_img_mode', None) if mode is None else mode
    n = len(reader)
    for attempt in range(MAX_SKIPS if skip else 1):
        i = (index + attempt) % n
        src, target, *_ = reader[i]
        try:
            return _decode(src, mode), target, i
        except (OSError, ValueError, SyntaxError) as e:  # PIL: UnidentifiedImageError, truncated data, bad headers
            name = reader.filename(i)
            if not skip:
                raise UnreadableImageError(f'image {name} (index {i}) cannot be decoded: {e}') from None
            _logger.warning(f'Skipped unreadable image {name} (index {i}): {e}')
    raise UnreadableImageError(
        f'{MAX_SKIPS} consecutive unreadable images from index {index} ({reader.filename(index)})'
    )


def read_sample(dataset, index: int, skip: bool = False):
    """``dataset[index]`` (image through the dataset's ``transform``, target). By default for a tool that needs
    the image *of that index* (a store row, a seeded mask): a timm image dataset is read with :func:`read_image`
    without skipping, so an unreadable image raises :class:`UnreadableImageError` naming the file (``skip``:
    skip it for the next, named); other datasets are indexed as they are."""
    if not readable(dataset):
        return dataset[index]
    base = dataset.dataset if isinstance(dataset, CheckedImageDataset) else dataset
    img, target, _ = read_image(base, index, skip=skip)
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

    def __init__(self, dataset):
        if not readable(dataset):
            raise ValueError(
                f'dataset: expected a timm ImageDataset reading images (a reader, load_bytes=False), '
                f'got {type(dataset).__name__}'
            )
        self.dataset = dataset
        self.transform, self.target_transform = dataset.transform, dataset.target_transform
        dataset.transform = dataset.target_transform = None

    @property
    def reader(self):
        return self.dataset.reader

    @property
    def input_img_mode(self):
        return self.dataset.input_img_mode

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        return read_sample(self, index, skip=True)

    def filename(self, index: int, basename: bool = False, absolute: bool = False):
        return self.dataset.filename(index, basename, absolute)

    def filenames(self, basename: bool = False, absolute: bool = False):
        return self.dataset.filenames(basename, absolute)


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
