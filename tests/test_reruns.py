"""Reruns and output folders: one rule for every step and for train.py (README, "Reruns and output folders").

* a folder holding a finished run (a saved model) is refused unless ``--overwrite``, which deletes the old
  model, checkpoints and metrics.jsonl first (train.py's ``training.log`` stays);
* an unfinished run's checkpoints are resumed from only when every flag that changes the result is the same;
* ``metrics.jsonl`` never mixes attempts: a fresh run starts it empty, a resumed one keeps the rows up to
  the resumed step;
* Ctrl-C says where the run stopped and how to go on, instead of a KeyboardInterrupt traceback.
"""
import json
import os
import signal
from types import SimpleNamespace

import pytest

import train
from tests.conftest import run_entry
from utils import fault_injection
from utils.errors import UserInputError


def finished_folder(folder):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"old model")
    (folder / "metrics.jsonl").write_text('{"step": 1, "phase": "train"}\n')
    (folder / "checkpoints" / "step-00000001").mkdir(parents=True)
    (folder / "training.log").write_text("this run's log, started by train.py\n")
    return folder


# --------------------------------------------------------------------------- the rule, per step

def test_a_finished_run_is_refused_and_overwrite_sets_it_aside_until_the_first_step(tmp_path):
    """Through preflight's prepare_output_dir, on a folder an older version left (no manifest); the folder
    object's whole life cycle is tests/test_run_folder.py's."""
    from utils.preflight import prepare_output_dir

    out = finished_folder(tmp_path / "out")
    before = sorted(os.listdir(out))
    with pytest.raises(UserInputError, match=r"--output_dir .*out already holds a finished run .* rerun with "
                                             r"--overwrite to replace it .* or give another --output_dir"):
        prepare_output_dir(SimpleNamespace(output_dir=str(out), overwrite=False, resume=False))
    assert sorted(os.listdir(out)) == before and (out / "model.safetensors").read_bytes() == b"old model"

    (out / "notes.txt").write_text("mine")  # e.g. --output_dir . by mistake: nothing a run wrote
    with pytest.raises(UserInputError, match=r"--overwrite: .*out has no record of what a run wrote there .* also "
                                             r"holds notes.txt, which no training run writes; nothing was touched"):
        prepare_output_dir(SimpleNamespace(output_dir=str(out), overwrite=True, resume=False))
    assert sorted(os.listdir(out)) == sorted(before + ["notes.txt"])
    os.remove(out / "notes.txt")

    messages = []
    folder = prepare_output_dir(SimpleNamespace(output_dir=str(out), overwrite=True, resume=False),
                                log=messages.append)
    assert sorted(n for n in os.listdir(out) if not n.startswith(".")) == ["training.log"]
    assert "set the earlier run's checkpoints, config.json, metrics.jsonl, model.safetensors aside" in messages[0]
    (out / "metrics.jsonl").write_text("the new run's\n")  # it fails before its first step: all as it was
    with pytest.raises(UserInputError), folder:
        raise UserInputError("refused after set-up")
    assert sorted(os.listdir(out)) == before and (out / "model.safetensors").read_bytes() == b"old model"
    assert not os.path.exists(folder.aside_path) and "put the earlier run's" in messages[-1]

    with prepare_output_dir(SimpleNamespace(output_dir=str(out), overwrite=True, resume=False),
                            log=messages.append) as folder:
        folder.step_done(1)  # its first step is done: the earlier run's files go
    assert sorted(n for n in os.listdir(out) if not n.startswith(".")) == ["training.log"]
    assert not os.path.exists(folder.aside_path)

    out2 = finished_folder(tmp_path / "out2")  # killed (SIGKILL) before its first step: the next run puts back
    before = sorted(os.listdir(out2))
    prepare_output_dir(SimpleNamespace(output_dir=str(out2), overwrite=True, resume=False),
                       log=messages.append).unlock()  # what a SIGKILL leaves: the set-aside run, nobody to settle it
    with pytest.raises(UserInputError, match="already holds a finished run"):
        prepare_output_dir(SimpleNamespace(output_dir=str(out2), overwrite=False, resume=False), log=messages.append)
    assert sorted(os.listdir(out2)) == before and "was killed before its first training step" in messages[-1]


