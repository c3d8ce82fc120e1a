# ImageNet-1k LV-ViT-S (the Token Labeling paper, Table 1: 26M, 83.3) trained by token labeling + MixToken, with the
# timm model `lvvit_s` (timm_plugin.lvvit) through mmpretrain's TIMMBackbone: the DeiT-Small recipe of
# deit-small_in1k_token-labeling.py (the paper trains both alike: AdamW lr 1e-3 * batch / 640, wd 0.05,
# 300 epochs, 5 warmup, drop path 0.1, colour-only RandAugment, random erasing 0.25, MixToken, beta = 0.5).
# TIMMBackbone resets timm's heads (head and aux_head) and pooling: the backbone returns every token
# after LV-ViT's final norm; TokenLabelingHead is the class head and the aux head.
_base_ = ['./deit-small_in1k_token-labeling.py']

custom_imports = dict(imports=['timm_plugin', 'mm_plugin', 'mm_plugin.enable_safe_load'], allow_failed_imports=False)

model = dict(
    backbone=dict(_delete_=True, type='TIMMBackbone', model_name='lvvit_s', img_size=224, drop_path_rate=0.1),
    head=dict(in_channels=384),
)
