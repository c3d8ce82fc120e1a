# UperNet with an LV-ViT-S backbone on ADE20K (Token Labeling paper Sec. 4.4, Table 7), from a tokenaug
# checkpoint converted with
#   tokenaug-convert --src CKPT --dst OUT --to mmseg --model lvvit_s
# Recipe of Sec. 4.4 on mmseg's DeiT-S UperNet (as upernet_deit-s16_ade20k-512x512_160k.py): 160k iterations,
# 8 GPUs x 2 images (batch 16), 512x512 crops, AdamW lr 6e-5, wd 0.01, linear (poly, power 1) decay to a
# minimum lr of 5e-6 after a 1500-iteration linear warmup. Blocks 4, 8, 12, 16 feed the head (no neck, as
# mmseg's DeiT-S UperNet); the paper gives no head widths: 384 channels give Table 7's 44M parameters
# (43.6M, auxiliary head counted). The backbone checkpoint: $TOKENAUG_BACKBONE.
_base_ = ['mmseg::vit/vit_deit-s16_upernet_8xb2-160k_ade20k-512x512.py']

custom_imports = dict(
    imports=['mm_plugin', 'mm_plugin.enable_safe_load'], allow_failed_imports=False
)  # LVViT; weights_only-safe checkpoints

backbone_checkpoint = '{{$TOKENAUG_BACKBONE:pretrain/lvvit-s_tokenaug_mmseg.pth}}'
# the backbone must load entirely (mm_plugin.backbone_check): a wrong file is an error, not a random backbone
custom_hooks = [dict(type='BackboneCheckpointCheck')]
model = dict(
    type='PretrainedEncoderDecoder',  # also takes mmseg's model.pretrained=PATH (mm_plugin.segmentors)
    pretrained=None,
    backbone=dict(
        _delete_=True,
        type='LVViT',
        arch='s',
        img_size=(512, 512),  # the 224 px position embedding is resampled at load
        out_indices=(3, 7, 11, 15),
        drop_path_rate=0.1,
        final_norm=False,  # as tokenaug-convert's default (give --final-norm and True together)
        init_cfg=dict(type='Pretrained', checkpoint=backbone_checkpoint),
    ),
    neck=None,
    decode_head=dict(in_channels=[384, 384, 384, 384], channels=384, num_classes=150),
    auxiliary_head=dict(in_channels=384, num_classes=150),
)
optim_wrapper = dict(optimizer=dict(type='AdamW', lr=6e-5, betas=(0.9, 0.999), weight_decay=0.01))
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-6, by_epoch=False, begin=0, end=1500),
    dict(type='PolyLR', eta_min=5e-6, power=1.0, begin=1500, end=160000, by_epoch=False),
]
train_cfg = dict(type='IterBasedTrainLoop', max_iters=160000, val_interval=16000)
train_dataloader = dict(batch_size=2)
