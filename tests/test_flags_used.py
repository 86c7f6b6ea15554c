"""Every flag an entry point accepts is read by its code, or refused when given (README rule 7: "a flag the run would
not use is refused"), proved by introspection rather than by a list of flags.

The entry points are found on disk (a top-level or step-folder script with an ``if __name__ == "__main__":`` block
and a ``parse_args``), their parsers are built the way scripts/gen_readme_tables.py builds them, and the code an
entry point can run is followed statically from its script through the project's modules (:class:`Reach`): a flag
counts as read when that code reads ``args.<flag>``, ``getattr(args, "<flag>")`` (an f-string name matches as a
pattern), names it in a tuple or list of flag names (the ``for name in (...): getattr(args, name)`` form), or
declares it as a config :func:`~step3_rlhf_finetuning.config.knob` of a class it reaches (``from_args`` reads every
knob). Sets of names (``RUN_ONLY_FLAGS``: flags that may change on resume) are exclusion lists, not reads.

The flags of the compatibility help group (:data:`utils.arguments.COMPAT_GROUP`) are exempt: each either says it
has no effect by design ("Accepted for …") or is refused when given, which :func:`test_compat_flags_are_refused`
exercises.
"""
from __future__ import annotations

import argparse
import ast
import os
import re
from collections import defaultdict

import pytest

from tests.conftest import REPO

from scripts import gen_readme_tables as gen
from utils.arguments import COMPAT_GROUP

PACKAGES = ("utils", "inference", "step1_supervised_finetuning", "step2_reward_model_finetuning",
            "step2_dpo_finetuning", "step3_rlhf_finetuning")


def entry_points() -> list:
    """The scripts a user runs: top-level and step-folder .py files with a ``__main__`` block and ``parse_args``."""
    found = []
    for folder in ["."] + sorted(d for d in os.listdir(REPO) if d.startswith("step") and os.path.isdir(REPO / d)):
        for name in sorted(os.listdir(REPO / folder)):
            path = REPO / folder / name
            if not name.endswith(".py") or name.startswith(("_", "test")):
                continue
            text = path.read_text()
            if "__name__ == \"__main__\"" in text and "parse_args" in text:
                found.append(os.path.normpath(os.path.join(folder, name)))
    return found


class Reach:
    """The code an entry point can run, followed statically through the project's modules.

    Names are resolved in their module (its functions, classes and assignments, and what it imports from the
    project); ``module.f`` and ``Class.method`` through the import; any other ``obj.method(...)`` call reaches every
    project function or method of that name (an over-approximation: a flag read anywhere reachable counts)."""

    def __init__(self, sources: dict | None = None):
        self.sources = sources or {}  # module name -> source text (tests of the checker itself)
        self.trees, self.chunks, self.seen = {}, [], set()
        self.functions, self.wanted = defaultdict(list), set()  # function name -> its definitions; names called
        self.scopes = {}

    def tree(self, module: str):
        if module not in self.trees:
            text = self.sources.get(module)
            if text is None:
                base = REPO / module.replace(".", os.sep)
                path = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
                text = path.read_text() if path.is_file() else None
            self.trees[module] = tree = ast.parse(text) if text is not None else None
            for node in ast.walk(tree) if tree is not None else ():
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self.functions[node.name].append((module, node))
                    if node.name in self.wanted:
                        self.add(module, node)
        return self.trees[module]

    @staticmethod
    def project(module: str) -> bool:
        return module.split(".")[0] in PACKAGES or module in ("train", "chat") or module.startswith("fake")

    def scope(self, module: str) -> dict:
        """name -> ("def", node) | ("module", name) | ("import", module, attr) at module level."""
        if module not in self.scopes:
            self.scopes[module] = self._scope(module)
        return self.scopes[module]

    def _scope(self, module: str) -> dict:
        tree, names = self.tree(module), {}
        if tree is None:
            return names
        for node in ast.walk(tree):  # imports anywhere (function-level imports included)
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and self.project(node.module):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    is_module = self.tree(sub) is not None if self.project(sub) else False
                    names[alias.asname or alias.name] = ("module", sub) if is_module else \
                        ("import", node.module, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if self.project(alias.name):
                        names[alias.asname or alias.name.split(".")[0]] = ("module", alias.asname and alias.name
                                                                           or alias.name.split(".")[0])
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names[node.name] = ("def", node)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, ast.Name):
                        names[target.id] = ("def", node)
        return names

    def add(self, module: str, node) -> None:
        if (module, id(node)) not in self.seen:
            self.seen.add((module, id(node)))
            self.chunks.append((module, node))

    def resolve(self, module: str, name: str, attr: str | None = None) -> None:
        entry = self.scope(module).get(name)
        if entry is None:
            return
        if entry[0] == "import":
            return self.resolve(entry[1], entry[2], attr)
        if entry[0] == "module":
            return self.resolve(entry[1], attr) if attr else None
        node = entry[1]
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self.add(module, item)  # fields (knobs), class constants
                elif item.name in ("__init__", "__post_init__") or item.name == attr:
                    self.add(module, item)
        else:
            self.add(module, node)

    def methods_named(self, attr: str) -> None:
        if attr not in self.wanted:
            self.wanted.add(attr)
            for module, node in self.functions[attr]:
                self.add(module, node)

    def run(self, entry: str) -> set:
        tree = self.tree(entry)
        for node in tree.body:
            self.add(entry, node)
        i = 0
        while i < len(self.chunks):
            module, chunk = self.chunks[i]
            i += 1
            for node in ast.walk(chunk):
                if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                    self.resolve(module, node.id)
                elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                    self.resolve(module, node.value.id, node.attr)
            for node in ast.walk(chunk):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                    self.methods_named(node.func.attr)
        return self.reads()

    def reads(self) -> set:
        """Flag names (and f-string patterns, as regexes) the reached code reads."""
        out = set()
        for _, chunk in self.chunks:
            excluded = set()
            for node in ast.walk(chunk):  # sets of names: exclusion lists
                if isinstance(node, ast.Set) or (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                                                 and node.func.id in ("set", "frozenset")):
                    excluded.update(id(n) for n in ast.walk(node))
            for node in ast.walk(chunk):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and "args" in node.value.id:
                    out.add(node.attr)
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2 \
                        and node.func.id in ("getattr", "hasattr", "setattr"):
                    out.add(pattern(node.args[1]))
                elif isinstance(node, (ast.Tuple, ast.List)) and id(node) not in excluded:
                    out.update(e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str))
                elif isinstance(node, ast.AnnAssign) and isinstance(node.value, ast.Call) \
                        and getattr(node.value.func, "id", None) == "knob":
                    flag = [k.value.value for k in node.value.keywords if k.arg == "flag"]
                    out.add(flag[0] if flag else node.target.id)
        out.discard(None)
        return out


