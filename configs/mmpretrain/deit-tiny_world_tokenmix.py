# TokenMix on the synthetic world (CPU-sized DeiT-Tiny at 112 px): block masks, lambda ~ Beta(1, 1) (the paper's
# choice for small models), switched with MixUp, targets from a teacher's activation maps (Eq. 2). The base's
# label-smoothed cross entropy, not the paper's ImageNet BCE (Table 11): BCE does not leave the class prior in a
# schedule this short (see configs/timm/world_vit-tiny_tokenmix.yaml); deit-small_in1k_tokenmix.py uses BCE.
# Data and the map-carrying train pipeline: _base_/world_deit-tiny_label-maps.py ($TOKENAUG_WORLD: the world
# root; $TOKENAUG_MAPS: the teacher's map store of <world>/imagenet/train).
_base_ = ['./_base_/world_deit-tiny_label-maps.py']

model = dict(
    train_cfg=dict(
        augments=[
            dict(type='TAMixup', alpha=0.8),
            dict(type='TATokenMix', alpha=1.0, mask='block', activation_targets='true_class'),
        ]
    )
)
