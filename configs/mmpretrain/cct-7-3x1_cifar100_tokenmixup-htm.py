# TokenMixup (HTM) with CCT-7/3x1 on CIFAR-100 through mmpretrain's TIMMBackbone (the TokenMixup paper, Table 1:
# 82.87 -> 83.56). Hyperparameters of the public code (mlvlab/TokenMixup on GitHub,
# experiments/cct/configs/pretrained/cct_cifar100_HTM.yaml): HTM at block 2, tau 0.2, rho 0.005, ScoreNet weight
# 0.001 (attention pooling: CCT has no class token), MixUp 0.8 / CutMix 1.0, label smoothing 0.1, AdamW 6e-4,
# weight decay 0.06, 1500 epochs with 10 warmup epochs, batch 128. mmpretrain's CIFAR-100 data config (data/cifar100).
_base_ = ['mmpretrain::_base_/datasets/cifar100_bs16.py', 'mmpretrain::_base_/default_runtime.py']

custom_imports = dict(imports=['timm_plugin', 'mm_plugin', 'mm_plugin.enable_safe_load'], allow_failed_imports=False)

data_preprocessor = dict(
    type='TokenAugDataPreprocessor',
    num_classes=100,
    patch_size=2,  # the tokenizer's step: 32 px -> 16x16 tokens
    mean=[129.304, 124.070, 112.434],
    std=[68.170, 65.392, 70.418],
    to_rgb=False,
)
model = dict(
    type='TokenMixupClassifier',
    backbone=dict(type='TIMMBackbone', model_name='cct_7_3x1_32', num_classes=0, pretrained=False),
    neck=None,
    head=dict(
        type='LinearClsHead',
        num_classes=100,
        in_channels=256,
        loss=dict(type='LabelSmoothLoss', label_smooth_val=0.1, mode='original'),
    ),
    tokenmixup=dict(htm_layers=[2], rho=0.005, tau=0.2, scorenet='attn_pool', scorenet_weight=0.001),
    train_cfg=dict(augments=[dict(type='TAMixup', alpha=0.8), dict(type='TACutMix', alpha=1.0)]),
)

train_dataloader = dict(batch_size=128, drop_last=True)
optim_wrapper = dict(optimizer=dict(type='AdamW', lr=6e-4, weight_decay=0.06))
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-6 / 6e-4, by_epoch=True, begin=0, end=10, convert_to_iter_based=True),
    dict(type='CosineAnnealingLR', eta_min=1e-5, by_epoch=True, begin=10, end=1500),
]
train_cfg = dict(by_epoch=True, max_epochs=1500, val_interval=10)
val_cfg = dict()
test_cfg = dict()
