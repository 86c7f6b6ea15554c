"""README.md stays true: generated flag tables, commands that parse, files that exist."""
import re
import shlex
import subprocess
import sys

import pytest

from scripts import gen_readme_tables as gen
from tests.conftest import REPO

README = (REPO / "README.md").read_text()


def code_blocks(text):
    return re.findall(r"```(?:bash|text)?\n(.*?)```", text, re.S)


def commands(prefix):
    """Shell commands in the README's code blocks that start with ``prefix`` (continuations joined)."""
    found = []
    for block in code_blocks(README):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith(prefix):
                found.append(shlex.split(line))
    return found


def test_flag_tables_match_the_parsers():
    assert gen.render(README) == README, "README flag tables are stale: run python scripts/gen_readme_tables.py"
    for name in gen.ENTRY_POINTS:
        assert f"<!-- flags:{name}:start -->" in README


def test_check_mode_fails_on_a_stale_table(tmp_path):
    stale = tmp_path / "README.md"
    stale.write_text(README.replace("| `--dry-run` |", "| `--dry-run-old` |"))
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_readme_tables.py"), "--check",
                          "--readme", str(stale)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "out of date" in res.stderr


def test_flags_table_lists_every_flag_with_default_and_help():
    import train

    table = gen.flags_table(train.build_parser())
    assert "| `--deployment-type` | `single_gpu` |" in table and "(choices: single_gpu, single_node, multi_node)" in table
    assert "| `--demo` | off |" in table and "`--help`" not in table


def test_set_up_commands_come_first():
    first_section = README.split("\n## ")[1]
    assert first_section.startswith("Set-up")
    setup = code_blocks(first_section)[0].splitlines()
    assert [line.split("#")[0].strip() for line in setup] == ["make demo", "make test"]


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


def test_architecture_tree_names_existing_files():
    tree = README.split("## Architecture")[1]
    paths = [line.split()[0] for line in code_blocks(tree)[0].splitlines() if line.strip()]
    assert "train.py" in paths and len(paths) > 20
    missing = [p for p in paths if not (REPO / p).exists()]
    assert not missing, f"README architecture lists missing files: {missing}"


def sections_with_code():
    """(section title, text before each code block since the previous one, the block) for every code block."""
    for section in README.split("\n## ")[1:]:
        title, body = section.split("\n", 1)
        parts = re.split(r"```(?:bash|text)?\n(.*?)```", body, flags=re.S)
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
            words = shlex.split(command.strip()) if command.strip().startswith(("python", "deepspeed")) else []
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
        in " ".join(README.split())
    assert "vocabulary size (669 for tiny-opt" in README and "1000 tokens" not in README