def test_a_finished_run_rerun_with_changed_flags_names_them(tmp_path):
    import torch

    from utils.checkpoint import STATE
    from utils.preflight import prepare_output_dir

    out = finished_folder(tmp_path / "out")
    torch.save({"step": 1, "config": {"learning_rate": 1e-3, "seed": 1234, "dtype": "fp32", "save_interval": 1}},
               out / "checkpoints" / "step-00000001" / STATE)
    args = SimpleNamespace(output_dir=str(out), overwrite=False, resume=False, learning_rate=2e-3, seed=1234,
                           dtype=None, save_interval=5)  # dtype not resolved yet, save_interval changes nothing
    with pytest.raises(UserInputError, match=r"already holds a finished run \(its model is in .*; changed since: "
                                             r"--learning_rate 0.001 -> 0.002\); rerun with --overwrite"):
        prepare_output_dir(args)


def test_step3_layout_counts_as_finished_and_unfinished_runs_are_left_to_resume(tmp_path):
    from utils.preflight import prepare_output_dir

    step3 = tmp_path / "step3"
    finished_folder(step3 / "actor")
    with pytest.raises(UserInputError, match="already holds a finished run"):
        prepare_output_dir(SimpleNamespace(output_dir=str(step3), overwrite=False, resume=False))
    unfinished = tmp_path / "unfinished"
    (unfinished / "checkpoints" / "step-00000003").mkdir(parents=True)
    prepare_output_dir(SimpleNamespace(output_dir=str(unfinished), overwrite=False, resume=True))
    assert (unfinished / "checkpoints" / "step-00000003").is_dir()  # resumed from later, not deleted


def test_overwrite_and_resume_contradict_each_other():
    from utils.arguments import validate_checkpoint_args

    args = SimpleNamespace(save_interval=0, max_checkpoints=2, resume=True, overwrite=True, output_dir="o")
    with pytest.raises(UserInputError, match="--overwrite starts afresh and --resume continues a run"):
        validate_checkpoint_args(args)


class Engine:
    def save_checkpoint(self, save_dir, tag, save_latest=True):
        os.makedirs(os.path.join(save_dir, tag), exist_ok=True)
        with open(os.path.join(save_dir, tag, "w"), "w") as f:
            f.write("w")

    def load_checkpoint(self, load_dir, tag):
        return load_dir, {}


def step_args(out, **changes):
    args = SimpleNamespace(output_dir=str(out), max_checkpoints=2, save_interval=1, resume=False, overwrite=False,
                           learning_rate=1e-3, seed=1234, data_path=["builtin/preference"], print_loss=False,
                           local_rank=0, tensorboard_path="tb")
    vars(args).update(changes)
    return args


def test_every_flag_that_changes_the_result_must_match_to_resume(tmp_path):
    from utils.checkpoint import CheckpointManager
    from utils.logger import TrainLogger

    log = TrainLogger("t")
    first = CheckpointManager.from_args(step_args(tmp_path), log)
    first.save(1, {"model": Engine()}, {})
    changed = CheckpointManager.from_args(step_args(tmp_path, learning_rate=2e-3), log)
    with pytest.raises(UserInputError, match=r"learning_rate: checkpoint 0.001, now 0.002\); rerun with the same "
                                             r"settings \(--learning_rate as before\) to resume it, or start afresh "
                                             r"with --overwrite"):
        changed.resume({"model": Engine()})
    # output, logging and checkpoint-cadence flags change nothing the run computes: resumed
    same = CheckpointManager.from_args(step_args(tmp_path, save_interval=5, print_loss=True, tensorboard_path="x"),
                                       log)
    assert same.resume({"model": Engine()})["step"] == 1


