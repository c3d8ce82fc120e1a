# DeiT-Tiny on the synthetic world (world_deit-tiny.py) with a train pipeline that carries a label-map store
# (token labels or a teacher's activation maps) through every crop and flip: the shared data part of
# deit-tiny_world_token-labeling.py and deit-tiny_world_tokenmix.py.
# $TOKENAUG_WORLD: the world root; $TOKENAUG_MAPS: the map store of its train split, keyed by paths relative to
# <world>/imagenet/train (`tokenaug-maps generate --data-dir <world>/imagenet --split train --out ...`).
_base_ = ['./world_deit-tiny.py']

world_root = '{{$TOKENAUG_WORLD:data/world}}'
label_maps = '{{$TOKENAUG_MAPS:data/world/token_label_maps}}'
img_size = 112

train_pipeline = [
    # as read by tokenaug-maps (PIL, EXIF orientation not applied): the map and the image must agree
    dict(type='LoadImageFromFile', color_type='color_ignore_orientation'),
    dict(type='LoadTokenLabelMap', store=label_maps, split_root=world_root + '/imagenet/train'),
    dict(
        type='TokenLabelRandomResizedCrop',
        scale=img_size,
        crop_ratio_range=(0.35, 1.0),
        backend='pillow',
        interpolation='bicubic',
    ),
    dict(type='RandomFlip', prob=0.5, direction='horizontal'),
    dict(type='PackTokenLabelInputs'),
]
train_dataloader = dict(dataset=dict(pipeline=train_pipeline))
# every training image must have a map, checked before the first iteration (paths only)
custom_hooks = [dict(type='TokenLabelStoreCheck')]
