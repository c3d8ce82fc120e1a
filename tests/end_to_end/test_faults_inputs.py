"""Faults from the fault-injection pass (reviews/reliability.md), second part: images that cannot be opened, a run
that a second one would replace, a split that is not there, numbers that would switch a method off or poison the
run, checkpoints named as what they are, and the API's sharp edges. Each case: a clear error naming the argument
or the file, or the documented behaviour, and nothing lost."""

import argparse
import hashlib
import logging
import os
import random
import shutil

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from timm.data import create_dataset

from timm_plugin.image_data import SKIP_WINDOW, CheckedImageDataset, UnreadableImageError, read_image

from ..end_to_end.test_faults import train_cmd


def sha(path):
    return hashlib.sha256(open(path, 'rb').read()).hexdigest()


def image_folder(root, files):
    """``root/train/<class>/<name>``: ``files`` maps a relative path to a writer ``f(path)``."""
    for rel, write in files.items():
        path = root / 'train' / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        write(path)
    return root


def rgb(value):
    return lambda p: Image.fromarray(np.full((8, 8, 3), value, np.uint8)).save(p)


# 1. an image that cannot be opened is skipped by name; a broken dataset stops -------------------------------------
def test_unopenable_oversized_and_16_bit_images(tmp_path, caplog):
    """A dangling link (a file removed mid-run, EIO on NFS take the same path) and an image over Pillow's
    decompression-bomb limit are skipped for the next one, each named; ``skip=False`` names them in the error. A
    16-bit grayscale PNG is scaled to 8 bits (Pillow's RGB conversion clips it to white)."""

    def dangling(p):
        os.symlink(p.parent / 'gone.jpg', p)

    def bomb(p):  # 20000 x 20000 1-bit: 48 KB on disk, 400 M pixels decoded (over Pillow's limit)
        Image.new('1', (20000, 20000)).save(p)

    def sixteen_bit(p):
        Image.fromarray(np.full((8, 8), 30000, np.uint16)).save(p)

    root = image_folder(
        tmp_path,
        {'c0/a.png': rgb(10), 'c0/b.jpg': dangling, 'c0/c.png': bomb, 'c1/d.png': sixteen_bit, 'c1/e.png': rgb(20)},
    )
    base = create_dataset('', root=str(root), split='train', is_training=True)
    assert Image.open(root / 'train' / 'c1' / 'd.png').mode.startswith('I;16')
    img, _, i = read_image(base, 3, mode='RGB')
    assert i == 3 and abs(np.asarray(img).mean() - 30000 / 256) < 1  # not 255
    with caplog.at_level(logging.WARNING):
        img, target, i = read_image(base, 1, mode='RGB')  # b.jpg (dangling), c.png (bomb), then d.png
    assert i == 3 and target == 1
    skipped = [r.getMessage() for r in caplog.records if 'Skipped unreadable image' in r.getMessage()]
    assert len(skipped) == 2 and 'b.jpg' in skipped[0] and 'c.png' in skipped[1] and 'decompression' in skipped[1]
    for index, name in ((1, 'b.jpg'), (2, 'c.png')):
        with pytest.raises(UnreadableImageError, match=rf'image .*{name} \(index {index}\) cannot be read'):
            read_image(base, index, skip=False)
    ds = CheckedImageDataset(base)
    assert [ds[k][1] for k in range(len(ds))] == [0, 1, 1, 1, 1]  # every index gives a sample


def test_a_dataset_that_is_mostly_unreadable_stops_with_a_clear_error(tmp_path):
    """Two files of every three unreadable: skipping one by one would go on (never 50 in a row); the dataset
    stops once more than half of its last reads failed, naming some of the files."""
    files = {}
    for k in range(3 * SKIP_WINDOW):
        good = k % 3 == 2
        files[f'c{k % 2}/f{k:04d}.png'] = rgb(k % 250) if good else (lambda p: p.write_bytes(b'not an image'))
    ds = CheckedImageDataset(create_dataset('', root=str(image_folder(tmp_path, files)), split='train'))
    with pytest.raises(UnreadableImageError, match=rf'of the last {SKIP_WINDOW} images read could not be read'):
        for k in range(len(ds)):
            ds[k]
    with pytest.raises(ValueError, match=r'max_skip_share: expected a share in \[0, 1\]'):
        CheckedImageDataset(create_dataset('', root=str(tmp_path), split='train'), max_skip_share=1.5)


