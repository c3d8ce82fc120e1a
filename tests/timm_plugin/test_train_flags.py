"""``tokenaug-train`` is a superset of timm's ``train.py``: every flag with timm's default and help text
(diffed against the flag table ``tests/data/timm_train_flags.json``, made by ``scripts/timm_flag_table.py``),
YAML configs read as timm 1.0.31 reads them, a timm ``args.yaml`` runs, and timm's newer flags work."""

import argparse
import json
import logging
from pathlib import Path

import pytest
import torch
import yaml

from timm_plugin.recipe import resolve_flags
from tokenaug.train_args import REFUSED, build_parser, check_supported, parse_args

TABLE = json.loads((Path(__file__).parents[1] / 'data' / 'timm_train_flags.json').read_text())
#: the defaults we change on purpose, and why (docs/guides/timm.md, "Where we depart from timm's train.py")
DEFAULT_EXCEPTIONS = {'device': "'cuda' where CUDA is available, else 'cpu' (timm's 'cuda' fails there)"}


def _ours():
    p = build_parser()
    return {a.dest: a for a in p._actions if not isinstance(a, argparse._HelpAction)}


def _config_action():
    from tokenaug.train_args import config_parser

    return next(a for a in config_parser._actions if a.dest == 'config')


def test_every_timm_flag_with_its_default_and_help():
    ours = _ours()
    ours['config'] = _config_action()
    missing, wrong_default, wrong_help = [], [], []
    for row in TABLE['flags']:
        action = ours.get(row['dest'])
        if action is None or not set(row['flags']) <= set(action.option_strings):
            missing.append(row['flags'] or row['dest'])
            continue
        default = action.default
        if isinstance(default, tuple):
            default = list(default)
        if row['dest'] not in DEFAULT_EXCEPTIONS and default != row['default']:
            wrong_default.append((row['dest'], row['default'], default))
        if row['help'] and not (action.help or '').startswith(row['help']):
            wrong_help.append(row['dest'])
    assert not missing, f'timm flags missing from tokenaug-train: {missing}'
    assert not wrong_default, f'defaults that differ from timm train.py (name, timm, ours): {wrong_default}'
    assert not wrong_help, f"help text that is not timm's: {wrong_help}"
    assert len(TABLE['flags']) >= 179  # the 173 of the stored train.py and timm 1.0.31's six
    assert parse_args([]).device == ('cuda' if torch.cuda.is_available() else 'cpu')  # resolved after parsing


def test_every_flag_has_help_and_no_help_cites_a_file_outside_the_package():
    for dest, action in _ours().items():
        assert action.help, f'{dest} has no help text'
        assert '.md' not in action.help, f'{dest} cites a file: {action.help}'


def test_refused_flags_are_named_when_set_and_pass_at_their_defaults(tmp_path):
    args = parse_args(['--data-dir', str(tmp_path)])
    check_supported(args)  # every refused flag at its default: accepted
    for argv, flag in (
        (['--aug-splits', '2'], '--aug-splits'),
        (['--jsd-loss'], '--jsd-loss'),
        (['--naflex-loader'], '--naflex-loader'),
        (['--kd-model-name', 'resnet18'], '--kd-model-name'),
        (['--train-img-sizes', '96', '112'], '--train-img-sizes'),
        (['--torchscript'], '--torchscript'),
    ):
        with pytest.raises(ValueError, match=flag):
            check_supported(parse_args(['--data-dir', str(tmp_path), *argv]))
    assert set(REFUSED) <= set(_ours())


def _with_config(tmp_path, cfg, *argv):
    path = tmp_path / 'config.yaml'
    path.write_text(yaml.safe_dump(cfg))
    return parse_args(['--config', str(path), '--data-dir', '/nonexistent', *argv])


