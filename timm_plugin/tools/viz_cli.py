"""``tokenaug-viz``: pictures of what the methods do, as PNGs with an HTML index (``index.html``) and the
numbers behind them (``meta.json``). The commands and their flags: ``tokenaug-viz --help``
(:data:`tokenaug.tool_args.VIZ_USAGE`, parsed by :func:`tokenaug.tool_args.parse_viz`); each command is a
module of :mod:`timm_plugin.tools.viz`.

- ``mix``: training samples as ``tokenaug-train`` builds them (its parser, model, data config, training
  transform and mixer, from the same flags), each with its partner, the mixed image and the partner share of
  every token (two-colour scale of :mod:`shared_core.viz`, over the image and alone); with
  ``--activation-map-dir`` (TokenMix's activation-map targets for each pair) also the teacher's map of each
  image's own class and of its partner's (grey, 0 to 1, after the crop and flip) and the area λ beside Eq. 2's λ';
- ``tl-align``: TL-Align's Fig. 6 for a timm ViT / DeiT or Swin and a checkpoint: the two inputs, the mixed
  image, the initial label embedding (each token's partner share) and the aligned one after the last block
  (``--per-block``: after each; Swin's on each stage's grid), with the area λ and the aligned λ of what the
  classifier reads; the cut branch of the MixUp/CutMix switch by default, where the two λ differ (``--branch``);
- ``token-labels``: each image's stored label map (top-1 class, its confidence as saturation) and, for several
  draws of the training augmentation (crop, flip, RandAugment with ``--geometric-aa``), the augmented image
  beside its per-token targets in class colours: whether the labels follow the image, checked by eye;
- ``tokenmix``: the masks of each sampler at a λ side by side: TokenMix blocks and random tokens (λ fixed),
  a token-grid box and timm's CutMix pixel box (the draws of Beta(--cutmix) nearest λ among 512); the
  activation-map targets of pairs are ``mix --mixup-type tokenmix_block --activation-map-dir MAPS``;
- ``tokenmixup``: one batch at the first HTM block: each sample's token saliency (grey, min to max), the partner
  HTM matched it with, the tokens swapped and the same swap in image space (a sample not easy enough under τ
  swaps nothing: raise ``--tokenmixup-tau`` to see the matching of an untrained ScoreNet).

Every ``*_share.png`` / mask PNG is exact (one colour per token, pixel for pixel): ``shared_core.viz.
share_from_colour`` reads a share back from it. The pictures' library functions are :mod:`shared_core.viz`
(arrays) and :mod:`shared_core.plotting` (files), for use in a notebook.
"""

from __future__ import annotations

import sys

from tokenaug.tool_args import VIZ_COMMANDS, VIZ_USAGE

from .viz.mix import mix
from .viz.tl_align import tl_align
from .viz.token_labels import token_labels
from .viz.tokenmix import tokenmix
from .viz.tokenmixup import tokenmixup

__all__ = ['main', 'mix', 'tl_align', 'token_labels', 'tokenmix', 'tokenmixup']


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = VIZ_USAGE
    if argv[:1] in (['-h'], ['--help']):
        print(usage)
        return 0
    if not argv or argv[0] not in VIZ_COMMANDS:
        print(usage, file=sys.stderr)
        print(f'tokenaug-viz: error: the first argument is one of {VIZ_COMMANDS}', file=sys.stderr)
        return 2
    try:
        commands = {
            'mix': mix,
            'tl-align': tl_align,
            'token-labels': token_labels,
            'tokenmix': tokenmix,
            'tokenmixup': tokenmixup,
        }
        index = commands[argv[0]](argv[1:])
    except (ValueError, FileNotFoundError) as e:
        print(f'tokenaug-viz {argv[0]}: error: {e}', file=sys.stderr)
        return 2
    print(index)
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
