"""TL-Align's graph route for conv nets (Table 9 read off the fx graph): the same labels as the ResNet and ConvNeXt
tracers, explicit-loop references for EfficientNet, MobileNetV3, DenseNet and VGG, the invariants of a label
program on the other families it takes, its refusals, and the training call."""

import pytest
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers.bottleneck_attn import BottleneckAttn
from timm.models.densenet import DenseNet
from timm.models.efficientformer_v2 import Attention2d
from timm.models.shvit import SHSA
from timm.models.swiftformer import EfficientAdditiveAttention
from timm.models.vgg import VGG

from shared_core.tl_align import conv_stencil_labels
from timm_plugin import create_mixer
from timm_plugin.tl_align import ConvNeXtTracer, GraphTracer, ResNetTracer, TLAlign, timm_tracer
from timm_plugin.tl_align.graph import GraphRouteError
from timm_plugin.token_grid import tl_align_stride

from ..timm_plugin.test_tl_align import C, random_token_labels
from ..timm_plugin.test_tl_align_more import _adaptive_mean, _window_mean
from .tl_align_checks import (
    check_against_reference,
    check_compact_equals_dense,
    grid_mix,
    mean_abs_stencil,
    stencil_loops,
    window_mix,
)


def sym(conv):
    p = conv.padding
    return (p[1], p[1], p[0], p[0])


@pytest.mark.parametrize('pads, stride, dilation', [((1, 1, 1, 1), 1, 1), ((0, 1, 0, 1), 2, 1), ((2, 2, 2, 2), 1, 2)])
def test_a_stencil_with_dilation_or_an_asymmetric_padding_is_the_loops(pads, stride, dilation):
    g = torch.Generator().manual_seed(0)
    Y = torch.rand(2, 3, 7, 8, generator=g)
    S = torch.rand(3, 3, generator=g)
    padding = pads if pads[0] != pads[1] else (pads[2], pads[0])
    got = conv_stencil_labels(Y, S, padding, stride, dilation)
    want = stencil_loops(Y.permute(0, 2, 3, 1), S, pads, stride, dilation).permute(0, 3, 1, 2)
    assert torch.allclose(got.double(), want, atol=1e-6)


# ---------------------------------------------------------------- the same labels as the family tracers


@pytest.mark.parametrize(
    'name, tracer',
    [
        ('resnet18', ResNetTracer),
        ('resnet26d', ResNetTracer),  # ResNet-D: the average-pooled shortcut
        ('seresnext26d_32x4d', ResNetTracer),  # grouped convs, SE gates
        ('ecaresnet26t', ResNetTracer),  # ECA gates, the tiered stem
        ('convnext_atto', ConvNeXtTracer),
        ('convnextv2_atto', ConvNeXtTracer),  # GRN: a channel gate
    ],
)
def test_the_graph_route_gives_the_family_tracers_labels(name, tracer):
    """Table 9 read op by op is the ResNet and ConvNeXt tracers' block rules: the same labels on a training forward
    whose drop paths drop samples."""
    kw = {'zero_init_last': False} if 'res' in name else {}  # a zero last norm makes every branch 0 (all "kept")
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=C, drop_path_rate=0.5, **kw).train()
    family, graph = tracer(model), GraphTracer(model)
    x = torch.randn(4, 3, 64, 64)
    Y = random_token_labels(4, 256, torch.Generator().manual_seed(1))
    torch.manual_seed(2)
    out, caps = family.capture(lambda: model(x))
    torch.manual_seed(2)
    out_g, caps_g = graph.capture(lambda: model(x))
    assert torch.equal(out, out_g)
    assert sum(int((~c.keep).sum()) for c in caps_g if c.keep is not None) > 0  # samples were dropped
    want, got = family.label_path(caps, out, Y), graph.label_path(caps_g, out_g, Y)
    assert (got - want).abs().max() < 1e-6
    assert (got - Y.mean(1)).abs().max() > 1e-3  # the labels moved
    assert graph.stride == 4 and graph.depth == len(caps_g)


# ---------------------------------------------------------------- explicit references


def efficientnet_reference(model, Y):
    """timm's EfficientNet / MobileNetV3 by its blocks: the labels start at the output of the depthwise conv that
    brings the stem's stride 2 to 4; each later block mixes them by its depthwise (or, EdgeResidual, its expansion)
    conv's stencil and, with a skip, averages them with its input; the 1x1 convs and SE gates leave them."""
    stride, started = model.conv_stem.stride[0], False
    for blk in (b for stage in model.blocks for b in stage):
        conv = getattr(blk, 'conv_dw', None) or getattr(blk, 'conv_exp', None) or blk.conv
        if not started:
            stride *= conv.stride[0]
            started = stride >= 4
            continue
        Z = stencil_loops(Y, mean_abs_stencil(conv.weight), sym(conv), conv.stride[0])
        Y = (Y + Z) / 2 if blk.has_skip else Z
    return Y.mean((1, 2))


