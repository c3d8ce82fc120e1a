# TL-Align on the synthetic world with a timm ConvNeXt-Atto through mmpretrain's TIMMBackbone (TL-Align Appendix A's
# generalised rules, timm_plugin.tl_align.ConvNeXtTracer): the backbone's final map is average-pooled by the neck
# (the label readout is the mean label), and the mix is drawn on ConvNeXt's 4-px stem grid (patch_size=4 on the
# data preprocessor, the one place the grid is set).
_base_ = ['./_base_/world_tl-align_4px.py']

model = dict(
    backbone=dict(_delete_=True, type='TIMMBackbone', model_name='convnext_atto', drop_path_rate=0.1),
    neck=dict(_delete_=True, type='GlobalAveragePooling'),
    head=dict(in_channels=320),
)
