# TL-Align on the synthetic world with mmpretrain's Swin Transformer V2 (post-norm blocks, cosine attention with the
# log-spaced continuous position bias, read at its softmax: mm_plugin.tl_align.MMSwinV2Tracer). Three stages at
# 112 px: 28x28, 14x14 and 7x7 tokens in 7x7 windows (the last stage's map is one window, so mmpretrain drops its
# shift); the mix is drawn on the 4-px patch grid (patch_size=4 on the data preprocessor).
_base_ = ['./_base_/world_tl-align_4px.py']

model = dict(
    backbone=dict(
        _delete_=True,
        type='SwinTransformerV2',
        arch=dict(embed_dims=48, depths=[2, 2, 2], num_heads=[3, 6, 12], extra_norm_every_n_blocks=0),
        img_size=112,
        window_size=[7, 7, 7],
        out_indices=(2,),
        drop_path_rate=0.1,
    ),
    neck=dict(_delete_=True, type='GlobalAveragePooling'),
    head=dict(in_channels=192),
)
