"""The argument checks every entry point shares (``shared_core.checks``): what they accept, and for what they refuse,
a message naming the argument and what was expected."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from shared_core.checks import ArgumentError, argument_errors, check_int, check_layers, check_real


@given(v=st.floats(allow_nan=False, allow_infinity=False), lo=st.floats(-1e6, 1e6), width=st.floats(0, 1e6))
def test_check_real_takes_every_finite_number_in_its_closed_range(v, lo, width):
    hi = lo + width
    if lo <= v <= hi:
        assert check_real(v, 'x', lo=lo, hi=hi) == v
    else:
        with pytest.raises(ValueError, match=r'^x: expected a number in \['):
            check_real(v, 'x', lo=lo, hi=hi)


def test_check_real_bounds_messages_and_kinds():
    assert check_real(np.float32(0.5), 'alpha') == 0.5 and check_real(3, 'alpha') == 3.0
    assert check_real(torch.tensor(2.0).item(), 'alpha') == 2.0
    for bad, why in ((True, 'expected a number, got True .bool.'), ('1', "expected a number, got '1' .str."),
                     (math.nan, 'expected a finite number'), (math.inf, 'expected a finite number')):  # fmt: skip
        with pytest.raises(ValueError, match=f'^alpha: {why}'):
            check_real(bad, 'alpha')
    with pytest.raises(ValueError, match=r'^p: expected a number in \[0, 1\], got 1.5$'):
        check_real(1.5, 'p', lo=0.0, hi=1.0)
    with pytest.raises(ValueError, match=r'^p: expected a number in \(0, 1\), got 0.0$'):
        check_real(0.0, 'p', lo=0.0, hi=1.0, lo_open=True, hi_open=True)
    with pytest.raises(ValueError, match=r'^t: expected a number > 0, got 0$'):
        check_real(0, 't', lo=0.0, lo_open=True)
    with pytest.raises(ValueError, match=r'^t: expected a number <= 2, got 3$'):
        check_real(3, 't', hi=2.0)
    assert check_real(1.0, 'p', lo=0.0, hi=1.0) == 1.0  # closed ends are in


def test_check_int_refuses_bools_floats_and_values_below_its_floor():
    assert check_int(np.int64(4), 'n', lo=1) == 4 and type(check_int(np.int64(4), 'n')) is int
    for bad in (True, 2.0, '2', None):
        with pytest.raises(ValueError, match=r'^n: expected an integer, got '):
            check_int(bad, 'n')
    with pytest.raises(ValueError, match=r'^n: expected an integer >= 1, got 0$'):
        check_int(0, 'n', lo=1)


@given(depth=st.integers(1, 40), data=st.data())
def test_check_layers_is_the_set_of_indices_in_range(depth, data):
    layers = data.draw(st.lists(st.integers(-3, depth + 3), max_size=8))
    if all(0 <= i < depth for i in layers):
        assert check_layers(layers, depth) == set(layers)
    else:
        with pytest.raises(ValueError, match=rf'^layers: block indices must be in \[0, {depth}\)'):
            check_layers(layers, depth)


def test_check_layers_takes_one_index_and_refuses_strings_fractions_and_bools():
    assert check_layers(None, 12) is None and check_layers(3, 12) == {3} and check_layers(np.int64(0), 1) == {0}
    assert check_layers(range(2), 4) == {0, 1} and check_layers([], 4) == set()
    with pytest.raises(
        ValueError, match=r"^tl_align.layers: expected a block index or a list of block indices, got '12'"
    ):
        check_layers('12', 24, 'tl_align.layers')
    for bad in ([1.0], [True], [0, 'x']):
        with pytest.raises(ValueError, match='^layers: block indices must be integers'):
            check_layers(bad, 4)
    with pytest.raises(ValueError, match=r'^layers: expected a block index or a list'):
        check_layers(True, 4)


def test_argument_errors_are_value_errors_and_openmmlab_assertion_errors():
    with pytest.raises(ArgumentError, match='^alpha: expected a finite number') as e:
        with argument_errors():
            check_real(math.nan, 'alpha')
    assert isinstance(e.value, ValueError) and isinstance(e.value, AssertionError)
    with pytest.raises(KeyError):  # other errors pass as they are
        with argument_errors():
            raise KeyError('k')
