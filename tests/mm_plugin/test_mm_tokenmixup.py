"""TokenMixup on MMPretrain: parity with timm on converted weights (the same plan, targets and logits through
the shared driver), the classifier's loss, a CCT through TIMMBackbone, and mmpretrain's own tools/train.py."""

import pytest
import torch
from mmengine.config import Config
from mmpretrain.registry import MODELS
from mmpretrain.structures import DataSample
from timm.models.vision_transformer import VisionTransformer as TimmViT

import mm_plugin  # noqa: F401
from mm_plugin import TokenMixupClassifier
from mm_plugin.convert import timm_vit_to_mmpretrain
from timm_plugin import TokenMixup

from ..conftest import REPO
from ..helpers.observers import record_into
from ..helpers.processes import mmpretrain_train
from ..shared_core.test_tokenmixup_core import tie_free

C = 6
# ρ > 0: at ρ = 0 with every row easy the optimal assignment is tied (a reversed cycle has the same total), and
# two implementations whose saliency differs by float noise may pick either
TM = dict(htm_layers=[3], vtm_layers=[5], rho=0.005, tau=1e9, kappa=2, scorenet_weight=0.01)


def mm_model(**tokenmixup):
    return MODELS.build(
        dict(
            type='TokenMixupClassifier',
            tokenmixup=tokenmixup,
            backbone=dict(type='VisionTransformer', arch='deit-tiny', img_size=32, patch_size=8),
            neck=None,
            head=dict(type='VisionTransformerClsHead', num_classes=C, in_channels=192),
        )
    )


def test_timm_and_mmpretrain_make_the_same_plan_targets_and_logits():
    torch.manual_seed(0)
    timm_model = TimmViT(img_size=32, patch_size=8, embed_dim=192, depth=12, num_heads=3, num_classes=C).train()
    with torch.no_grad():  # peaked attention, so that the plans are not ties
        for blk in timm_model.blocks:
            blk.attn.qkv.weight.normal_(0, 0.15)
    tm = TokenMixup(timm_model, **TM)
    mm = mm_model(**TM).train()
    state = timm_vit_to_mmpretrain(
        {k: v for k, v in timm_model.state_dict().items() if not k.startswith('tokenmixup_scorenet.')}
    )
    mm.load_state_dict(
        dict(state, **{k: v for k, v in timm_model.state_dict().items() if k.startswith('tokenmixup_scorenet.')}),
        strict=True,
    )
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, 32, 32, generator=g)
    y = torch.rand(5, C, generator=g).softmax(-1)
    with tm.hooks.observing(record_into(record := {})):
        logits, target = tm.mix_forward(x, y)
    seen = record[3]
    assert tie_free(seen['saliency'], seen['easy'].tolist(), TM['rho'], tol=1e-4, margin=1e-3)  # one plan to find
    feats, mm_y, aux, stats, mixes = mm.tokenmixup.run(y, lambda: mm.extract_feat(x))
    assert target.stats['htm3']['mixed'] > 0 and stats == target.stats
    assert torch.equal(mixes[0].partner, target.mixes[0].partner)
    assert torch.equal(mixes[0].token_share, target.mixes[0].token_share)
    assert torch.allclose(mm_y, target, atol=1e-6)
    assert torch.allclose(mm.head(feats), logits, atol=1e-4)
    assert torch.allclose(aux, target.aux_loss, atol=1e-6)


