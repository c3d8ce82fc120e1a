"""The label-attention backend (``shared_core.label_attention.LabelBackend``): one object per wrapper resolves the
choice to a path once per device, dtype and process choice, and the blocks read that path, not the choice."""

from __future__ import annotations

import pytest
import timm
import torch

import shared_core.label_attention as la
from shared_core.label_attention import LabelBackend, LabelPath, compute_dtype, fused_label_attn, set_fused_label_attn
from timm_plugin import create_mixer
from timm_plugin.tl_align import TLAlign


def test_each_choice_resolves_to_its_path_on_each_device(monkeypatch):
    from shared_core import label_kernel

    monkeypatch.setattr(la, '_TRITON', True)
    monkeypatch.setattr(label_kernel, 'self_check', lambda *a: None)  # the kernels pass, as on a GPU where they build
    monkeypatch.setattr(la, '_KERNEL_FAILED', None)
    f32 = torch.float32
    assert LabelBackend().path('cpu', f32) == LabelPath('columns', 'softmax')  # shared fused, label-only calls unfused
    assert LabelBackend().path('cuda', f32) == LabelPath('columns', 'sdpa')  # auto, nothing to time: the SDPA call
    assert LabelBackend(True).path('cuda', f32) == LabelPath('columns', 'sdpa')
    assert LabelBackend(False).path('cuda', f32) == LabelPath('materialised', 'softmax')
    assert LabelBackend('Triton').path('cpu', f32) == LabelPath('kernel', 'sdpa', "fused='triton'")
    assert LabelBackend('triton', 'tl_align.fused').path('cpu', f32).forced == "tl_align.fused='triton'"
    assert LabelBackend(' LABELS ').path('cuda', f32) == LabelPath('apart', 'labels')  # the model's own attention
    with fused_label_attn('triton'):  # the process's choice, where the wrapper makes none
        assert LabelBackend().path('cpu', f32).forced == "'triton' ($TOKENAUG_FUSED_LABEL_ATTN or set_fused_label_attn)"
        assert LabelBackend(False).path('cpu', f32).shared == 'materialised'  # the wrapper's own comes first
    with pytest.raises(ValueError, match="fused: expected True, False, 'triton', 'labels', 'auto' or None"):
        LabelBackend('cuda')
    with pytest.raises(ValueError, match="^fused='triton': the Triton label kernel does not run here: no kernel"):
        LabelBackend('triton').refuse_unrun_kernel('no kernel')
    LabelBackend(True).refuse_unrun_kernel('no kernel')  # only a forced kernel is refused


def test_the_path_is_chosen_once_per_device_dtype_and_process_choice_not_per_block(monkeypatch):
    """A depth-6 ViT's forwards resolve the choice once (the blocks read the path); a new process choice or another
    dtype resolves it again."""
    calls = []
    resolve = la.use_label_kernel
    monkeypatch.setattr(la, 'use_label_kernel', lambda device: calls.append(device) or resolve(device))
    model = timm.create_model('vit_tiny_patch16_224', img_size=32, patch_size=8, depth=6, num_classes=4).eval()
    mixer = create_mixer('cutmix', cutmix_alpha=1.0, num_classes=4, patch_size=8, carry_mix=True)
    xm, target = mixer(torch.randn(2, 3, 32, 32), torch.arange(2))
    wrapped = TLAlign(model)
    for _ in range(3):
        wrapped(xm, target)
    assert len(calls) == 1
    with torch.autocast('cpu', dtype=torch.bfloat16):
        assert compute_dtype(xm) == torch.bfloat16
        wrapped(xm, target)
    assert len(calls) == 2
    set_fused_label_attn(False)
    try:
        wrapped(xm, target)  # the process chose: no default to resolve, the materialised path
        assert wrapped.backend.path(xm.device, xm.dtype).shared == 'materialised'
    finally:
        set_fused_label_attn(None)
    wrapped(xm, target)
    assert len(calls) == 2  # the default's path was kept


def test_auto_keeps_the_fastest_path_that_passed_its_self_check_timed_once(monkeypatch, caplog):
    """``'auto'`` (the default on CUDA) with injected timings: the fastest path is kept; a kernel that fails its
    self-check is never timed nor chosen (one warning); the timing runs once per (device, dtype, shape) and is
    logged; an explicit choice times nothing; without the shared attention the label-only calls compete."""
    from shared_core import label_kernel

    f32, shape = torch.float32, (128, 6, 197, 64)
    timed = []

    def timings(**ms):
        def time_label_paths(candidates, device, dtype, shape):
            timed.append(tuple(candidates))
            return {c: ms[c] / 1e3 for c in candidates}

        monkeypatch.setattr(la, 'time_label_paths', time_label_paths)

    monkeypatch.setattr(label_kernel, 'self_check', lambda *a: None)
    timings(columns=3.0, kernel=2.0, labels=1.5, sdpa=2.5)
    backend = LabelBackend('auto')
    with caplog.at_level('INFO', logger='tokenaug.label_attention'):
        for _ in range(3):
            assert backend.path('cuda', f32, shape) == LabelPath('apart', 'labels')
    assert timed == [('columns', 'kernel', 'labels')]
    assert 'labels (columns 3.000 ms, kernel 2.000 ms, labels 1.500 ms)' in caplog.text
    assert backend.path('cuda', f32, (64, 6, 197, 64)) == LabelPath('apart', 'labels') and len(timed) == 2
    assert backend.path('cuda', f32, shape, shared_ok=False) == LabelPath('apart', 'labels')
    assert timed[-1] == ('sdpa', 'labels')
    timings(columns=3.0, kernel=2.0, labels=2.5, sdpa=2.5)
    assert LabelBackend('auto').path('cuda', f32, shape) == LabelPath('kernel', 'sdpa')
    # the fastest kernel fails its self-check: left out, after one warning; the next fastest is kept
    monkeypatch.setattr(label_kernel, 'self_check', lambda kind, *a: 'differs by 1' if kind == 'fused' else None)
    with pytest.warns(RuntimeWarning, match='the Triton label kernel failed its self-check on cuda.*leaves it out'):
        assert LabelBackend('auto').path('cuda', f32, shape) == LabelPath('apart', 'labels')
    assert timed[-1] == ('columns', 'labels')
    n = len(timed)
    assert LabelBackend(True).path('cuda', f32, shape) == LabelPath('columns', 'sdpa') and len(timed) == n
