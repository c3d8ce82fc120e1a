"""TL-Align across timm's zoo: one model per timm family (module of ``timm.models``), built on the meta device (no
weights, no memory), handed to TL-Align's tracer lookup; the page ``docs/methods/tl_align_zoo.md`` lists each
family with its status: traced (by which tracer, held to which explicit reference), refused with the reason, or
no tracer yet.

    .venv/bin/python scripts/tl_align_zoo.py            # writes the page
    .venv/bin/python scripts/tl_align_zoo.py --check    # exit 1 if the page differs from what timm gives now

The representative of a family is its first model name (sorted) with ``tiny``, else ``small``, else ``base``,
else its first; the status is what TL-Align says of that model (other models of a family may differ: a ResNet
with CBAM gates is refused where a plain or SE one is traced).
"""

from __future__ import annotations

import sys
from pathlib import Path

import timm
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.generated_page import write_or_check  # noqa: E402
from timm_plugin.tl_align import timm_tracer  # noqa: E402
from timm_plugin.tl_align.graph import GraphRouteError  # noqa: E402

PAGE = REPO / 'docs' / 'methods' / 'tl_align_zoo.md'

#: each tracer and the tests that hold it to an explicit reference (loops over heads, materialised attention or
#: dense matrices), every one at max |diff| <= 1e-6
HELD_BY = {
    'ViTTracer': 'test_tl_align.py, test_tl_align_shared.py, test_tl_align_sdpa.py',
    'DistilledViTTracer': 'test_tl_align.py::test_distilled_deit_reads_both_tokens',
    'NaFlexViTTracer': 'test_tl_align_sdpa.py::test_the_tracer_is_the_brute_force',
    'CaitTracer': 'test_tl_align_more.py::test_cait_dense_trace_matches_materialised_reference',
    'CCTTracer': 'test_tl_align_more.py::test_cct_labels_match_an_explicit_reference',
    'SwinTracer': 'test_tl_align.py::test_swin_dense_trace_matches_index_reference',
    'SwinV2Tracer': 'test_tl_align_swin_v2.py::test_swin_v2_labels_match_the_index_reference',
    'PvtV2Tracer': 'test_tl_align_more.py::test_pvt_dense_trace_matches_materialised_reference',
    'MlpMixerTracer': 'test_tl_align_beyond_vit.py::test_dense_trace_matches_the_explicit_reference',
    'ConvNeXtTracer': 'test_tl_align_beyond_vit.py::test_cnn_dense_trace_matches_the_explicit_reference',
    'ResNetTracer': 'test_tl_align_beyond_vit.py::test_cnn_dense_trace_matches_the_explicit_reference',
    'EvaTracer': 'test_tl_align_sdpa.py::test_the_tracer_is_the_brute_force',
    'BeitTracer': 'test_tl_align_sdpa.py::test_the_tracer_is_the_brute_force',
    'RelPosViTTracer': 'test_tl_align_sdpa.py::test_the_tracer_is_the_brute_force',
    'SamViTTracer': 'test_tl_align_sam.py::test_the_tracer_is_the_reference_in_image_cells',
    'ConViTTracer': 'test_tl_align_convit.py::test_the_tracer_is_the_explicit_reference',
    'EfficientFormerTracer': 'test_tl_align_efficientformer.py::test_the_tracer_is_the_reference_in_image_cells',
    'DaViTTracer': 'test_tl_align_davit.py::test_the_tracer_is_the_reference_in_image_cells',
    'MetaFormerTracer': 'test_tl_align_metaformer.py::test_the_tracer_is_the_explicit_reference',
    'HieraTracer': 'test_tl_align_hiera.py::test_the_tracer_is_the_reference_in_image_coordinates',
    'TwinsTracer': 'test_tl_align_twins.py::test_the_tracer_is_the_reference_in_image_cells',
    'MViTv2Tracer': 'test_tl_align_mvitv2.py::test_the_tracer_is_the_reference_in_image_cells',
}

