# ImageNet-1k DeiT-Small trained by token labeling + MixToken (token-labeling.md Sec. 3.2-3.3, Table 4:
# DeiT-S 79.9 -> 81.0). The paper's recipe on mmpretrain's DeiT-Small config: AdamW, lr 1e-3 * batch / 640
# (1.6e-3 at 4 x 256), weight decay 0.05, 300 epochs cosine after a 5-epoch warmup, drop path 0.1,
# RandAugment m9 / std 0.5 *without* its geometric policies (the token labels cannot follow them),
# random erasing 0.25, no MixUp / CutMix: MixToken (beta = 1, one box per batch) is in the model,
# beta = 0.5 weighs the token loss (Eq. 3).
# Data: data_root as mmpretrain's ImageNet configs (data/imagenet); the label-map store of the train split
# (`tokenaug-maps generate --data-dir data/imagenet --split train --out ...`) from $TOKENAUG_MAPS.
_base_ = ['mmpretrain::deit/deit-small_4xb256_in1k.py']

custom_imports = dict(imports=['mm_plugin'], allow_failed_imports=False)

data_root = 'data/imagenet'
label_maps = '{{$TOKENAUG_MAPS:data/imagenet/token_label_maps}}'
num_classes = 1000

model = dict(
    type='TokenLabelingClassifier',
    backbone=dict(out_type='raw', drop_path_rate=0.1),  # every token, after the final norm
    head=dict(_delete_=True, type='TokenLabelingHead', num_classes=num_classes, in_channels=384,
              dense_weight=0.5, cls_target='gt', label_smoothing=0.1, head_rule='cls+aux'),
    mix_token=True, mix_beta=1.0, mix_prob=1.0, mix_mode='batch',
    train_cfg=None,  # no image batch augments: MixToken replaces MixUp / CutMix
)

bgr_mean = [103.53, 116.28, 123.675]
bgr_std = [57.375, 57.12, 58.395]
train_pipeline = [
    # as read by tokenaug-maps (PIL, EXIF orientation not applied): the map and the image must agree
    dict(type='LoadImageFromFile', color_type='color_ignore_orientation'),
    dict(type='LoadTokenLabelMap', store=label_maps, split_root=data_root + '/train'),
    dict(type='TokenLabelRandomResizedCrop', scale=224, backend='pillow', interpolation='bicubic'),
    dict(type='RandomFlip', prob=0.5, direction='horizontal'),
    # mmpretrain's 'timm_increasing' policies less Rotate / Shear / Translate (TokenLabelRandAugment)
    dict(type='TokenLabelRandAugment', policies='timm_increasing', num_policies=2, total_level=10,
         magnitude_level=9, magnitude_std=0.5,
         hparams=dict(pad_val=[round(x) for x in bgr_mean], interpolation='bicubic')),
    dict(type='RandomErasing', erase_prob=0.25, mode='rand', min_area_ratio=0.02, max_area_ratio=1 / 3,
         fill_color=bgr_mean, fill_std=bgr_std),
    dict(type='PackTokenLabelInputs'),
]
# pairwise mixing needs even batches: drop the last, possibly odd, batch of an epoch
train_dataloader = dict(batch_size=256, drop_last=True, dataset=dict(pipeline=train_pipeline))

# lr = 1e-3 * batch / 640 for the 4 x 256 batch; --auto-scale-lr rescales it for other batches
optim_wrapper = dict(optimizer=dict(lr=1e-3 * 1024 / 640, weight_decay=0.05))
auto_scale_lr = dict(base_batch_size=1024)
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-3, by_epoch=True, begin=0, end=5, convert_to_iter_based=True),
    dict(type='CosineAnnealingLR', eta_min=1e-5, by_epoch=True, begin=5, end=300, convert_to_iter_based=True),
]
train_cfg = dict(by_epoch=True, max_epochs=300, val_interval=1)
