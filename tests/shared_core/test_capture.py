"""shared_core.capture: the attention a block computed, recorded where the token path computes it
(``scaled_dot_product_attention``'s arguments, or the one softmax of a module that materialises its attention), only
while a watched module runs, and left whatever happens."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shared_core.capture import LabelCapture, SdpaCapture, SoftmaxCapture


class _Sdpa(nn.Module):
    def __init__(self, heads=2, kv_heads=2, calls=1, causal=False, mask=None, scale=None):
        super().__init__()
        self.heads, self.kv_heads, self.calls, self.causal, self.mask, self.scale = (
            heads,
            kv_heads,
            calls,
            causal,
            mask,
            scale,
        )

    def forward(self, x):
        B, T, _ = x.shape
        q = x.view(B, T, self.heads, -1).transpose(1, 2)
        k = v = q[:, : self.kv_heads]
        for _ in range(self.calls):
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=self.mask,
                is_causal=self.causal,
                scale=self.scale,
                enable_gqa=self.heads != self.kv_heads,
            )
        return out.transpose(1, 2).reshape(B, T, -1)


class _Softmax(nn.Module):
    def __init__(self, softmaxes=1):
        super().__init__()
        self.softmaxes = softmaxes

    def forward(self, x):
        a = x @ x.transpose(-1, -2)
        for _ in range(self.softmaxes):
            a = a.softmax(-1)
        return a @ x


def _watch(mode, module):
    cap, handles = LabelCapture(), []
    mode.start(handles)
    mode.watch(module, cap, handles)
    return cap, handles


def test_sdpa_capture_records_the_watched_modules_call_and_nothing_else():
    watched, other = _Sdpa(mask=torch.ones(5, 5, dtype=torch.bool), scale=0.3), _Sdpa()
    mode = SdpaCapture()
    cap, handles = _watch(mode, watched)
    x = torch.randn(2, 5, 8, requires_grad=True)
    other(x)  # not watched: passes untouched, records nothing
    assert cap.q is None
    out = watched(x)
    assert torch.equal(out, _Sdpa(mask=torch.ones(5, 5, dtype=torch.bool), scale=0.3)(x))  # the call as it was
    q = x.view(2, 5, 2, 4).transpose(1, 2)
    assert torch.equal(cap.q, q) and torch.equal(cap.k, q) and not cap.q.requires_grad
    assert cap.scale == 0.3 and torch.equal(cap.mask, torch.ones(5, 5, dtype=torch.bool))
    for h in handles:
        h.remove()
    watched(x)  # the hooks and the mode are gone: a second call is no "called twice"
    assert not torch.overrides._get_current_function_mode_stack()


def test_sdpa_capture_default_scale_grouped_queries_and_refusals():
    x = torch.randn(1, 3, 8)
    module = _Sdpa(heads=4, kv_heads=2)
    cap, handles = _watch(SdpaCapture(), module)
    module(x)
    assert cap.scale == pytest.approx(2**-0.5)  # head dim 2: the kernel's default scale
    assert cap.k.shape[1] == 4  # each key head repeated for its group of query heads
    for twice, causal, match in ((2, False, 'twice'), (1, True, 'causal attention has no TL-Align rule')):
        module = _Sdpa(calls=twice, causal=causal)
        _, handles = _watch(SdpaCapture(), module)
        with pytest.raises(ValueError, match=match):
            module(torch.randn(1, 3, 8))
        for h in handles:
            h.remove()  # a forward that raised inside the module: the mode is left all the same
        assert not torch.overrides._get_current_function_mode_stack()


def test_softmax_capture_keeps_the_attention_probabilities():
    module = _Softmax()
    cap, handles = _watch(SoftmaxCapture(), module)
    x = torch.randn(2, 4, 3)
    module(x)
    assert torch.allclose(cap.attn, (x @ x.transpose(-1, -2)).softmax(-1))
    for h in handles:
        h.remove()
    twice = _Softmax(softmaxes=2)
    _, handles = _watch(SoftmaxCapture(), twice)
    with pytest.raises(ValueError, match='two softmaxes'):
        twice(x)
    for h in handles:
        h.remove()
    assert not torch.overrides._get_current_function_mode_stack()
