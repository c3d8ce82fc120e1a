# TL-Align on the synthetic world for a backbone whose token grid is 4 px (a conv stem, a 4-px patch embedding): the
# DeiT-Tiny world run's schedule and MixUp/CutMix switch, the mix drawn on the 4-px grid (patch_size=4 on the data
# preprocessor, the one place the grid is set), a linear head on the backbone's pooled last map. A config on it sets
# the backbone, and the head's in_channels.
_base_ = ['../deit-tiny_world_tl-align.py']

data_preprocessor = dict(patch_size=4)

model = dict(
    head=dict(
        _delete_=True,
        type='LinearClsHead',
        num_classes=10,
        in_channels=None,
        loss=dict(type='LabelSmoothLoss', label_smooth_val=0.1, mode='original'),  # as the DeiT head
    ),
)
