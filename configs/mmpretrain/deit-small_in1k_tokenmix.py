# ImageNet-1k DeiT-Small with TokenMix as in the paper (tokenmix.md Sec. 4.2, Tables 7-11): block masks at
# lambda = 0.5 switched with MixUp (0.8) with probability 0.5, targets from a teacher's activation maps (Eq. 2,
# the true-class channel), BCE loss (Table 11), AdamW lr 1e-3 at batch 1024, cosine to 1e-6, 5 warmup epochs.
# The maps follow every crop and flip: the train pipeline records them (token-label transforms), and
# RandAugment loses its geometric policies (the maps cannot follow them).
# Data: data_root as mmpretrain's ImageNet configs (data/imagenet); the teacher's map store of the train
# split (`tokenaug-maps generate --data-dir data/imagenet --split train --model <teacher> ...`) from
# $TOKENAUG_MAPS.
_base_ = ['mmpretrain::deit/deit-small_4xb256_in1k.py']

custom_imports = dict(imports=['mm_plugin'], allow_failed_imports=False)

data_root = 'data/imagenet'
label_maps = '{{$TOKENAUG_MAPS:data/imagenet/token_label_maps}}'

data_preprocessor = dict(type='TokenAugDataPreprocessor', patch_size=16)
model = dict(
    head=dict(loss=dict(_delete_=True, type='CrossEntropyLoss', use_sigmoid=True, loss_weight=1.0)),  # BCE
    train_cfg=dict(_delete_=True, augments=[
        dict(type='TAMixup', alpha=0.8),
        dict(type='TATokenMix', mask='block', lam=0.5, activation_targets='true_class'),
    ]))

bgr_mean = [103.53, 116.28, 123.675]
bgr_std = [57.375, 57.12, 58.395]
train_pipeline = [
    # as read by tokenaug-maps (PIL, EXIF orientation not applied): the map and the image must agree
    dict(type='LoadImageFromFile', color_type='color_ignore_orientation'),
    dict(type='LoadTokenLabelMap', store=label_maps, split_root=data_root + '/train'),
    dict(type='TokenLabelRandomResizedCrop', scale=224, backend='pillow', interpolation='bicubic'),
    dict(type='RandomFlip', prob=0.5, direction='horizontal'),
    dict(type='TokenLabelRandAugment', policies='timm_increasing', num_policies=2, total_level=10,
         magnitude_level=9, magnitude_std=0.5,
         hparams=dict(pad_val=[round(x) for x in bgr_mean], interpolation='bicubic')),
    dict(type='RandomErasing', erase_prob=0.25, mode='rand', min_area_ratio=0.02, max_area_ratio=1 / 3,
         fill_color=bgr_mean, fill_std=bgr_std),
    dict(type='PackTokenLabelInputs'),
]
# pairwise mixing needs even batches: drop the last, possibly odd, batch of an epoch
train_dataloader = dict(drop_last=True, dataset=dict(pipeline=train_pipeline))

optim_wrapper = dict(optimizer=dict(lr=1e-3, weight_decay=0.05))
auto_scale_lr = dict(base_batch_size=1024)
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-3, by_epoch=True, begin=0, end=5, convert_to_iter_based=True),
    dict(type='CosineAnnealingLR', eta_min=1e-6, by_epoch=True, begin=5, end=300, convert_to_iter_based=True),
]
