"""README.md and docs/ stay true: generated flag tables, commands that parse (and, offline, run), files and
links that exist, a README a newcomer reads in five minutes."""
import re
import shlex
import subprocess
import sys

import pytest

from scripts import gen_readme_tables as gen
from tests.conftest import REPO

README = (REPO / "README.md").read_text()
PAGES = {"README.md": README, **{f"docs/{p.name}": p.read_text() for p in sorted((REPO / "docs").glob("*.md"))}}
FLAGS = PAGES["docs/flags.md"]


def code_blocks(text):
    return re.findall(r"```[\w-]*\n(.*?)```", text, re.S)  # any language (mermaid too), so blocks pair up


def commands(prefix, pages=PAGES):
    """Shell commands in the code blocks of README.md and docs/ that start with ``prefix`` (continuations joined;
    sketches with elided flags, ``...``, left out)."""
    found = []
    for text in pages.values():
        for block in code_blocks(text):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split("  #")[0].strip()
                if line.startswith(prefix) and " ... " not in line:
                    found.append(shlex.split(line))
    return found


def test_flag_tables_match_the_parsers():
    assert gen.render(FLAGS) == FLAGS, "docs/flags.md is stale: run python scripts/gen_readme_tables.py"
    for name in gen.ENTRY_POINTS:
        assert f"<!-- flags:{name}:start -->" in FLAGS


@pytest.mark.slow
def test_check_mode_fails_on_a_stale_table(tmp_path):
    stale = tmp_path / "flags.md"
    stale.write_text(FLAGS.replace("| `--dry-run` |", "| `--dry-run-old` |"))
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_readme_tables.py"), "--check",
                          "--readme", str(stale)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "out of date" in res.stderr


def test_algorithm_tables_are_the_specs():
    """docs/algorithms.md's estimator, policy-loss and aggregation tables are rendered from the specs of
    step3_rlhf_finetuning/algorithms.py; a spec changed without regenerating the page fails here."""
    from step3_rlhf_finetuning.algorithms import DOC_TABLES, ESTIMATORS, POLICY_LOSSES

    page = PAGES["docs/algorithms.md"]
    assert gen.render(page) == page, "docs/algorithms.md is stale: run python scripts/gen_readme_tables.py"
    for name, table in DOC_TABLES.items():
        assert f"<!-- specs:{name}:start -->\n{table()}<!-- specs:{name}:end -->" in page
    for spec in ESTIMATORS.values():
        assert f"| `{spec.name}`" in page and spec.formula in page
    for spec in POLICY_LOSSES.values():
        assert f"| `{spec.name}` ({spec.title}) | {spec.formula} |" in page
    # and the flags page says the specs' defaults (derived, not written twice)
    assert "default: 0.2 for ppo; 0.0003 for gspo; 1.0 for cispo" in FLAGS


@pytest.mark.slow
def test_check_mode_fails_when_a_spec_and_the_algorithms_page_disagree(tmp_path):
    stale = tmp_path / "algorithms.md"
    stale.write_text(PAGES["docs/algorithms.md"].replace("| ≥ 2 | k3 in the loss |", "| ≥ 2 | k1 in the loss |", 1))
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_readme_tables.py"), "--check",
                          "--algorithms", str(stale)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and f"{stale}: generated tables are out of date" in res.stderr
    assert str(REPO / "docs" / "flags.md") not in res.stderr  # the real pages are current


def test_flags_table_lists_every_flag_with_default_and_help():
    import train

    table = gen.flags_table(train.build_parser())
    assert "| `--deployment-type` | `single_gpu` |" in table and "(choices: single_gpu, single_node, multi_node)" in table
    assert "| `--demo` | off |" in table and "`--help`" not in table


def test_set_up_commands_come_first():
    first_section = README.split("\n## ")[1]
    assert first_section.startswith("Set-up")
    setup = code_blocks(first_section)[0].splitlines()
    assert [line.split("#")[0].strip() for line in setup] == ["make demo", "make test-all"]


