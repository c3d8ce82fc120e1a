# TransMix on the synthetic world: DeiT's MixUp/CutMix switch, targets from the last block's class attention.
_base_ = ['./_base_/world_deit-tiny.py']

model = dict(
    type='TransMixClassifier',
    transmix=dict(mode='paper'),
    train_cfg=dict(augments=[dict(type='TAMixup', alpha=0.8), dict(type='TACutMix', alpha=1.0)]),
)
