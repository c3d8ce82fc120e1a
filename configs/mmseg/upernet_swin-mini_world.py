# UperNet on the synthetic world with the small Swin of configs/timm/world_swin-mini.yaml (patch 4, window 7,
# embed 32, depths 2-2-2-2, heads 1-2-4-8; 112 px scenes upsampled to 224 so every stage is whole windows),
# converted by tokenaug-convert --to mmseg --model swin_tiny_patch4_window7_224
# --model-kwargs embed_dim=32 'depths=(2,2,2,2)' 'num_heads=(1,2,4,8)'. Backbone checkpoint: $TOKENAUG_BACKBONE.
_base_ = ['mmseg::_base_/models/upernet_swin.py', 'mmseg::_base_/default_runtime.py', './_base_/world_ade20k.py']

custom_imports = dict(imports=['mm_plugin', 'mm_plugin.enable_safe_load'], allow_failed_imports=False)

backbone_checkpoint = '{{$TOKENAUG_BACKBONE:demo_out/backbones/swin-mini_mmseg.pth}}'
# the backbone must load entirely (mm_plugin.backbone_check): a wrong file is an error, not a random backbone
custom_hooks = [dict(type='BackboneCheckpointCheck')]
norm_cfg = dict(type='BN', requires_grad=True)
model = dict(
    type='PretrainedEncoderDecoder',  # also takes mmseg's model.pretrained=PATH (mm_plugin.segmentors)
    data_preprocessor=dict(size=(224, 224)),
    backbone=dict(
        embed_dims=32,
        depths=[2, 2, 2, 2],
        num_heads=[1, 2, 4, 8],
        window_size=7,
        drop_path_rate=0.0,
        use_abs_pos_embed=False,
        patch_norm=True,
        init_cfg=dict(type='Pretrained', checkpoint=backbone_checkpoint),
    ),
    decode_head=dict(in_channels=[32, 64, 128, 256], channels=64, num_classes=10, norm_cfg=norm_cfg),
    auxiliary_head=dict(in_channels=128, channels=32, num_classes=10, norm_cfg=norm_cfg),
    test_cfg=dict(mode='whole'),
)
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='Resize', scale=(224, 224), keep_ratio=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackSegInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=(224, 224), keep_ratio=True),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='PackSegInputs'),
]
train_dataloader = dict(dataset=dict(pipeline=train_pipeline))
val_dataloader = dict(dataset=dict(pipeline=test_pipeline))
test_dataloader = val_dataloader
optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=2e-4, betas=(0.9, 0.999), weight_decay=0.01),
    paramwise_cfg=dict(
        custom_keys={
            'absolute_pos_embed': dict(decay_mult=0.0),
            'relative_position_bias_table': dict(decay_mult=0.0),
            'norm': dict(decay_mult=0.0),
        }
    ),
)
env_cfg = dict(dist_cfg=dict(backend='gloo'))
