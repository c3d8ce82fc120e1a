# ImageNet-1k DeiT-Small whose train pipeline carries a label-map store (token labels or a teacher's activation
# maps) through every crop and flip: the shared data part of deit-small_in1k_token-labeling.py and
# deit-small_in1k_tokenmix.py. RandAugment keeps all its policies; the maps follow Rotate / Shear / Translate.
# Data: data_root as mmpretrain's ImageNet configs (data/imagenet); the map store of the train split
# (`tokenaug-maps generate --data-dir data/imagenet --split train --out ...`) from $TOKENAUG_MAPS.
_base_ = ['mmpretrain::deit/deit-small_4xb256_in1k.py']

custom_imports = dict(imports=['mm_plugin', 'mm_plugin.enable_safe_load'], allow_failed_imports=False)

data_root = 'data/imagenet'
label_maps = '{{$TOKENAUG_MAPS:data/imagenet/token_label_maps}}'

bgr_mean = [103.53, 116.28, 123.675]
bgr_std = [57.375, 57.12, 58.395]
train_pipeline = [
    # as read by tokenaug-maps (PIL, EXIF orientation not applied): the map and the image must agree
    dict(type='LoadImageFromFile', color_type='color_ignore_orientation'),
    dict(type='LoadTokenLabelMap', store=label_maps, split_root=data_root + '/train'),
    dict(type='TokenLabelRandomResizedCrop', scale=224, backend='pillow', interpolation='bicubic'),
    dict(type='RandomFlip', prob=0.5, direction='horizontal'),
    # mmpretrain's 'timm_increasing' policies; Rotate / Shear / Translate record their affines and the maps
    # follow them (geometric='drop' removes them instead)
    dict(
        type='TokenLabelRandAugment',
        policies='timm_increasing',
        geometric='follow',
        num_policies=2,
        total_level=10,
        magnitude_level=9,
        magnitude_std=0.5,
        hparams=dict(pad_val=[round(x) for x in bgr_mean], interpolation='bicubic'),
    ),
    dict(
        type='RandomErasing',
        erase_prob=0.25,
        mode='rand',
        min_area_ratio=0.02,
        max_area_ratio=1 / 3,
        fill_color=bgr_mean,
        fill_std=bgr_std,
    ),
    dict(type='PackTokenLabelInputs'),
]
# pairwise mixing needs even batches: drop the last, possibly odd, batch of an epoch
train_dataloader = dict(drop_last=True, dataset=dict(pipeline=train_pipeline))
# every training image must have a map, checked before the first iteration (paths only)
custom_hooks = [dict(type='TokenLabelStoreCheck')]
