# TokenMix on the synthetic world (CPU-sized DeiT-Tiny at 112 px): block masks, lambda ~ Beta(1, 1) (the paper's
# choice for small models), switched with MixUp, targets from a teacher's activation maps (Eq. 2). The base's
# label-smoothed cross entropy, not the paper's ImageNet BCE (Table 11): BCE does not leave the class prior in a
# schedule this short (see configs/timm/world_vit-tiny_tokenmix.yaml); deit-small_in1k_tokenmix.py uses BCE.
# $TOKENAUG_WORLD: the world root; $TOKENAUG_MAPS: the teacher's map store of <world>/imagenet/train.
_base_ = ['./_base_/world_deit-tiny.py']

world_root = '{{$TOKENAUG_WORLD:data/world}}'
label_maps = '{{$TOKENAUG_MAPS:data/world/token_label_maps}}'
img_size = 112

model = dict(
    train_cfg=dict(augments=[
        dict(type='TAMixup', alpha=0.8),
        dict(type='TATokenMix', alpha=1.0, mask='block', activation_targets='true_class'),
    ]))

train_pipeline = [
    # as read by tokenaug-maps (PIL, EXIF orientation not applied): the map and the image must agree
    dict(type='LoadImageFromFile', color_type='color_ignore_orientation'),
    dict(type='LoadTokenLabelMap', store=label_maps, split_root=world_root + '/imagenet/train'),
    dict(type='TokenLabelRandomResizedCrop', scale=img_size, crop_ratio_range=(0.35, 1.0), backend='pillow',
         interpolation='bicubic'),
    dict(type='RandomFlip', prob=0.5, direction='horizontal'),
    dict(type='PackTokenLabelInputs'),
]
train_dataloader = dict(dataset=dict(pipeline=train_pipeline))
