"""Generalised TL-Align (TL-Align Appendix A, Table 9) beyond ViTs: timm's MlpMixer family (MLP-Mixer, ResMLP,
gMLP) and ConvNeXt against explicit per-position references, compact-vs-dense agreement, stochastic depth, the
unchanged token path, the refusals, and tokenaug-train runs."""

import re

import pytest
import timm
import torch
from timm.layers import GatedMlp
from timm.models.convnext import ConvNeXt
from timm.models.mlp_mixer import Affine, MlpMixer, ResBlock, SpatialGatingBlock

from shared_core.tl_align import abs_row_norm, linear_token_mixing
from timm_plugin import create_mixer
from timm_plugin.tl_align import TLAlign, TransMix
from timm_plugin.tl_align.cnn import CHANNEL_GATES

from ..timm_plugin.test_tl_align import C, random_token_labels, sharpen
from ..timm_plugin.test_tl_align_more import _window_mean
from .tl_align_checks import check_compact_equals_dense, stencil_loops

# the block settings of timm's mixer_*, resmlp_* and gmlp_* entry points, at a tiny size
ARCHS = {
    'mixer': dict(),
    'resmlp': dict(mlp_ratio=4, block_layer=ResBlock, norm_layer=Affine),
    'gmlp': dict(mlp_ratio=6, block_layer=SpatialGatingBlock, mlp_layer=GatedMlp),
}


def tiny(arch, **kw):
    torch.manual_seed(0)
    args = dict(img_size=32, patch_size=8, num_blocks=2, embed_dim=16, num_classes=C) | ARCHS[arch] | kw
    return sharpen(MlpMixer(**args))


def _mix_rows(W, Y):
    """``Norm(|W|) · Y`` written out: each output position the |W|-weighted mean of the input labels."""
    W = W.detach()
    n_out, n_in = W.shape
    out = torch.zeros(Y.shape[0], n_out, Y.shape[-1])
    for n in range(n_out):
        total = sum(abs(float(W[n, m])) for m in range(n_in))
        for m in range(n_in):
            out[:, n] += abs(float(W[n, m])) / total * Y[:, m]
    return out


def mlp_reference(model, arch, Y, layers=None, residual=True, dropped=()):
    """The label state through the blocks by explicit loops over positions (Table 9 op by op); ``dropped``: the
    blocks whose token branch stochastic depth dropped for every sample."""
    for idx, blk in enumerate(model.blocks):
        if (layers is not None and idx not in layers) or idx in dropped:
            continue
        if arch == 'resmlp':
            g = _mix_rows(blk.linear_tokens.weight, Y)
        elif arch == 'mixer':  # hidden units of the token MLP, then back to the tokens
            g = _mix_rows(blk.mlp_tokens.fc2.weight, _mix_rows(blk.mlp_tokens.fc1.weight, Y))
        else:  # gMLP: u (own label) times proj(v) (mixed labels): their Norm(sum)
            g = (Y + _mix_rows(blk.mlp_channels.gate.proj.weight, Y)) / 2
        Y = (Y + g) / 2 if residual else g
    return Y.mean(1)


@pytest.mark.parametrize('arch', list(ARCHS))
def test_dense_trace_matches_the_explicit_reference(arch):
    model = tiny(arch).eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 32, 32, generator=g)
    Y = random_token_labels(2, 16, g)
    out, label = TLAlign(model).trace(x, Y)
    assert torch.equal(out, model(x))
    assert torch.allclose(label, mlp_reference(model, arch, Y), atol=1e-6)
    assert torch.allclose(label.sum(1), torch.ones(2), atol=1e-6) and label.min() >= 0
    for layers, residual in [([], True), ([1], False), ([0], True)]:
        _, label = TLAlign(model, layers=layers, residual=residual).trace(x, Y)
        assert torch.allclose(label, mlp_reference(model, arch, Y, layers, residual), atol=1e-6)
    # the labels move: a wrong weight, transpose or order would show
    assert (label - Y.mean(1)).abs().max() > 1e-3


def test_linear_token_mixing_rows_and_order():
    g = torch.Generator().manual_seed(0)
    W1, W2 = torch.randn(5, 4, generator=g), torch.randn(4, 5, generator=g)
    A = linear_token_mixing(W1, W2)
    assert A.shape == (4, 4) and torch.allclose(A.sum(1), torch.ones(4)) and A.min() >= 0
    assert torch.allclose(A, abs_row_norm(W2) @ abs_row_norm(W1))
    assert torch.equal(abs_row_norm(torch.zeros(2, 3)), torch.zeros(2, 3))  # a zero row stays zero
    P = torch.tensor([[2.0, 0.0], [1.0, 3.0]])  # non-negative: Table 9's Norm(W) itself
    assert torch.allclose(abs_row_norm(P), P / P.sum(1, keepdim=True))


