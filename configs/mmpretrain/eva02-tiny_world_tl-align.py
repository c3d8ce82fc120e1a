# TL-Align on the synthetic world with mmpretrain's EVA-02 (RoPE, SwiGLU): DeiT's MixUp/CutMix switch, aligned
# targets read from each layer's attention softmax (mm_plugin.tl_align.MMSoftmaxViTTracer).
_base_ = ['./_base_/world_deit-tiny.py']

model = dict(
    type='TLAlignClassifier',
    backbone=dict(
        _delete_=True,
        type='ViTEVA02',
        arch='tiny',
        img_size=112,
        patch_size=16,
        out_type='cls_token',
        drop_path_rate=0.1,
        final_norm=True,
    ),
    train_cfg=dict(augments=[dict(type='TAMixup', alpha=0.8), dict(type='TACutMix', alpha=1.0)]),
)
