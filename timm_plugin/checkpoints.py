"""The one reader of a model's weights from a checkpoint file, for every timm entry point (``tokenaug-train
--initial-checkpoint``, ``tokenaug-maps generate --checkpoint``, ``tokenaug-occlusion``, ``tokenaug-viz``): the
project's checked loader (:func:`shared_core.checkpoint_io.load_checkpoint_file`: weights only, and a one-line
reason for a missing, empty, truncated, foreign or pickle-bearing file), then the weights as timm's
``load_state_dict`` picks them."""

from __future__ import annotations

import os

from timm.models import clean_state_dict, load_state_dict

from shared_core.checkpoint_io import CheckpointError, check_input_file, load_checkpoint_file

__all__ = ['read_state_dict']


def read_state_dict(path, name: str = 'checkpoint', use_ema: bool = False) -> dict:
    """The weights in ``path`` as timm's ``load_state_dict`` picks them: ``state_dict_ema`` / ``model_ema`` with
    ``use_ema`` where present, else ``state_dict`` (timm's saver), ``model`` (DeiT's and TokenMix's ``main.py``), or
    the file itself (a bare state dict); ``module.`` prefixes removed. A ``.safetensors`` file goes to timm's own
    reader. Errors name ``name`` and say what is wrong with the file."""
    path = check_input_file(path, name)
    if os.fspath(path).endswith('.safetensors'):
        return load_state_dict(path, use_ema=use_ema)
    ckpt = load_checkpoint_file(path, name, mmap=True)
    if not isinstance(ckpt, dict):
        raise CheckpointError(f'{name}: {path} holds a {type(ckpt).__name__}, not a state dict of model weights')
    keys = (('state_dict_ema', 'model_ema') if use_ema else ()) + ('state_dict', 'model')
    key = next((k for k in keys if isinstance(ckpt.get(k), dict)), None)
    state = ckpt[key] if key else ckpt
    bad = [k for k, v in state.items() if not hasattr(v, 'shape')]
    if bad:
        raise CheckpointError(
            f'{name}: {path} has entries that are not tensors where the weights should be ({bad[:5]}); expected a '
            'state dict, or a checkpoint holding one as state_dict / model'
        )
    return clean_state_dict(state)
