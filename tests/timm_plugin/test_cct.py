"""CCT-7/3x1 (timm_plugin.cct) against a port of the public model (SHI-Labs Compact-Transformers, as copied into
mlvlab/TokenMixup ``experiments/cct/src``): the tokenizer, ``TransformerEncoderLayer`` (pre_norm -> attention ->
residual -> norm1 -> MLP residual, every LayerNorm ``nn.LayerNorm(d)``: eps 1e-5), SeqPool and the registered
names, including the public ``_cct()`` that drops ``positional_embedding`` (so ``*_sine`` learns its positions)."""

import pytest
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F

import timm_plugin  # noqa: F401  (registers cct_*)
from timm_plugin.cct import LAYER_NORM_EPS, checkpoint_filter_fn, sinusoidal_embedding


class PublicAttention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads, self.scale = num_heads, (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        attn = (qkv[0] @ qkv[1].transpose(-2, -1) * self.scale).softmax(-1)
        return self.proj((attn @ qkv[2]).transpose(1, 2).reshape(B, N, C))


class PublicEncoderLayer(nn.Module):
    """The public ``TransformerEncoderLayer`` without TokenMixup, dropout and drop path (eval)."""

    def __init__(self, d_model, nhead, dim_feedforward):
        super().__init__()
        self.pre_norm = nn.LayerNorm(d_model)
        self.self_attn = PublicAttention(d_model, nhead)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.norm1 = nn.LayerNorm(d_model)
        self.linear2 = nn.Linear(dim_feedforward, d_model)

    def forward(self, src):
        src = src + self.self_attn(self.pre_norm(src))
        src = self.norm1(src)
        return src + self.linear2(F.gelu(self.linear1(src)))


class PublicTokenizer(nn.Module):
    """The public ``Tokenizer`` for one conv layer: ``conv_layers.0`` = conv 3x3 (no bias), ReLU, max pool 3/2."""

    def __init__(self, embed_dim):
        super().__init__()
        self.conv_layers = nn.Sequential(
            nn.Sequential(nn.Conv2d(3, embed_dim, 3, stride=1, padding=1, bias=False), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        )
        self.flattener = nn.Flatten(2, 3)

    def forward(self, x):
        return self.flattener(self.conv_layers(x)).transpose(-2, -1)


class PublicClassifier(nn.Module):
    """The public ``TransformerClassifier`` with ``seq_pool=True`` ('learnable' whatever the model name says)."""

    def __init__(self, num_classes, embed_dim, depth, num_heads, mlp_ratio, seq_len=256):
        super().__init__()
        self.attention_pool = nn.Linear(embed_dim, 1)
        self.positional_emb = nn.Parameter(torch.zeros(1, seq_len, embed_dim))
        self.blocks = nn.ModuleList(
            [PublicEncoderLayer(embed_dim, num_heads, int(embed_dim * mlp_ratio)) for _ in range(depth)]
        )
        self.norm = nn.LayerNorm(embed_dim)
        self.fc = nn.Linear(embed_dim, num_classes)

    def forward(self, x):
        x = x + self.positional_emb
        for blk in self.blocks:
            x = blk(x)
        x = self.norm(x)
        return self.fc((F.softmax(self.attention_pool(x), dim=1).transpose(-1, -2) @ x).squeeze(-2))


class PublicCCT(nn.Module):
    """The public ``CCT`` for 32 px (``tokenizer`` + ``classifier``, the state-dict names its checkpoints hold)."""

    def __init__(self, num_classes, embed_dim=256, depth=7, num_heads=4, mlp_ratio=2.0):
        super().__init__()
        self.tokenizer = PublicTokenizer(embed_dim)
        self.classifier = PublicClassifier(num_classes, embed_dim, depth, num_heads, mlp_ratio)

    def forward(self, x):
        return self.classifier(self.tokenizer(x))


def peaked(model):
    """Random LayerNorm affines, a random positional embedding and sharp attention, so that an eps difference shows
    in the logits."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if 'qkv' in name or 'positional_emb' in name:
                p.normal_(0, 0.2, generator=g)
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(torch.rand(m.weight.shape, generator=g) * 2)
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)
    return model


def public_checkpoint(path, classes, seed=0):
    """A public CCT with random weights, saved as its training script saves it (``{'state_dict': ...}``)."""
    torch.manual_seed(seed)
    public = peaked(PublicCCT(classes)).double().eval()
    torch.save({'state_dict': public.state_dict(), 'epoch': 3}, path)
    return public


@pytest.mark.parametrize('name, classes', [('cct_7_3x1_32', 100), ('cct_7_3x1_32_sine', 10)])
def test_a_public_checkpoint_loads_into_ours_with_equal_logits_in_float64(name, classes, tmp_path):
    """The public model's checkpoint (its names) loads through timm's own route, ``create_model(pretrained=True,
    pretrained_cfg_overlay=dict(file=...))`` (``checkpoint_filter_fn`` renames), strictly; the logits agree to
    float64 noise, every LayerNorm has eps 1e-5; with timm's block default eps 1e-6 they would differ by far
    more (the pin bites)."""
    public = public_checkpoint(tmp_path / 'public.pth', classes)
    model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(tmp_path / 'public.pth')))
    model = model.double().eval()
    assert model.num_classes == classes
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    assert len(norms) == 2 * 7 + 1 and all(m.eps == LAYER_NORM_EPS == 1e-5 for m in norms)
    renamed = checkpoint_filter_fn(torch.load(tmp_path / 'public.pth', weights_only=True), model)
    assert set(renamed) == set(model.state_dict())  # every key, once
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        ours, ref = model(x), public(x)
        assert (ours - ref).abs().max() < 1e-10
        for m in norms[:-1]:
            m.eps = 1e-6  # timm's Block default: what the blocks had before
        assert (model(x) - ref).abs().max() > 1e-6


def test_a_public_tokenmixup_checkpoint_brings_its_scorenet(tmp_path):
    """mlvlab's TokenMixup CCT saves the HTM block's ScoreNet as ``classifier.blocks.L.small_h_*``: it becomes
    ``tokenmixup_scorenet.L`` (attention pooling), which computes what the public ScoreNet does."""
    from timm_plugin.tokenmixup import attach_scorenets

    public_checkpoint(tmp_path / 'p.pth', 100)
    state = torch.load(tmp_path / 'p.pth', weights_only=True)['state_dict']
    g = torch.Generator().manual_seed(2)
    pool_w, pool_b = torch.randn(1, 256, generator=g).double(), torch.randn(1, generator=g).double()
    fc_w, fc_b = torch.randn(100, 256, generator=g).double(), torch.randn(100, generator=g).double()
    state['classifier.blocks.2.small_h_attention_pool.weight'] = pool_w
    state['classifier.blocks.2.small_h_attention_pool.bias'] = pool_b
    state['classifier.blocks.2.small_h_fc.weight'] = fc_w
    state['classifier.blocks.2.small_h_fc.bias'] = fc_b
    model = timm.create_model('cct_7_3x1_32')
    nets = attach_scorenets(model, [2])
    model.double().load_state_dict(checkpoint_filter_fn({'state_dict': state}, model), strict=True)
    src = torch.randn(2, 256, 256, generator=g).double()  # a block's input tokens
    pooled = F.softmax(src @ pool_w.T + pool_b, dim=1).transpose(-1, -2) @ src  # the public ScoreNet
    expect = pooled.squeeze(-2) @ fc_w.T + fc_b
    with torch.no_grad():
        assert torch.allclose(nets['2'](src), expect, atol=1e-10)


def test_a_released_htm_checkpoint_evaluates_through_timms_pretrained_route(tmp_path, caplog):
    """An HTM/HVTM release carries its ScoreNet: ``create_model(pretrained=True, pretrained_cfg_overlay=dict(file=
    ...))`` into a plain model (evaluation) drops the training-only ScoreNet with one log line naming it, loads
    everything else strictly and gives the public model's logits; with ``attach_scorenets`` first it loads too."""
    import logging

    public = public_checkpoint(tmp_path / 'p.pth', 100)
    state = torch.load(tmp_path / 'p.pth', weights_only=True)
    g = torch.Generator().manual_seed(2)
    state['state_dict']['classifier.blocks.2.small_h_attention_pool.weight'] = torch.randn(1, 256, generator=g)
    state['state_dict']['classifier.blocks.2.small_h_attention_pool.bias'] = torch.randn(1, generator=g)
    state['state_dict']['classifier.blocks.2.small_h_fc.weight'] = torch.randn(100, 256, generator=g)
    state['state_dict']['classifier.blocks.2.small_h_fc.bias'] = torch.randn(100, generator=g)
    torch.save(state, tmp_path / 'htm.pth')
    overlay = dict(file=str(tmp_path / 'htm.pth'), num_classes=100)
    with caplog.at_level(logging.INFO, logger='timm_plugin.cct'):
        model = timm.create_model('cct_7_3x1_32', pretrained=True, num_classes=100, pretrained_cfg_overlay=overlay)
    dropped = [r.getMessage() for r in caplog.records if 'ScoreNet' in r.getMessage()]
    assert len(dropped) == 1 and 'tokenmixup_scorenet.2' in dropped[0], dropped
    assert not hasattr(model, 'tokenmixup_scorenet')
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        assert (model.double().eval()(x) - public(x)).abs().max() < 1e-10
    from timm_plugin.tokenmixup import attach_scorenets

    model = timm.create_model('cct_7_3x1_32', num_classes=100)
    attach_scorenets(model, [2])
    filtered = checkpoint_filter_fn(torch.load(tmp_path / 'htm.pth', weights_only=True), model)
    model.load_state_dict(filtered, strict=True)  # the ScoreNet kept where the model has it
    assert torch.equal(
        model.tokenmixup_scorenet['2'].fc.bias, state['state_dict']['classifier.blocks.2.small_h_fc.bias']
    )


def test_sine_is_the_public_learnable_model_and_the_fixed_sinusoid_on_request():
    """``cct_7_3x1_32_sine`` is what the public code builds under that name (a learnable embedding: 3,783,269
    parameters with 100 classes, as counted against the public model; the paper's CIFAR-10 model);
    ``positional='sine'`` is CCT's fixed sinusoid, a buffer (65,536 fewer)."""
    public_named = timm.create_model('cct_7_3x1_32_sine', num_classes=100)
    assert timm.create_model('cct_7_3x1_32_sine').num_classes == 10
    assert isinstance(public_named.pos_embed, nn.Parameter) and public_named.pos_embed.requires_grad
    assert sum(p.numel() for p in public_named.parameters()) == 3_783_269
    assert 'pos_embed' in public_named.state_dict()
    fixed = timm.create_model('cct_7_3x1_32_sine', positional='sine', num_classes=100)
    assert 'pos_embed' not in dict(fixed.named_parameters()) and 'pos_embed' not in fixed.state_dict()
    assert sum(p.numel() for p in fixed.parameters()) == 3_717_733
    assert torch.equal(fixed.pos_embed, sinusoidal_embedding(256, 256))
    # the public sinusoid, written out: sin on even, cos on odd channels of p / 10000^(2 (i // 2) / D)
    p, i = 5, 7
    assert abs(float(fixed.pos_embed[0, p, i]) - torch.cos(torch.tensor(p / 10000 ** (2 * (i // 2) / 256)))) < 1e-6
    with pytest.raises(ValueError, match="positional: expected 'learnable' or 'sine'"):
        timm.create_model('cct_7_3x1_32', positional='none')