#: the graph route (GraphTracer) by family: the test that holds it there and its measured max |difference|; families
#: not listed are held by the invariants every label program must keep
GRAPH_HELD = {
    'maxxvit': ('test_tl_align_graph.py::test_maxvit_window_and_grid_attention_are_the_explicit_reference', '3.0e-8'),
    'efficientnet': ('test_tl_align_graph.py::test_the_graph_route_is_the_explicit_reference', '4.7e-8'),
    'mobilenetv3': ('test_tl_align_graph.py::test_the_graph_route_is_the_explicit_reference', '2.2e-8'),
    'hardcorenas': ('test_tl_align_graph.py::test_the_graph_route_is_the_explicit_reference (MobileNetV3)', '2.2e-8'),
    'densenet': ('test_tl_align_graph.py::test_the_graph_route_is_the_explicit_reference', '2.6e-8'),
    'vgg': ('test_tl_align_graph.py::test_the_graph_route_is_the_explicit_reference', '2.7e-8'),
    'tiny_vit': ('test_tl_align_sized.py::test_tiny_vit_is_the_window_reference', '3.4e-8 to 3.6e-8'),
    'mobilevit': ('test_tl_align_sized.py::test_mobilevit_is_the_patch_reference', '2.9e-8'),
    'efficientvit_msra': ('test_tl_align_sized.py::test_efficientvit_msra_is_the_cascade_reference', '2.9e-8'),
    'gcvit': ('test_tl_align_sized.py::test_gcvit_global_query_is_the_window_reference', '2.1e-8'),
    'swiftformer': (
        'test_tl_align_graph.py::test_additive_attention_is_a_channel_gate (its attention), and the invariants',
        '2.6e-8',
    ),
    'efficientformer_v2': (
        'test_tl_align_graph.py::test_talking_heads_are_caits_rule_on_the_explicit_reference (its attention), '
        'and the invariants',
        '2.9e-8',
    ),
}
GRAPH_INVARIANTS = (
    'test_tl_align_graph.py::test_a_label_program_keeps_labels_a_distribution_and_a_constant_map_constant (its ops '
    "as in the references, and the ResNet and ConvNeXt tracers' labels to 6e-8)"
)


#: the measured max |difference| of a tracer's labels against its test's reference, where the test or the TL-Align
#: page records one (elsewhere the column gives the bound the test asserts)
MEASURED = {
    'ViTTracer': '1.1e-7',
    'DistilledViTTracer': '4.5e-8',
    'NaFlexViTTracer': '2.3e-8 to 3.3e-8 (float64 brute force)',
    'CaitTracer': '3e-8',
    'SwinTracer': '1.5e-8',
    'PvtV2Tracer': '1.5e-8 to 3e-8',
    'ConvNeXtTracer': '1.5e-8',
    'ResNetTracer': '4.5e-8 to 1.3e-7',
    'EvaTracer': '3e-8 to 1.1e-7',
    'BeitTracer': '3e-8 to 1.1e-7',
    'RelPosViTTracer': '< 1e-6 (float64 brute force)',
    'MetaFormerTracer': '3e-8 to 7e-8',
    'HieraTracer': '4.5e-8',
    'TwinsTracer': '3e-8 to 6e-8',
    'MViTv2Tracer': '3.0e-8 to 4.4e-8',
    'SwinV2Tracer': '1.5e-8',
    'SamViTTracer': '1.5e-8 to 6e-8',
    'ConViTTracer': '3e-8',
    'EfficientFormerTracer': '4.5e-8',
    'DaViTTracer': '6e-8',
}


def transmix(tracer) -> str:
    """Whether TransMix applies: the class token's attention (the paper's rule), the pooled label after the last
    block's attention (our extension, no class token), or no attention in the last block."""
    if not tracer.attends:
        return f'no: {tracer.why_no_attention}'
    if tracer.readout in ('cls', 'cls_dist'):
        return "yes: the class token's attention"
    return 'yes: the pooled label after the last attention (ours)'


