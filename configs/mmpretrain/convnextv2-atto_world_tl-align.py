# TL-Align on the synthetic world with mmpretrain's ConvNeXt V2-Atto (global response norm: a channel gate, labels
# unchanged; mm_plugin.tl_align.MMConvNeXtTracer, the rules of timm's ConvNeXt): the backbone pools its last map
# before the final norm (the label readout is the mean label), and the mix is drawn on the 4-px stem grid.
_base_ = ['./_base_/world_tl-align_4px.py']

model = dict(
    backbone=dict(
        _delete_=True, type='ConvNeXt', arch='atto', use_grn=True, layer_scale_init_value=0.0, drop_path_rate=0.1
    ),
    head=dict(in_channels=320),
)