# 2. a second run in the same --experiment folder ------------------------------------------------------------------
def test_a_second_run_in_an_experiment_folder_is_refused_unless_resumed_or_overwritten(tiny_world, tmp_path):
    from timm_plugin.train import check_output_folder, run

    out = tmp_path / 'x'
    out.mkdir()
    for name in ('args.yaml', 'summary.csv', 'last.pth.tar', 'model_best.pth.tar'):
        (out / name).write_bytes(os.urandom(64))
    before = {p.name: sha(p) for p in out.iterdir()}
    with pytest.raises(FileExistsError, match=r'--experiment: .*/x holds a run \(args.yaml, last.pth.tar, .*--resume'):
        run(train_cmd(tiny_world / 'imagenet', tmp_path, 'x', '--epochs', '1'))
    assert {p.name: sha(p) for p in out.iterdir()} == before  # nothing replaced

    def args(**kw):
        return argparse.Namespace(**dict(dict(output=str(tmp_path), experiment='x', overwrite=False), **kw))

    check_output_folder(args(), str(out / 'last.pth.tar'))  # continuing that run
    (out / 'checkpoint-1.pth.tar').write_bytes(b'old')
    (out / 'milestone-2.pth.tar').write_bytes(b'old')
    (out / 'notes.txt').write_text('mine')
    check_output_folder(args(overwrite=True), '')  # asked for: the old run's files go, none left beside the new
    assert sorted(p.name for p in out.iterdir()) == ['notes.txt']
    (out / 'last.pth.tar').write_bytes(b'x')  # a run in x again
    check_output_folder(args(experiment='fresh'), '')  # no such folder yet
    (tmp_path / 'empty').mkdir()
    check_output_folder(args(experiment='empty'), '')  # a folder without run files
    other = tmp_path / 'other'
    other.mkdir()
    (other / 'last.pth.tar').write_bytes(b'x')
    with pytest.raises(FileExistsError, match='holds a run'):  # a resume from elsewhere would write over x's run
        check_output_folder(args(), str(other / 'last.pth.tar'))


# 3. a split that is not there -------------------------------------------------------------------------------------
def test_a_split_that_is_not_there_is_an_error_not_the_whole_folder(tiny_world, tmp_path):
    from timm_plugin.train import check_split_folder, run

    data = tiny_world / 'imagenet'
    for flag, split in (('--val-split', 'nothere'), ('--train-split', 'trian')):
        with pytest.raises(FileNotFoundError, match=rf"{flag}: no folder '{split}' under .* \['train', 'val'\]"):
            run(train_cmd(data, tmp_path, 'x', '--epochs', '1', flag, split))
    check_split_folder(str(data), 'validation', '--val-split')  # a synonym of val, as timm reads it
    check_split_folder(str(data), 'train[:50%]', '--train-split')  # a sub-split of train
    check_split_folder(str(data / 'train'), 'train', '--train-split')  # a folder of class folders: read as it is
    assert not (tmp_path / 'x').exists()


# 4. numbers that switch a method off or poison the run ------------------------------------------------------------
@pytest.mark.parametrize(
    'extra, match',
    [
        (['--dense-weight', 'nan'], '--dense-weight: expected a finite number, got nan'),
        (['--dense-weight', '-1'], '--dense-weight: expected a number >= 0, got -1.0'),
        (['--tokenmixup-htm-layers', '1', '--tokenmixup-tau', 'nan'], '--tokenmixup-tau: expected a number >= 0'),
        (['--tokenmixup-tau', '-1'], '--tokenmixup-tau: expected a number >= 0'),
        (['--tokenmixup-scorenet-weight', 'inf'], '--tokenmixup-scorenet-weight: expected a finite number'),
        (['--tokenmixup-rho', 'inf'], '--tokenmixup-rho: expected a finite number'),
        (['--lr', 'inf'], '--lr: expected a finite number, got inf'),
        (['--epochs', '0'], '--epochs: expected an integer >= 1, got 0'),
        (['--smoothing', '1'], r'--smoothing: expected a number in \[0, 1\), got 1.0'),
    ],
)
def test_train_refuses_numbers_that_switch_a_method_off(extra, match, tiny_world, tmp_path):
    from timm_plugin.train import run

    with pytest.raises(ValueError, match=match):
        run(train_cmd(tiny_world / 'imagenet', tmp_path, 'x', '--epochs', '1', *extra))
    assert not (tmp_path / 'x').exists()


