# Cascade Mask R-CNN with a Swin-T backbone, the Swin detection recipe (TL-Align paper Table 4): 3x schedule
# (36 epochs, milestones 27/33), multi-scale + crop training (DETR-style), AdamW lr 1e-4, wd 0.05, and the
# 4conv1fc box heads with GIoU loss of the original Swin Cascade configs. mmdet 3.3 ships no such config;
# this inherits its Swin Mask R-CNN 3x config and replaces the RoI head by a 3-stage cascade.
# Backbone: a tokenaug checkpoint converted with
#   tokenaug-convert --src CKPT --dst OUT --to mmdet --model swin_tiny_patch4_window7_224     ($TOKENAUG_BACKBONE)
_base_ = ['mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_ms-crop-3x_coco.py']

custom_imports = dict(
    imports=['mm_plugin', 'mm_plugin.enable_safe_load'], allow_failed_imports=False
)  # weights_only-safe mmengine checkpoints

backbone_checkpoint = '{{$TOKENAUG_BACKBONE:pretrain/swin-tiny_tokenaug_mmdet.pth}}'
# the backbone must load entirely (mm_plugin.backbone_check): a wrong file is an error, not a random backbone
custom_hooks = [dict(type='BackboneCheckpointCheck')]
num_classes = 80
_norm = dict(type='BN', requires_grad=True)  # SyncBN in the original; the Runner converts BN under DDP


def _box_head(stds):
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


def _rcnn_stage(iou):
    return dict(
        assigner=dict(
            type='MaxIoUAssigner',
            pos_iou_thr=iou,
            neg_iou_thr=iou,
            min_pos_iou=iou,
            match_low_quality=False,
            ignore_iof_thr=-1,
        ),
        sampler=dict(type='RandomSampler', num=512, pos_fraction=0.25, neg_pos_ub=-1, add_gt_as_proposals=True),
        mask_size=28,
        pos_weight=-1,
        debug=False,
    )


model = dict(
    type='CascadeRCNN',
    backbone=dict(
        convert_weights=False,  # tokenaug-convert already wrote mmdet's layout
        init_cfg=dict(type='Pretrained', checkpoint=backbone_checkpoint),
    ),
    roi_head=dict(
        _delete_=True,
        type='CascadeRoIHead',
        num_stages=3,
        stage_loss_weights=[1, 0.5, 0.25],
        bbox_roi_extractor=dict(
            type='SingleRoIExtractor',
            roi_layer=dict(type='RoIAlign', output_size=7, sampling_ratio=0),
            out_channels=256,
            featmap_strides=[4, 8, 16, 32],
        ),
        bbox_head=[
            _box_head([0.1, 0.1, 0.2, 0.2]),
            _box_head([0.05, 0.05, 0.1, 0.1]),
            _box_head([0.033, 0.033, 0.067, 0.067]),
        ],
        mask_roi_extractor=dict(
            type='SingleRoIExtractor',
            roi_layer=dict(type='RoIAlign', output_size=14, sampling_ratio=0),
            out_channels=256,
            featmap_strides=[4, 8, 16, 32],
        ),
        mask_head=dict(
            type='FCNMaskHead',
            num_convs=4,
            in_channels=256,
            conv_out_channels=256,
            num_classes=num_classes,
            loss_mask=dict(type='CrossEntropyLoss', use_mask=True, loss_weight=1.0),
        ),
    ),
    train_cfg=dict(rcnn=[_rcnn_stage(0.5), _rcnn_stage(0.6), _rcnn_stage(0.7)]),
    test_cfg=dict(
        rcnn=dict(score_thr=0.05, nms=dict(type='nms', iou_threshold=0.5), max_per_img=100, mask_thr_binary=0.5)
    ),
)