def representative(module: str) -> str:
    names = sorted(timm.list_models(module=module))
    for word in ('tiny', 'small', 'base'):
        for name in names:
            if word in name:
                return name
    return names[0]


def status(module: str, name: str):
    """``(status, detail, exactness, TransMix)`` of TL-Align on ``name`` built on the meta device."""
    with torch.device('meta'):
        model = timm.create_model(name, num_classes=10)
    try:
        tracer = timm_tracer(model)
    except ValueError as e:
        reason = str(e).removeprefix('model: ')
        graph = e.__cause__ if isinstance(e.__cause__, GraphRouteError) else None
        if graph is not None and not graph.decided:  # no family tracer, and a part the graph route does not read
            why = str(graph).split(f'{type(model).__name__}: ', 1)[1].replace('|', '\\|')
            return 'no tracer yet', f'`{type(model).__name__}`; the graph route does not read it: {why}', '–', '–'
        if reason.startswith('TL-Align has no tracer for'):
            return 'no tracer yet', f'`{type(model).__name__}`', '–', '–'
        return 'refused', reason.replace('|', '\\|'), '–', '–'
    kind = type(tracer).__name__
    if kind == 'GraphTracer':
        held, exact = GRAPH_HELD.get(module, (GRAPH_INVARIANTS, 'no per-family reference'))
        ops = len(tracer.program.ops)
        return 'traced', f'`GraphTracer` (the graph route, {ops} label ops); {held}', exact, transmix(tracer)
    detail = f'`{kind}`; against an explicit reference in {HELD_BY[kind]}'
    if type(getattr(model, 'patch_embed', None)).__name__ == 'HybridEmbed':
        detail += "; the CNN stem is not traced: the labels start on its output grid, as for ResNet's stem"
    return 'traced', detail, MEASURED.get(kind, '< 1e-6 (the bound its test asserts)'), transmix(tracer)


def page() -> str:
    rows, counts = [], {'traced': 0, 'refused': 0, 'no tracer yet': 0}
    for module in timm.list_modules():
        if not timm.list_models(module=module):
            continue
        name = representative(module)
        state, detail, exact, tm = status(module, name)
        counts[state] += 1
        rows.append(f'| {module} | `{name}` | {state} | {exact} | {tm} | {detail} |')
    head = [
        "# TL-Align across timm's zoo",
        '',
        f'timm {timm.__version__}: one model per family (module of `timm.models`), as TL-Align sees it when',
        '`TLAlign(model)` is built. Generated by `scripts/tl_align_zoo.py` (built on the meta device: no weights);',
        '`tests/timm_plugin/test_tl_align_sdpa.py` checks that this page is what the script gives, so it cannot',
        "drift. A family's other models may differ (a ResNet with CBAM gates is refused where a plain or SE one is",
        'traced).',
        '',
        f'{counts["traced"]} families traced, {counts["refused"]} refused with a reason, '
        f'{counts["no tracer yet"]} without a tracer yet.',
        '',
        "Exactness: the largest difference of the tracer's labels from its test's independent reference (explicit",
        'loops, materialised attention, float64 where it says so). TransMix: whether it applies, and by which rule.',
        'Conv nets without a family tracer go to the graph route (`GraphTracer`: Table 9 read off the fx graph, op',
        'by op; docs/methods/tl_align.md has its rules); where it cannot take a model it names the node: a refusal',
        'where Table 9 gives no reading, "no tracer yet" where the part it does not read (attention, tokens as rows)',
        "is a family tracer's work.",
        '',
        '| family | model | status | exactness | TransMix | tracer and test, or why not |',
        '|---|---|---|---|---|---|',
    ]
    return '\n'.join(head + rows) + '\n'


def main():
    write_or_check(PAGE, page, __doc__.splitlines()[0], __file__)


if __name__ == '__main__':
    main()