def tiny_vit():
    torch.manual_seed(0)
    return timm.create_model('vit_tiny_patch16_224', img_size=32, patch_size=8, depth=2, num_classes=10)


@pytest.mark.parametrize(
    'kwargs, match',
    [
        (dict(tau=float('nan')), 'tau: expected a number >= 0'),
        (dict(tau=-1.0), 'tau: expected a number >= 0'),
        (dict(difficulty_scale=float('nan')), 'difficulty_scale: expected a finite number'),
        (dict(difficulty_scale=0.0), 'difficulty_scale: expected a number > 0'),
        (dict(rho=float('inf')), 'rho: expected a finite number'),
        (dict(scorenet_weight=float('nan')), 'scorenet_weight: expected a finite number'),
        (dict(scorenet_weight=float('inf')), 'scorenet_weight: expected a finite number'),
        (dict(htm_layers='12'), "htm_layers: expected a block index or a list of block indices, got '12'"),
        (dict(htm_layers=[1.7]), r'htm_layers: block indices must be integers, got 1.7 \(float\)'),
        (dict(htm_layers=[True]), r'htm_layers: block indices must be integers, got True \(bool\)'),
    ],
)
def test_tokenmixup_refuses_what_would_switch_it_off(kwargs, match):
    from timm_plugin import TokenMixup

    with pytest.raises(ValueError, match=match):
        TokenMixup(tiny_vit(), **dict(dict(htm_layers=(1,)), **kwargs))


def test_tokenmixup_tau_setter_and_single_block_layers():
    from timm_plugin import TokenMixup
    from timm_plugin.tl_align import TLAlign

    tm = TokenMixup(tiny_vit(), htm_layers=1)  # one block, as an int
    assert tm.hooks.htm_layers == [1]
    tm.tau = float('inf')  # every sample easy
    with pytest.raises(ValueError, match='tau: expected a number >= 0'):
        tm.tau = float('nan')
    assert TLAlign(tiny_vit(), layers=1).layers == {1}
    with pytest.raises(ValueError, match=r'layers: block indices must be integers, got 1.7'):
        TLAlign(tiny_vit(), layers=[1.7])


def test_token_labeling_loss_and_mixer_mode_name_their_argument():
    from timm_plugin import create_mixer
    from timm_plugin.token_labeling import TokenLabelingLoss

    for bad in (float('nan'), float('inf'), -1.0):
        with pytest.raises(ValueError, match='dense_weight: expected a'):
            TokenLabelingLoss(10, dense_weight=bad)
    with pytest.raises(ValueError, match=r"mode: expected one of \('batch', 'pair', 'elem', 'half'\), got None"):
        create_mixer('cutmix', mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=10, mode=None)
    with pytest.raises(ValueError, match=r"mode: expected one of \('batch', 'pair', 'elem', 'half'\), got 'rows'"):
        create_mixer('cutmix', mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=10, mode='rows', collate=True)


def test_tokenmixup_in_eval_returns_a_pair_for_two_samples():
    """``logits, target = tm(x, y)`` in eval with B = 2 must not unpack the logits' two rows."""
    from timm_plugin import TokenMixup

    tm = TokenMixup(tiny_vit(), htm_layers=(1,)).eval()
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([3, 4])
    logits, target = tm(x, y)
    assert logits.shape == (2, 10) and target.shape == (2, 10) and torch.equal(target.argmax(1), y)


# 5. checkpoints named as what they are ----------------------------------------------------------------------------
def test_initial_checkpoint_errors_name_the_flag_and_file(tiny_world, tmp_path):
    from shared_core.checkpoint_io import CheckpointError
    from timm_plugin.train import run

    with pytest.raises(FileNotFoundError, match=r'--initial-checkpoint: no such file: .*nothere.pth'):
        run(train_cmd(tiny_world / 'imagenet', tmp_path, 'x', '--initial-checkpoint', str(tmp_path / 'nothere.pth')))
    junk = tmp_path / 'junk.pth.tar'
    junk.write_bytes(random.Random(0).randbytes(5000))
    with pytest.raises(CheckpointError, match=r'--initial-checkpoint: .*junk.pth.tar is not a PyTorch checkpoint'):
        run(train_cmd(tiny_world / 'imagenet', tmp_path, 'x', '--initial-checkpoint', str(junk)))


