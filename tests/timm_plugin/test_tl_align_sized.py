"""TL-Align's graph route inside blocks that branch on the map's size (TinyViT's window attention, MobileViT's
patch unfolding): fx reads them at one input size, and the label program is the explicit reference there, by loops
over windows and patches."""

import pytest
import timm
import torch

from timm_plugin.tl_align import GraphTracer

from ..timm_plugin.test_tl_align import C, random_token_labels
from .tl_align_checks import check_against_reference, mean_abs_stencil, stencil_loops, window_mix


def _records(model, attention_type):
    """Hooks recording each ``attention_type`` module's input and each drop path's kept samples."""
    from shared_core.capture import kept_samples

    records, handles = {}, []
    for m in model.modules():
        if isinstance(m, attention_type):
            handles.append(m.register_forward_pre_hook(lambda m, a: records.__setitem__(m, a[0].detach())))
        if isinstance(m, timm.layers.DropPath):
            handles.append(m.register_forward_hook(lambda m, i, o: records.__setitem__(m, kept_samples(i[0], o))))
    return records, handles


def _mix(records, Y, branch, drop_path, rows=None):
    """Eq. 11: the shortcut's and the branch's labels averaged, a sample whose drop path dropped the branch keeping
    the shortcut's; ``rows(s, i, j)``: where the drop path's rows are parts of each sample, the row of cell ``(i,
    j)`` of sample ``s`` (a dropped row keeps its cells' shortcut labels)."""
    B, H, W, _ = Y.shape
    keep = records.get(drop_path)
    if keep is None:  # (an identity: nothing dropped)
        keep = torch.ones(B * (1 if rows is None else rows(B, 0, 0)), dtype=torch.bool)
    k = torch.zeros(B, H, W, 1, dtype=torch.float64)
    for s in range(B):
        for i in range(H):
            for j in range(W):
                k[s, i, j] = float(keep[s if rows is None else rows(s, i, j)])
    return (Y + k * branch) / (1 + k)


def _stencil(Y, conv):
    """A conv with padding ``k // 2``, by loops: the mean |K| stencil at its stride."""
    p = conv.padding[0]
    return stencil_loops(Y, mean_abs_stencil(conv.weight), (p, p, p, p), conv.stride[0])


# ---------------------------------------------------------------- TinyViT


def tiny_vit_probabilities(attn, x):
    """A TinyViT ``Attention``'s head-mean weights from its input ``(windows, N, C)``, by the paper's formula:
    ``softmax(q kᵀ · scale + b)`` with the learned bias of each offset (``attention_biases`` at the offsets'
    indices)."""
    B, N, _ = x.shape
    q, k, _ = (
        attn.qkv(attn.norm(x)).view(B, N, attn.num_heads, -1).split([attn.key_dim, attn.key_dim, attn.val_dim], dim=3)
    )
    q, k = q.permute(0, 2, 1, 3).double(), k.permute(0, 2, 1, 3).double()
    bias = attn.attention_biases[:, attn.attention_bias_idxs].double()
    return ((q @ k.transpose(-2, -1)) * attn.scale + bias).softmax(-1).mean(1)


def tiny_vit_reference(model, Y, records):
    """TinyViT by its blocks from the stem's output (stride 4): the MBConvs of the first stage (the depthwise conv's
    stencil, a residual), then per stage the patch merging (its stride-2 depthwise conv's stencil) and per block the
    window attention (Eq. 9 on ``ws x ws`` windows; one window where the map is the window), its residual, the
    local depthwise conv (no residual) and the MLP (labels unchanged)."""
    Y = Y.double()
    for blk in model.stages[0].blocks:
        Y = _mix(records, Y, _stencil(Y, blk.conv2.conv), blk.drop_path)
    for stage in model.stages[1:]:
        Y = _stencil(Y, stage.downsample.conv2.conv)
        for blk in stage.blocks:
            A = tiny_vit_probabilities(blk.attn, records[blk.attn])
            Y = _mix(records, Y, window_mix(Y, A, min(blk.window_size, Y.shape[1])), blk.drop_path1)
            Y = _stencil(Y, blk.local_conv.conv)
    return Y.mean((1, 2))


