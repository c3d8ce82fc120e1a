# UperNet with a Swin-Small backbone on ADE20K (TL-Align paper Table 3), from a tokenaug checkpoint converted with
#   tokenaug-convert --src CKPT --dst OUT --to mmseg --model swin_small_patch4_window7_224
# mmseg's Swin UperNet recipe: 160k iterations, 8 GPUs x 2 images (batch 16), AdamW lr 6e-5, wd 0.01,
# linear warmup 1500 iterations then poly decay. The backbone checkpoint: $TOKENAUG_BACKBONE.
_base_ = ['mmseg::swin/swin-small-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py']

custom_imports = dict(
    imports=['mm_plugin', 'mm_plugin.enable_safe_load'], allow_failed_imports=False
)  # weights_only-safe mmengine checkpoints

backbone_checkpoint = '{{$TOKENAUG_BACKBONE:pretrain/swin-small_tokenaug_mmseg.pth}}'
# the backbone must load entirely (mm_plugin.backbone_check): a wrong file is an error, not a random backbone
custom_hooks = [dict(type='BackboneCheckpointCheck')]
model = dict(
    type='PretrainedEncoderDecoder',  # also takes mmseg's model.pretrained=PATH (mm_plugin.segmentors)
    backbone=dict(init_cfg=dict(type='Pretrained', checkpoint=backbone_checkpoint)),
)
