# ImageNet-1k MLP-Mixer-S/16 trained by token labeling + MixToken (Token Labeling Table 5: 75.6 -> 76.1), with
# the timm model `mixer_s16_224` through mmpretrain's TIMMBackbone. Table 5 has no recipe of its own: this is the
# supplement's Table 1 token-labeling column, as deit-small_in1k_token-labeling.py.
# TIMMBackbone returns the Mixer's 14x14 tokens after its final norm (timm's pooling and classifier reset); MixToken
# swaps them after the PatchEmbed stem, as for ViTs; with no class token, TokenLabelingHead's class head reads the
# tokens' mean (the Mixer's own global average pooling).
_base_ = ['./deit-small_in1k_token-labeling.py']

custom_imports = dict(imports=['mm_plugin', 'mm_plugin.enable_safe_load'], allow_failed_imports=False)

model = dict(
    backbone=dict(_delete_=True, type='TIMMBackbone', model_name='mixer_s16_224', drop_path_rate=0.1),
    head=dict(in_channels=512),
)
