# Cascade Mask R-CNN, Swin-B backbone (Swin-base), same recipe as the Swin-T config beside it.
#   tokenaug-convert --src CKPT --dst OUT --to mmdet --model swin_base_patch4_window7_224     ($TOKENAUG_BACKBONE)
_base_ = ['./cascade-mask-rcnn_swin-t-p4-w7_fpn_giou-4conv1fc_ms-crop-3x_coco.py']

backbone_checkpoint = '{{$TOKENAUG_BACKBONE:pretrain/swin-base_tokenaug_mmdet.pth}}'
# the backbone must load entirely (mm_plugin.backbone_check): a wrong file is an error, not a random backbone
custom_hooks = [dict(type='BackboneCheckpointCheck')]
model = dict(
    backbone=dict(
        embed_dims=128,
        depths=[2, 2, 18, 2],
        num_heads=[4, 8, 16, 32],
        drop_path_rate=0.3,
        init_cfg=dict(type='Pretrained', checkpoint=backbone_checkpoint),
    ),
    neck=dict(in_channels=[128, 256, 512, 1024]),
)