def densenet_reference(model, Y):
    """DenseNet by its blocks: each layer's input the mean label of the features it concatenates, its new features
    that input mixed by its 3x3 conv; a block's output the mean over all its features; a transition's 2x2 average
    pooling the mean of each window."""
    for name, part in model.features.named_children():
        if name.startswith('denseblock'):
            parts = [Y]
            for layer in part.values():
                conv = layer.conv2
                parts.append(stencil_loops(sum(parts) / len(parts), mean_abs_stencil(conv.weight), sym(conv)))
            Y = sum(parts) / len(parts)
        elif name.startswith('transition'):
            Y = _window_mean(Y, 2, 2, 0)
    return Y.mean((1, 2))


def vgg_reference(model, Y):
    """VGG by its layers after the second max pool (stride 4): 3x3 convs by their stencils, max pools the mean of
    each 2x2 window; its head (ConvMlp) pools a map smaller than 7x7 adaptively to 7x7, then mixes it by its 7x7
    conv to one cell."""
    pools = 0
    for m in model.features:
        if pools < 2:
            pools += isinstance(m, nn.MaxPool2d)
        elif isinstance(m, nn.Conv2d):
            Y = stencil_loops(Y, mean_abs_stencil(m.weight), sym(m))
        elif isinstance(m, nn.MaxPool2d):
            Y = _window_mean(Y, 2, 2, 0)
    Y = _adaptive_mean(Y, 7)
    return stencil_loops(Y, mean_abs_stencil(model.pre_logits.fc1.weight), (0, 0, 0, 0)).mean((1, 2))


REFERENCES = {
    'efficientnet_b0': (lambda: timm.create_model('efficientnet_b0', num_classes=C), efficientnet_reference),
    'mobilenetv3': (lambda: timm.create_model('mobilenetv3_small_050', num_classes=C), efficientnet_reference),
    'densenet': (lambda: DenseNet(growth_rate=8, block_config=(2, 2, 2, 2), num_classes=C), densenet_reference),
    'vgg': (lambda: VGG([8, 'M', 16, 'M', 16, 16, 'M', 32, 'M', 32, 'M'], num_classes=C), vgg_reference),
}


@pytest.mark.parametrize('name', sorted(REFERENCES))
def test_the_graph_route_is_the_explicit_reference(name):
    make, reference = REFERENCES[name]
    torch.manual_seed(0)
    model = make().eval()
    wrapped = TLAlign(model)
    assert type(wrapped.tracer) is GraphTracer and tl_align_stride(model) == (4, 4)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 64, 64, generator=g)
    Y = random_token_labels(2, 256, g)  # the 16x16 grid at stride 4
    out, label = wrapped.trace(x, Y)
    assert torch.equal(out, model(x))
    want = reference(model, Y.reshape(2, 16, 16, C)).float()
    assert (label - want).abs().max() < 1e-6
    assert torch.allclose(label.sum(1), torch.ones(2), atol=1e-6) and label.min() >= 0
    assert (label - Y.mean(1)).abs().max() > 1e-3


# ---------------------------------------------------------------- the other families it takes

#: one model of each further family the graph route takes, and the ops it exercises there
FAMILIES = {
    'resnetv2_50': 'pre-activation blocks, weight-standardised convs',
    'regnetx_002': 'grouped convs',
    'dla34': 'tree aggregation: concatenations, max-pooled projections',
    'hrnet_w18_small': 'parallel resolutions: nearest upsampling, strided fusions',
    'ghostnet_050': 'ghost modules: cheap depthwise features concatenated and sliced',
    'cs3darknet_focus_s': 'a space-to-depth stem, cross-stage splits and concatenations',
    'dpn68': 'dual paths: a sum and a concatenation of the split outputs',
    'convmixer_768_32': 'a patchify stem (stride 7), 9x9 depthwise convs',
    'starnet_s050': 'the star operation: a product of two maps with the same labels',
    'fasternet_t0': 'partial convs on a slice of the channels',
    'inception_next_tiny': 'band kernels (1x11, 11x1) on split channels',
    'repvit_m0_9': 'a sum of a 3x3, a 1x1 and an identity branch',
    'vovnet39a': 'one-shot aggregation, ESE gates',
    'selecsls42': 'concatenations of the block outputs',
    'visformer_tiny': 'attention on token rows (a softmax) after conv stages',
    'nest_tiny': 'attention in nested blocks, block aggregation by conv and pooling',
    'nextvit_small': 'token rows whose keys an AvgPool1d pools, multi-head conv attention, concatenations',
    'sam2_hiera_tiny': 'windowed attention whose queries a MaxPool2d pools, summed with a pooled shortcut',
    'botnet26t_256': 'attention logits plus relative logits from the queries, heads in the batch dim',
    'shvit_s1': 'single-head attention on part of the channels, channels-first values times transposed weights',
    'efficientformerv2_s0': 'talking heads, attention with a stride, attention that downsamples its queries',
    'swiftformer_xs': 'additive attention: a query pooled by weights normalised over the tokens, gating each key',
}


