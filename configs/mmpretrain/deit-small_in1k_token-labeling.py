# ImageNet-1k DeiT-Small trained by token labeling + MixToken (the Token Labeling paper, Sec. 3.2-3.3, Table 4:
# DeiT-S 79.9 -> 81.0). The paper's recipe on mmpretrain's DeiT-Small config: AdamW, lr 1e-3 * batch / 640
# (1.6e-3 at 4 x 256), weight decay 0.05, 300 epochs cosine after a 5-epoch warmup, drop path 0.1,
# RandAugment m9 / std 0.5 with all its policies (the token labels follow rotate / shear / translate),
# random erasing 0.25, no MixUp / CutMix: MixToken (beta = 1, one box per batch) is in the model,
# beta = 0.5 weighs the token loss (Eq. 3).
# Data and the map-carrying train pipeline: _base_/deit-small_in1k_label-maps.py (data/imagenet; the label-map
# store of the train split from $TOKENAUG_MAPS).
_base_ = ['./_base_/deit-small_in1k_label-maps.py']

num_classes = 1000

model = dict(
    type='TokenLabelingClassifier',
    backbone=dict(out_type='raw', drop_path_rate=0.1),  # every token, after the final norm
    head=dict(
        _delete_=True,
        type='TokenLabelingHead',
        num_classes=num_classes,
        in_channels=384,
        dense_weight=0.5,
        cls_target='gt',
        label_smoothing=0.1,
        head_rule='cls+aux',
    ),
    mix_token=True,
    mix_beta=1.0,
    mix_prob=1.0,
    mix_mode='batch',
    train_cfg=None,  # no image batch augments: MixToken replaces MixUp / CutMix
)

train_dataloader = dict(batch_size=256)  # 4 x 256

# lr = 1e-3 * batch / 640 for the 4 x 256 batch; --auto-scale-lr rescales it for other batches
optim_wrapper = dict(optimizer=dict(lr=1e-3 * 1024 / 640, weight_decay=0.05))
auto_scale_lr = dict(base_batch_size=1024)
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-3, by_epoch=True, begin=0, end=5, convert_to_iter_based=True),
    dict(type='CosineAnnealingLR', eta_min=1e-5, by_epoch=True, begin=5, end=300, convert_to_iter_based=True),
]
train_cfg = dict(by_epoch=True, max_epochs=300, val_interval=1)