def test_mmpretrain_judges_difficulty_on_the_smoothed_target_as_timm():
    """mmpretrain smooths in the head's loss (LabelSmoothLoss), after the classifier wrote ``gt_score``; timm's target
    arrives smoothed. With τ between a sample's smoothed and unsmoothed difficulty (the two judgements differ), the
    mm classifier marks the same samples easy as timm's ``TokenMixup(smoothing=0.1)``, trains the ScoreNet on the
    same target, and writes the unsmoothed relabelled score, which the loss smooths into timm's target."""
    from mmpretrain.models.losses import LabelSmoothLoss

    from mm_plugin.tokenmixup import head_smoothing
    from shared_core.label_maps import smooth

    eps, labels = 0.1, torch.tensor([0, 1, 2, 3, 4])
    torch.manual_seed(0)
    timm_model = TimmViT(img_size=32, patch_size=8, embed_dim=192, depth=12, num_heads=3, num_classes=C).train()
    with torch.no_grad():
        for blk in timm_model.blocks:
            blk.attn.qkv.weight.normal_(0, 0.15)
        for net in TokenMixup(timm_model, **TM).hooks.nets.values():  # a ScoreNet that is sure of some samples
            net.fc.weight.normal_(0, 0.5)
    x = torch.randn(5, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    tm = TokenMixup(timm_model, **dict(TM, smoothing=eps))
    with tm.hooks.observing(record_into(record := {})):
        tm.mix_forward(x, labels)
        smoothed = record[3]['difficulty']
        tm.smoothing = 0.0
        tm.mix_forward(x, labels)
        plain = record[3]['difficulty']
    k = int((smoothed - plain).abs().argmax())
    tau = float(smoothed[k] + plain[k]) / 2
    assert (smoothed <= tau).tolist() != (plain <= tau).tolist()  # the two judgements differ
    tm.hooks.tau, tm.smoothing = tau, eps
    with tm.hooks.observing(record_into(record := {})):
        logits, target = tm.mix_forward(x, labels)
    seen = record[3]
    assert seen['easy'].tolist() == (smoothed <= tau).tolist()

    mm = MODELS.build(
        dict(
            type='TokenMixupClassifier',
            tokenmixup=dict(TM, tau=tau),
            backbone=dict(type='VisionTransformer', arch='deit-tiny', img_size=32, patch_size=8),
            neck=None,
            head=dict(
                type='VisionTransformerClsHead',
                num_classes=C,
                in_channels=192,
                loss=dict(type='LabelSmoothLoss', label_smooth_val=eps, mode='original'),
            ),
        )
    ).train()
    assert isinstance(mm.head.loss_module, LabelSmoothLoss) and head_smoothing(mm.head) == eps
    state = timm_vit_to_mmpretrain(
        {k: v for k, v in timm_model.state_dict().items() if not k.startswith('tokenmixup_scorenet.')}
    )
    nets = {k: v for k, v in timm_model.state_dict().items() if k.startswith('tokenmixup_scorenet.')}
    mm.load_state_dict(dict(state, **nets), strict=True)
    samples = [DataSample().set_gt_label(int(i)) for i in labels]
    with mm.tokenmixup.observing(record_into(mm_record := {})):
        losses = mm.loss(x, samples)
    assert mm_record[3]['easy'].tolist() == seen['easy'].tolist()
    assert torch.allclose(mm_record[3]['difficulty'], seen['difficulty'], atol=1e-5)
    assert torch.allclose(losses['loss_scorenet'], target.aux_loss, atol=1e-6)
    scores = torch.stack([s.gt_score for s in samples])
    assert torch.allclose(scores.sum(1), torch.ones(5), atol=1e-6)
    assert torch.allclose(smooth(scores, eps), target, atol=1e-6)  # what LabelSmoothLoss makes of it: timm's target
    with pytest.raises(ValueError, match="mode='multi_label'"):
        head_smoothing(_Head(LabelSmoothLoss(0.1, mode='multi_label')))


class _Head(torch.nn.Module):
    def __init__(self, loss):
        super().__init__()
        self.loss_module = loss


def test_loss_writes_the_relabelled_scores_and_the_scorenet_loss():
    torch.manual_seed(0)
    model = mm_model(**TM).train()
    x = torch.randn(4, 3, 32, 32)
    samples = [DataSample().set_gt_label(i) for i in range(4)]
    losses = model.loss(x, samples)
    assert {'loss', 'loss_scorenet', 'htm_mixed'} <= set(losses) and float(losses['htm_mixed']) > 0
    scores = torch.stack([s.gt_score for s in samples])
    assert torch.allclose(scores.sum(1), torch.ones(4)) and not torch.equal(scores, torch.eye(C)[:4])
    (losses['loss'] + losses['loss_scorenet']).backward()
    assert model.tokenmixup_scorenet['3'].fc.weight.grad is not None
    model.eval()
    assert len(model.predict(x)) == 4
    with pytest.raises(ValueError, match=r'tokenmixup: unknown keys \[.htm.\]'):
        mm_model(htm=[1])
    with pytest.raises(ValueError, match='tokenmixup.htm_layers'):
        mm_model(htm_layers=[12])
    with pytest.raises(ValueError, match='backbone: TokenMixup supports'):
        MODELS.build(
            dict(
                type='TokenMixupClassifier',
                tokenmixup=dict(htm_layers=[1]),
                backbone=dict(type='ResNet', depth=18),
                neck=None,
                head=dict(type='LinearClsHead', num_classes=C, in_channels=512),
            )
        )


def test_cct_config_through_timm_backbone():
    cfg = Config.fromfile(str(REPO / 'configs' / 'mmpretrain' / 'cct-7-3x1_cifar100_tokenmixup-htm.py'))
    assert cfg.model.tokenmixup == dict(
        htm_layers=[2], rho=0.005, tau=0.2, scorenet='attn_pool', scorenet_weight=0.001
    )  # the public CIFAR-100 HTM config
    model_cfg = cfg.model
    model_cfg.data_preprocessor = cfg.data_preprocessor
    model = MODELS.build(model_cfg)
    assert isinstance(model, TokenMixupClassifier)
    model.tokenmixup.tau, model.tokenmixup.rho = 1e9, 0.0  # an untrained CCT's saliency is nearly flat
    losses = model.loss(torch.randn(4, 3, 32, 32), [DataSample().set_gt_label(i) for i in range(4)])
    assert torch.isfinite(losses['loss']) and float(losses['htm_mixed']) > 0


@pytest.mark.slow
def test_upstream_train_py_runs_the_tokenmixup_config(tiny_world, tmp_path, run_env):
    run_env['TOKENAUG_WORLD'] = str(tiny_world)
    log = mmpretrain_train('deit-tiny_world_tokenmixup.py', tmp_path, run_env, tmp_path)
    assert 'Epoch(train) [1][2/2]' in log and 'accuracy/top1' in log and 'loss_scorenet' in log
    assert "type='TokenMixupClassifier'" in (tmp_path / 'deit-tiny_world_tokenmixup.py').read_text()
