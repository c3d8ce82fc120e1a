# The world variant with the small Swin the demo pretrains (patch 4, window 7, 224 px input; embed 32,
# depths (2, 2, 2, 2), heads (1, 2, 4, 8)): tokenaug-train --model swin_tiny_patch4_window7_224
# --model-kwargs embed_dim=32 depths='(2,2,2,2)' num_heads='(1,2,4,8)', then tokenaug-convert --to mmdet.
_base_ = ['./cascade-mask-rcnn_swin-t_world.py']

backbone_checkpoint = '{{$TOKENAUG_BACKBONE:demo_out/backbones/swin-mini_mmdet.pth}}'
# the backbone must load entirely (mm_plugin.backbone_check): a wrong file is an error, not a random backbone
custom_hooks = [dict(type='BackboneCheckpointCheck')]
# Neck and heads sized to this backbone: 64 channels in the FPN, the RPN and the RoI heads (the recipe's 256 / 1024
# are Swin-T's on COCO). One iteration of batch 2 then takes 1.0 s on 2 CPU cores instead of 8.7 s, so the demo
# trains enough iterations to detect. Measured on the demo's world from a 3-epoch MixUp/CutMix mini Swin:
# 200 iterations (1 epoch of the 400 scenes) at lr 4e-4: box AP 0.105, mask AP 0.153; 400: 0.337 / 0.432; the
# recipe's widths, 100 iterations at 2e-4: 0.063 / 0.106 in 8x the time.
width = 64
num_classes = {{_base_.num_classes}}  # the base config's (the heads below replace its list)


def _mini_box_head(stds):
    return dict(
        type='Shared4Conv1FCBBoxHead',
        in_channels=width,
        conv_out_channels=width,
        fc_out_channels=256,
        roi_feat_size=7,
        num_classes=num_classes,
        norm_cfg=dict(type='BN', requires_grad=True),
        reg_class_agnostic=False,
        reg_decoded_bbox=True,
        bbox_coder=dict(type='DeltaXYWHBBoxCoder', target_means=[0.0, 0.0, 0.0, 0.0], target_stds=stds),
        loss_cls=dict(type='CrossEntropyLoss', use_sigmoid=False, loss_weight=1.0),
        loss_bbox=dict(type='GIoULoss', loss_weight=10.0),
    )


model = dict(
    backbone=dict(
        embed_dims=32,
        depths=[2, 2, 2, 2],
        num_heads=[1, 2, 4, 8],
        init_cfg=dict(type='Pretrained', checkpoint=backbone_checkpoint),
    ),
    neck=dict(in_channels=[32, 64, 128, 256], out_channels=width),
    rpn_head=dict(in_channels=width, feat_channels=width),
    roi_head=dict(
        bbox_roi_extractor=dict(out_channels=width),
        bbox_head=[
            _mini_box_head([0.1, 0.1, 0.2, 0.2]),
            _mini_box_head([0.05, 0.05, 0.1, 0.1]),
            _mini_box_head([0.033, 0.033, 0.067, 0.067]),
        ],
        mask_roi_extractor=dict(out_channels=width),
        mask_head=dict(in_channels=width, conv_out_channels=width),
    ),
)
# batch 2 and few iterations: AdamW at 4e-4 (the recipe's 1e-4 is for batch 16 over 36 epochs), a 10-iteration
# warmup (the base's 20 took the demo's whole run before), no step decay within the 2 epochs
optim_wrapper = dict(optimizer=dict(lr=4e-4))
max_epochs = 2
train_cfg = dict(max_epochs=max_epochs, val_interval=max_epochs)
param_scheduler = [
    dict(type='LinearLR', start_factor=0.001, by_epoch=False, begin=0, end=10),
    dict(type='MultiStepLR', begin=0, end=max_epochs, by_epoch=True, milestones=[max_epochs], gamma=0.1),
]
