"""The public mixing API in one import, for users (a facade: tokenaug's own modules import each part from its
module, whose layout may change):

- :mod:`shared_core.mix` — the :class:`Mix` description, input checks, applying a mix (images, tokens,
  targets, :func:`mix_rows`);
- :mod:`shared_core.boxes` — λ and box draws (timm's ``rand_bbox`` logic, explicit generators);
- :mod:`shared_core.token_masks` — MixToken's grid box, TokenMix's random and block masks;
- :mod:`shared_core.samplers` — :class:`MixSampler`, timm ``Mixup``'s parameter logic for every mixing kind.
"""

from .boxes import box_token_share, minmax_sides, rand_box, rand_box_minmax, sample_beta
from .mix import (
    IntPair,
    Mix,
    check_image_size,
    check_labels,
    check_pairwise_batch,
    grid_size,
    identity_mix,
    mix_images,
    mix_images_reversed,
    mix_rows,
    mix_target,
    mix_tokens,
    one_hot,
    pair_target,
    to_2tuple,
)
from .samplers import CUT_KINDS, MIX_KINDS, MODES, MixSampler
from .token_masks import TOKENMIX_MAX_ROUNDS, grid_box_mask, random_token_mask, tokenmix_masks

__all__ = [
    'MIX_KINDS',
    'CUT_KINDS',
    'MODES',
    'Mix',
    'MixSampler',
    'identity_mix',
    'sample_beta',
    'rand_box',
    'rand_box_minmax',
    'minmax_sides',
    'box_token_share',
    'grid_box_mask',
    'random_token_mask',
    'tokenmix_masks',
    'TOKENMIX_MAX_ROUNDS',
    'one_hot',
    'mix_rows',
    'mix_images',
    'mix_images_reversed',
    'mix_tokens',
    'mix_target',
    'pair_target',
    'check_labels',
    'check_pairwise_batch',
    'check_image_size',
    'grid_size',
    'to_2tuple',
    'IntPair',
]
