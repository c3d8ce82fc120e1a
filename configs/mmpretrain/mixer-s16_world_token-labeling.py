# Token labeling + MixToken on the synthetic world with a timm MLP-Mixer-S/16 at 112 px (7x7 tokens) through
# mmpretrain's TIMMBackbone: deit-tiny_world_token-labeling.py with the backbone swapped.
_base_ = ['./deit-tiny_world_token-labeling.py']

model = dict(
    backbone=dict(_delete_=True, type='TIMMBackbone', model_name='mixer_s16_224', img_size=112),
    head=dict(in_channels=512),
)
