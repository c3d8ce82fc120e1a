"""Argument checks shared by the core and both plugins: a number must be a real, finite number in its range (an
infinite Beta parameter gives NaN images; a NaN one compares False everywhere and silently disables mixing),
and an integer must be an integer; the message names the argument as the caller spells it.

The checks raise ``ValueError``. :class:`ArgumentError` (through :func:`argument_errors`) is the one that
classes standing in for OpenMMLab ones raise: also an ``AssertionError``, the kind OpenMMLab's argument
checks (``assert``) raise."""

from __future__ import annotations

import math
import numbers
from contextlib import contextmanager
from typing import Iterator, Optional, Set

__all__ = ['check_real', 'check_int', 'check_layers', 'ArgumentError', 'argument_errors']


class ArgumentError(ValueError, AssertionError):
    """A bad argument of a class that stands in for an OpenMMLab one (mm_plugin's batch augments): a
    ``ValueError`` as all our checks, and the ``AssertionError`` that the OpenMMLab class raises for it
    (mmpretrain's ``Mixup``/``CutMix`` ``assert`` their ``alpha``), so code written against theirs
    (``except AssertionError``, mmpretrain's own tests) gets the same kind of error from ours."""


@contextmanager
def argument_errors() -> Iterator[None]:
    """Raise the block's ``ValueError`` (its argument checks) as :class:`ArgumentError`: same message,
    same traceback."""
    try:
        yield
    except ArgumentError:
        raise
    except ValueError as e:
        raise ArgumentError(*e.args).with_traceback(e.__traceback__) from None


def check_real(
    value,
    name: str,
    lo: Optional[float] = None,
    hi: Optional[float] = None,
    lo_open: bool = False,
    hi_open: bool = False,
) -> float:
    """``float(value)`` if it is a finite real number in the range (``lo``/``hi`` inclusive unless ``*_open``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f'{name}: expected a number, got {value!r} ({type(value).__name__})')
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f'{name}: expected a finite number, got {value!r}')
    below = lo is not None and (v <= lo if lo_open else v < lo)
    above = hi is not None and (v >= hi if hi_open else v > hi)
    if below or above:
        left = '' if lo is None else f'{"(" if lo_open else "["}{lo:g}'
        right = '' if hi is None else f'{hi:g}{")" if hi_open else "]"}'
        if lo is not None and hi is not None:
            want = f'in {left}, {right}'
        elif lo is not None:
            want = f'{">" if lo_open else ">="} {lo:g}'
        else:
            want = f'{"<" if hi_open else "<="} {hi:g}'
        raise ValueError(f'{name}: expected a number {want}, got {value!r}')
    return v


def check_int(value, name: str, lo: Optional[int] = None) -> int:
    """``int(value)`` if it is an integer (not a bool, not a float) ``>= lo``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f'{name}: expected an integer, got {value!r} ({type(value).__name__})')
    if lo is not None and value < lo:
        raise ValueError(f'{name}: expected an integer >= {lo}, got {value!r}')
    return int(value)


def check_layers(layers, depth: int, name: str = 'layers') -> Optional[Set[int]]:
    """``None`` (every block) or the set of block indices, each an integer in ``[0, depth)``; one integer is one
    block. A string (``'12'`` is not blocks 1 and 2), a fraction or a bool is refused, naming ``name``."""
    if layers is None:
        return None
    if isinstance(layers, numbers.Integral) and not isinstance(layers, bool):
        layers = [layers]
    if isinstance(layers, (str, bytes)) or not hasattr(layers, '__iter__'):
        raise ValueError(f'{name}: expected a block index or a list of block indices, got {layers!r}')
    out = set()
    for i in layers:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise ValueError(f'{name}: block indices must be integers, got {i!r} ({type(i).__name__})')
        out.add(int(i))
    if not out <= set(range(depth)):
        raise ValueError(f'{name}: block indices must be in [0, {depth}), got {sorted(out)}')
    return out
