# ImageNet-1k DeiT-Small (mmpretrain's recipe: MixUp 0.8 / CutMix 1.0) trained on TransMix's targets, the baseline
# TL-Align compares with (TL-Align paper Table 1: 80.7). mode='paper' is the attention share alone; 'average'
# is the public TransMix code (the mean of the attention and area shares). data_root as mmpretrain's ImageNet configs.
_base_ = ['mmpretrain::deit/deit-small_4xb256_in1k.py']

custom_imports = dict(imports=['mm_plugin', 'mm_plugin.enable_safe_load'], allow_failed_imports=False)

data_preprocessor = dict(type='TokenAugDataPreprocessor', patch_size=16)
model = dict(
    type='TransMixClassifier',
    transmix=dict(mode='paper'),
    train_cfg=dict(_delete_=True, augments=[dict(type='TAMixup', alpha=0.8), dict(type='TACutMix', alpha=1.0)]),
)

# pairwise mixing needs even batches: drop the last, possibly odd, batch of an epoch
train_dataloader = dict(drop_last=True)
