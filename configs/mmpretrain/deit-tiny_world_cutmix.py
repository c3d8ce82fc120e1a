# Baseline: DeiT's MixUp (α=0.8) / CutMix (α=1.0) switch, with tokenaug's augments so the mix reaches the model.
_base_ = ['./_base_/world_deit-tiny.py']

model = dict(
    train_cfg=dict(
        augments=[
            dict(type='TAMixup', alpha=0.8),
            dict(type='TACutMix', alpha=1.0),
        ]
    )
)
