# DeiT-Tiny on the synthetic world (tokenaug-data), small enough for 2 CPU cores.
# Inherits mmpretrain's DeiT-Tiny recipe; changes data, input size, schedule, and the data preprocessor
# to tokenaug's, which carries the mix to the model. The world root comes from $TOKENAUG_WORLD
# (default: data/world, relative to the working directory).
_base_ = ['mmpretrain::deit/deit-tiny_4xb256_in1k.py']

custom_imports = dict(imports=['mm_plugin', 'mm_plugin.enable_safe_load'], allow_failed_imports=False)

world_root = '{{$TOKENAUG_WORLD:data/world}}'
num_classes = 10
img_size = 112
patch_size = 16

data_preprocessor = dict(
    type='TokenAugDataPreprocessor',
    num_classes=num_classes,
    patch_size=patch_size,
    mean=[123.675, 116.28, 103.53],
    std=[58.395, 57.12, 57.375],
    to_rgb=True,
)

model = dict(
    backbone=dict(img_size=img_size, patch_size=patch_size),
    head=dict(num_classes=num_classes),
)

train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(
        type='RandomResizedCrop',
        scale=img_size,
        crop_ratio_range=(0.35, 1.0),
        backend='pillow',
        interpolation='bicubic',
    ),
    dict(type='RandomFlip', prob=0.5, direction='horizontal'),
    dict(type='PackInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='ResizeEdge', scale=img_size, edge='short', backend='pillow', interpolation='bicubic'),
    dict(type='CenterCrop', crop_size=img_size),
    dict(type='PackInputs'),
]

train_dataloader = dict(
    batch_size=32,
    num_workers=2,
    persistent_workers=False,
    drop_last=True,  # pairwise mixing needs even batches
    dataset=dict(
        _delete_=True,
        type='CustomDataset',
        data_root=world_root + '/imagenet',
        data_prefix='train',
        pipeline=train_pipeline,
    ),
)
val_dataloader = dict(
    batch_size=50,
    num_workers=2,
    persistent_workers=False,
    dataset=dict(
        _delete_=True,
        type='CustomDataset',
        data_root=world_root + '/imagenet',
        data_prefix='val',
        pipeline=test_pipeline,
    ),
)
test_dataloader = val_dataloader
val_evaluator = dict(type='Accuracy', topk=(1, 5))
test_evaluator = val_evaluator

# schedule: AdamW as DeiT; a 10-iteration linear warmup chained with a cosine decay over all epochs
optim_wrapper = dict(optimizer=dict(lr=1e-3))
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-2, by_epoch=False, begin=0, end=10),
    dict(type='CosineAnnealingLR', eta_min=1e-5, by_epoch=True, begin=0, convert_to_iter_based=True),
]
train_cfg = dict(by_epoch=True, max_epochs=4, val_interval=1)
auto_scale_lr = dict(base_batch_size=32)

default_hooks = dict(
    logger=dict(type='LoggerHook', interval=5), checkpoint=dict(type='CheckpointHook', interval=1, max_keep_ckpts=1)
)
env_cfg = dict(dist_cfg=dict(backend='gloo'))
randomness = dict(seed=0)
