"""The methods as timm training tasks (timm.task.TrainingTask), in a minimal timm-style loop: what a user of
timm's own train.py gets by changing its task line (docs/guides/timm.md, "With timm's own train.py")."""

import pytest
import timm
import torch
import torch.distributed as dist
from timm.loss import SoftTargetCrossEntropy
from timm.task import ClassificationTask, TrainingTask

import timm_plugin  # noqa: F401  (registers lvvit_*)
from shared_core.label_maps import CropMaps, dense_maps
from timm_plugin import (
    MixTarget,
    TLAlign,
    TLAlignTask,
    TokenLabeling,
    TokenLabelingLoss,
    TokenLabelingTask,
    TransMix,
    TransMixTask,
    attach_aux_head,
    create_mixer,
)
from timm_plugin.token_label_data import TokenLabelTarget

C = 5


def tiny_vit(**kw):
    torch.manual_seed(0)
    return timm.create_model('vit_tiny_patch16_224', img_size=32, patch_size=8, depth=3, num_classes=C, **kw)


def batches(n=3, B=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(B, 3, 32, 32, generator=g), torch.randint(0, C, (B,), generator=g)) for _ in range(n)]


def timm_style_loop(task: TrainingTask, mixer, data, ema: bool = True):
    """timm train.py's step, reduced: mixer -> result = task(input, target) -> backward -> step -> EMA."""
    optimizer = torch.optim.SGD(task.get_trainable_module().parameters(), lr=0.1)
    if ema:
        task.setup_ema(decay=0.5)
    task.train()
    results = []
    for step, (x, y) in enumerate(data):
        if mixer is not None:
            x, y = mixer(x, y)
        result = task(x, y)
        optimizer.zero_grad()
        result['loss'].backward()
        optimizer.step()
        task.update_ema(step=step)
        results.append(result)
    return results


@pytest.mark.parametrize('task_cls, wrapper_cls', [(TLAlignTask, TLAlign), (TransMixTask, TransMix)])
def test_tl_align_and_transmix_tasks_in_a_timm_loop(task_cls, wrapper_cls):
    model = tiny_vit()
    reference = tiny_vit()  # the same weights: the wrapper's result on the same batch
    task = task_cls(model, SoftTargetCrossEntropy(), verbose=False)
    assert isinstance(task, TrainingTask) and isinstance(task, ClassificationTask)
    method = 'tl_align' if task_cls is TLAlignTask else 'transmix'
    mixer = create_mixer(
        'cutmix',
        method=method,
        mixup_alpha=0.0,
        cutmix_alpha=1.0,
        num_classes=C,
        patch_size=8,
        mode='elem',
        generator=torch.Generator().manual_seed(3),
    )
    x, y = batches(1)[0]
    xm, t = mixer(x, y)
    task.train()
    result = task(xm, t)
    logits, aligned = wrapper_cls(reference).train()(xm, t)
    assert set(result) == {'loss', 'output', 'target'}
    assert torch.allclose(result['output'], logits, atol=1e-6)  # the model's own logits
    assert torch.allclose(result['target'], aligned, atol=1e-6)  # the wrapper's aligned target
    assert not torch.allclose(result['target'], t.as_tensor(), atol=1e-3)  # re-weighted, not the area target
    assert torch.allclose(result['loss'], SoftTargetCrossEntropy()(logits, aligned), atol=1e-6)
    # the loop: EMA, checkpoint keys unchanged, eval model = the plain model
    results = timm_style_loop(task, mixer, batches(3))
    assert all(torch.isfinite(r['loss']) for r in results)
    state = task.get_checkpoint_state()
    assert list(state['state_dict']) == list(model.state_dict())
    assert 'state_dict_ema' in task.get_checkpoint_state(ema=True)
    task.eval()
    with torch.no_grad():
        assert torch.equal(task.get_eval_model()(x), model(x))
        task.get_eval_model(ema=True)(x)
    # mixing switched off (a plain target): the ClassificationTask step
    plain = task_cls(tiny_vit(), torch.nn.CrossEntropyLoss(), verbose=False).train()
    out = plain(x, y)
    assert torch.allclose(out['loss'], torch.nn.functional.cross_entropy(out['output'], y))