@pytest.mark.parametrize('arch', list(ARCHS))
@pytest.mark.parametrize('kind', ['cutmix', 'tokenmix_block'])
def test_compact_and_dense_labels_give_the_same_target(arch, kind):
    g = torch.Generator().manual_seed(3)
    mixer = create_mixer(
        kind, num_classes=C, patch_size=8, mode='elem', mixup_alpha=0.0, cutmix_alpha=1.0, label_smoothing=0.1,
        generator=g, carry_mix=True,
    )  # fmt: skip
    x, y = torch.randn(6, 3, 32, 32, generator=g), torch.randint(0, C, (6,), generator=g)
    check_compact_equals_dense(tiny(arch, drop_path_rate=0.3).train(), mixer, x, y, C)


@pytest.mark.parametrize('arch', list(ARCHS))
def test_a_dropped_token_branch_leaves_the_labels(arch):
    """Block 0's stochastic depth drops every sample's branches, block 1's none: the labels skip block 0."""
    model = tiny(arch).train()
    model.blocks[0].drop_path = timm.layers.DropPath(1.0)
    g = torch.Generator().manual_seed(2)
    x, Y = torch.randn(3, 3, 32, 32, generator=g), random_token_labels(3, 16, g)
    _, label = TLAlign(model).trace(x, Y)
    assert torch.allclose(label, mlp_reference(model, arch, Y, dropped={0}), atol=1e-6)
    _, public = TLAlign(model, drop_path='public').trace(x, Y)
    assert torch.allclose(public, mlp_reference(model, arch, Y), atol=1e-6)


@pytest.mark.parametrize('arch', list(ARCHS))
def test_eval_is_the_plain_model_and_training_logits_are_unchanged(arch):
    model = tiny(arch, drop_path_rate=0.2)
    wrapped = TLAlign(model)
    x = torch.randn(4, 3, 32, 32)
    wrapped.eval()
    assert torch.equal(wrapped(x), model(x))
    wrapped.train()
    mixer = create_mixer('cutmix', mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=C, patch_size=8, carry_mix=True)
    xm, target = mixer(x, torch.tensor([0, 1, 2, 3]))
    torch.manual_seed(0)
    out, aligned = wrapped(xm, target)
    torch.manual_seed(0)
    assert torch.equal(out, model(xm))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert torch.allclose(aligned.sum(1), torch.ones(4), atol=1e-6)


def test_refusals():
    with pytest.raises(ValueError, match="global_pool='' has no TL-Align rule"):
        TLAlign(tiny('mixer', global_pool=''))
    model = tiny('resmlp')
    mixer = create_mixer('cutmix', mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=C, patch_size=4, carry_mix=True)
    xm, target = mixer(torch.randn(2, 3, 32, 32), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match='64 token labels for 16 tokens'):
        TLAlign(model).train()(xm, target)
    model.blocks[1].mlp_channels = torch.nn.Sequential()
    with pytest.raises(ValueError, match='block 1.mlp_channels is a torch.nn.modules.container.Sequential'):
        TLAlign(model)


@pytest.mark.slow
@pytest.mark.parametrize('model', ['mixer_s16_224', 'resmlp_12_224', 'gmlp_ti16_224'])
def test_tokenaug_train_tl_align_on_the_mlp_family(tiny_world, tmp_path, model):
    """``tokenaug-train --method tl_align`` on a small MLP-Mixer / ResMLP / gMLP over the world (the mixer draws
    on the stem's 16-pixel grid, the model's 7x7 tokens), with stochastic depth."""
    from timm_plugin.train import run

    from ..conftest import REPO

    metrics = run(
        ['-c', str(REPO / 'configs' / 'timm' / 'world_vit-tiny.yaml'), '--data-dir', str(tiny_world / 'imagenet')]
        + ['--model', model, '--model-kwargs', 'img_size=112']  # timm's entry points fix depth and width
        + ['--epochs', '1', '-b', '8', '--workers', '0', '--method', 'tl_align', '--drop-path', '0.1']
        + ['--output', str(tmp_path), '--experiment', 'run']
    )
    assert set(metrics) == {'loss', 'top1', 'top5'} and 0 <= metrics['top1'] <= 100
    ckpt = torch.load(tmp_path / 'run' / 'last.pth.tar', map_location='cpu', weights_only=True)
    plain = timm.create_model(model, img_size=112, num_classes=10)
    plain.load_state_dict(ckpt['state_dict'])  # a plain timm model: nothing of TL-Align in the checkpoint


