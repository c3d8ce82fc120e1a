"""The names of every choice the methods and tools take (mixing kinds, rules, switches), in a module that imports
nothing: the modules that implement each choice read their names from here, and so do the command-line parsers
(:mod:`tokenaug`), which must answer ``--help`` without importing torch."""

from __future__ import annotations

# ---------------------------------------------------------------------------------------------- mixing
#: kinds whose "cut" branch replaces a region (pixel box, token box, token masks)
CUT_KINDS = ('cutmix', 'token_box', 'tokenmix_block', 'tokenmix_random')
#: every mixing kind a :class:`~shared_core.samplers.MixSampler` can draw
MIX_KINDS = ('mixup',) + CUT_KINDS
#: methods that re-weight the target of a mixing kind (``create_mixer(mix_kind, method=...)``); their mixers
#: carry the mix
TARGET_METHODS = ('tl_align', 'transmix')
#: the mixing kinds that act in the model and the loss (token labeling's MixToken); their data carries label maps
TOKEN_LABELING_TYPES = ('mixtoken',)
#: how a box's far side is rounded: ``'timm'`` (today's timm, ``cut - cut // 2`` after the centre) or
#: ``'public'`` (the timm the authors' code pinned, ``cut // 2`` on both sides: a box one cell smaller
#: for odd cuts)
BOX_ROUNDINGS = ('timm', 'public')
#: TokenMix mask rules: ``'paper'`` (exactly ``round((1 - λ) N)`` tokens, parts of at least ``min_tokens``:
#: :func:`~shared_core.token_masks.tokenmix_masks`) or ``'public'`` (the authors' code: ``int((1 - λ) N) +
#: min_tokens`` tokens targeted, parts from 1 token: :func:`~shared_core.token_masks.tokenmix_masks_public`)
TOKENMIX_RULES = ('paper', 'public')
#: how a teacher's maps become the target of a mixed image
ACTIVATION_TARGETS = ('true_class', 'distribution')

# ------------------------------------------------------------------------------------ TL-Align, TransMix
#: what the label path does where stochastic depth dropped a sample's attention branch: ``'kept'`` (ours: the
#: branch did not run, the labels stay) or ``'public'`` (the public code: the labels update regardless)
DROP_PATH_LABELS = ('kept', 'public')
#: TransMix's rules: ``'paper'`` (the attention share alone) and ``'average'`` (its mean with the area share)
TRANSMIX_MODES = ('paper', 'average')

# -------------------------------------------------------------------------------------- token labeling
#: inference rules of a model with an aux head: ``cls + AUX_WEIGHT · max_tokens(aux)`` (the public code) or ``cls``
HEAD_RULES = ('cls+aux', 'cls')
#: what the data path does with RandAugment's geometric ops: the targets follow them (the public code), or they
#: are dropped (ours)
GEOMETRIC_AA = ('follow', 'drop')
#: where RandAugment runs: on the crop after the flip (timm's transform), or on the whole flipped image before the
#: crop (the public Token Labeling code)
AA_ORDERS = ('timm', 'public')
#: how the annotator's class target pools the crop: the mean of the cells' distributions (ReLabel, ours) or the
#: softmax of the mean of their logits (the public Token Labeling code's ``get_label``)
CLS_TARGET_POOLS = ('distributions', 'logits')
#: where a map is registered on its image: on the whole image, whatever the store records (the public code), or
#: on the region the store records that the annotator saw (the released maps: the image's centre square)
MAP_REGIONS = ('full_image', 'recorded')
#: stores ``tokenaug-maps import --from`` reads
IMPORT_SOURCES = ('tokenlabeling',)

# ------------------------------------------------------------------------------------------ TokenMixup
#: how VTM picks the memory tokens of an HTM block: by the block's attention on its mixed input (ours), or by
#: HTM's pre-mix saliency, gathered from the mixed input (the public code)
VTM_MEMORY = ('mixed', 'public')

# ----------------------------------------------------------------------------------- occlusion, grids
#: the grid of models without a patch embedding where one is drawn on anyway (TokenMix's masks in image space,
#: occlusion's patches): DeiT's 16 px
DEFAULT_STRIDE = (16, 16)
#: ``tokenaug-occlusion``'s drop ratios, modes (blank the pixels / remove the tokens) and fills
OCCLUSION_RATIOS = tuple(i / 10 for i in range(10))
OCCLUSION_MODES = ('zero', 'drop')
OCCLUSION_FILLS = ('zero', 'black')

# ------------------------------------------------------------------------------------------- convert
#: ``tokenaug-convert``'s targets and source layouts
CONVERT_TARGETS = ('mmseg', 'mmdet', 'timm')
CONVERT_SOURCES = ('timm', 'mmpretrain', 'tokenmixup')