def pattern(node):
    """A getattr name: its text, or for an f-string a regex of it (``f"{role}_lora_dim"`` → ``\\w*_lora_dim``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and any(isinstance(v, ast.Constant) and v.value for v in node.values):
        return "re:" + "".join(re.escape(v.value) if isinstance(v, ast.Constant) else r"\w*" for v in node.values)
    return None


def unread(parser: argparse.ArgumentParser, reads: set) -> list:
    regexes = [re.compile(r[3:]) for r in reads if r.startswith("re:")]
    out = []
    for group in parser._action_groups:
        for action in group._group_actions:
            dest = action.dest
            if isinstance(action, argparse._HelpAction) or group.title == COMPAT_GROUP:
                continue
            if dest not in reads and not any(r.fullmatch(dest) for r in regexes):
                out.append(f"--{dest}")
    return out


ENTRY_POINTS = entry_points()


def test_the_entry_points_are_found():
    assert {"train.py", "chat.py", "step1_supervised_finetuning/main.py", "step1_supervised_finetuning/prompt_eval.py",
            "step2_reward_model_finetuning/main.py", "step2_reward_model_finetuning/rw_eval.py",
            "step2_reward_model_finetuning/collect_comparisons.py", "step2_dpo_finetuning/main.py",
            "step3_rlhf_finetuning/main.py"} <= set(ENTRY_POINTS)


@pytest.mark.parametrize("relpath", ENTRY_POINTS)
def test_every_flag_is_read_or_refused(relpath):
    parser = gen.load_parser(relpath)
    reads = Reach().run(relpath[:-3].replace(os.sep, "."))
    missing = unread(parser, reads)
    assert not missing, (f"{relpath} accepts {', '.join(missing)} but no code it runs reads them: read them, refuse "
                         f"them when given (in the {COMPAT_GROUP!r} help group), or drop them")


@pytest.mark.parametrize("relpath", ENTRY_POINTS)
def test_compat_flags_say_what_becomes_of_them(relpath):
    for group in gen.load_parser(relpath)._action_groups:
        if group.title == COMPAT_GROUP:
            for action in group._group_actions:
                assert action.help.startswith(("Accepted for", "Refused when given")), action.option_strings


def test_compat_flags_are_refused():
    """Step 3's "Refused when given" flags: each, given, is refused by its checks (naming it), before any set-up."""
    from step3_rlhf_finetuning.main import build_parser, parse_args, validate_flags
    from utils.errors import UserInputError

    base = ["--actor_model_name_or_path", "a", "--critic_model_name_or_path", "c", "--output_dir", "/tmp/unused"]
    validate_flags(parse_args(base))
    refused = [a for g in build_parser()._action_groups if g.title == COMPAT_GROUP for a in g._group_actions
               if a.help.startswith("Refused when given")]
    assert {a.dest for a in refused} >= {"zero_stage", "print_loss", "max_seq_len"}
    for action in refused:
        flag = action.option_strings[0]
        given = [flag] if action.nargs == 0 else \
            [flag, str([c for c in action.choices if c != action.default][-1] if action.choices else 7)]
        with pytest.raises(UserInputError, match=re.escape(flag) + ".* would not be used"):
            validate_flags(parse_args(base + given))


FAKE = '''
import argparse
from fake.helpers import configure

def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--used")
    p.add_argument("--used_by_helper")
    p.add_argument("--role_lr")
    p.add_argument("--looped")
    p.add_argument("--only_in_a_set")
    p.add_argument("--new_unread_flag")
    return p.parse_args(argv)

def main(args):
    print(args.used)
    configure(args, "role")
    for name in ("looped",):
        getattr(args, name)
    ignored = frozenset(("only_in_a_set",))

if __name__ == "__main__":
    main(parse_args())
'''
FAKE_HELPERS = '''
def configure(args, role):
    return args.used_by_helper, getattr(args, f"{role}_lr")

def never_called(args):
    return args.new_unread_flag
'''


def test_the_checker_finds_an_unread_flag():
    """Self-check: a new flag no reachable code reads is reported (a read in an unreached function does not count;
    a helper's read through an import, an f-string getattr and a tuple of names do)."""
    reach = Reach({"fake.entry": FAKE, "fake.helpers": FAKE_HELPERS})
    reads = reach.run("fake.entry")
    namespace = {}
    exec(compile(FAKE.split("def main")[0].replace("from fake.helpers import configure", ""), "fake", "exec"),
         namespace)
    captured = []
    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = lambda self, *a, **k: captured.append(self)
    try:
        namespace["parse_args"]([])
    finally:
        argparse.ArgumentParser.parse_args = original
    assert unread(captured[0], reads) == ["--only_in_a_set", "--new_unread_flag"]