# ---------------------------------------------------------------- ConvNeXt


def tiny_convnext(**kw):
    torch.manual_seed(0)
    return ConvNeXt(**(dict(depths=(1, 2, 1, 1), dims=(8, 8, 16, 16), num_classes=C, patch_size=4) | kw))


def _stencil_mix(Y, S, pad, stride=1):
    """``(B, H, W, K)`` labels mixed by the stencil ``S`` at every ``stride``-th window, normalised over in-grid
    cells (:func:`.tl_align_checks.stencil_loops` with the same padding on every side)."""
    return stencil_loops(Y, S, (pad,) * 4, stride).float()


def convnext_reference(model, Y_tok, grid, layers=None, residual=True, dropped=()):
    B = Y_tok.shape[0]
    Y = Y_tok.reshape(B, *grid, -1)
    idx = 0
    for stage in model.stages:
        if not isinstance(stage.downsample, torch.nn.Identity):
            Y = _window_mean(Y, 2, 2, 0)
        for blk in stage.blocks:
            if (layers is None or idx in layers) and idx not in dropped:
                Kc = blk.conv_dw.weight.detach()  # (C, 1, k, k): one signed kernel per channel
                S = sum(Kc[c, 0].abs() for c in range(Kc.shape[0])) / Kc.shape[0]
                g = _stencil_mix(Y, S, blk.conv_dw.padding[0])
                Y = (Y + g) / 2 if residual else g
            idx += 1
    return Y.flatten(1, 2).mean(1)


def test_convnext_refusals():
    with pytest.raises(ValueError, match='overlapping stem'):
        TLAlign(tiny_convnext(stem_type='overlap'))
    with pytest.raises(ValueError, match="head pooling 'max'"):
        TLAlign(tiny_convnext(global_pool='max'))


@pytest.mark.slow
@pytest.mark.parametrize('model', ['convnext_atto', 'convnext_tiny'])
def test_tokenaug_train_tl_align_on_convnext(tiny_world, tmp_path, model):
    """``tokenaug-train --method tl_align`` on ConvNeXt-Atto and ConvNeXt-T over the world: the mixer draws on
    the stem's 4-pixel grid (28x28 tokens at 112 px; on another grid the label path would refuse the token count)."""
    from timm_plugin.train import run

    from ..conftest import REPO

    metrics = run(
        ['-c', str(REPO / 'configs' / 'timm' / 'world_vit-tiny.yaml'), '--data-dir', str(tiny_world / 'imagenet')]
        + ['--model', model, '--model-kwargs', '--drop-path', '0.1']  # no img_size for a CNN
        + ['--epochs', '1', '-b', '8', '--workers', '0', '--method', 'tl_align']
        + ['--output', str(tmp_path), '--experiment', 'run']
    )
    assert set(metrics) == {'loss', 'top1', 'top5'} and 0 <= metrics['top1'] <= 100


# ---------------------------------------------------------------- ResNet


def tiny_resnet(block='basic', **kw):
    """A one-block-per-stage timm ResNet whose 3x3 kernels get a strongly non-uniform magnitude per position (random
    init is near uniform), so a transposed, shifted or mis-strided stencil shows in the labels."""
    from timm.models.resnet import BasicBlock, Bottleneck, ResNet

    torch.manual_seed(0)
    # zero_init_last=False: a zero-initialised last norm makes every branch output 0, which stochastic depth
    # cannot drop (a zero branch counts as kept)
    model = ResNet(
        BasicBlock if block == 'basic' else Bottleneck, [1, 1, 1, 1], num_classes=C, zero_init_last=False, **kw
    )
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Conv2d) and m.kernel_size == (3, 3):
                m.weight.mul_(torch.rand(3, 3, generator=g) ** 3 * 4)
    return model