def test_a_timm_checkpoint_saver_file_loads_and_a_pickle_payload_does_not(tmp_path):
    """timm's own ``CheckpointSaver`` stores ``args`` as an ``argparse.Namespace`` (timm's loader allows exactly
    that global): our reader loads the file; a file with any other global is refused without running it."""
    from timm.utils import CheckpointSaver

    from shared_core.checkpoint_io import CheckpointError, load_checkpoint_file

    model = tiny_vit()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    saver = CheckpointSaver(model, opt, args=argparse.Namespace(model='vit', lr=0.1), checkpoint_dir=str(tmp_path))
    saver.save_checkpoint(epoch=0, metric=1.0)
    ckpt = load_checkpoint_file(tmp_path / 'last.pth.tar', '--initial-checkpoint')
    assert isinstance(ckpt['args'], argparse.Namespace) and ckpt['args'].model == 'vit'
    assert torch.equal(ckpt['state_dict']['head.weight'], model.state_dict()['head.weight'])
    evil = tmp_path / 'evil.pth'
    torch.save({'args': argparse.Namespace(a=1), 'hook': os.system}, evil)
    with pytest.raises(CheckpointError, match=r'evil.pth holds Python objects .*\(posix.system\)'):
        load_checkpoint_file(evil, '--initial-checkpoint')
    assert argparse.Namespace not in torch.serialization.get_safe_globals()  # allowed for the load only


# 6. a YAML key one typo away from an argument ---------------------------------------------------------------------
def test_a_near_miss_yaml_key_is_an_error_and_other_unknown_keys_a_warning(tmp_path, caplog, capsys):
    import yaml

    from tokenaug.train_args import parse_args

    typo = tmp_path / 'typo.yaml'
    typo.write_text(yaml.safe_dump(dict(mixup_typ='tl_align', lr=0.1)))
    with pytest.raises(SystemExit):
        parse_args(['-c', str(typo), '--data-dir', 'x'])
    assert 'mixup_typ: not an argument of tokenaug-train; did you mean mixup_type?' in capsys.readouterr().err
    other = tmp_path / 'other.yaml'
    other.write_text(yaml.safe_dump(dict(some_tool_key=1, lr=0.1)))
    with caplog.at_level(logging.WARNING):
        assert parse_args(['-c', str(other), '--data-dir', 'x']).lr == 0.1
    assert 'unknown keys ignored' in caplog.text and 'some_tool_key' in caplog.text


# 7. checkpoint bytes, temporaries and the summary of a resumed run ------------------------------------------------
def test_checkpoint_bytes_do_not_depend_on_the_temporary_name(tmp_path):
    from shared_core.checkpoint_io import save_checkpoint_file

    state = {'epoch': 3, 'state_dict': tiny_vit().state_dict()}
    save_checkpoint_file(state, tmp_path / 'a.pth.tar')
    save_checkpoint_file(state, tmp_path / 'b.pth.tar')
    assert sha(tmp_path / 'a.pth.tar') == sha(tmp_path / 'b.pth.tar')


def test_stale_temporaries_are_removed_and_nothing_else(tmp_path):
    from shared_core.checkpoint_io import remove_stale_temporaries

    keep = ['last.pth.tar', '.hidden', '.last.pth.tar.tmp', 'x.abcdefgh.tmp', '.notes.txt.too_long_1.tmp']
    for name in keep + ['.last.pth.tar.zyll4h1x.tmp', '.summary.csv.ab_cd123.tmp']:
        (tmp_path / name).write_bytes(b'x')
    removed = remove_stale_temporaries(tmp_path)
    assert sorted(os.path.basename(p) for p in removed) == ['.last.pth.tar.zyll4h1x.tmp', '.summary.csv.ab_cd123.tmp']
    assert sorted(os.listdir(tmp_path)) == sorted(keep)
    assert remove_stale_temporaries(tmp_path / 'missing') == []


def test_the_summary_of_a_resumed_run_drops_the_epochs_it_redoes(tmp_path):
    from timm_plugin.train import drop_summary_rows

    path = tmp_path / 'summary.csv'
    text = 'epoch,train_loss,eval_top1\n0,2.3,10.0\n1,2.2,12.5\n2,2.1,15.0\n'
    path.write_text(text)
    drop_summary_rows(str(path), from_epoch=3)
    assert path.read_text() == text  # nothing to drop: untouched
    drop_summary_rows(str(path), from_epoch=1)
    assert path.read_text().splitlines() == ['epoch,train_loss,eval_top1', '0,2.3,10.0']


