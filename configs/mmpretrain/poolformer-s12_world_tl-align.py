# TL-Align on the synthetic world with mmpretrain's PoolFormer-S12 (each token mixer pool(x) - x read as its average
# pool; mm_plugin.tl_align.MMPoolFormerTracer, the rules of timm's PoolFormer): the last stage's map is average-pooled
# by the neck (the label readout is the mean label), and the mix is drawn on the 4-px grid of the 7x7 stride-4 stem.
_base_ = ['./_base_/world_tl-align_4px.py']

model = dict(
    backbone=dict(_delete_=True, type='PoolFormer', arch='s12', drop_path_rate=0.1),
    neck=dict(_delete_=True, type='GlobalAveragePooling'),
    head=dict(in_channels=512),
)
