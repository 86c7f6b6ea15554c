"""Issue 57, the rules kept everywhere: R2 (a run that changed nothing never ends as a success), R3 (no traceback from
any script the project ships: a user's mistake is one ``error:`` line and exit 2, Ctrl-C one line and exit 130) and
R6 (a setting that will be very slow on this machine says so in one line, naming the faster one).

The scan (:func:`entry_scripts`) finds every shipped script with a ``__main__`` block by reading the sources, so a
new script that skips :func:`utils.entrypoint.run_main` / :func:`utils.entrypoint.run_script` fails here."""
import ast
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import REPO
from utils.errors import BAD_INPUT, INTERRUPTED, UserInputError
from utils.reward_functions import call_reward_fn, load_reward_fn

PROMPTS, ANSWERS, ROWS = [" Human: Describe the lamp. Assistant:"] * 2, [" bright", " kind"], [{}, {}]


def run_python(*args, cwd=REPO, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    return subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def one_error_line(proc, *fragments):
    """Exit 2, no traceback, exactly one ``error:`` line holding every fragment."""
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == BAD_INPUT, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


# --------------------------------------------------------------------------- (a) a reward function that exits

@pytest.mark.parametrize("code", [0, 1, "bye"])
def test_a_reward_function_that_calls_sys_exit_is_an_error_naming_it(code):
    """R2/R3: before, SystemExit went through call_reward_fn (it caught Exception) and step 3 stopped at its first
    scoring with exit 0 and no word; now it is a UserInputError naming the function and the row."""
    def score(prompts, answers, rows):
        sys.exit(code)

    with pytest.raises(UserInputError) as caught:
        call_reward_fn(score, "r.py:score", PROMPTS, ANSWERS, ROWS)
    message = str(caught.value)
    assert message.startswith(f"--reward_fn r.py:score raised SystemExit({code!r})")
    assert "sys.exit()" in message and "on row 0 (prompt" in message


def test_a_label_function_that_exits_only_on_a_batch_is_named_too():
    """The batch call exits, no single row does: still one error, naming --label_fn (collect_comparisons)."""
    def label(prompts, answers, rows):
        if len(answers) > 1:
            raise SystemExit(0)
        return [1.0]

    with pytest.raises(UserInputError, match=r"^--label_fn f.py:label raised SystemExit\(0\).*no single row raises"):
        call_reward_fn(label, "f.py:label", PROMPTS, ANSWERS, ROWS, flag="--label_fn")


def test_a_reward_file_that_exits_when_imported_is_an_error(tmp_path):
    """Own case (R2): a file whose top level calls sys.exit() (a script turned into a reward file): before, loading
    it ended step 3 with that exit code and no word; now one error naming the file."""
    path = tmp_path / "r.py"
    path.write_text("import sys\nsys.exit(0)\ndef score(prompts, answers, rows):\n    return [1.0] * len(answers)\n")
    with pytest.raises(UserInputError, match=r"r.py:score: importing .*r.py failed: SystemExit\(0\)"):
        load_reward_fn(f"{path}:score")


def test_ctrl_c_inside_a_reward_function_stays_the_runs_ctrl_c():
    """Own case (kept before too): KeyboardInterrupt from the function is the user's Ctrl-C, not the function's
    fault: it goes through untouched, so run_main says where the run stopped (exit 130), and nothing retries it."""
    calls = []

    def score(prompts, answers, rows):
        calls.append(len(answers))
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        call_reward_fn(score, "r.py:score", PROMPTS, ANSWERS, ROWS)
    assert calls == [2]


def test_a_slow_reward_function_is_named_once_after_the_time_given(capsys):
    """R6: a reward function still running after ``slow_after`` seconds (60 by default) is one warning line."""
    def slow(prompts, answers, rows):
        time.sleep(0.6)
        return [1.0] * len(answers)

    assert call_reward_fn(slow, "r.py:slow", PROMPTS, ANSWERS, ROWS, slow_after=0.05) == [1.0, 1.0]
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("warning: --reward_fn r.py:slow has not returned after 0.05 s")
    assert call_reward_fn(lambda p, a, r: [0.5] * len(a), "r.py:fast", PROMPTS, ANSWERS, ROWS, slow_after=0.05) \
        == [0.5, 0.5]
    time.sleep(0.15)  # the fast call's timer was cancelled: nothing more is said
    assert capsys.readouterr().err == ""
    from utils.reward_functions import SLOW_REWARD_SECONDS

    assert SLOW_REWARD_SECONDS == 60.0
    assert not [t for t in threading.enumerate() if isinstance(t, threading.Timer) and t.is_alive()]


@pytest.mark.slow
def test_step3_with_a_reward_function_that_exits_ends_with_one_error_and_saves_nothing(tmp_path):
    """(a) end to end: step 3 alone, GRPO on the tiny actor, the reward function calls sys.exit(0)."""
    (tmp_path / "r.py").write_text("import sys\ndef score(prompts, answers, rows):\n    sys.exit(0)\n")
    out = tmp_path / "out"
    proc = run_python("step3_rlhf_finetuning/main.py", "--actor_model_name_or_path", "tiny-opt", "--data_path",
                      "builtin/preference-small", "--max_prompt_seq_len", "16", "--max_answer_seq_len", "8",
                      "--advantage_estimator", "grpo", "--n_samples_per_prompt", "2", "--do_sample", "--max_steps",
                      "1", "--reward_fn", f"{tmp_path / 'r.py'}:score", "--data_output_path", tmp_path / "data",
                      "--output_dir", out, timeout=900)
    one_error_line(proc, "r.py:score raised SystemExit(0)", "on row 0")
    assert not out.exists()  # nothing saved


# --------------------------------------------------------------------------- (b) bench_real_rl's user mistakes

@pytest.mark.slow
def test_bench_real_rl_train_weights_without_a_weight_is_one_error(tmp_path):
    """Before: exit 0 ("skipped") without the model, a traceback from the data builder's subprocess with it; now
    checked before anything else."""
    proc = run_python("bench/bench_real_rl.py", "--train_weights", "keywords:existence", "--work", tmp_path / "w")
    one_error_line(proc, "--train_weights", "'keywords:existence' is not TYPE=W")
    assert not (tmp_path / "w").exists()


@pytest.mark.slow
def test_bench_real_rl_summarize_a_truncated_results_file_is_one_error(tmp_path):
    """Before: json.decoder.JSONDecodeError's traceback."""
    work = tmp_path / "seed1"
    work.mkdir()
    (work / "results.json").write_text('{"base": {"strict": 0.1')
    proc = run_python("bench/bench_real_rl.py", "--summarize", work)
    one_error_line(proc, str(work / "results.json"), "not a readable results file")
    (work / "results.json").write_text("[1, 2]")
    one_error_line(run_python("bench/bench_real_rl.py", "--summarize", work), "not a results object")


@pytest.mark.slow
def test_bench_real_rl_unknown_row_is_refused_before_anything_runs(tmp_path):
    """Own case (R2): ``--rows gpro`` (a typo): before, exit 0 ("skipped") without the model, and with it an hour of
    base evaluation before "unknown row" (exit 1); now one error line first."""
    one_error_line(run_python("bench/bench_real_rl.py", "--rows", "grpo,gpro", "--work", tmp_path / "w"),
                   "--rows grpo,gpro: 'gpro'")


# --------------------------------------------------------------------------- (c) every shipped script's __main__

EXEMPT = {  # path: why it does not go through run_main
    "bench/peers/trl_run.py": "runs inside the peer environment (TRL's), where only the pure-Python reward functions "
                              "are imported; bench_peers.py / bench_real_rl.py launch it and report its failure",
}
NOT_SHIPPED = ("tests", "scripts", ".venv", ".venv-peers", ".cache", ".git")  # scripts/: maintainers' table writers
WRAPPERS = ("run_main", "run_script")


def _is_main_block(node) -> bool:
    test = getattr(node, "test", None)
    return (isinstance(node, ast.If) and isinstance(test, ast.Compare) and isinstance(test.left, ast.Name)
            and test.left.id == "__name__" and len(test.comparators) == 1
            and getattr(test.comparators[0], "value", None) == "__main__")


def _calls(node, names) -> bool:
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            f = call.func
            if (f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)) in names:
                return True
    return False