def test_a_symlink_loop_in_the_data_is_refused_naming_the_folder(tmp_path):
    from timm_plugin.image_data import check_repeated_folders

    root = image_folder(tmp_path, {'c0/a.png': rgb(1), 'c1/b.png': rgb(2)})
    check_repeated_folders(create_dataset('', root=str(root), split='train'), '--data-dir')
    os.symlink(root / 'train' / 'c0', root / 'train' / 'c0' / 'loop')  # c0/loop/loop/... : c0 again and again
    ds = create_dataset('', root=str(root), split='train')
    assert len(ds) > 2  # timm lists c0's image once per level of the loop
    with pytest.raises(ValueError, match=r'--data-dir: the folder .*train/c0 is listed .* times .*symlink'):
        check_repeated_folders(ds, '--data-dir')


@pytest.mark.slow
def test_a_run_resumed_into_another_folder_takes_its_best_checkpoint(tiny_world, tmp_path):
    from timm_plugin.train import run

    data = tiny_world / 'imagenet'
    run(train_cmd(data, tmp_path, 'a', '--epochs', '2', '--stop-epoch', '1'))
    before = {p.name: sha(p) for p in (tmp_path / 'a').iterdir()}
    run(train_cmd(data, tmp_path, 'b', '--epochs', '2', '--resume', str(tmp_path / 'a' / 'last.pth.tar')))
    import json

    best = json.loads((tmp_path / 'b' / 'results.json').read_text())['best_epoch']
    assert (tmp_path / 'b' / 'model_best.pth.tar').exists()
    assert torch.load(tmp_path / 'b' / 'model_best.pth.tar', weights_only=True)['epoch'] == best
    assert {p.name: sha(p) for p in (tmp_path / 'a').iterdir()} == before  # the other run untouched


@pytest.mark.parametrize('method', ['tl_align', 'transmix'])
def test_a_mixer_for_another_class_count_is_named(method):
    """TL-Align and TransMix alike (TransMix once skipped the check: a 100-class target on a 10-class model gave a
    wrong loss, or an error far from its cause)."""
    from timm_plugin import create_mixer
    from timm_plugin.tl_align import TLAlign, TransMix

    wrapper = (TLAlign if method == 'tl_align' else TransMix)(tiny_vit()).train()
    mixer = create_mixer('cutmix', method=method, mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=100, patch_size=8)
    x, target = mixer(torch.randn(4, 3, 32, 32), torch.arange(4))
    with pytest.raises(ValueError, match='target: the mixer made 100-class targets for a model with 10 classes'):
        wrapper(x, target)
    mixer = create_mixer('cutmix', method=method, mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=10, patch_size=8)
    x, target = mixer(torch.randn(4, 3, 32, 32), torch.arange(4))
    output, aligned = wrapper(x, target)
    assert output.shape == aligned.shape == (4, 10)


def test_python_api_edges_are_refused_by_name():
    """Values that would silently do something else (or fail later, unnamed) are refused, naming the argument:
    the loss's smoothing and class count, TL-Align's switches that are not booleans, a second aux head of another
    class count, map rows with NaN or out-of-range classes."""
    import timm

    from shared_core.label_maps import CropMaps
    from timm_plugin import TLAlign, TokenLabelingLoss, attach_aux_head

    for smoothing in (float('nan'), -0.1, 1.5):
        with pytest.raises(ValueError, match='smoothing'):
            TokenLabelingLoss(10, smoothing=smoothing)
    with pytest.raises(ValueError, match='num_classes'):
        TokenLabelingLoss(0)
    model = timm.create_model('vit_tiny_patch16_224', img_size=32, patch_size=8, depth=1, num_classes=10)
    for kw, name in ((dict(residual='no'), 'residual'), (dict(shared=1), 'shared'), (dict(fused='yes'), 'fused')):
        with pytest.raises(ValueError, match=f'{name}: expected'):
            TLAlign(model, **kw)
    attach_aux_head(model, 10)
    assert attach_aux_head(model, 10).aux_head.out_features == 10  # the same again: kept
    with pytest.raises(ValueError, match='already has an aux head for 10 classes, asked for 12'):
        attach_aux_head(model, 12)
    values, indices = torch.full((1, 1, 2, 2), 0.5), torch.zeros(1, 1, 2, 2, dtype=torch.long)
    crops, flips = torch.tensor([[0.0, 0.0, 1.0, 1.0]]), torch.zeros(1, dtype=torch.bool)
    CropMaps(values, indices, 10, crops, flips)  # a valid row
    with pytest.raises(ValueError, match='values: expected probabilities'):
        CropMaps(torch.full_like(values, float('nan')), indices, 10, crops, flips)
    with pytest.raises(ValueError, match=r'indices: class indices must be in \[0, 10\), got \[10, 10\]'):
        CropMaps(values, indices + 10, 10, crops, flips)


