# TokenMix-style multi-block token masks (switching with MixUp by probability 0.5, as in the TokenMix paper).
_base_ = ['./_base_/world_deit-tiny.py']

model = dict(
    train_cfg=dict(
        augments=[
            dict(type='TAMixup', alpha=0.8),
            dict(type='TATokenMix', alpha=1.0, mask='block'),
        ]
    )
)