def test_ci_runs_the_readmes_test_command_and_it_runs_every_test():
    """.ci/run's command is the README's test command, ``make test-all``: ``make test`` (the fast tests) and
    ``make test-slow`` (the rest), whose marker expressions (pytest.ini's markers) together select every test."""
    setup = code_blocks(README.split("\n## ")[1])[0].splitlines()
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci[-1] == setup[-1].split("#")[0].strip() == "make test-all"
    make = (REPO / "Makefile").read_text()
    fast = re.search(r"^FAST := (.*)$", make, re.M).group(1)
    slow = re.search(r"^SLOW := (.*)$", make, re.M).group(1)
    assert "$(MAKE) --no-print-directory test ||" in make and "$(MAKE) --no-print-directory test-slow ||" in make
    for marks in [set(), {"slow"}, {"slow", "smoke"}, {"slow", "multiproc"}, {"multiproc"}]:  # exactly one of the two
        where = {name: name in marks for name in ("slow", "multiproc", "smoke")}
        assert eval(fast, {}, where) != eval(slow, {}, where), marks



def test_every_test_the_docs_name_exists():
    """``tests/test_x.py::test_name`` (and ``, ::other_name`` after it) in the README and docs/: the file holds the
    test, so a renamed or split test file cannot leave a page pointing at nothing (DeepSpeed-Chat's own tests aside)."""
    import ast

    named, missing = 0, []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for m in re.finditer(r"(DeepSpeed-Chat's )?tests/(\w+\.py)((?:::\w+)?(?:,\s*::\w+)*)", page.read_text()):
            if m.group(1):
                continue
            named += 1
            path = REPO / "tests" / m.group(2)
            if not path.exists():
                missing.append(f"{page.name}: {m.group(0)}")
                continue
            tree = ast.parse(path.read_text())
            defined = {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
            missing += [f"{page.name}: {path.name}::{name}" for name in re.findall(r"::(\w+)", m.group(3))
                        if name not in defined]
    assert named > 100 and missing == []

def test_train_py_commands_in_the_readme_parse():
    import train

    found = commands("python train.py")
    assert ["python", "train.py", "--actor-model", "facebook/opt-1.3b", "--reward-model", "facebook/opt-350m",
            "--deployment-type", "single_gpu"] in found
    for cmd in found:
        train.parse_args(cmd[2:])  # SystemExit (argparse error) fails the test


@pytest.mark.parametrize("launcher", ["deepspeed", "python"])
def test_step_commands_in_the_readme_parse(launcher):
    found = [cmd for cmd in commands(launcher) if cmd[1].endswith("/main.py")]
    assert found
    for cmd in found:
        name = {v: k for k, v in gen.ENTRY_POINTS.items()}[cmd[1]]
        gen.load_parser(gen.ENTRY_POINTS[name]).parse_args(cmd[2:])


def test_architecture_names_existing_files_and_every_module():
    tree = PAGES["docs/architecture.md"]
    paths = [line.split()[0] for line in code_blocks(tree)[0].splitlines() if line.strip()]
    assert "train.py" in paths and len(paths) > 20
    missing = [p for p in paths if not (REPO / p).exists()]
    assert not missing, f"docs/architecture.md lists missing files: {missing}"
    modules = [str(p.relative_to(REPO)) for folder in ("utils", "inference", "step1_supervised_finetuning",
                                                        "step2_reward_model_finetuning", "step2_dpo_finetuning",
                                                        "step3_rlhf_finetuning")
               for p in sorted((REPO / folder).rglob("*.py")) if p.name != "__init__.py"]
    unlisted = [m for m in modules if m not in paths]
    assert not unlisted, f"modules docs/architecture.md does not describe: {unlisted}"


def test_readme_is_short_and_its_links_lead_somewhere():
    lines = README.splitlines()
    assert len(lines) <= 200, len(lines)  # issue 56: a page a user reads; the detail lives in docs/
    section = README.split("\n## A real model, trained here\n")[1].split("\n## ")[0]
    assert len(section.strip().splitlines()) <= 30
    assert len((REPO / "docs" / "real-model.md").read_text().splitlines()) <= 200
    demo = README.split("\n## What the demo shows\n")[1].split("\n## ")[0]
    assert len(demo.strip().splitlines()) <= 40
    for page, text in PAGES.items():
        base = (REPO / page).parent
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" not in target:
                assert (base / target).exists(), f"{page} links to {target}, which does not exist"
    assert set(re.findall(r"\(docs/([\w.-]+\.md)\)", README)) >= {p.split("/")[1] for p in PAGES if "/" in p}


def sections_with_code():
    """(section title, text before each code block since the previous one, the block) for every code block of
    README.md and docs/."""
    for text in PAGES.values():
        for section in text.split("\n## ")[1:]:
            title, body = section.split("\n", 1)
            parts = re.split(r"```[\w-]*\n(.*?)```", body, flags=re.S)
            for i in range(1, len(parts), 2):
                yield title, parts[i - 1], parts[i]


def needs_the_hub(cmd):
    """Does this README command read a model or data set from the Hugging Face hub?"""
    hub_name = re.compile(r"^(?!builtin/|output/|\.|/)[\w.-]+/[\w.-]+$")  # org/name, not a local path
    if cmd[1] == "train.py":
        return "--demo" not in cmd and "--dry-run" not in cmd
    if "--data_path" not in cmd and cmd[1].startswith("step") and "step3" not in cmd[1]:
        return True  # the default --data_path is Dahoas/rm-static
    return any(hub_name.match(arg) for arg in cmd[2:])


def test_every_command_that_needs_the_hub_says_so():
    """Offline, a hub command retries for about a minute and then fails: the README must say so beside it."""
    unmarked, checked = [], 0
    for title, intro, block in sections_with_code():
        for line in block.replace("\\\n", " ").splitlines():
            command, _, comment = line.partition("  #")
            sketch = " ... " in command  # elided flags: not a command to run as it is
            words = shlex.split(command.strip()) if command.strip().startswith(("python", "deepspeed")) and \
                not sketch else []
            if len(words) < 2 or not words[1].endswith(".py"):
                continue
            checked += 1
            context = intro.strip().split("\n\n")[-1] or title  # the paragraph just before the block (or heading)
            if needs_the_hub(words) and not any("hub" in text for text in (context, comment)):
                unmarked.append(command.strip())
    assert checked > 10 and not unmarked, unmarked


def test_built_in_tokenizer_sizes_in_the_readme_are_true():
    from utils.model.model_utils import load_hf_tokenizer

    sizes = {name: len(load_hf_tokenizer(name)) for name in ("tiny-opt", "tiny-llama", "small-opt")}
    assert sizes == {"tiny-opt": 669, "tiny-llama": 673, "small-opt": 669}
    assert f"{sizes['tiny-opt']} tokens for `tiny-opt` and `small-opt`, {sizes['tiny-llama']} for `tiny-llama`" \
        in " ".join(PAGES["docs/data.md"].split())
    assert "vocabulary size (669 for tiny-opt" in PAGES["docs/outputs.md"]
    assert not any("1000 tokens" in text for text in PAGES.values())


@pytest.mark.slow
def test_offline_commands_of_the_readme_and_docs_run(tmp_path):
    """Every train.py command of README.md and docs/ that needs no network runs: the quick steps-1-and-2 command of
    docs/running.md as it is, then each `--demo --step 3` command on its result, with `--max_steps 2` added to its
    step-3 flags (the README's own step 3 runs 80 steps)."""
    from tests.conftest import run_entry

    offline = [cmd for cmd in commands("python train.py") if "--demo" in cmd and "--dry-run" not in cmd]
    quick = [cmd for cmd in offline if "--step" in cmd and cmd[cmd.index("--step") + 1:cmd.index("--step") + 3] ==
             ["1", "2"]]
    step3 = [cmd for cmd in offline if "--step" in cmd and cmd[cmd.index("--step") + 1] == "3"]
    assert len(quick) == 1 and len(step3) >= 5, offline
    proc = run_entry("train.py", *quick[0][2:], "--output-dir", tmp_path, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for cmd in step3:
        args = list(cmd[2:])
        i = args.index("--step3-args") + 1
        args[i] += " --max_steps 2"
        proc = run_entry("train.py", *args, "--output-dir", tmp_path, env={"OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, (cmd, proc.stdout[-2000:] + proc.stderr[-2000:])
        assert (tmp_path / "step3-models" / "tiny-llama" / "actor" / "config.json").is_file()