def test_metrics_file_follows_the_resumed_step(tmp_path):
    from utils.logger import TrainLogger

    rows = [{"step": 0, "phase": "eval"}, {"step": 1, "phase": "train"}, {"step": 2, "phase": "train"},
            {"step": 2, "phase": "eval"}, {"step": 3, "phase": "train"}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "torn")
    log = TrainLogger("t", metrics_dir=str(tmp_path))
    log.restart_metrics(2)  # resumed from step 2: its eval and step 3 are redone
    log.scalars(2, "eval", loss=1.0)
    log.close()
    assert [(r["step"], r["phase"]) for r in map(json.loads, path.read_text().splitlines())] == [
        (0, "eval"), (1, "train"), (2, "train"), (2, "eval")]
    log = TrainLogger("t", metrics_dir=str(tmp_path))
    log.restart_metrics(None)  # a fresh run: no old rows
    assert path.read_text() == ""


def test_interrupt_message_says_where_and_how_to_go_on():
    from utils.entrypoint import interrupt_message
    from utils.errors import RunInterrupted
    from utils.run_folder import RunFolder

    folder = RunFolder(None)  # the run's folder follows its progress
    assert folder.interrupt_message() == interrupt_message(KeyboardInterrupt()) == (
        "interrupted before the first training step; nothing was saved, a rerun starts afresh")
    folder.step_done(7)
    assert "interrupted at step 7; no checkpoint was saved (--save_interval N" in folder.interrupt_message()
    folder.checkpoint_saved(6, "out/checkpoints")
    assert folder.interrupt_message() == ("interrupted at step 7; rerun the same command to resume from step 6 "
                                          "(checkpoint in out/checkpoints)")
    assert interrupt_message(RunInterrupted(folder.interrupt_message())) == folder.interrupt_message()


# --------------------------------------------------------------------------- train.py

def test_train_py_refuses_finished_steps_unless_overwrite(tmp_path):
    out = tmp_path / "out"
    finished_folder(out / "actor-models" / "tiny-opt")
    args = train.parse_args(["--step", "1", "2", "--output-dir", str(out)])
    with pytest.raises(train.PlanError, match=r"step 1's output folder .* already holds a finished model\n  pass "
                                              r"--overwrite to train it again .*, or run only the other steps "
                                              r"\(--step 2\)"):
        train.check_inputs(args, train.make_plan(args, 0))
    args = train.parse_args(["--step", "1", "2", "--output-dir", str(out), "--overwrite"])
    plan = train.make_plan(args, 0)
    train.check_inputs(args, plan)
    assert all("--overwrite" in launch.cmd for launch in plan)  # each step deletes its own old result


def test_train_py_interrupted_message_names_the_finished_steps_and_what_to_rerun(tmp_path):
    args = train.parse_args(["--output-dir", str(tmp_path)])
    step2 = train.make_plan(args, 0)[1]
    assert train.interrupted_message(args, step2) == (
        "interrupted in step 2 (reward model); step 1 finished; to continue, rerun the same command with --step 2 3 "
        "(step 2 resumes from its newest checkpoint, if it saved one)")


def test_train_py_gives_memory_advice_only_when_it_looks_like_memory(tmp_path):
    launch = train.make_plan(train.parse_args(["--step", "1", "--output-dir", str(tmp_path)]), 0)[0]
    os.makedirs(launch.out_dir)
    with open(launch.log_path, "w") as f:
        f.write("main.py: error: unrecognized arguments: --learning_rat 1\n")
    assert "--offload" not in train.failure_message(launch, 2) and "refused its input" in train.failure_message(launch, 2)
    assert "--offload" not in train.failure_message(launch, 1)
    assert "ran out of memory" in train.failure_message(launch, -9)
    with open(launch.log_path, "a") as f:
        f.write("torch.OutOfMemoryError: CUDA out of memory\n")
    assert "--offload" in train.failure_message(launch, 1)


