"""The data of a ``tokenaug-train`` run, as timm's ``train.py`` builds it, plus what the methods read: the training
and eval datasets and loaders, the label-map datasets of token labeling and TokenMix, their collate, and where the
mixer runs (:func:`build_data`); the training transform's arguments (:func:`train_augmentation`), which
``tokenaug-viz`` builds the same way (:func:`training_transform`); the split folders' checks.
"""

from __future__ import annotations

import logging
import os
from typing import NamedTuple

import torch
from timm.data import create_dataset, create_loader, create_transform
from timm.data.dataset_factory import _EVAL_SYNONYM, _TRAIN_SYNONYM

from .image_data import CheckedImageDataset, check_class_lists, check_repeated_folders, no_images_named, readable
from .token_grid import token_labeling_stride
from .token_label_data import TokenLabelCollate, TokenLabelDataset

__all__ = [
    'TrainingData',
    'build_data',
    'map_dataset',
    'train_augmentation',
    'training_transform',
    'check_split_folder',
    'seed_distributed_sampler',
]

_logger = logging.getLogger('tokenaug.train')


def train_augmentation(args, data_config: dict) -> dict:
    """The training transform's arguments from the command line, as timm's ``create_loader`` and
    ``create_transform`` both take them (``tokenaug-viz`` builds the same transform)."""
    interpolation = args.train_interpolation
    if args.no_aug or not interpolation:
        interpolation = data_config['interpolation']
    return dict(
        no_aug=args.no_aug,
        re_prob=args.reprob,
        re_mode=args.remode,
        re_count=args.recount,
        train_crop_mode=args.train_crop_mode,
        scale=args.scale,
        ratio=args.ratio,
        hflip=args.hflip,
        vflip=args.vflip,
        color_jitter=args.color_jitter,
        color_jitter_prob=args.color_jitter_prob,
        grayscale_prob=args.grayscale_prob,
        gaussian_blur_prob=args.gaussian_blur_prob,
        auto_augment=args.aa,
        interpolation=interpolation,
        mean=data_config['mean'],
        std=data_config['std'],
    )


def training_transform(args, data_config: dict, use_prefetcher: bool = False):
    """The training transform of these flags (uint8 images with ``use_prefetcher``, as the prefetcher loader
    takes them; else normalised tensors)."""
    return create_transform(
        data_config['input_size'],
        is_training=True,
        use_prefetcher=use_prefetcher,
        **train_augmentation(args, data_config),
    )


def map_dataset(args, dataset, store=None) -> tuple:
    """``(dataset, store)``: where the flags name label maps (``--token-label-dir``, else ``--activation-map-dir``),
    the dataset whose samples carry their map rows, crops and flips (:class:`TokenLabelDataset`) and the opened
    store (``store``: one already open); else ``(dataset, None)``. Maps of another class count are refused."""
    maps_dir, flag = (
        (args.token_label_dir, '--token-label-dir')
        if args.token_label_dir
        else (args.activation_map_dir, '--activation-map-dir')
    )
    if not maps_dir:
        return dataset, None
    if store is None:
        from shared_core.map_store import LabelMapStore

        store = LabelMapStore.open(maps_dir)
    if store.num_classes != args.num_classes:
        raise ValueError(f'{flag}: the maps have {store.num_classes} classes, the model {args.num_classes}')
    wrapped = TokenLabelDataset(
        dataset, store, geometric_aa=args.geometric_aa, aa_order=args.aa_order, map_region=args.map_region
    )
    return wrapped, store


#: the split synonyms timm's ``_search_split`` tries (``timm.data.dataset_factory``), as it has them
_SPLITS = (tuple(_TRAIN_SYNONYM), tuple(_EVAL_SYNONYM))


def check_split_folder(data_dir: str, split: str, flag: str) -> bool:
    """An image-folder split must exist: where ``data_dir`` has split folders but neither ``split`` nor one of
    its synonyms, timm falls back to reading ``data_dir`` itself, every split's images as this one (a typo in
    ``--val-split`` would validate on training images). A ``data_dir`` without split folders (a folder of class
    folders) is read as timm does; returns whether the split is ``data_dir`` itself so."""
    name = split.split('[')[0]
    synonyms = next((names for names in _SPLITS if name in names), (name,))
    if any(os.path.isdir(os.path.join(data_dir, s)) for s in (name,) + synonyms):
        return False
    known = {n for names in _SPLITS for n in names} | {'test'}  # ('test' is a split folder too)
    present = sorted(d for d in os.listdir(data_dir) if d in known and os.path.isdir(os.path.join(data_dir, d)))
    if present:
        raise FileNotFoundError(
            f'{flag}: no folder {name!r} under {data_dir} (its split folders: {present}); timm would read the whole '
            'folder, every split, as this split'
        )
    return True


def seed_distributed_sampler(loader, seed: int) -> None:
    """The training loader's ``DistributedSampler`` orders each epoch from ``(seed, epoch)``: timm's
    ``create_loader`` leaves it at its default seed 0, so under DDP the data order ignored ``--seed``."""
    sampler = getattr(loader, 'sampler', None)
    if isinstance(sampler, torch.utils.data.distributed.DistributedSampler):
        sampler.seed = int(seed)


