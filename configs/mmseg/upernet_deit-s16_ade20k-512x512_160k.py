# UperNet with a DeiT-S backbone on ADE20K (TL-Align paper Table 3), from a tokenaug checkpoint converted with
#   tokenaug-convert --src CKPT --dst OUT --to mmseg --model deit_small_patch16_224
# Recipe of mmseg's DeiT/Swin UperNet: 160k iterations, 8 GPUs x 2 images (batch 16), AdamW lr 6e-5, wd 0.01,
# linear warmup 1500 iterations then poly decay. The backbone checkpoint: $TOKENAUG_BACKBONE.
_base_ = ['mmseg::vit/vit_deit-s16_upernet_8xb2-160k_ade20k-512x512.py']

custom_imports = dict(
    imports=['mm_plugin', 'mm_plugin.enable_safe_load'], allow_failed_imports=False
)  # weights_only-safe mmengine checkpoints

backbone_checkpoint = '{{$TOKENAUG_BACKBONE:pretrain/deit-s16_tokenaug_mmseg.pth}}'
# the backbone must load entirely (mm_plugin.backbone_check): a wrong file is an error, not a random backbone
custom_hooks = [dict(type='BackboneCheckpointCheck')]
model = dict(
    type='PretrainedEncoderDecoder',  # also takes mmseg's model.pretrained=PATH (mm_plugin.segmentors)
    pretrained=None,
    backbone=dict(
        patch_bias=True,  # timm's patch embedding has a bias; mmseg's ViT defaults to none
        init_cfg=dict(type='Pretrained', checkpoint=backbone_checkpoint),
    ),
)
optim_wrapper = dict(optimizer=dict(type='AdamW', lr=6e-5, betas=(0.9, 0.999), weight_decay=0.01))
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-6, by_epoch=False, begin=0, end=1500),
    dict(type='PolyLR', eta_min=0.0, power=1.0, begin=1500, end=160000, by_epoch=False),
]
train_cfg = dict(type='IterBasedTrainLoop', max_iters=160000, val_interval=16000)
train_dataloader = dict(batch_size=2)
