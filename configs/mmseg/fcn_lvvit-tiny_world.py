# FCN on the synthetic world with LV-ViT-T at 112 px (timm_plugin.lvvit), converted by
#   tokenaug-convert --to mmseg --model lvvit_t --model-kwargs img_size=112
# Same model family and optimiser as fcn_lvvit-s_ade20k-512x512_160k.py (FCN on the last block, auxiliary FCN
# on block 9, AdamW, warmup + linear decay), a CPU-sized schedule. Backbone checkpoint: $TOKENAUG_BACKBONE.
_base_ = ['mmseg::_base_/models/fcn_r50-d8.py', 'mmseg::_base_/default_runtime.py', './_base_/world_ade20k.py']

custom_imports = dict(imports=['mm_plugin', 'mm_plugin.enable_safe_load'], allow_failed_imports=False)

backbone_checkpoint = '{{$TOKENAUG_BACKBONE:demo_out/backbones/lvvit-tiny_mmseg.pth}}'
# the backbone must load entirely (mm_plugin.backbone_check): a wrong file is an error, not a random backbone
custom_hooks = [dict(type='BackboneCheckpointCheck')]
norm_cfg = dict(type='BN', requires_grad=True)
model = dict(
    type='PretrainedEncoderDecoder',  # also takes mmseg's model.pretrained=PATH (mm_plugin.segmentors)
    pretrained=None,
    data_preprocessor=dict(size=(112, 112)),
    backbone=dict(
        _delete_=True,
        type='LVViT',
        arch='t',
        img_size=(112, 112),
        out_indices=(8, 11),
        drop_path_rate=0.0,
        init_cfg=dict(type='Pretrained', checkpoint=backbone_checkpoint),
    ),
    decode_head=dict(
        in_channels=240, in_index=1, channels=64, num_convs=2, concat_input=True, num_classes=10, norm_cfg=norm_cfg
    ),
    auxiliary_head=dict(in_channels=240, in_index=0, channels=32, num_classes=10, norm_cfg=norm_cfg),
    test_cfg=dict(mode='whole'),
)
optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=2e-4, betas=(0.9, 0.999), weight_decay=0.01),
    paramwise_cfg=dict(
        custom_keys={'pos_embed': dict(decay_mult=0.0), 'cls_token': dict(decay_mult=0.0), 'norm': dict(decay_mult=0.0)}
    ),
)
env_cfg = dict(dist_cfg=dict(backend='gloo'))
