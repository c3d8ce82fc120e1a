# ImageNet-1k DeiT-Small (mmpretrain's recipe: MixUp 0.8 / CutMix 1.0) with TokenMixup: HTM at block 3 and VTM at
# block 4 with kappa 3, at the public ViT-B/16 hyperparameters (mlvlab/TokenMixup on GitHub,
# experiments/run/train_vit_imagenet_HVTM.sh: rho 0.01, tau 0.1, ScoreNet on the class token with stop-gradient,
# ScoreNet weight 1.0). The paper reports TokenMixup on ViT-B/16 fine-tuning (its Table 2); DeiT-S from
# scratch with these values is our configuration. data_root as in mmpretrain's ImageNet configs (data/imagenet).
_base_ = ['mmpretrain::deit/deit-small_4xb256_in1k.py']

custom_imports = dict(imports=['mm_plugin', 'mm_plugin.enable_safe_load'], allow_failed_imports=False)

data_preprocessor = dict(type='TokenAugDataPreprocessor', patch_size=16)
model = dict(
    type='TokenMixupClassifier',
    tokenmixup=dict(
        htm_layers=[3],
        vtm_layers=[4],
        rho=0.01,
        tau=0.1,
        kappa=3,
        scorenet='cls',
        scorenet_weight=1.0,
        scorenet_stopgrad=True,
    ),
    train_cfg=dict(_delete_=True, augments=[dict(type='TAMixup', alpha=0.8), dict(type='TACutMix', alpha=1.0)]),
)

# pairwise mixing needs even batches: drop the last, possibly odd, batch of an epoch
train_dataloader = dict(drop_last=True)