def test_task_refuses_an_unsupported_model_before_building():
    with pytest.raises(ValueError, match='no tracer for .*EdgeNeXt'):
        with torch.device('meta'):
            TLAlignTask(timm.create_model('edgenext_small', num_classes=C), SoftTargetCrossEntropy())
    with pytest.raises(ValueError, match='layers'):
        TLAlignTask(tiny_vit(), SoftTargetCrossEntropy(), layers=[7])
    with pytest.raises(ValueError, match='mode'):
        TransMixTask(tiny_vit(), SoftTargetCrossEntropy(), mode='mean')
    with pytest.raises(ValueError, match='target: TLAlign needs the MixTarget'):
        TLAlignTask(tiny_vit(), SoftTargetCrossEntropy(), verbose=False).train().method.align(
            torch.randn(2, 3, 32, 32), torch.zeros(2, C)
        )


def label_maps_target(y, seed=0):
    """A TokenLabelTarget with random top-2 maps on a 4x4 grid, whole-image crops, no flips."""
    g = torch.Generator().manual_seed(seed)
    B = y.shape[0]
    probs = torch.rand(B, C, 4, 4, generator=g).softmax(1)
    values, indices = probs.topk(2, dim=1)
    boxes = torch.tensor([[0.0, 0.0, 1.0, 1.0]] * B)
    return TokenLabelTarget.of(y, CropMaps(values.half(), indices, C, boxes, torch.zeros(B, dtype=torch.bool)))


@pytest.mark.parametrize('name', ['vit', 'lvvit'])
def test_token_labeling_task_in_a_timm_loop(name):
    def make():
        torch.manual_seed(0)
        if name == 'lvvit':
            return timm.create_model('lvvit_t', img_size=64, num_classes=C, depth=2)
        return attach_aux_head(timm.create_model('vit_tiny_patch16_224', img_size=64, depth=2, num_classes=C))

    model, reference = make(), make()
    loss_fn = TokenLabelingLoss(C, dense_weight=0.5, smoothing=0.1)
    task = TokenLabelingTask(model, loss_fn, generator=torch.Generator().manual_seed(4), verbose=False)
    wrapper = TokenLabeling(reference, generator=torch.Generator().manual_seed(4)).train()
    x = torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    y = torch.tensor([0, 1, 2, 3])
    target = label_maps_target(y)
    task.train()
    result = task(x, target)
    out = wrapper(x)
    assert out.mix is not None and torch.allclose(result['output'], out.cls, atol=1e-5)
    assert torch.allclose(result['loss'], loss_fn(out, target), atol=1e-5)
    # an explicit check of the dense term: un-mixed aux logits against each sample's own dense maps
    dense = dense_maps(target.maps.values.float(), target.maps.indices, C).flatten(2).transpose(1, 2) * 0.9 + 0.1 / C
    ce = -(dense * out.aux.log_softmax(-1)).sum(-1).mean()
    cls_t = torch.nn.functional.one_hot(y, C) * 0.9 + 0.1 / C
    lam = out.mix.lam.view(-1, 1)
    cls_t = lam * cls_t + (1 - lam) * cls_t.flip(0)
    ce_cls = -(cls_t * out.cls.log_softmax(-1)).sum(-1).mean()
    assert torch.allclose(result['loss'], ce_cls + 0.5 * ce, atol=1e-4)
    # loop, EMA, checkpoints with the model's own keys, eval = the inference rule
    data = [(x, target)] * 2
    results = timm_style_loop(task, None, data)
    assert all(torch.isfinite(r['loss']) for r in results)
    assert list(task.get_checkpoint_state()['state_dict']) == list(model.state_dict())
    assert list(task.get_checkpoint_state(ema=True)['state_dict_ema']) == list(model.state_dict())
    eval_model = task.get_eval_model()
    eval_model.eval()
    assert not model.training  # eval() reaches the model
    with torch.no_grad():
        feats = model.forward_features(x)
        cls = model.head(feats[:, 0])
        aux = model.aux_head(feats[:, 1:])
        assert torch.allclose(eval_model(x), cls + 0.5 * aux.max(1).values, atol=1e-5)
        task.get_eval_model(ema=True).eval()(x)
    # switching MixToken off (--mixup-off-epoch): no mix
    task.train()
    task.sampler.mixup_enabled = False
    assert task.method.outputs(x).mix is None


