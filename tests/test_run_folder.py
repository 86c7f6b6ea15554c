"""The output folder's owner, :class:`utils.run_folder.RunFolder`: its life cycle (claim, set aside, commit,
restore, the manifest, the final saves), a second run refused, a kill -9 at each point recovered by the next run,
user files never touched by --overwrite, a refused rerun leaving every byte, and no other module knowing the
folder's layout. Fast: fake saves (real atomic_directory) instead of training, but for one real CLI case."""
import json
import os
import re
import signal
import subprocess
import sys

import pytest

from tests.conftest import REPO, run_entry
from utils import fault_injection
from utils.errors import RunInterrupted, TrainingDiverged, UserInputError
from utils.files import atomic_directory
from utils.run_folder import MANIFEST, RunFolder

USER_FILES = {"tokenizer_notes.md": b"my notes on the tokenizer\n", "my_experiment.model": b"not a weights file",
              "backup_of_old_model.bin": b"\x00my backup\x00", "notes/plan.txt": b"plan"}


def snapshot(root) -> dict:
    """Every file under ``root`` (hidden ones included) -> its bytes."""
    found = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, root)] = f.read()
    return found


def beside(out) -> list:
    """The entries beside ``out`` that belong to it (its lock, set-aside run, temporaries)."""
    return sorted(n for n in os.listdir(os.path.dirname(out)) if n.startswith(f".{os.path.basename(out)}."))


def save_model(content: bytes):
    """A final save as the steps do it (atomic_directory): config.json, weights, tokenizer."""
    def save(path):
        with atomic_directory(path) as tmp:
            for name, data in (("config.json", b"{}"), ("model.safetensors", content), ("tokenizer.json", b"{}")):
                with open(os.path.join(tmp, name), "wb") as f:
                    f.write(data)
    return save


