"""A pretrained backbone that must load entirely, for mmseg / mmdet runs (``custom_hooks`` in our configs).

mmseg's and mmdet's backbones load ``init_cfg=dict(type='Pretrained', checkpoint=...)`` with ``strict=False`` and
only print the keys that did not match: pointed at an unconverted ``tokenaug-train`` checkpoint, a conversion
for another depth, or an mmdet (``backbone.``-prefixed) file for mmseg, they train from random weights with
exit status 0. :class:`BackboneCheckpointCheck` makes that an error:

- before the run (training only, and not when ``load_from`` / ``resume`` supply the weights): the file must
  exist, else the error names the path and how to set it (``$TOKENAUG_BACKBONE`` in our configs, or
  ``--cfg-options model.backbone.init_cfg.checkpoint=PATH``), and its keys must be the backbone's as the
  backbone's loader reads them (mmdet's keep only ``backbone.`` keys, mmseg's Swin strips that prefix, mmseg's
  ViT and our LV-ViT read bare keys);
- after the weights are initialised: every tensor of the backbone must equal the file's tensor of that name
  (bare, or ``backbone.``-prefixed for mmdet files), except what the source cannot have (derived
  ``relative_position_index`` buffers, Swin's output norms, a resized ``pos_embed``, and what the file's
  ``tokenaug-convert`` metadata lists as not in the source), and every tensor of the file must belong to the
  backbone. The error lists what is missing, unexpected, or present but not loaded.
"""

from __future__ import annotations

import os
import re
from typing import Optional

import torch
from mmengine.hooks import Hook
from mmengine.model import is_model_wrapper
from mmengine.registry import HOOKS
from mmengine.runner.loops import BaseLoop

from shared_core.checkpoint_io import load_checkpoint_file

from .mmengine_safe_load import allow_mmengine_checkpoints

__all__ = ['BackboneCheckpointCheck', 'check_backbone_loaded']

HOW = (
    'set $TOKENAUG_BACKBONE (our configs read it) or --cfg-options model.backbone.init_cfg.checkpoint=PATH '
    '(mmseg: model.pretrained=PATH too); make the file with tokenaug-convert --to {mmseg,mmdet}'
)


def _checkpoint_path(backbone) -> Optional[str]:
    init = getattr(backbone, 'init_cfg', None)
    if isinstance(init, dict) and init.get('checkpoint'):
        return str(init['checkpoint'])
    return None


def _source_cannot_have(key: str, not_in_source) -> bool:
    return (
        key.endswith('relative_position_index')
        or bool(re.match(r'^norm\d+\.(weight|bias)$', key))
        or (key in not_in_source)
    )


def _key_rule(backbone) -> str:
    """How the backbone's own loader names the file's keys: mmdet's backbones keep only ``backbone.`` keys
    (``'prefixed'``), mmseg's Swin strips the prefix where present (``'either'``), the others (mmseg's ViT, our
    LV-ViT) read bare keys (``'bare'``)."""
    module = type(backbone).__module__
    if module.startswith('mmdet.'):
        return 'prefixed'
    if module.startswith('mmseg.') and type(backbone).__name__ == 'SwinTransformer':
        return 'either'
    return 'bare'


def check_backbone_loaded(backbone: torch.nn.Module, path: str, values: bool = True) -> None:
    """Raise ``ValueError`` unless the checkpoint file ``path`` fits ``backbone`` exactly (see the module
    docstring): the keys as the backbone's loader reads them, and with ``values`` every tensor loaded."""
    allow_mmengine_checkpoints()
    ckpt = load_checkpoint_file(path, 'model.backbone.init_cfg.checkpoint', mmap=True, mmengine=True)
    sd = ckpt.get('state_dict', ckpt) if isinstance(ckpt, dict) else {}
    meta = ckpt.get('meta', {}) if isinstance(ckpt, dict) else {}
    not_in_source = set((meta.get('tokenaug_convert') or {}).get('not_in_source', ()))
    target = backbone.state_dict()
    rule = _key_rule(backbone)
    prefixed = bool(sd) and all(k.startswith('backbone.') for k in sd)
    strip = prefixed and rule != 'bare'
    named = {k[len('backbone.') :] if strip else k: v for k, v in sd.items() if torch.is_tensor(v)}
    if rule == 'prefixed' and not prefixed:
        named = {}  # the loader reads nothing: every key is missing
    missing = sorted(k for k in target if k not in named and not _source_cannot_have(k, not_in_source))
    unexpected = sorted(k for k in named if k not in target)
    stale = []
    if values:
        stale = sorted(
            k
            for k, v in named.items()
            if k in target
            and not (k.endswith('pos_embed') and v.shape != target[k].shape)  # resized by the backbone
            and (v.shape != target[k].shape or not torch.equal(v.to(target[k].dtype), target[k].cpu()))
        )
    if missing or unexpected or stale:
        if rule == 'prefixed' and not prefixed:
            hint = " The file's keys are bare (an mmseg conversion); mmdet reads 'backbone.' keys (--to mmdet)."
        elif rule == 'bare' and prefixed:
            hint = " The file's keys carry the 'backbone.' prefix of an mmdet conversion (tokenaug-convert --to mmseg)."
        elif unexpected and 2 * len(unexpected) >= len(named):
            hint = (
                f' {len(unexpected)} of its {len(named)} keys are not keys of this backbone: a classification '
                'checkpoint? convert the checkpoint first (tokenaug-convert).'
            )
        else:
            hint = ''
        raise ValueError(
            f'model.backbone.init_cfg.checkpoint: {path} does not fit {type(backbone).__name__} '
            f'({len(target)} tensors): missing {len(missing)} {missing[:8]}, unexpected {len(unexpected)} '
            f'{unexpected[:8]}, present but not loaded {len(stale)} {stale[:8]}.{hint} Training from these weights '
            'would start from a random backbone.'
        )


@HOOKS.register_module()
class BackboneCheckpointCheck(Hook):
    """``custom_hooks = [dict(type='BackboneCheckpointCheck')]``: the backbone's pretrained checkpoint
    (``model.backbone.init_cfg.checkpoint``) must exist and load entirely, checked before the run (the keys) and
    after the weights are initialised (every tensor); see the module docstring.

    Args:
        (none): it reads the checkpoint path from the backbone's ``init_cfg``; it does nothing in test runs or
            when ``load_from`` / ``resume`` supply the weights. Priority ``'VERY_HIGH'``.
    """

    priority = 'VERY_HIGH'

    @staticmethod
    def _backbone(runner):
        model = runner.model.module if is_model_wrapper(runner.model) else runner.model
        return getattr(model, 'backbone', None)

    @staticmethod
    def _weights_from_elsewhere(runner) -> bool:
        return bool(runner.cfg.get('load_from')) or bool(runner.cfg.get('resume'))

    def before_run(self, runner) -> None:
        training = isinstance(getattr(runner, '_train_loop', None), BaseLoop)
        backbone = self._backbone(runner)
        path = _checkpoint_path(backbone) if backbone is not None else None
        if not training or path is None or self._weights_from_elsewhere(runner):
            return
        if not os.path.isfile(path):
            raise FileNotFoundError(f'model.backbone.init_cfg.checkpoint: {path} does not exist; {HOW}')
        check_backbone_loaded(backbone, path, values=False)  # the keys, before the backbone's own loader runs

    def before_train(self, runner) -> None:
        backbone = self._backbone(runner)
        path = _checkpoint_path(backbone) if backbone is not None else None
        if path is None or self._weights_from_elsewhere(runner):
            return
        check_backbone_loaded(backbone, path)
