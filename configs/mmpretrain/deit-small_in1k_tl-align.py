# ImageNet-1k DeiT-Small (mmpretrain's recipe: MixUp 0.8 / CutMix 1.0) trained on TL-Align's aligned targets
# (the TL-Align paper, Table 1: 79.8 -> 80.6). data_root as in mmpretrain's ImageNet configs (data/imagenet).
_base_ = ['mmpretrain::deit/deit-small_4xb256_in1k.py']

custom_imports = dict(imports=['mm_plugin', 'mm_plugin.enable_safe_load'], allow_failed_imports=False)

data_preprocessor = dict(type='TokenAugDataPreprocessor', patch_size=16)
model = dict(
    type='TLAlignClassifier',
    tl_align=dict(layers=None, residual=True),
    train_cfg=dict(_delete_=True, augments=[dict(type='TAMixup', alpha=0.8), dict(type='TACutMix', alpha=1.0)]),
)

# pairwise mixing needs even batches: drop the last, possibly odd, batch of an epoch
train_dataloader = dict(drop_last=True)
