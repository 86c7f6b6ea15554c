#!/usr/bin/env python
"""Regenerate docs/flags.md's flag tables from the entry points' own argument parsers, and docs/algorithms.md's
estimator, policy-loss and aggregation tables from step 3's specs (step3_rlhf_finetuning/algorithms.py).

    python scripts/gen_readme_tables.py           # rewrite the tables in docs/flags.md and docs/algorithms.md
    python scripts/gen_readme_tables.py --check   # exit 1 when either page is out of date

Each flag table lives between ``<!-- flags:NAME:start -->`` and ``<!-- flags:NAME:end -->``
(NAME: a key of :data:`ENTRY_POINTS`); each spec table between ``<!-- specs:NAME:start -->`` and
``<!-- specs:NAME:end -->`` (NAME: a key of ``algorithms.DOC_TABLES``). The parser is captured by importing the
entry point and calling its ``parse_args`` with ``ArgumentParser.parse_args``
replaced by a trap, so nothing is trained, initialised or downloaded.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import sys

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
README = os.path.join(REPO, "docs", "flags.md")  # the page that holds the flag tables
ALGORITHMS = os.path.join(REPO, "docs", "algorithms.md")  # the page that holds the spec tables
ENTRY_POINTS = {
    "step1": "step1_supervised_finetuning/main.py",
    "step2": "step2_reward_model_finetuning/main.py",
    "dpo": "step2_dpo_finetuning/main.py",
    "step3": "step3_rlhf_finetuning/main.py",
    "train": "train.py",
    "collect": "step2_reward_model_finetuning/collect_comparisons.py",
}
REGION = re.compile(r"(<!-- (?P<kind>flags|specs):(?P<name>\w+):start -->\n)(?P<body>.*?)"
                    r"(<!-- (?P=kind):(?P=name):end -->)", re.S)


class _Captured(Exception):
    def __init__(self, parser):
        super().__init__("parser captured")
        self.parser = parser


def _trap(self, args=None, namespace=None):
    raise _Captured(self)


def load_parser(relpath: str) -> argparse.ArgumentParser:
    """The ``ArgumentParser`` an entry point builds (its ``build_parser()``, else the one ``parse_args`` uses)."""
    module = importlib.import_module(relpath[:-3].replace("/", "."))
    if hasattr(module, "build_parser"):
        return module.build_parser()
    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = _trap
    try:
        takes_argv = bool(inspect.signature(module.parse_args).parameters)
        module.parse_args([]) if takes_argv else module.parse_args()
    except _Captured as captured:
        return captured.parser
    finally:
        argparse.ArgumentParser.parse_args = original
    raise RuntimeError(f"{relpath}: parse_args() returned without calling ArgumentParser.parse_args")


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "off" if action.default is False else "on"
    value = action.default
    if value is None or value == argparse.SUPPRESS or value == "":
        return ""
    if isinstance(value, (list, tuple)):
        return "`" + " ".join(str(v) for v in value) + "`" if value else ""
    return f"`{value}`"


def flags_table(parser: argparse.ArgumentParser) -> str:
    """Markdown: one table per argument group (flag, default, description)."""
    out = []
    for group in parser._action_groups:
        rows = []
        for action in group._group_actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            flag = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest}`"
            text = action.help or ""
            if action.choices is not None:
                text += f" (choices: {', '.join(str(c) for c in action.choices)})"
            rows.append(f"| {flag} | {_cell(_default(action))} | {_cell(text)} |")
        if rows:
            title = "options" if group.title in ("options", "optional arguments") else group.title
            out += [f"**{title}**", "", "| flag | default | description |", "|---|---|---|", *rows, ""]
    return "\n".join(out)


def table_for(name: str) -> str:
    relpath = ENTRY_POINTS[name]
    if not os.path.isfile(os.path.join(REPO, relpath)):
        return f"_`{relpath}` is not in this checkout._\n"
    return flags_table(load_parser(relpath))


def spec_table(name: str) -> str:
    from step3_rlhf_finetuning.algorithms import DOC_TABLES

    if name not in DOC_TABLES:
        raise KeyError(f"unknown specs region {name!r}; known: {', '.join(DOC_TABLES)}")
    return DOC_TABLES[name]()


def render(readme: str) -> str:
    """``readme`` with every flags and specs region regenerated."""
    def replace(match):
        name = match.group("name")
        if match.group("kind") == "specs":
            return match.group(1) + spec_table(name) + match.group(5)
        if name not in ENTRY_POINTS:
            raise KeyError(f"unknown flags region {name!r}; known: {', '.join(ENTRY_POINTS)}")
        return match.group(1) + table_for(name) + match.group(5)

    return REGION.sub(replace, readme)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="Only check; exit 1 when the page is out of date.")
    p.add_argument("--readme", default=README, help="The flags page to rewrite (docs/flags.md).")
    p.add_argument("--algorithms", default=ALGORITHMS, help="The algorithms page to rewrite (docs/algorithms.md).")
    args = p.parse_args(argv)
    stale = 0
    for page in (args.readme, args.algorithms):
        with open(page) as f:
            current = f.read()
        fresh = render(current)
        if args.check:
            if fresh != current:
                print(f"{page}: generated tables are out of date; run python scripts/gen_readme_tables.py",
                      file=sys.stderr)
                stale = 1
            continue
        if fresh != current:
            with open(page, "w") as f:
                f.write(fresh)
        print(f"{page}: generated tables {'updated' if fresh != current else 'already up to date'}")
    return stale


if __name__ == "__main__":
    sys.exit(main())
