# ImageNet-1k ResNeSt-50 trained by token labeling + MixToken (Token Labeling Table 5: 80.9 -> 81.5), with the
# timm model `resnest50d` through mmpretrain's TIMMBackbone. Table 5 has no recipe of its own: this is the
# supplement's Table 1 token-labeling column, as deit-small_in1k_token-labeling.py (AdamW lr 1e-3 * batch / 640,
# wd 0.05, 300 epochs, 5 warmup, drop path 0.1, RandAugment 9/0.5, random erasing 0.25, beta = 0.5).
# A CNN has no patch tokens: TIMMBackbone returns its final 7x7 map (timm's pooling and classifier reset),
# TokenLabelingHead reads one token per position (the aux head is a 1x1 conv on the map, the class head reads
# the map's mean), and MixToken pastes its box in the images on whole 32-px cells of that map.
_base_ = ['./deit-small_in1k_token-labeling.py']

custom_imports = dict(imports=['mm_plugin', 'mm_plugin.enable_safe_load'], allow_failed_imports=False)

model = dict(
    backbone=dict(_delete_=True, type='TIMMBackbone', model_name='resnest50d', drop_path_rate=0.1),
    head=dict(in_channels=2048),
)
