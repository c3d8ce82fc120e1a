# TL-Align on the synthetic world with mmpretrain's BEiT (relative position bias, layer scale) at DeiT-Tiny's
# size: DeiT's MixUp/CutMix switch, aligned targets read from each layer's attention softmax, the relative position
# bias in it (mm_plugin.tl_align.MMSoftmaxViTTracer).
_base_ = ['./_base_/world_deit-tiny.py']

model = dict(
    type='TLAlignClassifier',
    backbone=dict(
        _delete_=True,
        type='BEiTViT',
        arch=dict(embed_dims=192, num_layers=12, num_heads=3, feedforward_channels=768),
        img_size=112,
        patch_size=16,
        out_type='avg_featmap',
        use_abs_pos_emb=False,
        use_rel_pos_bias=True,
        use_shared_rel_pos_bias=False,
        layer_scale_init_value=0.1,
        drop_path_rate=0.1,
    ),
    train_cfg=dict(augments=[dict(type='TAMixup', alpha=0.8), dict(type='TACutMix', alpha=1.0)]),
)
