"""MMEngine 0.10.7 checkpoints under torch >= 2.6's ``torch.load(weights_only=True)`` default.

MMEngine calls ``torch.load`` without ``weights_only``; since torch 2.6 that means ``weights_only=True``,
and MMEngine's own checkpoints (``--resume``, ``load_from``) are refused because their message-hub
state holds ``HistoryBuffer`` objects with numpy arrays, and each buffer pickles its statistics
*methods* (``HistoryBuffer.min`` ... pickled through ``builtins.getattr``).

What we do, deliberately, instead of turning the safety off (``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``
or ``weights_only=False`` everywhere):

1. allow exactly the types MMEngine writes: ``HistoryBuffer`` and the numpy array/scalar/dtype
   reconstructors (``torch.serialization.add_safe_globals``); ``getattr`` is *not* allowed;
2. make ``HistoryBuffer`` stop pickling the four built-in statistics methods, which its
   ``__setstate__`` restores anyway (custom registered ones are still pickled, and such a checkpoint
   then needs the user's explicit ``weights_only=False``).

Nothing happens on import: :func:`allow_mmengine_checkpoints` is an explicit call. Our configs make it by
importing :mod:`mm_plugin.enable_safe_load` (``custom_imports=dict(imports=['mm_plugin',
'mm_plugin.enable_safe_load'])``), ``tokenaug-convert`` calls it; checkpoints written that way resume with
the upstream ``tools/train.py --resume`` under the default ``weights_only=True``. Our own code passes
``weights_only`` explicitly to every ``torch.load``.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ['allow_mmengine_checkpoints', 'MMENGINE_SAFE_GLOBALS']


def _numpy_globals():
    core = getattr(np, '_core', None) or np.core
    types = [core.multiarray._reconstruct, core.multiarray.scalar, np.ndarray, np.dtype]
    types += [getattr(np.dtypes, name) for name in dir(np.dtypes) if name.endswith('DType')]
    return types


def _history_buffer_getstate(self) -> dict:
    """``HistoryBuffer.__getstate__`` without the built-in statistics methods (restored on load)."""
    from mmengine.logging import HistoryBuffer

    builtin = {
        'min': HistoryBuffer.min,
        'max': HistoryBuffer.max,
        'current': HistoryBuffer.current,
        'mean': HistoryBuffer.mean,
    }
    state = dict(self.__dict__)
    state.pop('statistics_methods', None)
    custom = {k: v for k, v in self._statistics_methods.items() if builtin.get(k) is not v}
    if custom:
        state['statistics_methods'] = custom
    return state


MMENGINE_SAFE_GLOBALS: list = []


def allow_mmengine_checkpoints() -> None:
    """Idempotent. Allow MMEngine's checkpoint types under ``torch.load(weights_only=True)`` (see the module
    docstring); configs call it through ``custom_imports`` of :mod:`mm_plugin.enable_safe_load`."""
    from mmengine.logging import HistoryBuffer

    if MMENGINE_SAFE_GLOBALS:
        return
    MMENGINE_SAFE_GLOBALS.extend([HistoryBuffer] + _numpy_globals())
    torch.serialization.add_safe_globals(MMENGINE_SAFE_GLOBALS)
    HistoryBuffer.__getstate__ = _history_buffer_getstate
