# The Swin-T Cascade Mask R-CNN recipe on the synthetic world's COCO copy (tokenaug-data), CPU-sized:
# 112 px scenes resized to 224, 10 classes, a short schedule. World root: $TOKENAUG_WORLD (default data/world).
_base_ = ['./cascade-mask-rcnn_swin-t-p4-w7_fpn_giou-4conv1fc_ms-crop-3x_coco.py']

world_root = '{{$TOKENAUG_WORLD:data/world}}'
backbone_checkpoint = '{{$TOKENAUG_BACKBONE:demo_out/backbones/swin-t_mmdet.pth}}'
# the backbone must load entirely (mm_plugin.backbone_check): a wrong file is an error, not a random backbone
custom_hooks = [dict(type='BackboneCheckpointCheck')]
num_classes = 10
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
_norm = dict(type='BN', requires_grad=True)


def _box_head(stds):  # the base config's heads (lists replace, not merge), for 10 classes
    return dict(
        type='Shared4Conv1FCBBoxHead',
        in_channels=256,
        conv_out_channels=256,
        fc_out_channels=1024,
        roi_feat_size=7,
        num_classes=num_classes,
        norm_cfg=_norm,
        reg_class_agnostic=False,
        reg_decoded_bbox=True,
        bbox_coder=dict(type='DeltaXYWHBBoxCoder', target_means=[0.0, 0.0, 0.0, 0.0], target_stds=stds),
        loss_cls=dict(type='CrossEntropyLoss', use_sigmoid=False, loss_weight=1.0),
        loss_bbox=dict(type='GIoULoss', loss_weight=10.0),
    )


def _rcnn_stage(iou):  # the recipe's assigners, with 64 instead of 512 sampled RoIs (scenes hold 1-2 objects)
    return dict(
        assigner=dict(
            type='MaxIoUAssigner',
            pos_iou_thr=iou,
            neg_iou_thr=iou,
            min_pos_iou=iou,
            match_low_quality=False,
            ignore_iof_thr=-1,
        ),
        sampler=dict(type='RandomSampler', num=64, pos_fraction=0.25, neg_pos_ub=-1, add_gt_as_proposals=True),
        mask_size=28,
        pos_weight=-1,
        debug=False,
    )


model = dict(
    backbone=dict(drop_path_rate=0.0, init_cfg=dict(type='Pretrained', checkpoint=backbone_checkpoint)),
    roi_head=dict(
        bbox_head=[
            _box_head([0.1, 0.1, 0.2, 0.2]),
            _box_head([0.05, 0.05, 0.1, 0.1]),
            _box_head([0.033, 0.033, 0.067, 0.067]),
        ],
        mask_head=dict(num_classes=num_classes),
    ),
    # CPU-sized proposal and detection counts (the recipe's: 2000/1000 proposals, 512 RoIs, 100 detections)
    train_cfg=dict(
        rpn_proposal=dict(nms_pre=500, max_per_img=200), rcnn=[_rcnn_stage(0.5), _rcnn_stage(0.6), _rcnn_stage(0.7)]
    ),
    test_cfg=dict(rpn=dict(nms_pre=200, max_per_img=50), rcnn=dict(max_per_img=10)),
)
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='Resize', scale=(224, 224), keep_ratio=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackDetInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=(224, 224), keep_ratio=True),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='PackDetInputs', meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor')),
]
_data = dict(type='CocoDataset', data_root=world_root + '/coco', metainfo=dict(classes=world_classes))
train_dataloader = dict(
    batch_size=2,
    num_workers=2,
    persistent_workers=False,
    dataset=dict(
        _delete_=True,
        **_data,
        ann_file='annotations/instances_train2017.json',
        data_prefix=dict(img='train2017/'),
        filter_cfg=dict(filter_empty_gt=True),
        pipeline=train_pipeline,
    ),
)
val_dataloader = dict(
    batch_size=1,
    num_workers=2,
    persistent_workers=False,
    dataset=dict(
        _delete_=True,
        **_data,
        ann_file='annotations/instances_val2017.json',
        data_prefix=dict(img='val2017/'),
        test_mode=True,
        pipeline=test_pipeline,
    ),
)
test_dataloader = val_dataloader
val_evaluator = dict(
    _delete_=True,
    type='CocoMetric',
    ann_file=world_root + '/coco/annotations/instances_val2017.json',
    metric=['bbox', 'segm'],
    format_only=False,
)
test_evaluator = val_evaluator
max_epochs = 2
train_cfg = dict(max_epochs=max_epochs, val_interval=1)
param_scheduler = [
    dict(type='LinearLR', start_factor=0.001, by_epoch=False, begin=0, end=20),
    dict(type='MultiStepLR', begin=0, end=max_epochs, by_epoch=True, milestones=[1], gamma=0.1),
]
default_hooks = dict(logger=dict(type='LoggerHook', interval=5))
env_cfg = dict(dist_cfg=dict(backend='gloo'))
randomness = dict(seed=0)  # repeatable demo numbers (mmengine's default draws a fresh seed)
