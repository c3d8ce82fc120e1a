"""The tracer driver (``shared_core.tracer.Tracer``) on a toy family, against explicit loops: the ``layers`` filter,
Eq. 11 with the kept samples, the stage hooks in their order, the observer, every readout, and the shared checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from timm.layers import DropPath

from shared_core.capture import Captures
from shared_core.tracer import (
    READOUTS,
    Tracer,
    check_block_parts,
    check_fused_sdpa,
    check_pool,
    check_transmix,
    check_types,
)

N, K = 6, 3


class Mixing(nn.Module):
    """A block whose token mixing is a fixed row-stochastic matrix ``W``: ``x + drop_path1(W x)``."""

    def __init__(self, g: torch.Generator, drop: float = 0.0):
        super().__init__()
        self.register_buffer('W', torch.rand(N, N, generator=g).softmax(-1))
        self.drop_path1 = DropPath(drop) if drop else nn.Identity()

    def forward(self, x):
        return x + self.drop_path1(self.W @ x)


class Toy(nn.Module):
    def __init__(self, depth=4, drop=0.0):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.blocks = nn.ModuleList(Mixing(g, drop) for _ in range(depth))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.mean(1)


class ToyTracer(Tracer):
    """Two stages of two blocks; a stage's ``enter`` scales nothing but records the order of the hooks."""

    def __init__(self, model, log=None):
        super().__init__(model)
        self.log = [] if log is None else log

    def stages(self):
        b = self.model.blocks
        return [('s0', b[:2]), ('s1', b[2:])]

    def watch_model(self, captures: Captures, handles: list) -> None:
        captures.grid = (2, 3)

    def branch(self, blk, cap, Y):
        self.log.append('branch')
        return blk.W @ Y

    def enter(self, stage, Y):
        self.log.append(f'enter {stage}')
        return Y

    def leave(self, stage, Y):
        self.log.append(f'leave {stage}')
        return Y

    def after(self, stage, j, Y):
        self.log.append(f'after {stage}.{j}')
        return Y