def write(path, data: bytes = b"x"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def finished_run(out, content=b"old weights", step3=False) -> None:
    """A whole run in ``out``: metrics, a checkpoint, the final save (step 3: critic/ then actor/)."""
    folder = RunFolder(str(out), log=lambda m: None).claim()
    with folder:
        write(os.path.join(out, "metrics.jsonl"), b'{"step": 1}\n')
        folder.step_done(1)
        write(os.path.join(out, "checkpoints", "step-00000001", "trainer_state.pt"), content)
        folder.checkpoint_saved(1, os.path.join(out, "checkpoints"))
        saves = [("actor", save_model(content)), ("critic", save_model(b"critic"))] if step3 else \
            [(None, save_model(content))]
        folder.save_final(saves)


def manifest(out) -> dict:
    with open(os.path.join(out, MANIFEST)) as f:
        return json.load(f)


# --------------------------------------------------------------------------- life cycle

def test_the_manifest_lists_what_the_run_wrote_and_finished_means_the_final_save_ended(tmp_path):
    out = tmp_path / "out"
    write(out / "tokenizer_notes.md", b"mine")  # there before the run: never ours
    assert not RunFolder(str(out)).finished() and RunFolder(str(out)).model_dir() is None
    finished_run(out)
    data = manifest(out)
    assert data["finished"] and data["entries"] == ["checkpoints", "config.json", "metrics.jsonl",
                                                    "model.safetensors", "tokenizer.json"]
    folder = RunFolder(str(out))
    assert folder.finished() and folder.model_dir() == str(out)
    assert folder.ours() == (data["entries"], ["tokenizer_notes.md"])
    assert (out / "tokenizer_notes.md").read_bytes() == b"mine" and beside(str(out)) == [".out.lock"]

    step3 = tmp_path / "step3"
    finished_run(step3, step3=True)
    assert RunFolder(str(step3)).model_dir() == str(step3 / "actor") and RunFolder(str(step3)).finished()
    assert manifest(step3)["entries"] == ["actor", "checkpoints", "critic", "metrics.jsonl"]


def test_a_file_dropped_into_the_folder_while_the_run_goes_on_stays_the_users(tmp_path):
    """Only what the run's writers name is the run's: its fixed entries (metrics, checkpoints), the paths it was
    told it writes (a data cache inside the folder), and what its final saves made. A file a user puts into the
    folder mid-run is not recorded, so a later --overwrite leaves it."""
    out = tmp_path / "out"
    folder = RunFolder(str(out), log=lambda m: None).claim()
    with folder:
        folder.will_write(str(out / "data" / "cache"), str(tmp_path / "elsewhere"), str(out))
        write(out / "data" / "cache" / "train.pt", b"cache")
        write(out / "metrics.jsonl", b'{"step": 1}\n')
        write(out / "notes_while_training.md", b"mine")
        folder.step_done(1)
        write(out / "checkpoints" / "step-00000001" / "state.pt", b"state")
        folder.checkpoint_saved(1, str(out / "checkpoints"))
        write(out / "later_notes.md", b"mine too")
        folder.save_final([(None, save_model(b"weights"))])
    assert manifest(out)["entries"] == ["checkpoints", "config.json", "data", "metrics.jsonl", "model.safetensors",
                                        "tokenizer.json"]
    assert RunFolder(str(out)).ours()[1] == ["later_notes.md", "notes_while_training.md"]
    with RunFolder(str(out), log=lambda m: None).claim(overwrite=True) as again:
        again.step_done(1)
    assert (out / "notes_while_training.md").read_bytes() == b"mine" and (out / "later_notes.md").exists()
    assert not (out / "data").exists() and not (out / "model.safetensors").exists()


def test_a_result_that_is_not_a_model_is_finished_when_its_save_completed(tmp_path):
    """The comparison collector's folder (train.py's plan asks whether it is done): files, no model. A train.jsonl
    written by a save that was killed before the manifest said "finished" is not a finished result."""
    out = str(tmp_path / "comparisons")
    folder = RunFolder(out, log=lambda m: None).claim()
    with folder:
        def write_files(path):
            write(os.path.join(path, "train.jsonl"), b'{"prompt": "p"}\n')
        write_files(out)  # the killed save's files, before save_final marks the run
        assert not RunFolder(out).finished(model=False) and not RunFolder(out).finished()
        folder.save_final([(None, write_files)])
    assert RunFolder(out).finished(model=False) and not RunFolder(out).finished()  # no model: not a model's run


def test_the_model_that_marks_a_finished_run_is_saved_last():
    order = []
    folder = RunFolder("/nowhere/out", owner=False)  # another rank's: saves (collective), records nothing
    folder.save_final([("actor", order.append), (None, order.append), ("critic", order.append),
                       ("actor_ema", order.append)])
    assert order == ["/nowhere/out/critic", "/nowhere/out/actor_ema", "/nowhere/out/actor", "/nowhere/out"]


def test_a_second_run_on_the_folder_is_refused_naming_the_first(tmp_path):
    out = str(tmp_path / "out")
    first = RunFolder(out).claim()
    with pytest.raises(UserInputError, match=rf"{out} is in use by another run \(process {os.getpid()} on "):
        RunFolder(out).claim()
    with first:
        pass
    with RunFolder(out).claim():  # the lock went with the first run's end
        pass


def test_overwrite_sets_aside_exactly_the_manifest_entries_and_user_files_survive_byte_identical(tmp_path):
    out = tmp_path / "out"
    finished_run(out)
    for name, data in USER_FILES.items():
        write(out / name, data)
    users = {name: data for name, data in snapshot(out).items() if name in USER_FILES}
    earlier = snapshot(out)
    lines = []
    folder = RunFolder(str(out), log=lines.append).claim(overwrite=True)
    assert sorted(os.listdir(folder.aside_path)) == sorted(["checkpoints", "config.json", "metrics.jsonl",
                                                            "model.safetensors", "tokenizer.json", MANIFEST])
    assert "left in place: backup_of_old_model.bin, my_experiment.model, notes, tokenizer_notes.md" in lines[0]
    with folder:
        write(out / "metrics.jsonl", b"new\n")
        folder.step_done(1)  # the earlier run's entries are deleted now
        assert not os.path.exists(folder.aside_path) and beside(str(out)) == [".out.lock"]
        folder.save_final([(None, save_model(b"new weights"))])
    after = snapshot(out)
    assert {name: after[name] for name in users} == users
    assert after["model.safetensors"] == b"new weights" and "checkpoints/step-00000001/trainer_state.pt" not in after
    assert manifest(out)["entries"] == ["config.json", "metrics.jsonl", "model.safetensors", "tokenizer.json"]
    assert earlier != after and "deleted the earlier run's files" in lines[-1]


def earlier_run(out) -> dict:
    """A finished run in ``out``, with train.py's log and a user's file; returns the folder's snapshot."""
    finished_run(out)
    write(out / "training.log", b"the earlier run's log\n")
    write(out / "tokenizer_notes.md", b"mine")
    return snapshot(out)


def test_a_run_that_fails_before_its_first_step_leaves_every_byte(tmp_path):
    out = tmp_path / "out"
    earlier = earlier_run(out)
    for failure in (UserInputError("data refused after set-up"), KeyboardInterrupt()):
        with pytest.raises(type(failure)) as raised:
            with RunFolder(str(out), log=lambda m: None).claim(overwrite=True):
                write(out / "metrics.jsonl", b"the new run's\n")
                write(out / "checkpoints" / "new", b"new")
                write(out / "ds_tensorboard_logs" / "events.out.tfevents.1", b"new")
                write(out / "dropped_while_it_ran.txt", b"a user's")  # not the run's: stays
                raise failure
        assert snapshot(out) == {**earlier, "dropped_while_it_ran.txt": b"a user's"}
        assert beside(str(out)) == [".out.lock"]
        os.remove(out / "dropped_while_it_ran.txt")
    assert isinstance(raised.value, RunInterrupted)
    assert raised.value.message == "interrupted before the first training step; nothing was saved, a rerun starts " \
                                   "afresh"

    fresh = tmp_path / "fresh"  # a folder the run made: gone again
    with pytest.raises(UserInputError):
        with RunFolder(str(fresh)).claim():
            write(fresh / "metrics.jsonl")
            raise UserInputError("refused")
    assert not fresh.exists()


def test_a_refused_rerun_leaves_every_byte(tmp_path):
    out = tmp_path / "out"
    earlier = earlier_run(out)
    with pytest.raises(UserInputError, match=rf"--output_dir {out} already holds a finished run \(its model is in "
                                             rf"{out}; changed since: --seed 1 -> 2\); rerun with --overwrite"):
        RunFolder(str(out)).claim(changes=lambda: ["--seed 1 -> 2"])
    assert snapshot(out) == earlier and beside(str(out)) == [".out.lock"]


def test_a_folder_without_a_manifest_sets_aside_only_known_names_and_refuses_beside_others(tmp_path):
    out = tmp_path / "old"  # what an older version left: no manifest
    for name in ("config.json", "model.safetensors", "metrics.jsonl", "training.log", "checkpoints/step-1/x"):
        write(out / name, b"old")
    earlier = snapshot(out)
    with pytest.raises(UserInputError, match="already holds a finished run"):
        RunFolder(str(out)).claim()
    write(out / "my_experiment.model", b"mine")
    with pytest.raises(UserInputError, match=r"--overwrite: .*old has no record of what a run wrote there "
                                             r"\(\.dschat-run\.json: a folder from an older version\?\) and also "
                                             r"holds my_experiment.model, which no training run writes; nothing was "
                                             r"touched: move those away, or delete the earlier run's checkpoints, "
                                             r"config.json, metrics.jsonl, model.safetensors"):
        RunFolder(str(out)).claim(overwrite=True)
    assert snapshot(out) == {**earlier, "my_experiment.model": b"mine"}
    os.remove(out / "my_experiment.model")
    folder = RunFolder(str(out), log=lambda m: None).claim(overwrite=True)
    assert sorted(os.listdir(out)) == [MANIFEST, "training.log"]  # train.py's log is replaced by train.py
    with folder:
        folder.step_done(1)
    assert sorted(os.listdir(out)) == [MANIFEST, "training.log"]


def test_a_failure_after_the_first_step_says_what_overwrite_deleted(tmp_path):
    out = tmp_path / "out"
    finished_run(out)
    with pytest.raises(TrainingDiverged) as raised:
        with RunFolder(str(out), log=lambda m: None).claim(overwrite=True) as folder:
            folder.step_done(1)
            raise TrainingDiverged("non-finite loss at step 2")
    gone = (f"the earlier run's checkpoints, config.json, metrics.jsonl, model.safetensors, tokenizer.json in {out} "
            "were deleted after this run's first training step (--overwrite) and are gone")
    assert raised.value.__notes__ == [gone]
    from utils.entrypoint import error_line

    assert error_line(raised.value) == f"error: non-finite loss at step 2; {gone}"

    finished_run(out)
    with pytest.raises(RunInterrupted) as raised:
        with RunFolder(str(out), log=lambda m: None).claim(overwrite=True) as folder:
            folder.step_done(1)
            folder.step_done(2)
            folder.checkpoint_saved(2, "ckpts")
            raise KeyboardInterrupt
    assert raised.value.message == ("interrupted at step 2; rerun the same command to resume from step 2 (checkpoint "
                                    f"in ckpts); {gone}")


# --------------------------------------------------------------------------- kill -9

KILLED_RUN = r"""
import os, shutil, signal, sys
import utils.run_folder as run_folder
from utils.files import atomic_directory

out, point = sys.argv[1], sys.argv[2]

def kill(at):
    if at == point:
        os.kill(os.getpid(), signal.SIGKILL)

def save(path):
    with atomic_directory(path) as tmp:
        for name in ("config.json", "model.safetensors"):
            with open(os.path.join(tmp, name), "w") as f:
                f.write("new")
        kill("mid_save")

rmtree = shutil.rmtree
def deleting(path, *args, **kwargs):
    if os.path.exists(path) and path.endswith("replaced"):
        kill("mid_commit")
    rmtree(path, *args, **kwargs)
run_folder.shutil.rmtree = deleting

folder = run_folder.RunFolder(out, log=lambda m: None).claim(overwrite=True)
kill("set_aside")
with folder:
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        f.write("new\n")
    kill("before_step")
    folder.step_done(1)
    kill("after_step")
    folder.save_final([("critic", save), ("actor", save)])
    kill("after_save")
"""


@pytest.mark.slow
@pytest.mark.parametrize("point, outcome", [
    ("set_aside", "earlier"), ("before_step", "earlier"),  # the earlier run comes back, byte for byte
    ("mid_commit", "unfinished"), ("after_step", "unfinished"), ("killsave", "unfinished"),
    ("mid_save", "unfinished"), ("after_save", "finished"),
])
def test_kill_9_at_each_point_then_the_next_run_recovers(tmp_path, point, outcome):
    out = tmp_path / "out"
    finished_run(out, step3=True)
    write(out / "tokenizer_notes.md", b"mine")
    earlier = snapshot(out)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    if point == "killsave":  # right after the first of the final saves (critic/)
        env.update(fault_injection.setting("killsave", 1))
    proc = subprocess.run([sys.executable, "-c", KILLED_RUN, str(out), point], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    lines = []
    folder = RunFolder(str(out), log=lines.append)
    if outcome == "earlier":  # the next run (without --overwrite) finds the earlier, finished run: refused
        with pytest.raises(UserInputError, match="already holds a finished run"):
            folder.claim()
        assert snapshot(out) == earlier and "was killed before its first training step" in lines[-1]
    elif outcome == "unfinished":  # the earlier run was deleted; the killed one left an unfinished run: resumed
        with folder.claim():
            assert not folder.finished()
    else:  # the killed run had finished
        with pytest.raises(UserInputError, match="already holds a finished run"):
            folder.claim()
        assert snapshot(out)["actor/model.safetensors"] == b"new"
    assert snapshot(out)["tokenizer_notes.md"] == b"mine"
    assert beside(str(out)) == [".out.lock"]  # no set-aside run, no temporaries left
    assert not [n for n in os.listdir(out) if n.startswith(".") and n != MANIFEST]


# --------------------------------------------------------------------------- train.py's log of a step

def test_train_py_logs_a_rerun_beside_the_folder_until_the_step_takes_it(tmp_path):
    out = tmp_path / "out"
    first = RunFolder(str(out))
    log = first.step_log()
    assert log == str(out / "training.log")  # a first run: the log is in the folder, to follow live
    write(log, b"first run\n")
    finished_run(out)
    assert first.adopt_log(log, None, True) == log and "training.log" in manifest(out)["entries"]
    earlier = snapshot(out)

    folder = RunFolder(str(out))
    log = folder.step_log()
    assert log == str(tmp_path / ".out.training.log")
    write(log, b"refused rerun\n")
    assert folder.adopt_log(log, folder.run_id(), False) == log  # refused: the earlier run's log stays
    assert snapshot(out) == earlier

    before = folder.run_id()
    with RunFolder(str(out), log=lambda m: None).claim(overwrite=True) as run:
        run.step_done(1)
    assert folder.adopt_log(log, before, False) == str(out / "training.log")  # took the folder, then failed
    assert (out / "training.log").read_bytes() == b"refused rerun\n" and not os.path.exists(log)


# --------------------------------------------------------------------------- no other module knows the layout

LAYOUT = (".replaced", ".dschat-run", "lock_output_dir", "remove_stale_temporaries", "finished_model")


def project_sources():
    """The project's modules and entry points (not the tests, benchmarks and scripts that read results)."""
    return sorted(p for p in REPO.rglob("*.py") if not p.relative_to(REPO).parts[0].startswith(".")
                  and p.relative_to(REPO).parts[0] not in ("tests", "bench", "scripts", "build")
                  and p.name != "run_folder.py")


def test_no_module_outside_run_folder_knows_the_folder_layout():
    """The manifest, the set-aside run, the lock and what "finished" means are named in utils/run_folder.py only:
    no other module builds those names, or looks for a model's config.json in an output folder (``actor/``)."""
    found = []
    for path in project_sources():
        text = path.read_text()
        found += [f"{path.relative_to(REPO)}: {name}" for name in LAYOUT if name in text]
        found += [f"{path.relative_to(REPO)}: {m.group(0)}" for m in re.finditer(r'f"\.\{[^"]*\}\.lock"', text)]
        found += [f"{path.relative_to(REPO)}: {m.group(0)}"
                  for m in re.finditer(r'join\([^()]*"actor"[^()]*\)', text)]
    for name in ("train.py", "utils/heldout.py", "inference/chatbot.py"):
        if '"config.json"' in (REPO / name).read_text():
            found.append(f"{name}: config.json")
    assert found == []


def test_no_module_level_state_for_the_run():
    import utils.checkpoint
    import utils.entrypoint
    import utils.files

    for module in (utils.entrypoint, utils.checkpoint, utils.files):
        assert not [name for name in ("PROGRESS", "_PENDING", "_HELD_LOCKS") if hasattr(module, name)]
    assert not (REPO / "utils" / "overwrite.py").exists()


# --------------------------------------------------------------------------- the real entry point

@pytest.mark.slow
def test_step1_overwrite_keeps_user_files_and_a_refused_rerun_keeps_every_byte(tmp_path):
    out = tmp_path / "out"
    cmd = ["step1_supervised_finetuning/main.py", "--model_name_or_path", "tiny-opt", "--data_path",
           "builtin/preference-small", "--max_seq_len", "64", "--per_device_train_batch_size", "8", "--max_steps", "1",
           "--output_dir", out, "--data_output_path", tmp_path / "data"]
    env = {"OMP_NUM_THREADS": "1"}
    res = run_entry(*cmd, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    for name, data in USER_FILES.items():
        write(out / name, data)
    earlier = snapshot(out)

    res = run_entry(*cmd, env=env, timeout=120)
    assert res.returncode == 2 and res.stderr.count("error:") == 1 and "already holds a finished run" in res.stderr
    assert snapshot(out) == earlier

    res = run_entry(*cmd, "--overwrite", "--seed", "7", env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    after = snapshot(out)
    assert {name: after[name] for name in USER_FILES} == USER_FILES
    assert after["model.safetensors"] != earlier["model.safetensors"]
    assert "left in place: backup_of_old_model.bin, my_experiment.model, notes, tokenizer_notes.md" in res.stdout
