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
from timm_plugin.cct import LAYER_NORM_EPS, sinusoidal_embedding


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


class PublicCCT(nn.Module):
    """The public ``CCT`` (tokenizer, ``TransformerClassifier`` with ``seq_pool=True``) for 32 px, one conv layer."""

    def __init__(self, num_classes, embed_dim=256, depth=7, num_heads=4, mlp_ratio=2.0):
        super().__init__()
        self.conv = nn.Conv2d(3, embed_dim, 3, stride=1, padding=1, bias=False)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.positional_emb = nn.Parameter(torch.zeros(1, 256, embed_dim))  # 'learnable' whatever the name says
        self.blocks = nn.ModuleList(
            [PublicEncoderLayer(embed_dim, num_heads, int(embed_dim * mlp_ratio)) for _ in range(depth)]
        )
        self.norm = nn.LayerNorm(embed_dim)
        self.attention_pool = nn.Linear(embed_dim, 1)
        self.fc = nn.Linear(embed_dim, num_classes)

    def forward(self, x):
        x = self.pool(F.relu(self.conv(x))).flatten(2).transpose(1, 2) + self.positional_emb
        for blk in self.blocks:
            x = blk(x)
        x = self.norm(x)
        return self.fc((F.softmax(self.attention_pool(x), dim=1).transpose(-1, -2) @ x).squeeze(-2))


def public_state(ours: dict) -> dict:
    """Our state dict under the port's names (norm1 is the public pre_norm, norm2 its norm1)."""
    names = {
        'patch_embed.proj.0.weight': 'conv.weight',
        'pos_embed': 'positional_emb',
        'norm.weight': 'norm.weight',
        'norm.bias': 'norm.bias',
        'attention_pool.weight': 'attention_pool.weight',
        'attention_pool.bias': 'attention_pool.bias',
        'head.weight': 'fc.weight',
        'head.bias': 'fc.bias',
    }
    block = {
        'norm1': 'pre_norm',
        'attn.qkv': 'self_attn.qkv',
        'attn.proj': 'self_attn.proj',
        'norm2': 'norm1',
        'mlp.fc1': 'linear1',
        'mlp.fc2': 'linear2',
    }
    out = {}
    for k, v in ours.items():
        if k.startswith('blocks.'):
            _, i, rest = k.split('.', 2)
            mod, leaf = rest.rsplit('.', 1)
            out[f'blocks.{i}.{block[mod]}.{leaf}'] = v
        else:
            out[names[k]] = v
    return out


def peaked(model):
    """Random LayerNorm affines and sharp attention, so that an eps difference shows in the logits."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for blk in model.blocks:
            blk.attn.qkv.weight.mul_(8.0)
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(torch.rand(m.weight.shape, generator=g) * 2)
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)
    return model


@pytest.mark.parametrize('name, classes', [('cct_7_3x1_32', 100), ('cct_7_3x1_32_sine', 10)])
def test_cct_equals_the_public_model_in_float64(name, classes):
    """Same weights: the logits of ours and of the public port agree to float64 noise, every LayerNorm has eps
    1e-5; with timm's block default eps 1e-6 they would differ by far more (the pin bites)."""
    model = peaked(timm.create_model(name)).double().eval()
    assert model.num_classes == classes
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    assert len(norms) == 2 * 7 + 1 and all(m.eps == LAYER_NORM_EPS == 1e-5 for m in norms)
    public = PublicCCT(classes).double().eval()
    public.load_state_dict(public_state(model.state_dict()), strict=True)
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        ours, ref = model(x), public(x)
        assert (ours - ref).abs().max() < 1e-10
        for m in norms[:-1]:
            m.eps = 1e-6  # timm's Block default: what the blocks had before
        assert (model(x) - ref).abs().max() > 1e-6


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