@pytest.mark.parametrize('fused', [True, False])
def test_tiny_vit_is_the_window_reference(fused):
    """TinyViT's blocks branch on the map's size (a partition into windows, or one window where the map is as small
    as the window): read at that size, on a training forward whose drop paths drop samples, through SDPA with the
    bias as its mask or a materialised softmax alike."""
    from timm.models.tiny_vit import Attention

    torch.manual_seed(0)
    model = timm.create_model('tiny_vit_5m_224', num_classes=C, window_sizes=(4, 4, 2, 2), drop_path_rate=0.5).train()
    for m in model.modules():
        if isinstance(m, Attention):
            m.fused_attn = fused
            torch.nn.init.normal_(m.attention_biases)  # (zeros at init: a bias that tells offsets apart)
    tracer = GraphTracer(model, input_size=(3, 64, 64))
    assert tracer.stride == 4 and tracer.program.sized
    check_against_reference(tracer, model, *_records(model, Attention), tiny_vit_reference)


# ---------------------------------------------------------------- MobileViT


def vit_probabilities(attn, x):
    """A ViT ``Attention``'s head-mean weights from its input ``(rows, N, C)``: ``softmax(q kᵀ · scale)``."""
    B, N, _ = x.shape
    q, k, _ = attn.qkv(x).reshape(B, N, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    q, k = attn.q_norm(q).double(), attn.k_norm(k).double()
    return ((q @ k.transpose(-2, -1)) * attn.scale).softmax(-1).mean(1)


def patch_mix(Y, A, ph: int, pw: int):
    """Eq. 9 by loops across MobileViT's patches: the cell ``(i · ph + a, j · pw + b)`` is token ``n = i · nw + j``
    of row ``p = a · pw + b`` (one row per offset in the patch, per sample), ``A`` ``(B · ph · pw, N, N)``."""
    B, H, W, _ = Y.shape
    nh, nw, P = H // ph, W // pw, ph * pw
    new = torch.zeros_like(Y)
    for s in range(B):
        for i in range(H):
            for j in range(W):
                row, n = s * P + (i % ph) * pw + j % pw, (i // ph) * nw + j // pw
                for m in range(nh * nw):
                    new[s, i, j] += A[row, n, m] * Y[s, (m // nw) * ph + i % ph, (m % nw) * pw + j % pw]
    return new


def mobilevit_reference(model, Y, records):
    """MobileViT by its blocks from the first stride-4 map (the second stage's strided depthwise conv): each inverted
    residual's depthwise conv (a residual where the block has a shortcut), each MobileViT block's kxk conv, its
    transformer's attention across patches (Eq. 9 per offset in the patch) with residuals, and the fusion conv of
    the block input concatenated with its output (the mean of their labels, then the stencil)."""
    from timm.models.mobilevit import MobileVitBlock

    Y = Y.double()
    for blk in [b for s in model.stages[1:] for b in s][1:]:  # (the first: its strided conv is the start)
        if isinstance(blk, MobileVitBlock):
            ph, pw = blk.patch_size

            def rows(s, i, j):
                return s * ph * pw + (i % ph) * pw + j % pw

            Z = _stencil(Y, blk.conv_kxk.conv)
            for t in blk.transformer:
                new = patch_mix(Z, vit_probabilities(t.attn, records[t.attn]), ph, pw)
                Z = _mix(records, Z, new, t.drop_path1, rows)
            Y = _stencil((Y + Z) / 2, blk.conv_fusion.conv)
        else:  # (a block without a shortcut: its drop path scales whole samples, the labels stay)
            branch = _stencil(Y, blk.conv2_kxk.conv)
            Y = _mix(records, Y, branch, blk.drop_path) if blk.shortcut is not None else branch
    return Y.mean((1, 2))


def test_mobilevit_is_the_patch_reference():
    """MobileViT unfolds a map into rows of patches (one row per offset in the patch, sized from the map): read at
    that size, its attention across patches is Eq. 9 on the cells of each offset. Its drop paths drop rows (an
    offset of one image) in the transformer, and whole samples in the blocks without a shortcut."""
    from timm.layers import Attention

    torch.manual_seed(0)
    model = timm.create_model('mobilevit_xxs', num_classes=C, drop_path_rate=0.5).train()
    tracer = GraphTracer(model, input_size=(3, 64, 64))
    assert tracer.stride == 4 and tracer.program.sized
    assert sum(r is not None for r in tracer.program.keep_rows) == 2 * (2 + 4 + 3)  # (each transformer block: two)
    records, handles = _records(model, Attention)
    check_against_reference(tracer, model, records, handles, mobilevit_reference, B=2)
    rows = [k for m, k in records.items() if isinstance(m, timm.layers.DropPath) and len(k) > 2]
    assert any(not k.all() for k in rows)  # (some rows of some transformer dropped)


def test_a_program_read_at_one_size_is_read_again_at_another():
    """A graph read at one input size holds that size in its branches: a forward at another size gets a program
    read at that size (TinyViT at 64 px: one 2x2 window in the last stage; at 128 px: a 4x4 map of four windows)."""
    torch.manual_seed(0)
    model = timm.create_model('tiny_vit_5m_224', num_classes=C, window_sizes=(4, 4, 2, 2)).eval()
    tracer = GraphTracer(model, input_size=(3, 64, 64))
    again = tracer.program_at((32, 32))
    assert again is not tracer.program and again.sized and tracer.program_at((32, 32)) is again
    g = torch.Generator().manual_seed(1)
    x, Y = torch.randn(1, 3, 128, 128, generator=g), random_token_labels(1, 1024, g)
    out, caps = tracer.capture(lambda: model(x))
    label = tracer.label_path(caps, out, Y)
    assert torch.allclose(label.sum(1), torch.ones(1), atol=1e-6)
    assert (label - Y.mean(1)).abs().max() > 1e-3


# ---------------------------------------------------------------- EfficientViT (MSRA)


def cascaded_probabilities(attn, x):
    """A ``CascadedGroupAttention``'s weights per head from its input ``(windows, C, ws, ws)``, by its formula: head
    ``i`` reads its channel group plus head ``i - 1``'s output, its queries through a depthwise conv, and weighs by
    ``softmax(q kᵀ · scale + b)`` with the learned bias of each offset."""
    B, C, H, W = x.shape
    chunks = x.chunk(len(attn.qkvs), dim=1)
    bias = attn.attention_biases[:, attn.attention_bias_idxs].double()
    feat, out = chunks[0], []
    for i, (qkv, dws) in enumerate(zip(attn.qkvs, attn.dws)):
        if i:
            feat = feat + chunks[i]
        q, k, v = qkv(feat).view(B, -1, H, W).split([attn.key_dim, attn.key_dim, attn.val_dim], dim=1)
        q, k, v = dws(q).flatten(2), k.flatten(2), v.flatten(2)
        A = ((q.double().transpose(-2, -1) @ k.double()) * attn.scale + bias[i]).softmax(-1)
        out.append(A)
        feat = (v @ A.float().transpose(-2, -1)).view(B, attn.val_dim, H, W)
    return out


def efficientvit_reference(model, Y, records):
    """EfficientViT (MSRA) by its blocks from the stem's second conv (stride 4): the stem's strided convs, per stage
    the subsample's residual depthwise convs and patch merging (its strided depthwise conv's stencil; SE and the
    1x1 convs leave the labels), per block the residual depthwise convs and the window attention: head ``i``'s labels
    Eq. 9 on the mean of its channel group's labels and head ``i - 1``'s (the cascade's sum), the output the mean
    over heads (their concatenation), a residual."""
    from timm.models.efficientvit_msra import CascadedGroupAttention

    Y = Y.double()
    for conv in (model.patch_embed.conv3, model.patch_embed.conv4):
        Y = _stencil(Y, conv.conv)

    def dw(Y, part):
        return (Y + _stencil(Y, part.m.conv)) / 2

    for stage in model.stages:
        if not isinstance(stage.downsample, torch.nn.Identity):
            Y = dw(Y, stage.downsample.res1[0])
            Y = _stencil(Y, stage.downsample.patchmerge.conv2.conv)
            Y = dw(Y, stage.downsample.res2[0])
        for blk in stage.blocks:
            Y = dw(Y, blk.dw0)
            attn = blk.mixer.m.attn
            assert isinstance(attn, CascadedGroupAttention)
            ws = attn.resolution
            heads, head = [], Y
            for i, A in enumerate(cascaded_probabilities(attn, records[attn])):
                head = window_mix(head if i == 0 else (heads[-1] + Y) / 2, A, ws)
                heads.append(head)
            Y = (Y + sum(heads) / len(heads)) / 2
            Y = dw(Y, blk.dw1)
    return Y.mean((1, 2))


def test_efficientvit_msra_is_the_cascade_reference():
    """EfficientViT (MSRA) branches on the map's size (windows where the map is larger than one, else the map), and
    convs its queries in each window: a conv whose output is read only as queries is their positions (Eq. 9's
    rows), its labels unused. Windows of 4 and 2 at 128 px: 2x2 windows in the first two stages, one in the
    last."""
    from timm.models.efficientvit_msra import CascadedGroupAttention

    torch.manual_seed(0)
    model = timm.create_model('efficientvit_m0', num_classes=C, img_size=128, window_size=(4, 2, 2)).train()
    for m in model.modules():
        if isinstance(m, CascadedGroupAttention):
            torch.nn.init.normal_(m.attention_biases)
    tracer = GraphTracer(model, input_size=(3, 128, 128))
    assert tracer.stride == 4 and tracer.program.sized and tracer.program.positions_only
    records, handles = _records(model, CascadedGroupAttention)
    check_against_reference(tracer, model, records, handles, efficientvit_reference, B=2, side=128, dropped=False)
    assert {tuple(r.shape[-2:]) for r in records.values()} == {(4, 4), (2, 2)}


class _ConvInWindows(torch.nn.Module):
    """A depthwise conv inside 2x2 windows of a patchified map, its output put back on the map: a spatial mixing of
    tokens off the map that no attention reads as queries."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 4, 4)
        self.conv = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.head = torch.nn.Linear(8, C)

    def forward(self, x):
        x = self.stem(x)
        B, D, H, W = x.shape
        w = x.view(B, D, 2, H // 2, 2, W // 2).permute(0, 2, 4, 1, 3, 5).reshape(B * 4, D, H // 2, W // 2)
        w = self.conv(w)
        x = w.view(B, 2, 2, D, H // 2, W // 2).permute(0, 3, 1, 4, 2, 5).reshape(B, D, H, W)
        return self.head(x.mean((2, 3)))


def test_a_conv_on_tokens_read_as_labels_is_named():
    """A conv over token positions off the map gives tokens whose labels the route does not know: read as anything
    but attention queries (here: the map the head pools), the route names it."""
    with pytest.raises(ValueError, match='a spatial mixing of tokens .* read other than as attention queries'):
        GraphTracer(_ConvInWindows(), input_size=(3, 32, 32))


# ---------------------------------------------------------------- GCViT


def gcvit_reference(model, Y, records):
    """GCViT by its blocks from the stem's output (stride 4): per stage the downsampling's MBConv (its depthwise
    conv's stencil, a residual; SE and the 1x1 conv leave the labels) and strided conv, then per block the window
    attention (Eq. 9 on ``ws x ws`` windows): the local blocks' queries are the window's tokens, the global blocks'
    one global query per window position, shared by the windows, its output row ``i`` the window's cell ``i``
    (each output row mixes its own window's values), with the drop path's residual."""
    Y = Y.double()
    for stage in model.stages:
        if not isinstance(stage.downsample, torch.nn.Identity):
            d = stage.downsample
            Y = _stencil((Y + _stencil(Y, d.conv_block.conv_dw)) / 2, d.reduction)
        for blk in stage.blocks:
            A = records[blk.attn.attn_drop].double().mean(1)  # (the softmax output, head mean)
            Y = _mix(records, Y, window_mix(Y, A, blk.window_size[0]), blk.drop_path1)
    return Y.mean((1, 2))


def test_gcvit_global_query_is_the_window_reference():
    """GCViT's global blocks attend with a query computed from the whole stage (pooled to one window) and shared by
    every window: each window's output row ``i`` sits on the window's cell ``i`` and mixes that window's values,
    Eq. 9 as for its local blocks; on a training forward whose drop paths drop samples."""
    from shared_core.capture import kept_samples

    torch.manual_seed(0)
    model = timm.create_model('gcvit_xxtiny', num_classes=C, img_size=64, drop_path_rate=0.5).train()
    tracer = GraphTracer(model, input_size=(3, 64, 64))
    assert tracer.stride == 4
    records, handles = {}, []
    for blk in (b for s in model.stages for b in s.blocks):
        drop = blk.attn.attn_drop
        handles.append(drop.register_forward_pre_hook(lambda m, a: records.__setitem__(m, a[0].detach())))
        if isinstance(blk.drop_path1, timm.layers.DropPath):
            hook = blk.drop_path1.register_forward_hook(lambda m, i, o: records.__setitem__(m, kept_samples(i[0], o)))
            handles.append(hook)
    check_against_reference(tracer, model, records, handles, gcvit_reference)


def test_the_mixing_grid_and_the_first_program_are_the_training_sizes():
    """The mixer draws on the grid the graph route's labels start on, whatever a ``patch_embed`` of the model
    declares (EfficientViT-MSRA's says 16 px, its first stride-4 map is inside it); a model built for another
    input size than its ``pretrained_cfg`` one (GCViT with ``img_size=128``) is compiled at the size it trains at,
    which ``tokenaug-train`` passes from its data config."""
    from timm_plugin.tl_align import timm_tracer
    from timm_plugin.token_grid import mixing_stride, token_stride

    with torch.device('meta'):
        effvit = timm.create_model('efficientvit_m0', num_classes=C)
        gcvit = timm.create_model('gcvit_xxtiny', num_classes=C, img_size=128)
    assert token_stride(effvit) == (16, 16) and mixing_stride(effvit, 'tl_align') == (4, 4)
    assert mixing_stride(effvit, 'cutmix') == (16, 16)  # (other methods: the tokens)
    with pytest.raises(ValueError, match='does not run on a \\(3, 224, 224\\) fake batch'):
        timm_tracer(gcvit)
    assert timm_tracer(gcvit, input_size=(3, 128, 128)).stride == 4
    assert mixing_stride(gcvit, 'tl_align', (3, 128, 128)) == (4, 4)


@pytest.mark.parametrize('train', [False, True])
def test_reading_the_graph_leaves_the_model_as_it_was(train):
    """Reading a graph at one size runs its leaf modules on fake values in training mode: the model keeps its mode,
    its state (a batch norm's batch count) and no eval-time cache of the trace (TinyViT's attention biases)."""
    torch.manual_seed(0)
    model = timm.create_model('tiny_vit_5m_224', num_classes=C, window_sizes=(4, 4, 2, 2)).train(train)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    modes = [m.training for m in model.modules()]
    GraphTracer(model, input_size=(3, 64, 64)).program_at((32, 32))
    assert [m.training for m in model.modules()] == modes
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert not any(getattr(m, 'attention_bias_cache', None) for m in model.modules())