def test_lvvit_training_forward_is_the_class_head():
    """In training LV-ViT returns the class logits (the method reads the aux head); in eval, the head rule."""
    torch.manual_seed(0)
    model = timm.create_model('lvvit_t', img_size=64, num_classes=C, depth=2)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        feats = model.forward_features(x)
        cls = model.head(feats[:, 0])
        assert torch.allclose(model.train()(x), cls, atol=1e-5)
        assert not torch.allclose(model.eval()(x), cls, atol=1e-3)


def test_prepare_distributed_wraps_the_trainable_module_and_keeps_keys(tmp_path):
    """One gloo process: prepare_distributed wraps the model in DDP (as timm's tasks), the hooks still see the
    forward, gradients equal the unwrapped task's, and checkpoint keys stay the model's."""
    dist.init_process_group('gloo', init_method=f'file://{tmp_path / "store"}', rank=0, world_size=1)
    try:
        model, reference = tiny_vit(), tiny_vit()
        mixer = create_mixer(
            'cutmix',
            method='tl_align',
            mixup_alpha=0.0,
            cutmix_alpha=1.0,
            num_classes=C,
            patch_size=8,
            mode='elem',
            generator=torch.Generator().manual_seed(3),
        )
        x, t = mixer(*batches(1)[0])
        ddp_task = TLAlignTask(model, SoftTargetCrossEntropy(), verbose=False).prepare_distributed()
        plain_task = TLAlignTask(reference, SoftTargetCrossEntropy(), verbose=False)
        assert isinstance(ddp_task.get_trainable_module(), torch.nn.parallel.DistributedDataParallel)
        ddp_task.train()(x, t)['loss'].backward()
        plain_task.train()(x, t)['loss'].backward()
        for (n, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.allclose(p.grad, q.grad, atol=1e-6), n
        assert list(ddp_task.get_checkpoint_state()['state_dict']) == list(reference.state_dict())
    finally:
        dist.destroy_process_group()
    assert isinstance(t, MixTarget)


@pytest.mark.parametrize('prefetcher', [False, True])
def test_readme_diff_for_timm_train_py(prefetcher):
    """The timm guide's two changed lines of timm's train.py, with train.py's own argument dicts and calls: the mixer
    from timm's mixup_args (collate or in-loop), the task built with train.py's keywords, then its step."""
    mixup_args = dict(
        mixup_alpha=0.8,
        cutmix_alpha=1.0,
        cutmix_minmax=None,
        prob=1.0,
        switch_prob=0.5,
        mode='batch',
        label_smoothing=0.1,
        num_classes=C,
    )
    collate_fn = mixup_fn = None
    if prefetcher:
        collate_fn = create_mixer('cutmix', method='tl_align', collate=True, patch_size=8, **mixup_args)
    else:
        mixup_fn = create_mixer('cutmix', method='tl_align', patch_size=8, **mixup_args)
    task = TLAlignTask(
        model=tiny_vit(),
        criterion=SoftTargetCrossEntropy(),
        device=torch.device('cpu'),
        dtype=torch.float32,
        verbose=False,
    )
    model = task.get_trainable_module()
    eval_model = task.get_eval_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    task.train()
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        if prefetcher:  # uint8 samples through the collate, normalised afterwards as timm's prefetcher does
            batch = [(torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8, generator=g), i % C) for i in range(4)]
            input, target = collate_fn(batch)
            input = (input.float() - 127.5) / 64.0
        else:
            input, target = mixup_fn(torch.randn(4, 3, 32, 32, generator=g), torch.arange(4) % C)
        assert isinstance(target, MixTarget)
        result = task(input, target)
        optimizer.zero_grad()
        result['loss'].backward()
        optimizer.step()
        assert torch.isfinite(result['loss']) and torch.allclose(result['target'].sum(1), torch.ones(4))
    assert eval_model is model
