# TokenMixup on the synthetic world: DeiT's MixUp/CutMix switch, HTM at block 3 (a tau high enough that the
# untrained ScoreNet marks samples easy in a short CPU run) and VTM at block 4.
_base_ = ['./_base_/world_deit-tiny.py']

model = dict(
    type='TokenMixupClassifier',
    tokenmixup=dict(htm_layers=[3], vtm_layers=[4], rho=0.005, tau=1.0, kappa=3, scorenet_weight=0.001),
    train_cfg=dict(augments=[dict(type='TAMixup', alpha=0.8), dict(type='TACutMix', alpha=1.0)]),
)