@pytest.mark.slow
def test_ctrl_c_then_resume_then_refused_as_finished_then_overwrite(tmp_path):
    """A real Ctrl-C (SIGINT after step 3, checkpoints every 2 steps) under train.py, the suggested rerun,
    then the same command once more (refused: finished), then with --overwrite (trained afresh)."""
    out = tmp_path / "out"
    step1 = ("--data_path builtin/preference-small --max_seq_len 64 --per_device_train_batch_size 8 --max_steps 4 "
             "--save_interval 2")
    cmd = ["train.py", "--step", "1", "--output-dir", out, "--step1-args", step1]
    env = {"OMP_NUM_THREADS": "1"}
    res = run_entry(*cmd, env=dict(env, **fault_injection.setting("interrupt", 3)), timeout=300)
    text = res.stdout + res.stderr
    assert res.returncode == 128 + signal.SIGINT, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text
    folder = out / "actor-models" / "tiny-opt"
    assert (f"interrupted at step 3; rerun the same command to resume from step 2 (checkpoint in "
            f"{folder / 'checkpoints'})") in text
    assert "interrupted in step 1 (supervised fine-tuning (actor)); to continue, rerun the same command with " \
           "--step 1 (step 1 resumes from its newest checkpoint" in res.stderr
    assert "--offload" not in res.stderr

    res = run_entry(*cmd, env=env, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "resumed from" in res.stdout and "(step 2)" in res.stdout
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["phase"] == "train"] == [1, 2, 3, 4]  # step 3 once, not twice

    model = (folder / "model.safetensors").read_bytes()
    res = run_entry(*cmd, env=env, timeout=120)
    assert res.returncode == 2 and "already holds a finished model" in res.stderr and "--overwrite" in res.stderr
    assert "Running Step" not in res.stdout and (folder / "model.safetensors").read_bytes() == model

    res = run_entry(*cmd, "--overwrite", env=env, timeout=300)  # trains afresh: no resume, a new metrics file
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "--overwrite: set the earlier run's checkpoints, config.json" in res.stdout
    assert "--overwrite: deleted the earlier run's files" in res.stdout
    assert "resumed from" not in res.stdout and "ppl before training" in res.stdout
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["phase"] == "train"] == [1, 2, 3, 4]


