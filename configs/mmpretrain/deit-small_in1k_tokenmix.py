# ImageNet-1k DeiT-Small with TokenMix as in the paper (the TokenMix paper, Sec. 4.2, Tables 7-11): block masks at
# lambda = 0.5 switched with MixUp (0.8) with probability 0.5, targets from a teacher's activation maps (Eq. 2,
# the true-class channel), BCE loss (Table 11), AdamW lr 1e-3 at batch 1024, cosine to 1e-6, 5 warmup epochs.
# The maps follow every crop and flip: the train pipeline records them (token-label transforms), and
# RandAugment keeps all its policies (the maps follow its geometric ones); data and pipeline:
# _base_/deit-small_in1k_label-maps.py, with the teacher's map store of the train split
# (`tokenaug-maps generate --data-dir data/imagenet --split train --model <teacher> ...`) from $TOKENAUG_MAPS.
_base_ = ['./_base_/deit-small_in1k_label-maps.py']

data_preprocessor = dict(type='TokenAugDataPreprocessor', patch_size=16)
model = dict(
    head=dict(loss=dict(_delete_=True, type='CrossEntropyLoss', use_sigmoid=True, loss_weight=1.0)),  # BCE
    train_cfg=dict(
        _delete_=True,
        augments=[
            dict(type='TAMixup', alpha=0.8),
            dict(type='TATokenMix', mask='block', lam=0.5, activation_targets='true_class'),
        ],
    ),
)

optim_wrapper = dict(optimizer=dict(lr=1e-3, weight_decay=0.05))
auto_scale_lr = dict(base_batch_size=1024)
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-3, by_epoch=True, begin=0, end=5, convert_to_iter_based=True),
    dict(type='CosineAnnealingLR', eta_min=1e-6, by_epoch=True, begin=5, end=300, convert_to_iter_based=True),
]