def test_a_switch_that_would_do_nothing_is_refused_by_name(tmp_path):
    """A method's switch set where it does nothing (the run would train something else under its name) is refused,
    naming the switch and what it needs; with what it needs, it is taken."""
    from timm_plugin.recipe import build_training
    from tokenaug.train_args import parse_args

    base = ['--model', 'vit_tiny_patch16_224', '--num-classes', '4', '--data-dir', str(tmp_path)]
    base += ['--model-kwargs', 'img_size=32', 'patch_size=8', 'depth=2', '--mixup', '0.8', '--cutmix', '1.0']
    for extra, named in (
        (['--aa-order', 'public'], '--aa-order public: it does nothing here; it needs label maps'),
        (['--geometric-aa', 'drop'], '--geometric-aa drop: it does nothing here; it needs label maps'),
        (['--map-region', 'recorded'], '--map-region recorded: it does nothing here'),
        (['--token-targets', 'step'], "--token-targets step: it does nothing here; it needs token labeling's dense"),
        (['--cls-target-pool', 'logits'], '--cls-target-pool logits: it does nothing here'),
        (['--tokenmixup-htm-layers', '1', '--tokenmixup-vtm-memory', 'public'], 'it needs VTM'),
        (['--method', 'tl_align', '--tl-align-layers'], r'--tl-align-layers \(no block\): it does nothing here'),
    ):
        with pytest.raises(ValueError, match=named):
            build_training(parse_args([*base, *extra]))
    # with what they need, taken
    argv = [*base, '--tokenmixup-htm-layers', '1', '--tokenmixup-vtm-layers', '1', '--tokenmixup-vtm-memory', 'public']
    build_training(parse_args(argv))
    build_training(parse_args([*base, '--method', 'tl_align', '--tl-align-layers', '0']))


def test_a_data_dir_of_class_folders_warns_that_train_and_val_are_the_same_images(tiny_world, tmp_path, caplog):
    """``--data-dir .../imagenet/train`` (class folders, no split folders): timm reads it whole as both splits;
    tokenaug-train trains as timm does but says that validation measures the training images."""
    import logging

    from timm_plugin.train import check_split_folder, run

    train = tiny_world / 'imagenet' / 'train'
    assert check_split_folder(str(train), 'train', '--train-split') and check_split_folder(str(train), 'val', 'x')
    assert not check_split_folder(str(tiny_world / 'imagenet'), 'train', '--train-split')
    with caplog.at_level(logging.WARNING, logger='tokenaug.train'):
        run(train_cmd(train, tmp_path, 'same', '--epochs', '1'))
    said = [r.getMessage() for r in caplog.records if 'has no split folders' in r.getMessage()]
    assert len(said) == 1 and 'validation measures the images the model trains on' in said[0]


def test_the_distributed_sampler_orders_by_the_runs_seed():
    """timm's ``create_loader`` leaves its ``DistributedSampler`` at seed 0: the order ignored ``--seed``. After
    :func:`seed_distributed_sampler` two seeds give two orders, one seed the same order, epoch by epoch."""
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    from timm_plugin.train_data import seed_distributed_sampler

    def order(seed, epoch):
        loader = DataLoader(list(range(40)), sampler=DistributedSampler(range(40), num_replicas=2, rank=0))
        seed_distributed_sampler(loader, seed)
        loader.sampler.set_epoch(epoch)
        return list(loader.sampler)

    assert order(0, 0) != order(1, 0) and order(1, 0) == order(1, 0) and order(1, 0) != order(1, 1)
    timm_default = DistributedSampler(range(40), num_replicas=2, rank=0)  # seed 0, as create_loader builds it
    timm_default.set_epoch(3)
    assert order(0, 3) == list(timm_default)  # seed 0 is timm's order


