"""The console commands' front doors (``tokenaug.commands``): every ``--help`` answers without importing torch, timm,
OpenMMLab, numpy or matplotlib (a fraction of a second where those imports take seconds), prints the parser the
command runs with, and the installed console scripts are these front doors. No timing is asserted: the proof is
what was imported; the seconds are printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from tokenaug import commands

from ..conftest import REPO, VENV_BIN

#: every command, and each of its subcommands, asked for --help
HELPS = {
    'train': [[]],
    'maps': [[], ['generate'], ['import'], ['merge'], ['info']],
    'occlusion': [[]],
    'viz': [[], ['mix'], ['tl-align'], ['token-labels'], ['tokenmix'], ['tokenmixup']],
    'convert': [[]],
    'study': [[]],
}
#: what a --help must not import
HEAVY = ('torch', 'timm', 'torchvision', 'mmengine', 'mmcv', 'mmpretrain', 'mmseg', 'mmdet', 'numpy', 'matplotlib')

_CHILD = """
import contextlib, io, json, sys, time
start = time.perf_counter()
from tokenaug import commands
helps, codes = {}, {}
for name, prefixes in json.loads(sys.argv[1]).items():
    for prefix in prefixes:
        key, out = ' '.join([name, *prefix]), io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                codes[key] = getattr(commands, name)([*prefix, '--help'])
            except SystemExit as e:
                codes[key] = e.code
        helps[key] = out.getvalue()
heavy = sorted(m for m in sys.modules if m.split('.')[0] in json.loads(sys.argv[2]))
print(json.dumps(dict(codes=codes, helps=helps, heavy=heavy, seconds=time.perf_counter() - start)))
"""


@pytest.fixture(scope='module')
def helps():
    env = dict(os.environ, PYTHONPATH=f'{REPO}{os.pathsep}{os.environ.get("PYTHONPATH", "")}')
    res = subprocess.run(
        [sys.executable, '-c', _CHILD, json.dumps(HELPS), json.dumps(HEAVY)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_every_help_answers_without_the_heavy_libraries(helps):
    print(f'{len(helps["codes"])} --help pages in {helps["seconds"]:.2f} s in one process, imports included')
    assert helps['heavy'] == []
    assert set(helps['codes'].values()) == {0}, helps['codes']
    for key, text in helps['helps'].items():
        assert text.startswith('usage:'), (key, text[:200])


def test_the_help_is_the_parser_the_command_runs_with(helps):
    """``--help`` prints the parsers the tools parse with (one definition each): the training flags, the tools'
    own flags and the methods' spellings."""
    from timm_plugin.tools import maps_cli, occlusion_cli

    text = helps['helps']
    assert 'tl_align: TL-Align over cutmix' in text['train']
    assert '--tokenmixup-htm-layers' in text['viz tokenmixup'] and '--viz-dir' in text['viz tokenmixup']
    assert '--branch {cut,mixup,switch}' in text['viz tl-align']
    assert '--lam' in text['viz tokenmix'] and '--token-label-dir' in text['viz token-labels']
    assert '--from {tokenlabeling}' in text['maps import'] and '--input-size' in text['maps generate']
    assert '--to {mmseg,mmdet,timm}' in text['convert'] and '--ratios' in text['occlusion']
    assert '--emit-jobs FILE' in text['study'] and 'tl_align: TL-Align over MixUp/CutMix' in text['study']
    args = maps_cli.parse_args(['import', '--from', 'tokenlabeling', '--src', 's', '--data-dir', 'd'] +
                               ['--num-classes', '3', '--out', 'o'])  # fmt: skip
    assert (args.command, args.batch_size, args.workers) == ('import', 256, 2)
    assert occlusion_cli.parse_args(['--data-dir', 'd', '--model', 'm']).ratios[-1] == pytest.approx(0.9)


def test_the_console_scripts_are_the_front_doors(run_env):
    """Every installed console script of tokenaug is a function of :mod:`tokenaug.commands` (the six heavy
    commands and the four light ones), and the installed scripts answer ``--help``."""
    scripts = {e.name: e.value for e in entry_points(group='console_scripts') if e.name.startswith('tokenaug-')}
    names = [*HELPS, 'data', 'config', 'mim', 'mmcv_wheel']
    assert sorted(scripts) == sorted(f'tokenaug-{n.replace("_", "-")}' for n in names)
    for name in names:
        assert scripts[f'tokenaug-{name.replace("_", "-")}'] == f'tokenaug.commands:{name}'
        assert callable(getattr(commands, name))
    assert (VENV_BIN / 'tokenaug-maps').is_file()
    res = subprocess.run(['tokenaug-maps', 'generate', '--help'], capture_output=True, text=True, env=run_env)
    assert res.returncode == 0 and res.stdout.startswith('usage: tokenaug-maps generate'), res.stderr


def test_import_tokenaug_gives_the_timm_api_lazily():
    """``import tokenaug`` imports none of the heavy libraries; ``tokenaug.TLAlign`` and the rest of
    :data:`tokenaug.API` are :mod:`timm_plugin`'s own objects, imported on first use; the list is timm_plugin's
    public names (it cannot drift)."""
    code = (
        'import json, sys; import tokenaug; before = sorted(m for m in sys.modules if m.split(".")[0] in '
        f'{list(HEAVY)!r}); import timm_plugin; same = all(getattr(tokenaug, n) is getattr(timm_plugin, n) for n in '
        'tokenaug.API); print(json.dumps(dict(before=before, same=same, api=list(tokenaug.API), '
        'timm=[n for n in timm_plugin.__all__ if n != "__version__"], dir="TLAlign" in dir(tokenaug))))'
    )
    env = dict(os.environ, PYTHONPATH=f'{REPO}{os.pathsep}{os.environ.get("PYTHONPATH", "")}')
    res = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert got['before'] == [] and got['same'] and got['dir']
    assert sorted(got['api']) == sorted(got['timm'])
    import tokenaug

    with pytest.raises(AttributeError, match="has no attribute 'TLAlignn'"):
        tokenaug.TLAlignn  # noqa: B018
