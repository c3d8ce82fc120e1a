"""Guards of the layering: shared_core imports no framework nor adapter (not even inside a function), the command
line package loads none on import, mm_plugin does not load timm_plugin, and importing a plugin only registers (it
patches nothing in timm, MMEngine or torch)."""

import pkgutil
import subprocess
import sys

import shared_core

from ..conftest import REPO

FRAMEWORKS = ('timm', 'mmengine', 'mmcv', 'mmpretrain', 'mmseg', 'mmdet', 'timm_plugin', 'mm_plugin')


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, '-c', code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_every_shared_core_module_imports_no_framework():
    modules = sorted(m.name for m in pkgutil.walk_packages(shared_core.__path__, 'shared_core.'))
    assert {
        'shared_core.mix',
        'shared_core.tl_align',
        'shared_core.token_labeling',
        'shared_core.tokenmix',
        'shared_core.label_maps',
        'shared_core.map_store',
        'shared_core.tools.world',
    } <= set(modules)
    code = (
        f'import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n'
        f'print(sorted(m for m in sys.modules if m.split(".")[0] in {FRAMEWORKS!r}))'
    )
    assert _run(code) == '[]'


def test_no_shared_core_module_imports_an_adapter_or_a_framework_even_lazily():
    """The source of every shared_core module, read: no ``import`` / ``from ... import`` of a framework, an adapter
    or the command line anywhere in it, at module level or inside a function (an import inside a function is
    invisible to the test above until it runs)."""
    import ast

    banned = FRAMEWORKS + ('tokenaug',)
    found = []
    for path in sorted((REPO / 'shared_core').rglob('*.py')):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or '']
            found += [f'{path.relative_to(REPO)}:{node.lineno} {n}' for n in names if n.split('.')[0] in banned]
    assert not found, found


def test_the_command_line_package_imports_no_framework():
    """``tokenaug`` (the console commands and parsers) loads neither a framework nor an adapter on import."""
    code = (
        'import sys, tokenaug.commands, tokenaug.tool_args, tokenaug.train_args\n'
        f'print(sorted(m for m in sys.modules if m.split(".")[0] in {FRAMEWORKS + ("torch",)!r}))'
    )
    assert _run(code) == '[]'


def test_import_mm_plugin_does_not_load_timm_plugin():
    code = 'import sys, mm_plugin\nprint(sorted(m for m in sys.modules if m.startswith("timm_plugin")))'
    assert _run(code) == '[]'


def test_importing_the_plugins_patches_nothing():
    """Registration only: timm's RandAugment table, MMEngine's HistoryBuffer pickling and torch's safe globals
    are untouched until the explicit calls (timm_plugin.fix_posterize, mm_plugin.enable_safe_load)."""
    code = """
import torch
from timm.data import auto_augment
from mmengine.logging import HistoryBuffer
before = (dict(auto_augment.NAME_TO_OP), HistoryBuffer.__getstate__, list(torch.serialization.get_safe_globals()))
import timm, timm_plugin, mm_plugin
timm.create_model('lvvit_t')  # registered
after = (dict(auto_augment.NAME_TO_OP), HistoryBuffer.__getstate__, list(torch.serialization.get_safe_globals()))
print(before == after)
import mm_plugin.enable_safe_load
timm_plugin.fix_posterize()
print(HistoryBuffer.__getstate__ is not before[1], auto_augment.NAME_TO_OP['Posterize'] is not before[0]['Posterize'])
"""
    assert _run(code).split() == ['True', 'True', 'True']


def _import_graph() -> dict:
    """Our modules -> the modules of ours they import, read from the source: every ``import`` and ``from ...
    import`` anywhere in a file (inside functions too), relative ones resolved; ``from pkg import name`` counts
    as importing ``pkg.name`` where that is a module, else ``pkg``. A module's own parent packages are left out
    (Python imports them first whatever the module says)."""
    import ast

    files = {}
    for top in ('shared_core', 'timm_plugin', 'mm_plugin', 'tokenaug'):
        for path in (REPO / top).rglob('*.py'):
            name = '.'.join(path.relative_to(REPO).with_suffix('').parts)
            files[name.removesuffix('.__init__')] = path

    def ours(name):
        while name and name not in files:
            name = name.rpartition('.')[0]
        return name or None

    graph = {}
    for mod, path in files.items():
        package = mod if path.name == '__init__.py' else mod.rpartition('.')[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package.split('.')[: len(package.split('.')) - node.level + 1] if node.level else []
                module = '.'.join(base + ([node.module] if node.module else []))
                names = [f'{module}.{a.name}' for a in node.names]
            else:
                continue
            for n in names:
                target = ours(n)
                if target and target != mod and not mod.startswith(target + '.'):
                    edges.add(target)
        graph[mod] = edges
    return graph


def test_the_import_graph_of_our_modules_has_no_cycle():
    """No module of ours imports, directly or through others (lazily included), a module that imports it back:
    the core below the adapters, each adapter's tools above its library code."""
    graph = _import_graph()
    # the reading sees what it should: a module-level import, a relative one inside a method
    assert {'shared_core.map_store', 'tokenaug.tool_args'} <= graph['timm_plugin.tools.maps_cli']
    assert 'timm_plugin.tools.study_eval' in graph['timm_plugin.tools.study_cli']
    state, cycles = {}, []

    def visit(mod, path):
        state[mod] = 'open'
        for nxt in sorted(graph[mod]):
            if state.get(nxt) == 'open':
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[mod] = 'done'

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [mod])
    assert not cycles, '\n'.join(' -> '.join(c) for c in cycles)