class TrainingData(NamedTuple):
    """The loaders of a run, and where its mixer runs: ``collate_fn`` (the loader's: the maps' collate, or the
    fast-collate mixer with the prefetcher) or ``mixer`` (in the loop)."""

    dataset_train: object
    loader_train: object
    loader_eval: object
    collate_fn: object
    mixer: object


def build_data(args, recipe, data_config: dict, device, model_dtype) -> TrainingData:
    """The training and eval datasets and loaders as timm's ``train.py`` creates them, with the label maps a method
    reads and the recipe's mixer placed (the checks name the flag)."""
    # as timm's train.py: images converted to the model's channels (grayscale and CMYK JPEGs occur in ImageNet)
    input_img_mode = args.input_img_mode or ('RGB' if data_config['input_size'][0] == 3 else 'L')
    with no_images_named('--data-dir / --train-split'):
        dataset_train = create_dataset(
            args.dataset,
            root=args.data_dir,
            split=args.train_split,
            is_training=True,
            class_map=args.class_map,
            batch_size=args.batch_size,
            seed=args.seed,
            repeats=args.epoch_repeats,
            input_img_mode=input_img_mode,
            download=args.dataset_download,
            num_samples=args.train_num_samples,
            trust_remote_code=args.dataset_trust_remote_code,
            input_key=args.input_key,
            target_key=args.target_key,
        )
    with no_images_named('--data-dir / --val-split'):
        dataset_eval = create_dataset(
            args.dataset,
            root=args.data_dir,
            split=args.val_split,
            is_training=False,
            class_map=args.class_map,
            batch_size=args.batch_size,
            input_img_mode=input_img_mode,
            download=args.dataset_download,
            num_samples=args.val_num_samples,
            trust_remote_code=args.dataset_trust_remote_code,
            input_key=args.input_key,
            target_key=args.target_key,
        )
    check_repeated_folders(dataset_train, '--data-dir')
    check_repeated_folders(dataset_eval, '--data-dir')
    check_class_lists(dataset_train, dataset_eval, args.num_classes)
    # unreadable (and truncated) images are skipped with the file named, not fatal mid-epoch
    dataset_train, dataset_eval = (CheckedImageDataset(d) if readable(d) else d for d in (dataset_train, dataset_eval))

    collate_fn = mixer = None
    dataset_train, store = map_dataset(args, dataset_train)
    if store is not None:  # the samples carry their map rows, crops and flips
        # the dense term's token targets built by the loader's workers, not the training step
        loader_built = recipe.token_labeling and recipe.dense and args.token_targets == 'loader'
        stride = token_labeling_stride(recipe.model) if loader_built else None
        # (check=False: the dataset checks each row, named)
        collate_fn = TokenLabelCollate(args.num_classes, check=False, label_stride=stride, smoothing=args.smoothing)
        if stride is not None:
            _logger.info(f'Token labeling: the loader builds the token targets ({stride[0]}x{stride[1]} px tokens)')
    # mixing: where the recipe's mixer runs (fast-collate with the prefetcher, else in the loop; on the device
    # with activation-map targets, which are built there); MixToken runs in the task (TokenLabelingTask)
    if recipe.mixing is not None:
        if args.prefetcher and not args.activation_map_dir:
            collate_fn = recipe.mixer(collate=True)
        else:
            mixer = recipe.mixer()
        _logger.info(recipe.describe())

    loader_train = create_loader(
        dataset_train,
        input_size=data_config['input_size'],
        batch_size=args.batch_size,
        is_training=True,
        re_split=args.resplit,
        num_aug_repeats=args.aug_repeats,
        **train_augmentation(args, data_config),
        num_workers=args.workers,
        distributed=args.distributed,
        collate_fn=collate_fn,
        pin_memory=args.pin_mem,
        img_dtype=model_dtype or torch.float32,
        device=device,
        use_prefetcher=args.prefetcher,
        use_multi_epochs_loader=args.use_multi_epochs_loader,
        worker_seeding=args.worker_seeding,  # timm drops the last (possibly odd) training batch
        # workers start afresh each epoch from that epoch's seed (see epoch_seed): a resumed run repeats an
        # uninterrupted one exactly (and --mixup-off-epoch reaches the collate function they copy)
        persistent_workers=False,
    )
    seed_distributed_sampler(loader_train, args.seed)
    loader_eval = create_loader(
        dataset_eval,
        input_size=data_config['input_size'],
        batch_size=args.validation_batch_size or args.batch_size,
        is_training=False,
        interpolation=data_config['interpolation'],
        mean=data_config['mean'],
        std=data_config['std'],
        num_workers=args.workers,
        distributed=args.distributed,
        crop_pct=data_config['crop_pct'],
        pin_memory=args.pin_mem,
        img_dtype=model_dtype or torch.float32,
        device=device,
        use_prefetcher=args.prefetcher,
    )

    return TrainingData(dataset_train, loader_train, loader_eval, collate_fn, mixer)