def test_config_unknown_key_warns_as_timm(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        args = _with_config(tmp_path, dict(lr=0.5, not_an_arg=1))
    assert args.lr == 0.5 and not hasattr(args, 'not_an_arg')
    assert 'not_an_arg' in caplog.text


@pytest.mark.parametrize(
    'cfg',
    [
        dict(train_size_schedule='nope'),  # invalid choice
        dict(lr='fast'),  # non-numeric string where a float is expected
        dict(input_size=224),  # scalar where a list is expected
        dict(decay_milestones=[1, 'x']),
        dict(input_size=[3, 32]),  # nargs=3
        dict(amp='yes'),  # a flag takes true/false
    ],
)
def test_config_rejects_invalid_values(tmp_path, cfg):
    with pytest.raises(SystemExit):
        _with_config(tmp_path, cfg)


def test_config_accepts_and_converts_values_as_the_command_line(tmp_path):
    args = _with_config(
        tmp_path,
        dict(
            sched='wsd',
            lr='3e-4',  # YAML 1.1 reads 3e-4 as a string
            epochs='10',
            input_size=[3, 32, 32],
            mean=['0.5', 0.4, '0.3'],
            amp=True,
            model_ema=True,
            pretrained_cfg_overlay={'num_classes': 10},
            save_epochs=[4, 8],
            stop_epoch=None,
        ),
    )
    assert args.sched == 'wsd' and args.lr == 3e-4 and args.epochs == 10 and args.input_size == [3, 32, 32]
    assert args.mean == [0.5, 0.4, 0.3] and args.amp and args.save_epochs == [4, 8]
    assert args.pretrained_cfg_overlay == {'num_classes': 10}
    # the command line still wins
    assert _with_config(tmp_path, dict(lr=0.5), '--lr', '0.1').lr == 0.1


def test_pretrained_path_reinitialises_the_head_as_timm(tmp_path):
    """timm's train.py loads --pretrained-path with num_classes=-1: the body comes from the file, the
    classifier is always new (also when the class count matches)."""
    import timm

    from timm_plugin.recipe import build_model

    src = timm.create_model('vit_tiny_patch16_224', num_classes=10, img_size=32, patch_size=8, depth=1)
    torch.nn.init.constant_(src.head.weight, 0.25)
    path = tmp_path / 'src.pth'
    torch.save(src.state_dict(), path)
    args = parse_args(
        ['--data-dir', str(tmp_path), '--model', 'vit_tiny_patch16_224', '--pretrained-path', str(path)]
        + ['--num-classes', '10', '--model-kwargs', 'img_size=32', 'patch_size=8', 'depth=1']
    )
    model = build_model(args)
    assert torch.equal(model.patch_embed.proj.weight, src.patch_embed.proj.weight)
    assert torch.equal(model.blocks[0].attn.qkv.weight, src.blocks[0].attn.qkv.weight)
    assert not torch.equal(model.head.weight, src.head.weight)
    args.head_init_scale, args.head_init_bias = 0.0, 0.5  # --head-init-scale / --head-init-bias, as timm
    model = build_model(args)
    assert torch.all(model.head.weight == 0) and torch.all(model.head.bias == 0.5)


# real runs on the tiny world --------------------------------------------------------------------------------
CONFIG = str(Path(__file__).resolve().parents[2] / 'configs' / 'timm' / 'world_vit-tiny.yaml')
FAST = ['--model-kwargs', 'img_size=112', 'depth=1', '-b', '8', '--workers', '0', '--device', 'cpu']


def _summary_epochs(exp_dir):
    import csv

    with (exp_dir / 'summary.csv').open() as f:
        lines = [line for line in f.read().splitlines() if line]
    assert sum(line.startswith('epoch') for line in lines) == 1, 'one header'
    return [int(r['epoch']) for r in csv.DictReader(lines)]


def _epoch(path):
    return torch.load(path, map_location='cpu', weights_only=True)['epoch']


@pytest.mark.slow
def test_timm_1031_stop_save_epochs_val_interval_and_resume_auto(tiny_world, tmp_path):
    """timm 1.0.31's tests/test_train_resume.py scenarios, through tokenaug-train with a method."""
    from timm_plugin.train import run

    base = ['-c', CONFIG, '--data-dir', str(tiny_world / 'imagenet'), '--output', str(tmp_path), *FAST]
    base += ['--method', 'tl_align', '--epochs', '4', '--warmup-epochs', '0']
    stop = tmp_path / 'stop'
    run([*base, '--experiment', 'stop', '--stop-epoch', '2', '--save-epochs', '1', '2', '--val-interval', '2'])
    # the milestone after 1 epoch forces an evaluation that the interval would skip; the stop is evaluated
    assert _summary_epochs(stop) == [0, 1]
    assert _epoch(stop / 'milestone-1.pth.tar') == 0 and _epoch(stop / 'milestone-2.pth.tar') == 1
    assert yaml.safe_load((stop / 'args.yaml').read_text())['stop_epoch'] == 2
    with pytest.raises(ValueError, match='stop-epoch'):
        run([*base, '--experiment', 'bad', '--stop-epoch', '5'])

    auto = [*base, '--experiment', 'auto', '--resume', 'auto', '--checkpoint-hist', '2']
    run([*auto, '--stop-epoch', '2'])  # nothing to resume: a fresh run in the experiment folder
    exp = tmp_path / 'auto'
    assert _summary_epochs(exp) == [0, 1] and _epoch(exp / 'last.pth.tar') == 1
    run(auto)  # the same command without the stop continues from last.pth.tar
    assert _summary_epochs(exp) == [0, 1, 2, 3] and _epoch(exp / 'last.pth.tar') == 3
    assert len(list(exp.glob('checkpoint-*.pth.tar'))) == 2
    assert yaml.safe_load((exp / 'args.yaml').read_text())['resume'] == 'auto'
    run(auto)  # complete: a no-op that leaves the summary as it is
    assert _summary_epochs(exp) == [0, 1, 2, 3]
    with pytest.raises(SystemExit):
        run([*base, '--resume', 'auto'])  # auto needs --experiment


@pytest.mark.slow
def test_a_timm_args_yaml_runs(tiny_world, tmp_path):
    """An ``args.yaml`` as timm's train.py writes it (every one of its arguments, ``yaml.safe_dump``),
    read with ``-c``; the command line sets the machine's device."""
    from timm_plugin.train import run

    timm_args = {row['dest']: row['default'] for row in TABLE['flags'] if row['dest'] != 'config'}
    world = yaml.safe_load(open(CONFIG))
    timm_args.update({k: v for k, v in world.items() if k in timm_args})
    timm_args.update(
        data_dir=str(tiny_world / 'imagenet'),
        model_kwargs={'img_size': 112, 'depth': 1},
        batch_size=8,
        workers=0,
        epochs=1,
        output=str(tmp_path),
        experiment='timm',
        channels_last=True,
        recovery_interval=1,
        val_interval=1,
        log_wandb=True,  # wandb is not installed: timm's warning, no failure
    )
    path = tmp_path / 'args.yaml'
    path.write_text(yaml.safe_dump(timm_args))
    metrics = run(['-c', str(path), '--device', 'cpu'])
    assert 0 <= metrics['top1'] <= 100
    assert list((tmp_path / 'timm').glob('recovery-*.pth.tar'))


@pytest.mark.slow
def test_torchcompile_trains_plain_and_with_in_model_methods(tiny_world, tmp_path):
    """``--torchcompile`` as timm's (the task compiles the trainable module), with and without a method that runs
    inside the model (the compiled graph traces its hooks; tests/timm_plugin/test_compile.py checks the numbers)."""
    from timm_plugin.train import run

    base = ['-c', CONFIG, '--data-dir', str(tiny_world / 'imagenet'), '--output', str(tmp_path), *FAST]
    base += ['--epochs', '1', '--torchcompile', 'aot_eager', '--cutmix', '1.0']
    assert 0 <= run([*base, '--experiment', 'compiled'])['top1'] <= 100
    assert 0 <= run([*base, '--experiment', 'tl_align', '--method', 'tl_align'])['top1'] <= 100


def test_each_yaml_says_which_of_its_keys_timms_train_py_would_ignore():
    """timm's own ``train.py -c`` sets every YAML key as a default and ignores the ones its parser does not know:
    a tokenaug YAML would train without its method, silently. Each of ours says so in its first line, naming
    exactly those keys (against the flag table of timm's script)."""
    import re

    import yaml

    timm_dests = {f['dest'] for f in TABLE['flags']}
    configs = sorted((Path(__file__).parents[2] / 'configs' / 'timm').glob('*.yaml'))
    assert configs
    for path in configs:
        text = path.read_text()
        first = text.splitlines()[0]
        ours = sorted(k for k in yaml.safe_load(text) if k not in timm_dests)
        assert first.startswith(f'# tokenaug-train config (tokenaug-train -c {path.name})'), path.name
        named = re.search(r'would ignore its keys (.*) without a word', first).group(1)
        assert named == (', '.join(ours) or '(none)'), (path.name, named, ours)


def _spellings():
    """Every spelling of a method over a kind, with the canonical one it must equal: ``--mixup-type METHOD``
    (the promised spelling, the method over ``cutmix``) and ``--method METHOD [--mixup-type KIND]``, on the command
    line and from YAML."""
    from shared_core.samplers import MIX_KINDS

    for method in ('tl_align', 'transmix'):
        canonical = ['--method', method, '--mixup-type', 'cutmix']
        yield ['--mixup-type', method], {'mixup_type': method}, canonical
        yield ['--method', method], {'method': method}, canonical
        yield ['--method', method, '--mixup-type', method], {'method': method, 'mixup_type': method}, canonical
        for kind in MIX_KINDS:
            canonical = ['--method', method, '--mixup-type', kind]
            yield canonical, {'method': method, 'mixup_type': kind}, canonical
    for kind in ('mixup', 'cutmix', 'token_box', 'tokenmix', 'mixtoken'):
        yield ['--mixup-type', kind], {'mixup_type': kind}, ['--mixup-type', kind]


@pytest.mark.parametrize(
    'argv, yaml_cfg, canonical', [pytest.param(*case, id=' '.join(case[0])) for case in _spellings()]
)
def test_every_spelling_parses_to_its_canonical_arguments(tmp_path, argv, yaml_cfg, canonical):
    """``--mixup-type tl_align`` / ``transmix`` (the promised spelling) parse and resolve (``resolve_flags``, as
    ``build_training`` does) with no warning at all, from the command line and from YAML, into the method over
    ``cutmix``; every spelling resolves to exactly the arguments of its canonical ``--method METHOD --mixup-type
    KIND`` (the whole namespace, not only the two fields)."""
    import warnings

    def resolved(argv):  # the arguments as the recipe reads them (build_training resolves them first)
        args = parse_args(argv)
        resolve_flags(args)
        return vars(args)

    with warnings.catch_warnings():
        warnings.simplefilter('error')
        want = resolved(canonical)
    cfg = tmp_path / 'run.yaml'
    cfg.write_text(yaml.safe_dump(yaml_cfg))
    for args in (argv, ['-c', str(cfg)]):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            got = resolved(args)
        got['config'] = ''
        assert got == want, args
        assert not caught, [str(w.message) for w in caught]


def test_contradictory_spellings_are_refused_by_name():
    with pytest.raises(ValueError, match='--mixup-type tl_align: a method, and --method transmix names one too'):
        resolve_flags(parse_args(['--mixup-type', 'tl_align', '--method', 'transmix']))
    with pytest.raises(SystemExit):  # --method-mix (0.1.0's kind under a method, deprecated since) is gone
        parse_args(['--method', 'tl_align', '--method-mix', 'cutmix'])


def test_help_lists_the_methods_among_the_mixing_kinds(capsys):
    """``tokenaug-train --help``: ``tl_align`` and ``transmix`` among ``--mixup-type``'s choices, each choice with
    one line on what it does."""
    with pytest.raises(SystemExit):
        parse_args(['--help'])
    text = capsys.readouterr().out
    block = text[text.index('  --mixup-type {') :].split('\n  --')[0]
    assert block.splitlines()[0].endswith('tokenmix,tl_align,transmix}')
    lines = [line.strip() for line in block.splitlines()]
    for kind in ('mixup', 'cutmix', 'token_box', 'tokenmix', 'mixtoken', 'tl_align', 'transmix'):
        assert sum(line.startswith(f'{kind}: ') for line in lines) == 1, kind
    assert 'tl_align: TL-Align over cutmix' in block and 'transmix: TransMix over cutmix' in block
    assert '--method-mix' not in text


def test_initial_checkpoint_loads_the_methods_modules_it_holds(tmp_path, caplog):
    """``--initial-checkpoint`` of a TokenMixup or token-labeling run (ScoreNets, aux head): the method's modules are
    attached before the file loads, so the matching flags load them strictly; a plain file starts them afresh (one
    log line); a file with modules the flags do not attach is refused, naming the flag that would. The annotator
    (``tokenaug-maps generate --checkpoint``, ``tokenaug-occlusion``) loads such a file too."""
    import logging

    import timm

    from timm_plugin.annotator import create_annotator
    from timm_plugin.recipe import attach_method_modules, build_model, build_training
    from timm_plugin.token_labeling import attach_aux_head
    from timm_plugin.tokenmixup import attach_scorenets

    kw = dict(img_size=32, patch_size=8, depth=2, num_classes=5)
    src = timm.create_model('vit_tiny_patch16_224', **kw)
    attach_scorenets(src, [1])
    attach_aux_head(src)
    with torch.no_grad():
        for p in src.parameters():
            p.normal_(0, 0.3)
    full = {k: v.clone() for k, v in src.state_dict().items()}
    files = {}
    for name, keep in (('htm', 'tokenmixup_scorenet.'), ('dense', 'aux_head.'), ('plain', None)):
        files[name] = tmp_path / f'{name}.pth'
        state = {k: v for k, v in full.items() if not k.startswith(('aux_head.', 'tokenmixup_scorenet.')) or
                 (keep and k.startswith(keep))}  # fmt: skip
        torch.save({'state_dict': state, 'epoch': 3}, files[name])
    base = ['--model', 'vit_tiny_patch16_224', '--num-classes', '5', '--model-kwargs']
    base += ['img_size=32', 'patch_size=8', 'depth=2', '--data-dir', str(tmp_path)]

    model = build_training(
        parse_args([*base, '--initial-checkpoint', str(files['htm']), '--tokenmixup-htm-layers', '1'])
    ).model
    assert all(torch.equal(model.state_dict()[k], full[k]) for k in torch.load(files['htm'])['state_dict'])
    args = parse_args([*base, '--initial-checkpoint', str(files['dense'])])
    args.token_label_dir = str(tmp_path)  # dense targets: the aux head (the store is read later, by the loader)
    model = build_model(args, lambda m: attach_method_modules(m, args))
    assert torch.equal(model.aux_head.weight, full['aux_head.weight'])
    with caplog.at_level(logging.INFO, logger='tokenaug.train'):
        argv = [*base, '--initial-checkpoint', str(files['plain']), '--tokenmixup-htm-layers', '1']
        model = build_training(parse_args(argv)).model
    assert torch.equal(model.blocks[0].attn.qkv.weight, full['blocks.0.attn.qkv.weight'])
    assert any('initialised afresh: tokenmixup_scorenet.1' in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match=r"holds TokenMixup's ScoreNets: pass --tokenmixup-htm-layers 1 to load"):
        build_training(parse_args([*base, '--initial-checkpoint', str(files['htm'])]))
    with pytest.raises(ValueError, match=r"holds token labeling's aux head: pass --token-label-dir MAPS"):
        build_training(parse_args([*base, '--initial-checkpoint', str(files['dense'])]))
    for name in ('htm', 'dense'):
        annotator = create_annotator('vit_tiny_patch16_224', checkpoint=str(files[name]), model_kwargs=kw)
        assert torch.equal(annotator.head.weight, full['head.weight'])


def test_recipe_builds_what_the_flags_name():
    """``build_training``: the method and kind, the mixer's arguments once (the trainer's and tokenaug-viz's mixer),
    and timm's loss factory's criterion for each target kind."""
    from timm.loss import BinaryCrossEntropy, LabelSmoothingCrossEntropy, SoftTargetCrossEntropy

    from timm_plugin.recipe import build_training

    base = ['--model', 'vit_tiny_patch16_224', '--model-kwargs', 'img_size=32', 'depth=1', '--num-classes', '4']
    r = build_training(parse_args([*base, '--method', 'tl_align', '--cutmix', '1', '--smoothing', '0.1']))
    assert (r.method, r.mix_kind, r.in_model) == ('tl_align', 'cutmix', 'tl_align')
    assert r.mixing['method'] == 'tl_align' and r.mixing['patch_size'] == (16, 16) and r.mixing['num_classes'] == 4
    assert isinstance(r.train_loss, SoftTargetCrossEntropy) and type(r.task('cpu')).__name__ == 'TLAlignTask'
    x, y = torch.randn(4, 3, 32, 32), torch.arange(4)
    _, target = r.mixer()(x, y)
    assert target.shape == (4, 4) and torch.allclose(target.sum(1), torch.ones(4))
    plain = build_training(parse_args([*base, '--smoothing', '0.1']))
    assert plain.mixing is None and plain.mix_kind is None and plain.in_model is None
    assert isinstance(plain.train_loss, LabelSmoothingCrossEntropy) and plain.train_loss.smoothing == 0.1
    assert type(plain.task('cpu')).__name__ == 'ClassificationTask'
    bce = build_training(parse_args([*base, '--mixup', '0.8', '--bce-loss', '--bce-target-thresh', '0.2']))
    assert isinstance(bce.train_loss, BinaryCrossEntropy) and bce.train_loss.target_threshold == 0.2
    assert bce.mix_kind == 'mixup' and bce.method is None
    with pytest.raises(ValueError, match='--method tl_align needs --mixup and/or --cutmix'):
        build_training(parse_args([*base, '--method', 'tl_align', '--cutmix', '0']))
    with pytest.raises(ValueError, match='nothing mixes'):
        plain.mixer()
