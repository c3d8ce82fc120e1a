# Token labeling + MixToken on the synthetic world (CPU-sized DeiT-Tiny at 112 px).
# $TOKENAUG_WORLD: the world root (as _base_/world_deit-tiny.py); $TOKENAUG_MAPS: the label-map store of its
# train split, keyed by paths relative to <world>/imagenet/train (`tokenaug-maps generate --data-dir
# <world>/imagenet --split train --out ...`).
_base_ = ['./_base_/world_deit-tiny.py']

world_root = '{{$TOKENAUG_WORLD:data/world}}'
label_maps = '{{$TOKENAUG_MAPS:data/world/token_label_maps}}'
img_size = 112

model = dict(
    type='TokenLabelingClassifier',
    backbone=dict(out_type='raw'),
    head=dict(_delete_=True, type='TokenLabelingHead', num_classes=10, in_channels=192, dense_weight=0.5,
              cls_target='gt', label_smoothing=0.1, head_rule='cls+aux'),
    mix_token=True, mix_beta=1.0, mix_mode='batch',
    train_cfg=None,  # no image batch augments: MixToken is in the model
)

train_pipeline = [
    # as read by tokenaug-maps (PIL, EXIF orientation not applied): the map and the image must agree
    dict(type='LoadImageFromFile', color_type='color_ignore_orientation'),
    dict(type='LoadTokenLabelMap', store=label_maps, split_root=world_root + '/imagenet/train'),
    dict(type='TokenLabelRandomResizedCrop', scale=img_size, crop_ratio_range=(0.35, 1.0), backend='pillow',
         interpolation='bicubic'),
    dict(type='RandomFlip', prob=0.5, direction='horizontal'),
    dict(type='TokenLabelRandAugment', policies='timm_increasing', num_policies=2, magnitude_level=9,
         magnitude_std=0.5, hparams=dict(pad_val=[104, 116, 124], interpolation='bicubic')),
    dict(type='PackTokenLabelInputs'),
]
train_dataloader = dict(dataset=dict(pipeline=train_pipeline))
