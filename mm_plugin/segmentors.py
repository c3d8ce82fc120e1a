"""mmseg's ``EncoderDecoder`` that takes mmseg's own ``model.pretrained=PATH`` route too.

mmseg's ViT and Swin configs load a backbone with ``model.pretrained`` (e.g. ``--cfg-options
model.pretrained=pretrain/deit.pth``); our configs name the backbone's file in ``backbone.init_cfg`` (where
:class:`~mm_plugin.backbone_check.BackboneCheckpointCheck` reads it, and mmdet's backbones take it). With both set,
mmseg's backbones stop at ``assert not (init_cfg and pretrained)``. :class:`PretrainedEncoderDecoder`, the
``model.type`` of our mmseg configs, puts a given ``pretrained`` into the backbone's ``init_cfg`` as its checkpoint
(the file the command line names wins over the config's), so both routes load the same way and are checked the
same way.
"""

from __future__ import annotations

from mmseg.models.segmentors import EncoderDecoder
from mmseg.registry import MODELS

__all__ = ['PretrainedEncoderDecoder']


@MODELS.register_module()
class PretrainedEncoderDecoder(EncoderDecoder):
    """``EncoderDecoder``; ``pretrained=PATH`` becomes ``backbone.init_cfg = dict(type='Pretrained',
    checkpoint=PATH)`` (the module docstring). Args: as ``EncoderDecoder``."""

    def __init__(self, backbone: dict, *args, pretrained=None, **kwargs):
        if pretrained is not None:
            if not isinstance(pretrained, str):
                raise ValueError(f'model.pretrained: expected a checkpoint path, got {pretrained!r}')
            if backbone.get('pretrained') is not None:
                raise ValueError('model.pretrained: the backbone sets pretrained too; set one of them')
            init = backbone.get('init_cfg')
            init = dict(init) if isinstance(init, dict) else dict(type='Pretrained')
            backbone = dict(backbone, init_cfg=dict(init, type='Pretrained', checkpoint=pretrained))
        super().__init__(backbone, *args, pretrained=None, **kwargs)
