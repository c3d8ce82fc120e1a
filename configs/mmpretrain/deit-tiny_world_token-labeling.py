# Token labeling + MixToken on the synthetic world (CPU-sized DeiT-Tiny at 112 px).
# Data and the map-carrying train pipeline: _base_/world_deit-tiny_label-maps.py ($TOKENAUG_WORLD: the world
# root; $TOKENAUG_MAPS: the label-map store of its train split, keyed by paths relative to
# <world>/imagenet/train).
_base_ = ['./_base_/world_deit-tiny_label-maps.py']

model = dict(
    type='TokenLabelingClassifier',
    backbone=dict(out_type='raw'),
    head=dict(
        _delete_=True,
        type='TokenLabelingHead',
        num_classes=10,
        in_channels=192,
        dense_weight=0.5,
        cls_target='gt',
        label_smoothing=0.1,
        head_rule='cls+aux',
    ),
    mix_token=True,
    mix_beta=1.0,
    mix_mode='batch',
    train_cfg=None,  # no image batch augments: MixToken is in the model
)

# the base's pipeline with RandAugment (the labels follow its geometric policies: TokenLabelRandAugment) before packing
train_pipeline = [
    *_base_.train_pipeline[:-1],
    dict(
        type='TokenLabelRandAugment',
        policies='timm_increasing',
        geometric='follow',
        num_policies=2,
        magnitude_level=9,
        magnitude_std=0.5,
        hparams=dict(pad_val=[104, 116, 124], interpolation='bicubic'),
    ),
    _base_.train_pipeline[-1],  # PackTokenLabelInputs
]
train_dataloader = dict(dataset=dict(pipeline=train_pipeline))