def test_bare_tracebacks_are_one_line_errors(tiny_world, tmp_path, capsys):
    """What a user can get wrong ends as ``tool: error: ...`` on one line, naming the argument: an empty data
    folder (tokenaug-train, maps generate), an --out that is a file (maps generate), an unwritable world --out,
    --model-kwargs the model cannot take, an unreadable image in tokenaug-occlusion with workers, a --resume of
    another optimizer."""
    import timm

    from shared_core.tools import world
    from timm_plugin import train
    from timm_plugin.tools import maps_cli, occlusion_cli

    def one_line(expect: str) -> None:  # the error is the last line (a run logs before it), with no traceback
        err = capsys.readouterr().err.strip()
        assert expect in err.splitlines()[-1] and 'Traceback' not in err and 'Caught' not in err, err

    empty = tmp_path / 'empty'
    (empty / 'train' / 'a').mkdir(parents=True)
    (empty / 'val' / 'a').mkdir(parents=True)
    with pytest.raises(SystemExit) as e:
        train.main(train_cmd(empty, tmp_path, 'e', '--epochs', '1'))
    assert e.value.code == 2
    one_line('tokenaug-train: error: --data-dir / --train-split: Found 0 images')
    gen = ['generate', '--model', 'resnet18', '--num-classes', '10', '--input-size', '32', '--no-progress', '-j', '0']
    assert maps_cli.main([*gen, '--data-dir', str(empty), '--out', str(tmp_path / 'm')]) == 2
    one_line('tokenaug-maps generate: error: --data-dir')
    (tmp_path / 'afile').write_text('x')
    data = tiny_world / 'imagenet'
    assert maps_cli.main([*gen, '--data-dir', str(data), '--split', 'val', '--out', str(tmp_path / 'afile')]) == 2
    one_line('afile is a file: a label-map store is a folder')
    with pytest.raises(SystemExit) as e:
        world.main(['--out', '/proc/tokenaug-world', '--train-per-class', '1', '--val-per-class', '1'])
    assert e.value.code == 2
    one_line('--out /proc/tokenaug-world: cannot write the world there')
    with pytest.raises(SystemExit):
        train.main(train_cmd(data, tmp_path, 'k', '--epochs', '1', '--model-kwargs', 'depth=two'))
    one_line("--model-kwargs depth='two'")
    bad = tmp_path / 'bad'
    shutil.copytree(data, bad)
    victim = sorted((bad / 'val').rglob('*.jpg'))[3]
    victim.write_bytes(victim.read_bytes()[:50])
    occ = ['--data-dir', str(bad), '--model', 'resnet18', '--num-classes', '10', '--ratios', '0', '0.5']
    assert occlusion_cli.main([*occ, '--img-size', '32', '-j', '2', '--out', str(tmp_path / 'o'), '--no-progress']) == 2
    one_line(f'{victim.parent.name}/{victim.name}')
    ckpt = tmp_path / 'sgd.pth.tar'
    model = timm.create_model('resnet18', num_classes=10)
    torch.save(dict(state_dict=model.state_dict(), epoch=0, args=dict(opt='sgd')), ckpt)
    with pytest.raises(ValueError, match=r'holds the state of --opt sgd, this run has --opt adamw; pass --opt sgd'):
        train.check_resume_optimizer(str(ckpt), 'adamw')
    train.check_resume_optimizer(str(ckpt), 'SGD')  # the same optimizer


def test_32_bit_integer_and_float_tiffs_are_read_as_their_grey_levels(tmp_path):
    """TIFFs of 32-bit integers and of floats (PIL modes 'I' and 'F', which a dataset with a TIFF reader hands over):
    PIL's RGB conversion clips them to white or black; the checked reader decodes them as their grey levels
    (16-bit data in an int32 as 16 bits, floats in [0, 1] scaled by 255)."""
    from timm_plugin.image_data import _decode

    cases = {
        'int16range.tif': (np.full((8, 8), 30000, np.int32), 'I', 30000 / 256),
        'int8range.tif': (np.full((8, 8), 113, np.int32), 'I', 113),
        'unit.tif': (np.full((8, 8), 0.44, np.float32), 'F', 0.44 * 255),
        'wide.tif': (np.full((8, 8), 300.0, np.float32), 'F', 255),
    }
    for name, (array, mode, grey) in cases.items():
        Image.fromarray(array, mode).save(tmp_path / name)
        assert Image.open(tmp_path / name).mode == mode
        assert abs(np.asarray(_decode(str(tmp_path / name), 'RGB')).mean() - grey) < 1, name
        clipped = np.asarray(Image.open(tmp_path / name).convert('RGB')).mean()  # what PIL alone gives
        assert abs(clipped - grey) > 1 or name in ('int8range.tif', 'wide.tif'), (name, clipped)