def _handles(node, names) -> bool:
    """A ``try`` in ``node`` whose handlers catch every one of ``names`` (train.py's own wrapper)."""
    for t in ast.walk(node):
        if isinstance(t, ast.Try):
            caught = set()
            for handler in t.handlers:
                for n in ast.walk(handler.type) if handler.type is not None else ():
                    if isinstance(n, ast.Name):
                        caught.add(n.id)
            if set(names) <= caught:
                return True
    return False


def script_problems(path: Path) -> list:
    """What keeps ``path`` (a script with a ``__main__`` block) from the rules: its main not run through run_main /
    run_script (or train.py's equivalent: a try that catches KeyboardInterrupt and UserInputError), or an import
    before the Ctrl-C guard (``exit_quietly_on_ctrl_c`` in a ``__main__`` block ahead of every import)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    blocks = [node for node in tree.body if _is_main_block(node)]
    problems = []
    if not any(_calls(b, WRAPPERS) or _handles(b, ("KeyboardInterrupt", "UserInputError")) for b in blocks):
        problems.append("its __main__ does not go through utils.entrypoint.run_main / run_script")
    for node in tree.body:
        if _is_main_block(node) and _calls(node, ("exit_quietly_on_ctrl_c",)):
            break
        if isinstance(node, (ast.Import, ast.ImportFrom)) and not (
                isinstance(node, ast.ImportFrom) and node.module == "__future__"):
            problems.append(f"line {node.lineno} imports before the Ctrl-C guard (exit_quietly_on_ctrl_c)")
            break
    return problems


def entry_scripts() -> list:
    """Every shipped .py file with a ``if __name__ == "__main__":`` block, relative to the repository."""
    found = []
    for root, dirs, files in os.walk(REPO):
        rel_root = Path(root).relative_to(REPO)
        dirs[:] = [d for d in dirs if not (rel_root == Path(".") and d in NOT_SHIPPED) and not d.startswith(".")
                   and d != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                path = Path(root) / name
                text = path.read_text(encoding="utf-8")
                if "__main__" in text and any(_is_main_block(n) for n in ast.parse(text).body):
                    found.append(str(path.relative_to(REPO)))
    return sorted(found)


def test_every_shipped_script_routes_its_main_through_run_main():
    scripts = entry_scripts()
    # the scan sees what the issue names: the benches, the chat and eval tools, train.py, each step, utils' tools
    for expected in ("train.py", "chat.py", "inference/chatbot.py", "bench/bench_real_rl.py",
                     "step1_supervised_finetuning/main.py", "step2_reward_model_finetuning/main.py",
                     "step2_dpo_finetuning/main.py", "step3_rlhf_finetuning/main.py", "bench/ifeval_data.py"):
        assert expected in scripts
    assert len([s for s in scripts if s.startswith("bench/bench_")]) >= 12
    bad = {s: script_problems(REPO / s) for s in scripts if s not in EXEMPT}
    assert {s: p for s, p in bad.items() if p} == {}
    assert set(EXEMPT) <= set(scripts), "an exemption for a script that no longer exists: drop it"


def test_the_scan_catches_a_new_script_without_the_wrapper(tmp_path):
    bare = tmp_path / "bench_new.py"
    bare.write_text('"""A new bench."""\nimport json\n\ndef main():\n    return 0\n\n'
                    'if __name__ == "__main__":\n    main()\n')
    assert len(script_problems(bare)) == 2
    good = tmp_path / "bench_good.py"
    good.write_text('"""A new bench."""\nfrom __future__ import annotations\n\nif __name__ == "__main__":\n'
                    '    from utils.interrupt import exit_quietly_on_ctrl_c\n\n    exit_quietly_on_ctrl_c()\n\n'
                    'import json\n\ndef main():\n    return 0\n\nif __name__ == "__main__":\n'
                    '    from utils.entrypoint import run_script\n\n    run_script(main)\n')
    assert script_problems(good) == []


def test_run_script_gives_one_line_and_the_documented_codes(capsys):
    from utils.entrypoint import run_script

    def mistake():
        raise UserInputError("--rows: 'x' is not a row")

    def interrupted():
        raise KeyboardInterrupt

    for main, code in ((mistake, BAD_INPUT), (interrupted, INTERRUPTED), (lambda: 3, 3), (lambda: None, 0)):
        with pytest.raises(SystemExit) as stop:
            run_script(main)
        assert stop.value.code == code
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == ["error: --rows: 'x' is not a row",
                   "interrupted; what it reported as done is kept, the rest was not run"]


@pytest.mark.slow
def test_run_main_keeps_a_pure_python_tool_free_of_torch():
    """utils.entrypoint no longer imports torch (the OOM clause's type is looked up when something is raised), so
    ``python bench/ifeval_data.py`` under run_script stays a pure-Python start."""
    proc = run_python("-c", "import sys, utils.entrypoint, bench.ifeval_data; print('torch' in sys.modules)")
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr


DATA_TOOLS = {"bench/ifeval_data.py"}  # the data builders with a __main__ (utils/data/*, bench/*_data.py)


def test_the_data_tools_are_the_ones_tested_below():
    tools = {s for s in entry_scripts() if s.startswith("utils/data/") or (s.startswith("bench/")
                                                                           and s.endswith("_data.py"))}
    assert tools == DATA_TOOLS, "a new data tool: add its malformed inputs below"


@pytest.mark.slow
@pytest.mark.parametrize("case, content, fragments", [
    ("missing", None, ["no such file"]),
    ("empty", "", ["no alpaca rows in it (an empty file)"]),
    ("bad_json_line", '{"instruction": "a", "output": "b"}\n{"instruction": \n', ["line 2 is not JSON"]),
    ("not_utf8", b"\xff\xfe\x00[", ["not UTF-8 text"]),  # before: UnicodeDecodeError's traceback
    ("a_folder", "DIR", ["no such file"]),
])
def test_ifeval_data_on_malformed_input_is_one_error(tmp_path, case, content, fragments):
    src = tmp_path / "alpaca.json"
    if isinstance(content, bytes):
        src.write_bytes(content)
    elif content == "DIR":
        src.mkdir()
    elif content is not None:
        src.write_text(content)
    proc = run_python("bench/ifeval_data.py", "--alpaca", src, "--out", tmp_path / "out")
    one_error_line(proc, f"--alpaca {src}", *fragments)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_chat_on_a_folder_with_no_model_is_one_error(tmp_path):
    """Own case (kept before too): chat.py --path at an empty folder."""
    (tmp_path / "empty").mkdir()
    one_error_line(run_python("chat.py", "--path", tmp_path / "empty"), str(tmp_path / "empty"), "no config.json")


@pytest.mark.slow
def test_the_tiny_model_writer_into_a_file_is_one_error(tmp_path):
    """Own case: ``python -m utils.model.tiny OUT`` where OUT is a file: before, FileExistsError's traceback."""
    (tmp_path / "taken").write_text("x")
    one_error_line(run_python("-m", "utils.model.tiny", tmp_path / "taken"), "cannot write the model there")


# --------------------------------------------------------------------------- (d) bf16 on a CPU without bf16

AVX2_EPYC = frozenset("fpu sse2 avx avx2 fma bmi2 sha_ni".split())  # an AMD EPYC: torch reports AVX2
SAPPHIRE_RAPIDS = AVX2_EPYC | {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}


@pytest.mark.parametrize("capability, flags, slow", [
    ("AVX2", AVX2_EPYC, True),
    ("AVX512", AVX2_EPYC | {"avx512f", "avx512bw"}, True),  # AVX512 without its bf16 extension: still emulated
    ("AVX512", SAPPHIRE_RAPIDS, False),
    ("AVX512", AVX2_EPYC | {"avx512f", "avx512_bf16"}, False),
    ("DEFAULT", frozenset({"fp", "asimd", "bf16"}), False),  # aarch64's Features line
    ("AVX2", None, True),  # no /proc/cpuinfo: torch's capability rules the bf16 instructions out
    ("NO AVX", None, True),
    ("AVX512", None, False),  # cannot tell: say nothing
    (None, None, False),
])
def test_bf16_on_the_cpu_decision(capability, flags, slow):
    from utils.runtime import cpu_lacks_bf16, slow_bf16_warning

    assert (cpu_lacks_bf16(capability, flags) is not None) == slow
    line = slow_bf16_warning("bf16", False, None, capability, flags)
    assert (line is not None) == slow
    if slow:
        assert "\n" not in line and line.startswith("--dtype bf16 on the CPU") and "--dtype fp32" in line
    assert slow_bf16_warning("fp32", False, None, capability, flags) is None


def test_bf16_warning_names_the_faster_setting_of_each_bf16_flag():
    from utils.runtime import slow_bf16_warning

    autocast = slow_bf16_warning("bf16", True, None, "AVX2", AVX2_EPYC)
    assert autocast.startswith("--dtype bf16 --torch_autocast on the CPU") and \
        "--dtype fp32 (without --torch_autocast)" in autocast
    both = slow_bf16_warning("bf16", True, "bf16", "AVX2", AVX2_EPYC)
    assert both.startswith("--dtype bf16 --torch_autocast --generation_dtype bf16 on the CPU") and \
        both.endswith("--dtype fp32 (without --torch_autocast) and no --generation_dtype")
    generation = slow_bf16_warning("fp32", False, "bf16", "AVX2", AVX2_EPYC)
    assert generation.startswith("--generation_dtype bf16 on the CPU") and "no --generation_dtype" in generation


def test_cpu_flags_reads_the_flags_line(tmp_path):
    from utils.runtime import cpu_flags

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 fma\n\nprocessor\t: 1\n")
    assert cpu_flags(str(info)) == frozenset({"fpu", "avx2", "fma"})
    assert cpu_flags(str(tmp_path / "absent")) is None


def test_cpu_model_reads_the_model_name_line(tmp_path):
    from utils.runtime import cpu_model

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9554 64-Core Processor\nflags\t\t: fpu\n")
    assert cpu_model(str(info)) == "AMD EPYC 9554 64-Core Processor"
    info.write_text("processor\t: 0\nFeatures\t: fp asimd\n")  # aarch64: no model name line
    assert cpu_model(str(info)) is None and cpu_model(str(tmp_path / "absent")) is None


@pytest.mark.parametrize("flags, capability, gpu, line", [
    (AVX2_EPYC, "AVX2", None, "AMD EPYC, 2 cores, no bf16 instructions"),
    (AVX2_EPYC | {"avx512f", "avx512_bf16"}, "AVX512", None, "AMD EPYC, 2 cores, bf16 instructions: avx512_bf16"),
    (frozenset({"avx512_bf16", "amx_bf16"}), "AMX", None, "AMD EPYC, 2 cores, bf16 instructions: avx512_bf16, amx_bf16"),
    (None, "AVX2", None, "AMD EPYC, 2 cores, no bf16 instructions"),  # no cpuinfo: torch's capability tells
    (None, None, None, "AMD EPYC, 2 cores, bf16 instructions unknown"),
    (AVX2_EPYC, "AVX2", "NVIDIA H200", "NVIDIA H200"),  # the GPU did the work: the CPU's bf16 does not matter
])
def test_host_line_names_the_cpu_and_its_bf16_instructions(flags, capability, gpu, line):
    """A wall time's machine (bench_real_rl's table): the issue asks for the CPU named, with or without bf16."""
    from utils.runtime import host_line

    assert host_line("AMD EPYC", 2, flags, capability, gpu) == line
    assert host_line(None, 16, None, None) == "unknown CPU, 16 cores, bf16 instructions unknown"


def test_start_run_warns_once_for_bf16_on_a_cpu_without_it(monkeypatch, capsys):
    """The common start-up (steps 1, 2, DPO and 3): one warning line; fp32 or a GPU: none."""
    import torch

    from utils import runtime, training

    monkeypatch.setattr(training, "init_distributed", lambda args: torch.device("cpu"))
    monkeypatch.setattr(runtime, "cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(runtime, "cpu_flags", lambda: AVX2_EPYC)
    monkeypatch.setattr(runtime, "on_cpu", lambda: True)

    def args(**kw):
        return SimpleNamespace(**{"dtype": "bf16", "torch_autocast": False, "seed": 1, "enable_tensorboard": False,
                                  "tensorboard_path": "", "output_dir": None, **kw})

    training.start_run(args(), "step1_model")
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("warning: --dtype bf16 on the CPU") and "--dtype fp32" in err[0]
    training.start_run(args(dtype="fp32"), "step1_model")
    training.start_run(args(dtype="fp32", generation_dtype="bf16"), "step3_model")
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("warning: --generation_dtype bf16 on the CPU")
    assert runtime.cpu_bf16_warning(args(), torch.device("cuda")) is None