def resnet_reference(model, Y_tok, grid, layers=None, residual=True, dropped=()):
    """The label state by explicit loops: each block's 3x3 convs as their ``mean_{o,i} |K|`` stencil (at the conv's
    stride), the shortcut's geometry (a strided 1x1 conv picks one cell, ResNet-D's 2x2 average pool its mean)."""
    B = Y_tok.shape[0]
    Y = Y_tok.reshape(B, *grid, -1)
    blocks = [b for layer in (model.layer1, model.layer2, model.layer3, model.layer4) for b in layer]
    for idx, blk in enumerate(blocks):
        short = Y
        if blk.downsample is not None:
            if isinstance(blk.downsample[0], torch.nn.AvgPool2d):
                short = _window_mean(Y, 2, 2, 0)
            else:
                s = blk.downsample[0].stride[0] if isinstance(blk.downsample[0], torch.nn.Conv2d) else 1
                short = Y[:, ::s, ::s]
        if (layers is None or idx in layers) and idx not in dropped:
            g = Y
            convs = [blk.conv2] if hasattr(blk, 'conv3') else [blk.conv1, blk.conv2]
            for conv in convs:
                K = conv.weight.detach()  # (O, I, 3, 3), signed
                S = sum(K[o, i].abs() for o in range(K.shape[0]) for i in range(K.shape[1])) / (K.shape[0] * K.shape[1])
                g = _stencil_mix(g, S, conv.padding[0], conv.stride[0])
            Y = (short + g) / 2 if residual else g
        else:
            Y = short
    return Y.flatten(1, 2).mean(1)


def test_resnet_refusals():
    with pytest.raises(ValueError, match='ResNestBottleneck'):
        TLAlign(timm.create_model('resnest14d', num_classes=C))
    for kind, name in (('cbam', 'CbamModule'), ('gc', 'GlobalContext'), ('coord', 'CoordAttn')):
        with pytest.raises(ValueError, match=f'its attention layer {name} has no TL-Align rule'):
            TLAlign(tiny_resnet(block_args=dict(attn_layer=kind)))
    with pytest.raises(ValueError, match="global_pool='max'"):
        TLAlign(tiny_resnet(global_pool='max'))
    mixer = create_mixer('cutmix', mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=C, patch_size=16, carry_mix=True)
    xm, target = mixer(torch.randn(2, 3, 64, 64), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match='ResNet has none there: its blocks mix tokens by convolutions'):
        TransMix(tiny_resnet())  # nothing attends: TL-Align's rules, not TransMix's
    with pytest.raises(ValueError, match='16 token labels for 256 tokens'):
        TLAlign(tiny_resnet())(xm, target)  # the mix must be drawn on the stride-4 grid


# ---------------------------------------------------------------- both CNN tracers

# name -> (the model, its explicit reference, (layers, residual) settings, depth); 64 px: a 16x16 first grid
CNNS = {
    'convnext': (tiny_convnext, convnext_reference, [([], True), ([0, 2, 4], False), ([1, 3], True)], 5),
    'resnet': (
        lambda **kw: tiny_resnet('basic', **kw),
        resnet_reference,
        [([], True), ([0, 2], False), ([1, 3], True)],
        4,
    ),
    'resnet-bottleneck': (lambda **kw: tiny_resnet('bottleneck', **kw), resnet_reference, [([1, 3], False)], 4),
    'resnet-d': (
        lambda **kw: tiny_resnet('bottleneck', stem_type='deep', avg_down=True, **kw),
        resnet_reference,
        [([0, 1], True)],
        4,
    ),
    # channel gates (Table 9: channel mixing, labels unchanged): the reference has no rule for them at all; ConvNeXt
    # V2's global response norm is one
    'convnext-v2': (
        lambda **kw: tiny_convnext(use_grn=True, ls_init_value=None, **kw),
        convnext_reference,
        [([1, 3], True)],
        5,
    ),  # fmt: skip
    'resnet-se': (
        lambda **kw: tiny_resnet('bottleneck', block_args=dict(attn_layer='se'), **kw),
        resnet_reference,
        [([1], True)],
        4,
    ),
    'resnet-eca': (
        lambda **kw: tiny_resnet('basic', block_args=dict(attn_layer='eca'), **kw),
        resnet_reference,
        [([0, 3], True)],
        4,
    ),
}


@pytest.mark.parametrize('name', ['seresnet18', 'ecaresnet26t', 'seresnext26d_32x4d'])
def test_resnets_with_channel_gates_are_traced(name):
    """timm's SE / ECA ResNets: the gates leave the labels, so the trace is the plain ResNet rule's."""
    model = timm.create_model(name, num_classes=C).eval()
    assert isinstance(model.layer1[0].se, CHANNEL_GATES)
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    Y = random_token_labels(1, 256, torch.Generator().manual_seed(3))
    out, label = TLAlign(model).trace(x, Y)
    assert torch.equal(out, model(x)) and torch.allclose(label, resnet_reference(model, Y, (16, 16)), atol=1e-6)


