# TL-Align on the synthetic world with mmpretrain's DeiT3 (layer scale; its FFN's own drop path) at DeiT-Tiny's size:
# DeiT's MixUp/CutMix switch, aligned targets from each layer's attention (mm_plugin.tl_align.MMViTTracer, the ViT
# rules: layer scale and the FFN are per token).
_base_ = ['./deit-tiny_world_tl-align.py']

model = dict(
    backbone=dict(
        _delete_=True,
        type='DeiT3',
        arch=dict(embed_dims=192, num_layers=12, num_heads=3, feedforward_channels=768),
        img_size=112,
        patch_size=16,
        drop_path_rate=0.1,
    ),
)
