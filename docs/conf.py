"""Sphinx configuration of tokenaug's documentation (``make docs``): MyST Markdown pages, the API reference by
autodoc/autosummary from the docstrings, the furo theme. Built with warnings as errors and nitpicky references
(``tests/docs/test_docs.py``), so a broken link or a reference to a name that does not exist fails the build."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import shared_core  # noqa: E402

project = 'tokenaug'
author = 'the tokenaug developers'
copyright = '2026, the tokenaug developers'
release = version = shared_core.__version__

extensions = [
    'myst_parser',
    'sphinx.ext.autodoc',
    'sphinx.ext.autosummary',
    'sphinx.ext.napoleon',
    'sphinx.ext.viewcode',
]
source_suffix = {'.rst': 'restructuredtext', '.md': 'markdown'}
exclude_patterns = ['_build', '_fragments', 'PYPI.md', 'demo', 'timm_train']
myst_enable_extensions = ['colon_fence']
myst_heading_anchors = 3

autosummary_generate = True
# autosummary writes api/generated/ (ignored by git) and never removes a page: a module that moved or went would
# keep its stale page, which then fails to import; each build generates the folder afresh
import shutil  # noqa: E402

shutil.rmtree(Path(__file__).resolve().parent / 'api' / 'generated', ignore_errors=True)
autosummary_imported_members = False
# each object documented once, in the module that defines it (a package's facade and __all__ re-exports are not)
autodoc_default_options = {
    'members': True,
    'show-inheritance': True,
    'ignore-module-all': True,
}
autodoc_inherit_docstrings = False  # torch's nn.Module docstrings are torch's, not ours
autodoc_typehints = 'description'
autodoc_member_order = 'bysource'
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# every reference to our own names must resolve; the libraries we build on are not documented here (no network
# for intersphinx), so references into them are left as text
nitpicky = True
_EXTERNAL = (
    r'(torch|timm|mmengine|mmpretrain|mmseg|mmdet|mmcv|numpy|np|nn|PIL|scipy|torchvision|os|pathlib|typing|argparse|'
    r'collections|dataclasses|abc)'
)
nitpick_ignore_regex = [
    (r'py:.*', _EXTERNAL + r'(\..*)?'),
    # names of those libraries in our annotations and types, unqualified
    (
        r'py:class',
        r'(Tensor|Module|Path|Dataset|optional|callable|sequence|Sequence|Optional|Callable|Any|Iterable|'
        r'Iterator|VisionTransformer|SwinTransformer|Cait|MlpMixer|ConvNeXt|ResNet|PyramidVisionTransformerV2|DataSample|'
        r'Hiera|MetaFormer|MultiScaleVit|Twins|Eva|Beit|ViTEVA02|BEiTViT|ConVit|EfficientFormer|VisionTransformerSAM|'
        r'SwinTransformerV2|SwinTransformerV2Cr|VisionTransformerRelPos|DaVit|PoolFormer|DeiT3)',
    ),
    (
        r'py:.*',
        r'(.*\.)?_\w+(\..*)?',
    ),  # private names (a base class, a helper): not part of the API
]

templates_path = ['_templates']


PACKAGES = ('tokenaug', 'shared_core', 'timm_plugin', 'mm_plugin')


def _resolve_short_names(app, env, node, contnode):
    """A reference by a bare or partly qualified name (``Mix``, ``tl_align.TLAlign``) resolves to the one object of
    ours whose full name ends with it; an ambiguous or unknown name stays unresolved (and fails the build)."""
    if node.get('refdomain') != 'py':
        return None
    target = node['reftarget'].lstrip('~.')
    domain = env.get_domain('py')
    head, _, rest = target.partition('.')
    if (
        head in PACKAGES and rest
    ):  # a package's facade name (timm_plugin.TLAlign): the object it re-exports
        found = {
            n
            for n in domain.objects
            if n.startswith(head + '.') and n.endswith('.' + rest)
        }
    else:
        found = {
            n
            for n in domain.objects
            if n.split('.')[0] in PACKAGES and (n == target or n.endswith('.' + target))
        }
    if len(found) != 1:
        return None
    name = found.pop()
    obj = domain.objects[name]
    from sphinx.util.nodes import make_refnode

    return make_refnode(
        app.builder, node['refdoc'], obj.docname, obj.node_id, contnode, name
    )


def _attribute_as_written(self):
    """napoleon reads an attribute's docstring (``#:`` comments too) as ``type: description`` and makes a class
    reference of whatever stands before the first colon; ours are prose."""
    return self._consume_to_end()


def setup(app):
    from sphinx.ext.napoleon.docstring import GoogleDocstring

    GoogleDocstring._parse_attribute_docstring = _attribute_as_written
    app.connect('missing-reference', _resolve_short_names)


html_theme = 'furo'
# diffs wrap their long lines (the other code blocks fit the column: tests/docs/test_docs.py)
html_static_path = ['_static']
html_css_files = ['tokenaug.css']
html_title = f'tokenaug {release}'