@pytest.mark.parametrize('name', sorted(CNNS))
def test_cnn_dense_trace_matches_the_explicit_reference(name):
    make, reference, settings, depth = CNNS[name]
    model = make().eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 64, 64, generator=g)
    Y = random_token_labels(2, 256, g)  # the first 16x16 grid (stride 4)
    out, label = TLAlign(model).trace(x, Y)
    assert torch.equal(out, model(x))
    assert torch.allclose(label, reference(model, Y, (16, 16)), atol=1e-6)
    assert torch.allclose(label.sum(1), torch.ones(2), atol=1e-6) and label.min() >= 0
    for layers, residual in settings:
        _, label = TLAlign(model, layers=layers, residual=residual).trace(x, Y)
        assert torch.allclose(label, reference(model, Y, (16, 16), layers, residual), atol=1e-6)
    assert (label - Y.mean(1)).abs().max() > 1e-3  # the labels moved
    assert TLAlign(model).depth == depth


@pytest.mark.parametrize('name', ['convnext', 'resnet-bottleneck'])
@pytest.mark.parametrize('kind', ['cutmix', 'tokenmix_block'])
def test_cnn_compact_and_dense_labels_give_the_same_target(name, kind):
    g = torch.Generator().manual_seed(3)
    mixer = create_mixer(
        kind, num_classes=C, patch_size=4, mode='elem', mixup_alpha=0.0, cutmix_alpha=1.0, label_smoothing=0.1,
        generator=g, carry_mix=True,
    )  # fmt: skip
    x, y = torch.randn(6, 3, 64, 64, generator=g), torch.randint(0, C, (6,), generator=g)
    check_compact_equals_dense(CNNS[name][0](drop_path_rate=0.3).train(), mixer, x, y, C)


@pytest.mark.parametrize('name', ['convnext', 'resnet'])
def test_cnn_dropped_branch_training_logits_and_eval(name):
    make, reference, _, _ = CNNS[name]
    model = make()
    wrapped = TLAlign(model).train()
    wrapped.tracer.blocks()[1].drop_path = timm.layers.DropPath(1.0)  # block 1: every sample's branch dropped
    g = torch.Generator().manual_seed(2)
    x, Y = torch.randn(3, 3, 64, 64, generator=g), random_token_labels(3, 256, g)
    _, label = wrapped.trace(x, Y)
    assert torch.allclose(label, reference(model, Y, (16, 16), dropped={1}), atol=1e-6)
    mixer = create_mixer('cutmix', mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=C, patch_size=4, carry_mix=True)
    xm, target = mixer(torch.randn(4, 3, 64, 64), torch.tensor([0, 1, 2, 3]))
    torch.manual_seed(0)
    out, _ = wrapped(xm, target)
    torch.manual_seed(0)
    assert torch.equal(out, model(xm))  # the token path is the model's own
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    wrapped.eval()
    assert torch.equal(wrapped(x), model.eval()(x))


def test_transmix_refuses_at_construction_every_model_whose_last_block_does_not_attend():
    """TransMix reads the last block's self-attention; its eligibility is the tracer's ``attends``. PoolFormer
    (which it once took, to end in a bare ``StopIteration`` at the first mixed batch), ConvFormer, ConvNeXt,
    ResNet, MLP-Mixer and CaiT are refused when the wrapper is built, naming the family and what mixes the tokens
    there; CAFormer, whose last stages attend, is taken and gives a share in [0, 1]."""
    from .test_tl_align_metaformer import C as MC
    from .test_tl_align_metaformer import tiny_metaformer

    cait = timm.create_model('cait_xxs24_224', img_size=32, patch_size=8, depth=1, num_classes=C)
    refused = {
        'MetaFormer has none there: its last block mixes tokens by pooling (Pooling)': tiny_metaformer('poolformer'),
        'MetaFormer has none there: its last block mixes tokens by a depthwise convolution (SepConv)': (
            tiny_metaformer('convformer')
        ),
        'ConvNeXt has none there: its blocks mix tokens by depthwise convolutions': tiny_convnext(),
        'ResNet has none there: its blocks mix tokens by convolutions': tiny_resnet(),
        'MlpMixer has none there: its blocks mix tokens by an MLP across the tokens': tiny('mixer'),
        'Cait has none there: its last blocks are class attention': cait,
    }
    for words, model in refused.items():
        start = f"model: TransMix reads the last block's self-attention, and {words}"
        with pytest.raises(ValueError, match='^' + re.escape(start)):
            TransMix(model)
        TLAlign(model)  # TL-Align traces each of them
    mixer = create_mixer('cutmix', mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=MC, patch_size=4, carry_mix=True)
    xm, target = mixer(torch.randn(2, 3, 64, 64), torch.tensor([0, 1]))
    _, aligned = TransMix(tiny_metaformer('caformer'))(xm, target)
    assert aligned.shape == (2, MC) and torch.allclose(aligned.sum(1), torch.ones(2), atol=1e-5)