def _labels(B=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(B, N, K, generator=g).softmax(-1)


def _reference(model, Y, layers=None, keeps=None, residual=True):
    """Eq. 11 written out per sample and block, in float64."""
    Y = Y.double().clone()
    for i, blk in enumerate(model.blocks):
        if layers is not None and i not in layers:
            continue
        for b in range(Y.shape[0]):
            if keeps is not None and not keeps[i][b]:
                continue  # the branch was dropped for this sample: its labels stay
            branch = blk.W.double() @ Y[b]
            Y[b] = (Y[b] + branch) / 2 if residual else branch
    return Y


@pytest.mark.parametrize('layers', [None, {0, 3}, {1}])
@pytest.mark.parametrize('residual', [True, False])
def test_the_driver_is_eq11_at_the_chosen_blocks(layers, residual):
    model = Toy().eval()
    tracer = ToyTracer(model)
    x, Y = torch.randn(4, N, 5), _labels()
    out, captures = tracer.capture(lambda: model(x))
    assert torch.equal(out, model(x)) and len(captures) == 4 and captures.grid == (2, 3)
    got = tracer.propagate(captures, Y, layers, residual)
    assert (got.double() - _reference(model, Y, layers, residual=residual)).abs().max() < 1e-6
    # the stage hooks in their order, each block's rule only where it is aligned
    aligned = [i for i in range(4) if layers is None or i in layers]
    branch = iter(['branch' if i in aligned else None for i in range(4)])
    want = ['enter s0', next(branch), 'after s0.0', next(branch), 'after s0.1', 'leave s0']
    want += ['enter s1', next(branch), 'after s1.0', next(branch), 'after s1.1', 'leave s1']
    assert tracer.log == [w for w in want if w is not None]


def test_samples_whose_branch_stochastic_depth_dropped_keep_their_labels():
    model = Toy(drop=0.5).train()
    tracer = ToyTracer(model)
    torch.manual_seed(3)
    out, captures = tracer.capture(lambda: model(torch.randn(8, N, 5)))
    keeps = [c.keep for c in captures]
    assert all(k is not None for k in keeps) and not all(bool(k.all()) for k in keeps)
    Y = _labels(8)
    got = tracer.label_path(captures, out, Y)
    want = _reference(model, Y, keeps=keeps).mean(1)
    assert (got.double() - want).abs().max() < 1e-6
    # 'public': as if every branch had run
    public = tracer.label_path(captures, out, Y, drop_path='public')
    assert (public.double() - _reference(model, Y).mean(1)).abs().max() < 1e-6


def test_the_observer_sees_every_block_and_the_label_path_checks_the_token_count():
    model = Toy().eval()
    tracer = ToyTracer(model)
    out, captures = tracer.capture(lambda: model(torch.randn(2, N, 5)))
    seen = []
    Y = _labels(2)
    tracer.label_path(captures, out, Y, layers={2}, observe=lambda i, rows, grid: seen.append((i, rows, grid)))
    assert [i for i, _, _ in seen] == [0, 1, 2, 3] and all(grid == (2, 3) for _, _, grid in seen)
    assert torch.equal(seen[0][1], Y) and torch.equal(seen[1][1], Y) and not torch.equal(seen[2][1], Y)
    with pytest.raises(ValueError, match='labels: 5 token labels for 6 tokens'):
        tracer.label_path(captures, out, Y[:, :5])


@pytest.mark.parametrize('kind', READOUTS)
def test_every_readout_is_the_label_of_what_the_classifier_reads(kind):
    tracer = ToyTracer(Toy())
    tracer.num_prefix_tokens = 2
    Y = _labels()
    captures = Captures()
    captures.pool = torch.randn(4, N, 1)
    tracer.readout = kind
    want = {
        'cls': Y[:, 0],
        'mean': Y[:, 2:].sum(1) / (N - 2),
        'mean_all': Y.sum(1) / N,
        'cls_dist': (Y[:, 0] + Y[:, 1]) / 2,
        'pool': (captures.pool.softmax(1) * Y).sum(1),
    }[kind]
    torch.testing.assert_close(tracer.read(Y, torch.zeros(4, 5), captures), want, atol=1e-6, rtol=0)
    if kind == 'cls_dist':  # distilled training (two outputs): the class token's
        assert torch.equal(tracer.read(Y, (torch.zeros(4, 5), torch.zeros(4, 5)), captures), Y[:, 0])


def test_the_shared_checks_name_the_family_the_block_and_what_it_is():
    model = Toy()
    with pytest.raises(
        ValueError, match=r'TL-Align traces Toy blocks of type Linear with Identity; block 0 is a Mixing'
    ):
        check_types(model.blocks, (nn.Linear,), (nn.Identity,), 'Toy', attention=lambda b: nn.Identity())
    with pytest.raises(ValueError, match=r'block 2\.drop_path1 is a torch\.nn\.modules\.linear\.Identity; TL-Align'):
        check_block_parts(model.blocks, {'drop_path1': (DropPath,)}, first=2)
    unfused = nn.Module()
    unfused.fused_attn = False
    with pytest.raises(ValueError, match=r'blocks \[1\] compute their attention without scaled_dot_product'):
        check_fused_sdpa([model.blocks[0], model.blocks[1]], attention=lambda b: unfused if b is model.blocks[1] else b)
    with pytest.raises(
        ValueError, match="model: Toy with global_pool='max' has no TL-Align rule; use 'avg' or 'token'"
    ):
        check_pool('max', ('avg', 'token'), 'Toy')
    tracer = ToyTracer(model)
    check_transmix(tracer, model)  # attends (the base's default)
    tracer.attends, tracer.why_no_attention = False, 'its blocks mix by a fixed matrix'
    with pytest.raises(ValueError, match="TransMix reads the last block's self-attention, and Toy has none there: its"):
        check_transmix(tracer, model)