def test_occlusion_crop_pct_outside_0_1_is_refused_by_name(capsys):
    from timm_plugin.tools import occlusion_cli

    for value in ('0', 'nan', '1.5'):
        with pytest.raises(SystemExit):
            occlusion_cli.parse_args(['--data-dir', 'd', '--model', 'm', '--crop-pct', value])
        assert '--crop-pct: got' in capsys.readouterr().err


def test_one_checkpoint_reader_for_every_format_and_entry_point(tmp_path):
    """A table of checkpoint formats x timm entry points: timm's saver (``state_dict``, EMA), DeiT's and TokenMix's
    ``main.py`` (``model``), a bare state dict load the same weights through ``--initial-checkpoint`` and the
    annotator (``maps generate --checkpoint``, ``tokenaug-occlusion``; ``tokenaug-viz`` reads through the same
    function); a pickled object, garbage, an empty and a truncated file are named, flag included, by the checked
    reader at each."""
    import pickle

    from shared_core.checkpoint_io import CheckpointError
    from timm_plugin.annotator import create_annotator
    from timm_plugin.checkpoints import read_state_dict
    from timm_plugin.recipe import build_model
    from tokenaug.train_args import parse_args

    kw = dict(img_size=32, patch_size=8, depth=1, num_classes=5)
    model = timm.create_model('vit_tiny_patch16_224', **kw)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    formats = {
        'timm saver': dict(state_dict=weights, epoch=3, args=argparse.Namespace(opt='adamw')),
        'deit main.py': dict(model=weights, optimizer={}, lr_scheduler={}, epoch=3, args=argparse.Namespace()),
        'tokenmix main.py': dict(model=weights, state_dict_ema=weights, epoch=3),
        'bare state dict': weights,
        'DDP prefixes': {f'module.{k}': v for k, v in weights.items()},
    }
    argv = ['--model', 'vit_tiny_patch16_224', '--num-classes', '5', '--data-dir', str(tmp_path), '--model-kwargs']
    argv += ['img_size=32', 'patch_size=8', 'depth=1']
    readers = {
        '--initial-checkpoint': lambda f: build_model(parse_args([*argv, '--initial-checkpoint', f])).state_dict(),
        '--checkpoint': lambda f: create_annotator('vit_tiny_patch16_224', checkpoint=f, model_kwargs=kw).state_dict(),
        'read_state_dict': lambda f: read_state_dict(f, '--initial-checkpoint'),
    }
    for fmt, obj in formats.items():
        path = tmp_path / f'{fmt.replace(" ", "_")}.pth'
        torch.save(obj, path)
        for flag, read in readers.items():
            got = read(str(path))
            assert all(torch.equal(got[k], v) for k, v in weights.items()), (fmt, flag)

    class Payload:
        def __reduce__(self):
            return (os.system, ('true',))

    good = tmp_path / 'timm_saver.pth'
    bad = {
        'a pickled object': pickle.dumps({'state_dict': Payload()}),
        'garbage': os.urandom(500),
        'empty': b'',
        'truncated': good.read_bytes()[: good.stat().st_size // 2],
    }
    for what, data in bad.items():
        path = tmp_path / f'bad_{what.replace(" ", "_")}.pth'
        path.write_bytes(data)
        for flag, read in readers.items():
            with pytest.raises(CheckpointError, match=flag.replace('-', r'\-') if flag.startswith('-') else ''):
                read(str(path))


def test_resume_of_a_main_py_checkpoint_points_to_initial_checkpoint(tiny_world, tmp_path):
    """``--resume`` continues a timm run (state_dict, optimizer, epoch); a DeiT / TokenMix ``main.py`` file (its
    weights under ``model``) is named as such, with the flag that takes its weights."""
    from timm_plugin.train import run

    model = timm.create_model('vit_tiny_patch16_224', img_size=112, depth=1, num_classes=10)
    path = tmp_path / 'deit_main.pth'
    torch.save(dict(model=model.state_dict(), optimizer={}, epoch=2, args=argparse.Namespace()), path)
    with pytest.raises(ValueError, match='DeiT / TokenMix main.py checkpoint .*with --initial-checkpoint'):
        run(train_cmd(tiny_world / 'imagenet', tmp_path, 'r', '--epochs', '1', '--resume', str(path)))
