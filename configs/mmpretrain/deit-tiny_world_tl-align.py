# TL-Align on the synthetic world: DeiT's MixUp/CutMix switch, aligned targets.
_base_ = ['./_base_/world_deit-tiny.py']

model = dict(
    type='TLAlignClassifier',
    train_cfg=dict(augments=[dict(type='TAMixup', alpha=0.8), dict(type='TACutMix', alpha=1.0)]),
)
