# The synthetic world's ADE20K-layout copy (tokenaug-data): 0 = background (ignored, reduce_zero_label),
# k + 1 = class k. Root: $TOKENAUG_WORLD (default data/world). 112 px images, small schedule for CPU.
world_root = '{{$TOKENAUG_WORLD:data/world}}'
crop_size = (112, 112)
# the default world's 10 classes (tokenaug-data --num-classes 10), as named in its COCO json / world.json
world_classes = (
    '00_striped_circle',
    '01_checkered_square',
    '02_dotted_triangle',
    '03_gradient_star',
    '04_grid_hexagon',
    '05_striped_cross',
    '06_checkered_diamond',
    '07_dotted_arrow',
    '08_gradient_pentagon',
    '09_grid_lshape',
)
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackSegInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='PackSegInputs'),
]
_dataset = dict(
    type='BaseSegDataset',
    data_root=world_root + '/ade20k',
    img_suffix='.jpg',
    seg_map_suffix='.png',
    reduce_zero_label=True,
    metainfo=dict(classes=world_classes),
)
train_dataloader = dict(
    batch_size=4,
    num_workers=2,
    persistent_workers=False,
    sampler=dict(type='InfiniteSampler', shuffle=True),
    dataset=dict(
        **_dataset,
        pipeline=train_pipeline,
        data_prefix=dict(img_path='images/training', seg_map_path='annotations/training'),
    ),
)
val_dataloader = dict(
    batch_size=1,
    num_workers=2,
    persistent_workers=False,
    sampler=dict(type='DefaultSampler', shuffle=False),
    dataset=dict(
        **_dataset,
        pipeline=test_pipeline,
        data_prefix=dict(img_path='images/validation', seg_map_path='annotations/validation'),
    ),
)
test_dataloader = val_dataloader
val_evaluator = dict(type='IoUMetric', iou_metrics=['mIoU'])
test_evaluator = val_evaluator

# a CPU-sized schedule: warmup + poly over 200 iterations (mmseg recipes: 1500 + 160k)
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-3, by_epoch=False, begin=0, end=20),
    dict(type='PolyLR', eta_min=0.0, power=1.0, begin=20, end=200, by_epoch=False),
]
train_cfg = dict(type='IterBasedTrainLoop', max_iters=200, val_interval=100)
val_cfg = dict(type='ValLoop')
test_cfg = dict(type='TestLoop')
default_hooks = dict(
    logger=dict(type='LoggerHook', interval=10),
    checkpoint=dict(type='CheckpointHook', by_epoch=False, interval=100, max_keep_ckpts=1),
)
randomness = dict(seed=0)  # repeatable demo numbers (mmengine's default draws a fresh seed)
