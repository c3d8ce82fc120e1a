# The world variant with the small Swin the demo pretrains (patch 4, window 7, 224 px input; embed 32,
# depths (2, 2, 2, 2), heads (1, 2, 4, 8)): tokenaug-train --model swin_tiny_patch4_window7_224
# --model-kwargs embed_dim=32 depths='(2,2,2,2)' num_heads='(1,2,4,8)', then tokenaug-convert --to mmdet.
_base_ = ['./cascade-mask-rcnn_swin-t_world.py']

backbone_checkpoint = '{{$TOKENAUG_BACKBONE:demo_out/backbones/swin-mini_mmdet.pth}}'
# the backbone must load entirely (mm_plugin.backbone_check): a wrong file is an error, not a random backbone
custom_hooks = [dict(type='BackboneCheckpointCheck')]
model = dict(
    backbone=dict(
        embed_dims=32,
        depths=[2, 2, 2, 2],
        num_heads=[1, 2, 4, 8],
        init_cfg=dict(type='Pretrained', checkpoint=backbone_checkpoint),
    ),
    neck=dict(in_channels=[32, 64, 128, 256]),
)
