#!/usr/bin/env python3
"""Write the flag table of a timm ``train.py`` (``tests/data/timm_train_flags.json``), against which
``tests/timm_plugin/test_train_flags.py`` diffs ``tokenaug-train``'s parser so drift shows.

    python scripts/timm_flag_table.py PATH/TO/timm/train.py --source 'huggingface/pytorch-image-models@<commit>'

The script imports the given ``train.py`` (it needs the timm it was written for) and records each argument's
option strings, dest, default and help. timm's wheel and sdist do not ship ``train.py``; the table in the
repo was made from the newest stored ``train.py`` (see its ``source``) plus :data:`EXTRA`, the flags timm
1.0.31's own tests (``tests/test_train_resume.py`` of its sdist) drive through ``train.py``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

#: flags of timm 1.0.31's train.py that its sdist's tests use and the newer-than-stored source adds
#: (single-label classification only; the multi-label task's --loss* flags are not taken over)
EXTRA = [
    dict(flags=['--stop-epoch'], dest='stop_epoch', default=None, source='timm 1.0.31 tests/test_train_resume.py'),
    dict(flags=['--save-epochs'], dest='save_epochs', default=None, source='timm 1.0.31 tests/test_train_resume.py'),
    dict(
        flags=['--pretrained-cfg-overlay'],
        dest='pretrained_cfg_overlay',
        default={},
        source='timm 1.0.31 tests/test_train_resume.py',
    ),
    dict(flags=['--task'], dest='task', default='classification', source='timm 1.0.31 tests/test_multilabel.py'),
    dict(
        flags=['--lr-decay-fn'],
        dest='lr_decay_fn',
        default=None,
        source='timm 1.0.31 timm/scheduler/scheduler_factory.py scheduler_kwargs',
    ),
    dict(
        flags=['--lr-stable-timescale'],
        dest='lr_stable_timescale',
        default=None,
        source='timm 1.0.31 timm/scheduler/scheduler_factory.py scheduler_kwargs',
    ),
]


def flag_table(train_py: str, source: str) -> dict:
    spec = importlib.util.spec_from_file_location('timm_train_py', train_py)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = []
    for parser in (module.config_parser, module.parser):
        for a in parser._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            rows.append(dict(flags=list(a.option_strings), dest=a.dest, default=a.default, help=a.help, source=source))
    have = {r['dest'] for r in rows}
    rows += [dict(r, help=None) for r in EXTRA if r['dest'] not in have]
    return dict(source=source, flags=rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('train_py', help="timm's train.py")
    p.add_argument('--source', required=True, help='where it came from (repository@commit), kept in the table')
    p.add_argument('--out', default=str(Path(__file__).resolve().parents[1] / 'tests/data/timm_train_flags.json'))
    a = p.parse_args(argv)
    table = flag_table(a.train_py, a.source)
    Path(a.out).write_text(json.dumps(table, indent=1, default=str) + '\n')
    print(f'{len(table["flags"])} flags -> {a.out}', file=sys.stderr)


if __name__ == '__main__':
    main()