@pytest.mark.slow
def test_ctrl_c_in_a_terminal_reaches_train_py_and_its_step(tmp_path):
    """SIGINT to the whole foreground process group (what Ctrl-C does): one line from the step, one from
    train.py, exit 130, no KeyboardInterrupt trace from either process."""
    import subprocess
    import sys
    import time

    from tests.conftest import REPO

    out = tmp_path / "out"
    step1 = "--data_path builtin/preference-small --max_seq_len 64 --per_device_train_batch_size 8 " \
            "--num_train_epochs 1000"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    proc = subprocess.Popen([sys.executable, str(REPO / "train.py"), "--step", "1", "--output-dir", str(out),
                             "--step1-args", step1], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    log = out / "actor-models" / "tiny-opt" / "training.log"
    deadline = time.time() + 240
    while time.time() < deadline and not (log.is_file() and "Beginning of Epoch 2/" in log.read_text()):
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    text = stdout + stderr
    assert proc.returncode == 130, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert "interrupted at step " in stdout and "no checkpoint was saved" in stdout  # the step's line (via its log)
    assert "interrupted in step 1 (supervised fine-tuning (actor))" in stderr and "--step 1" in stderr


def _hold_lock(folder):
    """A process that locks ``folder`` as a run does, then waits; returns it once the lock is taken."""
    import subprocess
    import sys

    code = ("import sys, time; from utils.run_folder import RunFolder; folder = RunFolder(sys.argv[1]); "
            "folder.lock(); print('locked', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(folder)], cwd=train.REPO, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


@pytest.mark.slow
def test_one_output_folder_one_run_and_a_killed_run_leaves_no_stale_lock(tmp_path):
    """A second run on a folder in use is refused with one line naming the first's process, before it deletes
    or writes anything (--overwrite included); kill -9 of the first frees the folder (flock dies with it)."""
    from utils.run_folder import RunFolder

    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    holder = _hold_lock(out)
    try:
        with pytest.raises(UserInputError, match=rf"{out} is in use by another run \(process {holder.pid} on "):
            RunFolder(str(out)).lock()
        res = run_entry("step1_supervised_finetuning/main.py", "--model_name_or_path", "tiny-opt", "--data_path",
                        "builtin/preference-small", "--output_dir", out, "--overwrite", "--data_output_path",
                        tmp_path / "data", env={"OMP_NUM_THREADS": "1"}, timeout=300)
        assert res.returncode == 2 and f"is in use by another run (process {holder.pid}" in res.stderr
        assert "Traceback" not in res.stderr
        assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'  # --overwrite deleted nothing
    finally:
        holder.kill()
        holder.wait()
    RunFolder(str(out)).lock()  # the killed holder's lock is gone


@pytest.mark.slow
def test_two_train_py_runs_on_one_output_dir(tmp_path):
    holder = _hold_lock(tmp_path / "run")
    try:
        res = run_entry("train.py", "--demo", "--output-dir", tmp_path / "run", timeout=120)
        assert res.returncode == 2 and f"is in use by another run (process {holder.pid}" in res.stderr
        assert not (tmp_path / "run").exists()
    finally:
        holder.kill()
        holder.wait()


def test_a_build_lock_left_by_a_killed_compile_is_cleared_and_a_live_one_kept(tmp_path):
    """A run killed while DeepSpeed compiled its shared-memory op left torch's build ``lock``: every later run
    would wait for it forever. Old and with nobody working in the build folder: removed (one line). Fresh, or
    with a process working there (a live compile): kept."""
    import subprocess
    import time

    from utils.distributed import clear_stale_extension_locks

    def lock(name, age):
        folder = tmp_path / "py311_cpu" / name
        folder.mkdir(parents=True)
        (folder / "lock").write_text("")
        os.utime(folder / "lock", (time.time() - age, time.time() - age))
        return folder

    stale, fresh, live = lock("deepspeed_shm_comm", 600), lock("fresh_op", 1), lock("live_op", 600)
    compiler = subprocess.Popen(["sleep", "60"], cwd=live)  # a compile at work in its build folder
    try:
        lines = []
        cleared = clear_stale_extension_locks(str(tmp_path), log=lines.append)
    finally:
        compiler.kill()
        compiler.wait()
    assert cleared == [str(stale / "lock")] and not (stale / "lock").exists()
    assert (fresh / "lock").exists() and (live / "lock").exists()
    assert lines == [f"removed a stale build lock {stale / 'lock'} (a compile killed before it finished)"]
    assert clear_stale_extension_locks(str(tmp_path / "empty")) == []


def test_temporaries_of_a_killed_save_are_removed_by_the_next_run(tmp_path):
    """atomic_directory writes .NAME.tmp-* (and moves the old folder to .NAME.old-*) beside the folder; a
    kill -9 mid-save leaves them. The next run on that folder (holding its lock) removes them, and only them."""
    from utils.run_folder import RunFolder

    out = tmp_path / "out"
    left = [tmp_path / ".out.tmp-k2j3", tmp_path / ".out.old-9x", out / ".actor.tmp-77", out / ".critic.old-1"]
    keep = [tmp_path / ".other.tmp-1", out / "actor", out / "checkpoints" / ".tmp-step-00000004"]
    for folder in left + keep:
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"half")
    assert RunFolder(str(out)).remove_stale_temporaries() == sorted(map(str, left))
    assert not any(p.exists() for p in left) and all(p.exists() for p in keep)