@pytest.mark.parametrize('name', sorted(FAMILIES))
def test_a_label_program_keeps_labels_a_distribution_and_a_constant_map_constant(name):
    """Every op of Table 9 averages labels: on any family the program's output is a distribution within the range
    of its inputs, a map where every token has the same label gives that label, and a varying map moves."""
    torch.manual_seed(0)
    kw = {'img_size': 64} if name.startswith(('nest', 'visformer', 'botnet')) else {}  # (fixed-size models)
    model = timm.create_model(name, num_classes=C, **kw).eval()
    big = name.startswith(('sam2', 'shvit', 'efficientformerv2'))  # (windows, a stride-16 stem, fixed biases)
    tracer = GraphTracer(model, input_size=(3, 64, 64) if kw else (3, 224, 224) if big else None)
    s = tracer.stride
    side = 64 if kw else 224 if big else 16 * s if s == 4 else 8 * s
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 3, side, side, generator=g)
    out, caps = tracer.capture(lambda: model(x))
    T = (side // s) ** 2
    Y = random_token_labels(1, T, g)
    label = tracer.label_path(caps, out, Y)
    assert torch.allclose(label.sum(1), torch.ones(1), atol=1e-5)
    assert (label >= Y.amin(1) - 1e-6).all() and (label <= Y.amax(1) + 1e-6).all()
    const = Y[:, :1].expand(-1, T, -1)
    assert torch.allclose(tracer.label_path(caps, out, const), Y[:, 0], atol=1e-5)
    corner = torch.zeros(1, T, 2)
    corner[..., 0] = 1
    corner[:, 0] = torch.tensor([0.0, 1.0])  # one token of the other image: its share is spread, not lost
    share = tracer.label_path(caps, out, corner)[0, 1]
    assert 0 < share < 1


# ---------------------------------------------------------------- refusals and the training call


def meta(name, **kw):
    with torch.device('meta'):
        return timm.create_model(name, num_classes=C, **kw)


@pytest.mark.parametrize(
    'name, kw, decided, why',
    [
        ('mambaout_tiny', {}, True, 'a product of two maps with different labels'),
        ('efficientnet_b0', {'global_pool': 'max'}, True, 'no pooled label'),
        ('inception_v3', {}, True, 'no token grid tiles the image'),
        ('nasnetalarge', {}, True, 'first single feature map at stride >= 2'),  # two-input cells: the map before
        ('edgenext_small', {}, False, 'a product of tokens over their positions'),  # XCA: attention over channels
        ('volo_d1_224', {}, False, 'Unfold has no Table 9 rule'),  # outlook attention: weights on unfolded windows
        ('tnt_s_patch16_224', {}, False, 'no single feature map at stride >= 4'),
    ],
)
def test_the_graph_route_names_what_it_cannot_read(name, kw, decided, why):
    """A model no family tracer takes goes to the graph route; where it cannot take it, the error names the node and
    why: its refusal where Table 9 gives the op no reading (``decided``), else "no tracer", the supported classes and
    the part it does not read (attention, tokens as rows), which is a family tracer's work."""
    with pytest.raises(ValueError) as e:
        timm_tracer(meta(name, **kw))
    message = str(e.value)
    assert why in message
    if decided:
        assert message.startswith("model: TL-Align's graph route refuses ") and 'supported' not in message
    else:
        assert message.startswith('model: TL-Align has no tracer for') and 'supported: ' in message
        assert 'graph route does not read' in message
    assert e.value.__cause__.decided is decided


def _aligned_with_records(model, parts):
    """A 32-px training forward of a small stride-4 model on 8 images (stochastic depth drawn at seed 3) and its
    graph-route labels: ``(labels, initial labels, records)``, the records holding each of ``parts``' outputs
    (``{name: module}``) and, under ``'keep'``, the samples ``model.drop_path`` kept (some dropped, some kept)."""
    from shared_core.capture import kept_samples

    tracer = GraphTracer(model, input_size=(3, 32, 32))
    rec = {}
    hooks = [m.register_forward_hook(lambda m, i, o, n=n: rec.__setitem__(n, o.detach())) for n, m in parts.items()]
    hooks.append(model.drop_path.register_forward_hook(lambda m, i, o: rec.__setitem__('keep', kept_samples(i[0], o))))
    g = torch.Generator().manual_seed(1)
    x, Y = torch.randn(8, 3, 32, 32, generator=g), random_token_labels(8, 64, g)
    torch.manual_seed(3)
    out, caps = tracer.capture(lambda: model(x))
    for h in hooks:
        h.remove()
    assert not rec['keep'].all() and rec['keep'].any()
    return tracer.label_path(caps, out, Y), Y, rec


class _PooledQueryAttention(nn.Module):
    """HieraDet's query pooling in small: token rows as a ``(B, H, W, D)`` grid, queries max-pooled 2x2 on it,
    keys and values from every token, SDPA; the output on the pooled grid."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads, self.qkv, self.pool = heads, nn.Linear(d, 3 * d), nn.MaxPool2d(2, 2)

    def forward(self, x):
        B, H, W, D = x.shape
        q, k, v = self.qkv(x).reshape(B, H * W, 3, self.heads, -1).unbind(2)
        q = self.pool(q.reshape(B, H, W, -1).permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
        q = q.reshape(B, -1, self.heads, D // self.heads)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return a.transpose(1, 2).reshape(B, H // 2, W // 2, D)


class _PooledQueries(nn.Module):
    """A stride-4 stem, :class:`_PooledQueryAttention` through a drop path, summed with the 2x2 max-pooled map (as
    HieraDet's stage-opening block), the mean."""

    def __init__(self, d=16):
        super().__init__()
        self.stem, self.attn = nn.Conv2d(3, d, 4, 4), _PooledQueryAttention(d)
        self.drop_path, self.fc = timm.layers.DropPath(0.5), nn.Linear(d, C)

    def forward(self, x):
        x = self.stem(x).permute(0, 2, 3, 1)  # (B, H, W, D)
        short = F.max_pool2d(x.permute(0, 3, 1, 2), 2).permute(0, 2, 3, 1)
        x = short + self.drop_path(self.attn(x))
        return self.fc(x.mean((1, 2)))


def test_queries_pooled_on_the_grid_are_the_explicit_reference():
    """Queries pooled 2x2 on the grid (HieraDet): each pooled query's cell is a 2x2 window of the grid, its label
    Eq. 9 over every key, and the sum with the 2x2-pooled shortcut Eq. 11 on the pooled grid (both are the same
    windows, so they sum)."""
    torch.manual_seed(0)
    model = _PooledQueries().train()
    label, Y, rec = _aligned_with_records(model, {'qkv': model.attn.qkv})
    keep = rec['keep']
    with torch.no_grad():
        q, k, _ = rec['qkv'].double().reshape(8, 8, 8, 3, 2, 8).unbind(3)  # (B, H, W, heads, d)
        qp = q.permute(0, 3, 4, 1, 2).reshape(8, 16, 8, 8)
        qp = F.max_pool2d(qp, 2).reshape(8, 2, 8, 16).permute(0, 1, 3, 2)  # (B, heads, 16, d)
        P = torch.softmax(qp @ k.reshape(8, 64, 2, 8).permute(0, 2, 3, 1) / 8**0.5, -1).mean(1)  # (B, 16, 64)
        Yg = Y.double().reshape(8, 8, 8, C)
        pooled = torch.stack(
            [Yg[:, 2 * i : 2 * i + 2, 2 * j : 2 * j + 2].mean((1, 2)) for i in range(4) for j in range(4)], 1
        )  # (B, 16, C): each 2x2 window's mean label, in row-major order
        want = torch.where(keep[:, None, None], (pooled + P @ Y.double()) / 2, pooled).mean(1)
    assert (label - want).abs().max() < 1e-6
    assert (label - Y.mean(1)).abs().max() > 1e-3


class _RelativeLogits(nn.Module):
    """BoTNet's self-attention in small: a stride-4 stem, timm's ``BottleneckAttn`` (logits plus relative logits
    computed from the queries, heads in the batch dim) through a drop path and the residual, the mean."""

    def __init__(self, d=16):
        super().__init__()
        self.stem = nn.Conv2d(3, d, 4, 4)
        self.attn = BottleneckAttn(d, d, feat_size=(8, 8), num_heads=2)
        self.drop_path, self.fc = timm.layers.DropPath(0.5), nn.Linear(d, C)

    def forward(self, x):
        x = self.stem(x)
        x = x + self.drop_path(self.attn(x))
        return self.fc(x.mean((2, 3)))


def test_relative_logits_from_the_queries_are_the_explicit_reference():
    """Logits plus a term computed from the queries (BoTNet's relative position logits) are still logits: Eq. 9 on
    the probabilities the forward computed, recomputed here from q, k and the module's own relative logits."""
    torch.manual_seed(0)
    model = _RelativeLogits().train()
    label, Y, rec = _aligned_with_records(model, {'qkv': model.attn.qkv})
    keep, a = rec['keep'], model.attn
    with torch.no_grad():
        q, k, _ = torch.split(rec['qkv'], [a.dim_out_qk, a.dim_out_qk, a.dim_out_v], dim=1)
        q = q.reshape(16, a.dim_head_qk, 64).transpose(-1, -2)
        logits = (q @ k.reshape(16, a.dim_head_qk, 64)) * a.scale + a.pos_embed(q)
        P = logits.double().softmax(-1).reshape(8, 2, 64, 64).mean(1)
        want = torch.where(keep[:, None, None], (Y.double() + P @ Y.double()) / 2, Y.double()).mean(1)
    assert (label - want).abs().max() < 1e-6
    assert (label - Y.mean(1)).abs().max() > 1e-3


class _TransposedProbabilities(nn.Module):
    """SHViT's single-head attention in small: a stride-4 stem, timm's ``SHSA`` (attention on a part of the
    channels, values channels-first times the transposed probabilities, concatenated with the other channels)
    through a drop path and the residual, the mean."""

    def __init__(self, d=16):
        super().__init__()
        self.stem, self.attn = nn.Conv2d(3, d, 4, 4), SHSA(d, qk_dim=8, pdim=8)
        self.drop_path, self.fc = timm.layers.DropPath(0.5), nn.Linear(d, C)

    def forward(self, x):
        x = self.stem(x)
        x = x + self.drop_path(self.attn(x))
        return self.fc(x.mean((2, 3)))


def test_values_times_transposed_probabilities_are_the_explicit_reference():
    """``v @ attnᵀ`` with channels-first values (SHViT) is Eq. 9; the attended part of the channels concatenated
    with the rest is the mean of their labels (Table 9's Norm of the sum), then Eq. 11 where the drop path kept."""
    torch.manual_seed(0)
    model = _TransposedProbabilities().train()
    with torch.no_grad():  # SHSA's output norm starts at 0, and a zero branch shows no dropped sample
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.fill_(1.0)
    label, Y, rec = _aligned_with_records(model, {'qkv': model.attn.qkv})
    keep = rec['keep']
    with torch.no_grad():
        q, k, _ = torch.split(rec['qkv'].double().flatten(2), [8, 8, 8], dim=1)  # (B, 8, 64)
        P = torch.softmax(q.transpose(-2, -1) @ k * 8**-0.5, -1)  # (B, 64 queries, 64 keys)
        Yd = Y.double()
        mixed = (P @ Yd + Yd) / 2  # the attended channels and the others, concatenated
        want = torch.where(keep[:, None, None], (Yd + mixed) / 2, Yd).mean(1)
    assert (label - want).abs().max() < 1e-6
    assert (label - Y.mean(1)).abs().max() > 1e-3


class _TalkingHeads(nn.Module):
    """EfficientFormer v2's attention in small: a stride-4 stem, timm's ``Attention2d`` with a stride (a strided
    depthwise conv before it, a bilinear upsampling after), talking heads before and after the softmax and a local
    depthwise conv on the values, through a drop path and the residual, the mean."""

    def __init__(self, d=16):
        super().__init__()
        self.stem = nn.Conv2d(3, d, 4, 4)
        self.attn = Attention2d(d, key_dim=8, num_heads=2, attn_ratio=2, resolution=8, stride=2)
        self.drop_path, self.fc = timm.layers.DropPath(0.5), nn.Linear(d, C)

    def forward(self, x):
        x = self.stem(x)
        x = x + self.drop_path(self.attn(x))
        return self.fc(x.mean((2, 3)))


def test_talking_heads_are_caits_rule_on_the_explicit_reference():
    """Talking heads (EfficientFormer v2): a 1x1 conv over the heads of the logits keeps them logits (the recorded
    softmax holds it); one over the heads of the probabilities gives the signed weights that multiply the values,
    read as CaiT's are, ``Norm(|mean_h W|)``. The values' local conv is a stencil summed with the attention
    (Eq. 11's mean), the strided conv and the upsampling move the labels as on a map."""
    torch.manual_seed(0)
    model = _TalkingHeads().train()
    a = model.attn
    with torch.no_grad():
        a.attention_biases.normal_()
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):  # (a zero branch shows no dropped sample)
                m.weight.fill_(1.0)
    label, Y, rec = _aligned_with_records(model, {'x': a.stride_conv})
    keep = rec['keep']
    with torch.no_grad():
        x = rec['x']
        B = len(x)
        q = a.q(x).reshape(B, 2, -1, a.N).permute(0, 1, 3, 2).double()
        k = a.k(x).reshape(B, 2, -1, a.N).double()
        logits = (q @ k) * a.scale + a.attention_biases[:, a.attention_bias_idxs].double()
        th1, th2 = a.talking_head1, a.talking_head2
        logits = F.conv2d(logits, th1.weight.double(), th1.bias.double())
        W = F.conv2d(logits.softmax(-1), th2.weight.double(), th2.bias.double()).mean(1)  # (B, 16, 16)
        A = W.abs() / W.abs().sum(-1, keepdim=True)
        Yd = Y.double().reshape(B, 8, 8, C)
        Z = stencil_loops(Yd, mean_abs_stencil(a.stride_conv.conv.weight), (1, 1, 1, 1), 2)  # (B, 4, 4, C)
        local = stencil_loops(Z, mean_abs_stencil(a.v_local.conv.weight), (1, 1, 1, 1))
        both = ((A @ Z.reshape(B, 16, C)).reshape(B, 4, 4, C) + local) / 2
        up = F.interpolate(both.permute(0, 3, 1, 2), scale_factor=2, mode='bilinear').permute(0, 2, 3, 1)
        want = torch.where(keep[:, None, None, None], (Yd + up) / 2, Yd).mean((1, 2))
    assert (label - want).abs().max() < 1e-6
    assert (label - Y.mean(1)).abs().max() > 1e-3


class _AdditiveAttention(nn.Module):
    """SwiftFormer's attention in small: a stride-4 stem, timm's ``EfficientAdditiveAttention`` (a global query
    pooled by weights normalised over the tokens, times each key) through a drop path and the residual, a 3x3
    depthwise conv, the mean."""

    def __init__(self, d=16):
        super().__init__()
        self.stem, self.attn = nn.Conv2d(3, d, 4, 4), EfficientAdditiveAttention(d, d)
        self.drop_path, self.conv = timm.layers.DropPath(0.5), nn.Conv2d(d, d, 3, padding=1, groups=d)
        self.fc = nn.Linear(d, C)

    def forward(self, x):
        x = self.stem(x)
        x = x + self.drop_path(self.attn(x))
        return self.fc(self.conv(x).mean((2, 3)))


def test_additive_attention_is_a_channel_gate():
    """SwiftFormer's additive attention forms no token weights: ``x / ||x||`` over the tokens scales each channel
    of a sample, and the global query it pools multiplies each key channel by channel. Both are Table 9's
    data-dependent channel mixing, as an SE gate: the branch keeps the tokens' labels, Eq. 11 then gives the
    shortcut's, and the conv after it mixes by its stencil."""
    torch.manual_seed(0)
    model = _AdditiveAttention().train()
    label, Y, rec = _aligned_with_records(model, {})
    with torch.no_grad():
        S = mean_abs_stencil(model.conv.weight)
        want = stencil_loops(Y.double().reshape(8, 8, 8, C), S, (1, 1, 1, 1)).mean((1, 2))
    assert (label - want).abs().max() < 1e-6
    assert (label - Y.mean(1)).abs().max() > 1e-3


class _PadToWindows(nn.Module):
    """A stride-4 stem, a pad of the grid to a multiple of 3 cells (as HieraDet and Swin pad to their windows), a
    3x3 conv and the mean: at a size the windows tile, the pad adds nothing."""

    def __init__(self):
        super().__init__()
        self.stem, self.conv, self.fc = nn.Conv2d(3, 8, 4, 4), nn.Conv2d(8, 8, 3, padding=1), nn.Linear(8, C)

    def forward(self, x):
        x = self.stem(x)
        H, W = x.shape[-2:]
        x = F.pad(x, (0, (3 - W % 3) % 3, 0, (3 - H % 3) % 3))
        return self.fc(self.conv(x).mean((2, 3)))


def test_a_padding_by_nothing_is_no_op_and_a_real_one_is_refused():
    """A pad whose amounts the graph computes from the grid: at a size the windows tile they are 0 and the labels
    are the conv's stencil alone; where the pad adds cells the route refuses it."""
    torch.manual_seed(0)
    model = _PadToWindows()
    tracer = GraphTracer(model, input_size=(3, 96, 96))  # a 24x24 grid
    Y = random_token_labels(2, 576, torch.Generator().manual_seed(1))
    out, caps = tracer.capture(lambda: model(torch.randn(2, 3, 96, 96)))
    want = stencil_loops(Y.reshape(2, 24, 24, C).double(), mean_abs_stencil(model.conv.weight), (1, 1, 1, 1))
    assert (tracer.label_path(caps, out, Y) - want.mean((1, 2))).abs().max() < 1e-6
    with pytest.raises(GraphRouteError, match='a constant padding of the grid adds cells'):
        GraphTracer(model, input_size=(3, 64, 64))  # a 16x16 grid: two cells added


class _PooledKeyAttention(nn.Module):
    """NextViT's efficient attention in small: queries from every token row, keys and values from the rows
    average-pooled in runs of 4 (an ``AvgPool1d``), SDPA."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.sr, self.norm = nn.AvgPool1d(4, 4), nn.BatchNorm1d(d)

    def forward(self, t):
        B, N, D = t.shape
        q = self.q(t).reshape(B, N, self.heads, -1).transpose(1, 2)
        r = self.norm(self.sr(t.transpose(1, 2))).transpose(1, 2)
        k = self.k(r).reshape(B, -1, self.heads, D // self.heads).transpose(1, 2)
        v = self.v(r).reshape(B, -1, self.heads, D // self.heads).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, D)


class _PooledKeys(nn.Module):
    """A stride-4 stem, the map as token rows through :class:`_PooledKeyAttention`, the rows back on the map
    through a drop path and the residual (as NextViT's transformer block), the mean."""

    def __init__(self, d=16):
        super().__init__()
        self.stem, self.attn = nn.Conv2d(3, d, 4, 4), _PooledKeyAttention(d)
        self.drop_path, self.fc = timm.layers.DropPath(0.5), nn.Linear(d, C)

    def forward(self, x):
        x = self.stem(x)
        B, D, H, W = x.shape
        a = self.attn(x.reshape(B, D, -1).transpose(-1, -2))
        x = x + self.drop_path(a).transpose(-1, -2).reshape(B, D, H, W)
        return self.fc(x.mean((2, 3)))


def test_keys_pooled_from_token_rows_are_the_explicit_reference():
    """Tokens pooled in runs along their rows (NextViT's keys): each key's label is the mean of its run's cells, the
    attention Eq. 9 over those keys, Eq. 11 for the samples the drop path kept, the labels carried through the
    layout ops after the drop path."""
    torch.manual_seed(0)
    model = _PooledKeys().train()
    label, Y, rec = _aligned_with_records(model, {'q': model.attn.q, 'k': model.attn.k})
    keep = rec['keep']
    with torch.no_grad():
        q = rec['q'].double().reshape(8, 64, 2, 8).transpose(1, 2)
        k = rec['k'].double().reshape(8, 16, 2, 8).transpose(1, 2)
        P = torch.softmax(q @ k.transpose(-1, -2) / 8**0.5, -1).mean(1)  # (8, 64, 16)
        Yd = Y.double()
        Yk = torch.stack([Yd[:, 4 * j : 4 * j + 4].mean(1) for j in range(16)], 1)  # run j: tokens 4j .. 4j+3
        want = torch.where(keep[:, None, None], (Yd + P @ Yk) / 2, Yd).mean(1)
    assert (label - want).abs().max() < 1e-6
    assert (label - Y.mean(1)).abs().max() > 1e-3


def test_the_graph_route_has_no_blocks_to_pick():
    model = meta('efficientnet_b0')
    for kw in (dict(layers=[0]), dict(residual=False)):
        with pytest.raises(ValueError, match='layers / residual: .*whole graph'):
            TLAlign(model, **kw)


def test_compact_and_dense_labels_give_the_same_target_with_dropped_samples():
    torch.manual_seed(0)
    model = timm.create_model('efficientnet_b0', num_classes=C, drop_path_rate=0.5).train()
    g = torch.Generator().manual_seed(3)
    mixer = create_mixer(
        'cutmix', num_classes=C, patch_size=4, mixup_alpha=0.0, cutmix_alpha=1.0, label_smoothing=0.1,
        generator=g, carry_mix=True,
    )  # fmt: skip
    x, y = torch.randn(6, 3, 64, 64, generator=g), torch.randint(0, C, (6,), generator=g)
    wrapped, xm, aligned = check_compact_equals_dense(model, mixer, x, y, C)
    assert (aligned - torch.eye(C)[y]).abs().max() > 1e-3
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    wrapped.eval()
    assert torch.equal(wrapped(x), model.eval()(x))


def test_label_states_are_each_stages_last_map_and_the_readout():
    """``label_states`` (tokenaug-viz): the last map on each grid before the op that leaves it, then the map the
    head pools, whose mean is the aligned share."""
    torch.manual_seed(0)
    model = timm.create_model('efficientnet_b0', num_classes=C).eval()
    mixer = create_mixer('cutmix', num_classes=C, patch_size=4, mixup_alpha=0.0, cutmix_alpha=1.0, carry_mix=True)
    xm, target = mixer(torch.randn(2, 3, 64, 64), torch.tensor([0, 1]))
    out, share, states = TLAlign(model).label_states(xm, target)
    assert [grid for _, grid in states] == [(16, 16), (8, 8), (4, 4), (2, 2)]
    assert all(labels.shape == (2, h * w, 1) for labels, (h, w) in states)
    assert torch.allclose(states[-1][0].mean(1), share, atol=1e-6)
    assert torch.equal(out, model(xm))


@pytest.mark.parametrize('kind', ['std', 'scaled_std'])
def test_a_standardised_convs_stencil_is_read_from_the_kernel_it_applies(kind):
    """timm's weight-standardised TF-"same" convs are leaves of its fx tracing: the route takes the kernel as their
    forward applies it (standardised, NFNet's gain and scale in it) and their "same" padding on the grid."""
    from timm.layers.padding import pad_same_arg
    from timm.layers.std_conv import ScaledStdConv2dSame, StdConv2dSame

    from timm_plugin.tl_align.graph import _conv_of

    torch.manual_seed(0)
    m = (StdConv2dSame if kind == 'std' else ScaledStdConv2dSame)(8, 4, 3, stride=2)
    x = torch.randn(1, 8, 8, 8)  # an even grid: TF "same" pads one more cell right and below
    op = _conv_of(m)
    pads = pad_same_arg(x.shape[-2:], op.kernel, op.stride, op.dilation)
    assert torch.allclose(F.conv2d(F.pad(x, pads), op.weight(), m.bias, m.stride), m(x), atol=1e-5)
    assert op.padding == 'same' and not torch.allclose(op.weight(), m.weight)
    Y = torch.rand(1, 2, 8, 8)
    assert torch.allclose(op(Y), conv_stencil_labels(Y, mean_abs_stencil(op.weight()).float(), pads, 2), atol=1e-6)


# ---------------------------------------------------------------- attention in the graph route (MaxViT)


def maxvit_probabilities(attn, x, bias):
    """A MaxViT ``AttentionCl``'s head-mean attention, recomputed from its input ``(windows, ws, ws, C)`` by the
    paper's formula: ``softmax(q kᵀ · scale + relative position bias)`` (``bias`` ``(heads, ws², ws²)`` as the
    forward computed it: its MLP has dropout in training)."""
    B = x.shape[0]
    q, k, _ = attn.qkv(x).view(B, -1, attn.num_heads, attn.dim_head * 3).transpose(1, 2).chunk(3, dim=3)
    s = (q.double() @ k.double().transpose(-2, -1)) * attn.scale + bias.double()
    return s.softmax(-1).mean(1)  # (windows, ws², ws²)


def maxvit_reference(model, Y, records):
    """MaxViT by its blocks, from the first stage's first MBConv output (the first stride-4 map): per block an MBConv
    (its depthwise conv's stencil, at a stage start stride 2 with the shortcut's 2x2 average pooling), then window
    attention and grid attention (Eq. 9 on ``ws x ws`` windows, and on the grid whose token ``(a, b)`` of window
    ``(p, q)`` is the cell ``(a · H/G + p, b · W/G + q)``), each a residual with its drop path (Eq. 11)."""

    def mix(short, branch, drop_path):
        keep = records.get(drop_path, torch.ones(len(Y), dtype=torch.bool))  # (the first drop paths are identities)
        k = keep.view(-1, 1, 1, 1).double()
        return (short + k * branch) / (1 + k)

    Y = Y.double()  # (B, H, W, K)
    first = True
    for stage in model.stages:
        for blk in stage.blocks:
            conv = blk.conv
            if not first:
                stride = conv.conv2_kxk.stride[0]
                short = _window_mean(Y.float(), 2, 2, 0).double() if stride == 2 else Y
                branch = stencil_loops(Y, mean_abs_stencil(conv.conv2_kxk.weight), (1, 1, 1, 1), stride)
                Y = mix(short, branch, conv.drop_path)
            first = False
            for part in (blk.attn_block, blk.attn_grid):
                A = maxvit_probabilities(part.attn, records[part.attn], records[part.attn.rel_pos.bias_act])
                ws = part.partition_size[0]
                if part.partition_block:
                    new = window_mix(Y, A, ws)
                else:
                    new = grid_mix(Y, A, ws)
                Y = mix(Y, new, part.drop_path1)
    return Y.mean((1, 2))


@pytest.mark.parametrize('fused, compiled', [(True, 64), (False, 128)])
def test_maxvit_window_and_grid_attention_are_the_explicit_reference(fused, compiled):
    """The graph route reads attention (Eq. 9) where a reshape takes a map's tokens into windows or a grid: on a
    MaxViT training forward whose drop paths drop samples, through SDPA or a materialised softmax alike; a program
    compiled at another input size (128 px: four times the windows) is compiled again at the forward's."""
    from shared_core.capture import kept_samples

    torch.manual_seed(0)
    model = timm.create_model('maxvit_rmlp_pico_rw_256', num_classes=C, img_size=64, drop_path_rate=0.5).train()
    for m in model.modules():
        if hasattr(m, 'fused_attn'):
            m.fused_attn = fused
    tracer = GraphTracer(model, input_size=(3, compiled, compiled))
    assert tracer.stride == 4 and len(tracer.program.watched) == 2 * sum(len(s.blocks) for s in model.stages)
    assert (tracer.program_at((16, 16)) is tracer.program) == (compiled == 64)
    records, handles = {}, []
    for m in model.modules():
        if type(m).__name__ == 'AttentionCl':
            handles.append(m.register_forward_pre_hook(lambda m, a: records.__setitem__(m, a[0].detach())))
            bias = m.rel_pos.bias_act
            handles.append(bias.register_forward_hook(lambda m, i, o: records.__setitem__(m, o.detach())))
        if isinstance(m, timm.layers.DropPath):
            handles.append(m.register_forward_hook(lambda m, i, o: records.__setitem__(m, kept_samples(i[0], o))))
    check_against_reference(tracer, model, records, handles, maxvit_reference)
