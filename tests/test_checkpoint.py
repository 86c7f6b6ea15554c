"""utils.checkpoint without DeepSpeed: RNG round trip, the resumable sampler, the manifest,
save / rotate / fall back / refuse, the kill hook and the NaN guard's fault hook.

Engines are stand-ins with DeepSpeed's ``save_checkpoint`` / ``load_checkpoint``
signature; the real engines are exercised end to end in tests/test_resume.py."""
import ast
import errno
import os
import random
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.conftest import Payload
from utils import fault_injection
from utils.checkpoint import (MANIFEST, STATE, CheckpointManager, EpochSampler, ModuleState,
                              resumable_loader, rng_state, set_rng_state, verify_manifest, write_manifest)
from utils.errors import TrainingDiverged, UserInputError
from utils.finite import check_finite


class FakeEngine:
    """Holds one tensor; saves/loads it the way DeepSpeed lays out a tagged checkpoint."""

    def __init__(self, value: float):
        self.w = torch.tensor([value])

    def save_checkpoint(self, save_dir, tag, save_latest=True):
        os.makedirs(os.path.join(save_dir, tag), exist_ok=True)
        torch.save({"w": self.w}, os.path.join(save_dir, tag, "mp_rank_00_model_states.pt"))

    def load_checkpoint(self, load_dir, tag):
        self.w = torch.load(os.path.join(load_dir, tag, "mp_rank_00_model_states.pt"), weights_only=True)["w"]
        return load_dir, {}


def draws():
    return random.random(), float(np.random.rand()), float(torch.rand(()))


# --------------------------------------------------------------------------- RNG

def test_rng_state_round_trips_through_a_weights_only_file(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.randn()  # leaves a cached gaussian in numpy's state
    torch.save(rng_state(), tmp_path / "rng.pt")
    expected = draws()
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    assert draws() != expected
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert draws() == expected


# --------------------------------------------------------------------------- sampler

def test_epoch_sampler_order_is_a_function_of_seed_and_epoch_and_skips_consumed_batches():
    data = list(range(23))
    a, b = EpochSampler(data, seed=5), EpochSampler(data, seed=5)
    a.set_epoch(1)
    b.set_epoch(1)
    order = list(a)
    assert order == list(b) and sorted(order) == data  # one rank: every sample once
    a.set_epoch(0)
    assert list(a) != order
    b.set_epoch(1, skip_batches=2, batch_size=4)
    assert list(b) == order[8:] and len(b) == 15
    b.set_epoch(1, skip_batches=9, batch_size=4)  # past the end: empty, not an error
    assert list(b) == [] and len(b) == 0
    b.set_epoch(2)  # the skip is for one epoch only
    assert len(list(b)) == 23
    c = EpochSampler(data, seed=6)
    c.set_epoch(1)
    assert list(c) != order


def test_resumable_loader_leaves_the_global_rng_alone():
    loader = resumable_loader(list(range(10)), batch_size=3, seed=0)
    loader.sampler.set_epoch(0, skip_batches=1, batch_size=3)
    torch.manual_seed(0)
    batches = [b.tolist() for b in loader]
    after = torch.rand(())
    torch.manual_seed(0)
    assert float(torch.rand(())) == float(after)  # iterating drew nothing from the global RNG
    loader.sampler.set_epoch(0)
    full = [b.tolist() for b in loader]
    assert batches == full[1:] and len(full) == 4


class _Log:
    """The logger's two calls the loop makes; the bar's ``total`` is recorded."""

    def __init__(self):
        self.lines, self.totals = [], []

    def info(self, line):
        self.lines.append(line)

    def progress(self, iterable, desc, total):
        self.totals.append(total)
        return iterable


def _walk(position, args, loaders, per_step, stop_after=None):
    """Drive the shared loop as the steps do (one step per ``per_step`` batches); ``stop_after`` batches: a kill."""
    from utils.training import epoch_batches, epochs

    seen, log = [], _Log()
    for epoch in epochs(position, args):
        for batch in epoch_batches(loaders, position, args, log, f"epoch {epoch + 1}", per_step):
            seen.append((epoch, batch))
            if position.batches_in_epoch % per_step == 0:
                position.step += 1
            if stop_after is not None and len(seen) == stop_after:
                return seen, log
    return seen, log


def as_lists(seen):
    return [(e, b.tolist() if hasattr(b, "tolist") else tuple(x if x is None else x.tolist() for x in b))
            for e, b in seen]


def test_the_one_loop_resumes_where_the_checkpoint_stood_and_stops_at_max_steps():
    """Every step's loop (utils.training.epochs / epoch_batches): a run stopped after 5 batches and resumed from its
    Position sees exactly the batches the uninterrupted run saw after those 5; --max_steps 5 with 2 batches a step
    ends after 10 batches, in epoch 2, and the bar counts only the batches that run."""
    from utils.training import Position

    args = SimpleNamespace(num_train_epochs=3, max_steps=0)
    full, log = _walk(Position(), args, resumable_loader(list(range(10)), 3, seed=0), per_step=1)
    assert [e for e, _ in full] == [0] * 4 + [1] * 4 + [2] * 4 and log.totals == [4, 4, 4]
    assert "Beginning of Epoch 2/3, Total Micro Batches 4" in log.lines
    first, _ = _walk(Position(), args, resumable_loader(list(range(10)), 3, seed=0), per_step=1, stop_after=5)
    saved = Position(epoch=1, batches_in_epoch=1, step=5)  # what the checkpoint after batch 5 holds
    rest, log = _walk(Position.resumed({"epoch": 1, "batches_in_epoch": 1, "step": 5}), args,
                      resumable_loader(list(range(10)), 3, seed=0), per_step=1)
    assert as_lists(first + rest) == as_lists(full) and log.totals == [3, 4]
    assert Position.resumed(None) == Position() and saved == Position.resumed(vars(saved))

    capped = SimpleNamespace(num_train_epochs=3, max_steps=5)
    seen, log = _walk(Position(), capped, resumable_loader(list(range(10)), 3, seed=0), per_step=2)
    assert len(seen) == 10 and [e for e, _ in seen] == [0] * 4 + [1] * 4 + [2] * 2 and log.totals == [4, 4, 2]
    done, log = _walk(Position(epoch=2, batches_in_epoch=2, step=5), capped,
                      resumable_loader(list(range(10)), 3, seed=0), per_step=2)
    assert done == [] and log.totals == []  # a finished run resumed: nothing more


def test_the_one_loop_zips_loaders_and_keeps_a_missing_one_as_none():
    """Step 3's prompts and its text for the LM loss come in pairs, as many as the shorter loader has; without text
    the pair's second half is None."""
    from utils.training import Position

    args = SimpleNamespace(num_train_epochs=1, max_steps=0)
    prompts, text = resumable_loader(list(range(10)), 2, seed=0), resumable_loader(list(range(100, 106)), 2, seed=1)
    seen, log = _walk(Position(), args, (prompts, text), per_step=1)
    assert len(seen) == 3 and log.totals == [3]
    assert all(min(p) < 10 and min(t) >= 100 for _, (p, t) in as_lists(seen))
    seen, _ = _walk(Position(), args, (resumable_loader(list(range(10)), 2, seed=0), None), per_step=1)
    assert len(seen) == 5 and all(t is None for _, (_, t) in seen)


# --------------------------------------------------------------------------- manifest

def make_folder(root):
    (root / "sub").mkdir(parents=True)
    (root / "a.bin").write_bytes(b"0123456789")
    (root / "sub" / "b.pt").write_bytes(b"abc")
    (root / STATE).write_bytes(b"state")
    write_manifest(str(root))
    return root


@pytest.mark.parametrize("damage, problem", [
    (lambda r: None, None),
    (lambda r: (r / MANIFEST).unlink(), "no manifest"),
    (lambda r: (r / MANIFEST).write_text("{not json"), "unreadable manifest"),
    (lambda r: (r / "sub" / "b.pt").unlink(), "missing file sub/b.pt"),
    (lambda r: (r / "a.bin").write_bytes(b"01234"), "size mismatch in a.bin"),
    (lambda r: (r / "a.bin").write_bytes(b"0123456780"), "checksum mismatch in a.bin"),
])
def test_manifest_detects_missing_truncated_and_flipped_files(tmp_path, damage, problem):
    root = make_folder(tmp_path / "ck")
    damage(root)
    found = verify_manifest(str(root))
    assert found == problem if problem is None else problem in found


# --------------------------------------------------------------------------- manager

def manager(tmp_path, **kw):
    messages = []
    kw.setdefault("max_checkpoints", 2)
    m = CheckpointManager(str(tmp_path / "out"), log=messages.append, **kw)
    return m, messages


def test_save_rotates_and_load_restores_engines_state_and_rngs(tmp_path):
    m, messages = manager(tmp_path, config={"seed": 1})
    engine = FakeEngine(0.0)
    for step in (2, 4, 6):
        engine.w = torch.tensor([float(step)])
        torch.manual_seed(step)
        m.save(step, {"actor": engine}, {"epoch": 0, "batches_in_epoch": step})
    names = sorted(os.listdir(m.root))
    assert names == ["latest", "step-00000004", "step-00000006"]  # keep the last 2, no temporary left
    with open(os.path.join(m.root, "latest")) as f:
        assert f.read().strip() == "step-00000006"
    expected = float(torch.rand(()))
    torch.manual_seed(0)
    fresh = FakeEngine(-1.0)
    state = m.load({"actor": fresh})
    assert fresh.w.item() == 6.0 and state["step"] == 6 and state["batches_in_epoch"] == 6
    assert state["config"] == {"seed": 1}
    assert float(torch.rand(())) == expected
    assert messages[-1].startswith("resumed from") and "(step 6)" in messages[-1]


def test_corrupt_latest_falls_back_with_a_message_and_is_moved_aside(tmp_path):
    warnings = []
    m, messages = manager(tmp_path, warn=warnings.append)
    for step in (3, 6):
        m.save(step, {"actor": FakeEngine(float(step))}, {})
    target = os.path.join(m.root, "step-00000006", "actor", "state", "mp_rank_00_model_states.pt")
    with open(target, "rb") as f:
        blob = bytearray(f.read())
    blob[len(blob) // 2] ^= 0xFF
    with open(target, "wb") as f:
        f.write(bytes(blob))
    engine = FakeEngine(0.0)
    state = m.load({"actor": engine})
    assert state["step"] == 3 and engine.w.item() == 3.0
    assert len(warnings) == 1 and "step-00000006 is unusable (checksum mismatch in actor/state/" in warnings[0]
    assert sorted(os.listdir(m.root)) == ["latest", "step-00000003", "step-00000006.corrupt"]
    m.save(6, {"actor": FakeEngine(6.5)}, {})  # the rerun's own step 6 takes the name back
    assert m.find_valid().endswith("step-00000006")


def test_a_checkpoint_without_its_manifest_is_partial_and_skipped(tmp_path):
    warnings = []
    m, _ = manager(tmp_path, warn=warnings.append)
    m.save(3, {"actor": FakeEngine(3.0)}, {})
    m.save(6, {"actor": FakeEngine(6.0)}, {})
    os.remove(os.path.join(m.root, "step-00000006", MANIFEST))
    assert m.find_valid().endswith("step-00000003")
    assert "no manifest (incomplete checkpoint)" in warnings[0]


def test_a_different_run_configuration_is_refused(tmp_path):
    m, _ = manager(tmp_path, config={"seed": 1, "per_device_train_batch_size": 8})
    m.save(3, {"actor": FakeEngine(3.0)}, {})
    other, _ = manager(tmp_path, config={"seed": 1, "per_device_train_batch_size": 4})
    with pytest.raises(UserInputError, match=r"different run configuration \(per_device_train_batch_size: "
                                              r"checkpoint 8, now 4\)"):
        other.load({"actor": FakeEngine(0.0)})


def test_a_changed_model_folder_or_data_content_is_refused_on_resume(tmp_path):
    """The same flags, other inputs: a model folder replaced by another of the same architecture, data edited
    in place. run_inputs fingerprints what they hold; the resume names the input, not a flag to change."""
    import shutil

    from utils.checkpoint import run_inputs
    from utils.model.tiny import resolve_model_path

    folder = tmp_path / "actor"
    shutil.copytree(resolve_model_path("tiny-opt"), folder)
    data = type("Data", (), {"cache_key": "abc"})()
    before = run_inputs(data, actor_model_name_or_path=str(folder), critic_model_name_or_path=None)
    assert set(before) == {"content of --data_path", "content of --actor_model_name_or_path"}
    assert run_inputs(data, actor_model_name_or_path=str(folder)) == before  # unchanged: the same fingerprint
    assert run_inputs(None, m="facebook/opt-1.3b") == {"content of --m": "name:facebook/opt-1.3b"}  # a hub name
    weights = folder / "model.safetensors"
    stat = os.stat(weights)
    blob = bytearray(weights.read_bytes())
    blob[-1] ^= 0xFF  # another model's weights, same size and modification time
    weights.write_bytes(bytes(blob))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    after = run_inputs(data, actor_model_name_or_path=str(folder))
    assert after["content of --actor_model_name_or_path"] != before["content of --actor_model_name_or_path"]

    m, _ = manager(tmp_path, config={"seed": 1, **before})
    m.save(3, {"actor": FakeEngine(3.0)}, {})
    other, _ = manager(tmp_path, config={"seed": 1, **after})
    with pytest.raises(UserInputError, match=r"different run configuration \(content of --actor_model_name_or_path: "
                                              r"checkpoint '.*', now '.*'\); rerun with the same settings to resume"):
        other.load({"actor": FakeEngine(0.0)})


@pytest.mark.parametrize("planted", ["actor/state/mp_rank_00_model_states.pt", "trainer_state.pt"])
def test_a_pickle_payload_in_a_checkpoint_is_refused_and_never_runs(tmp_path, planted):
    """A checkpoint file replaced by a pickle that runs code, its manifest regenerated so it passes the integrity
    check: resuming refuses it in one line before DeepSpeed (weights_only=False) or we unpickle anything."""
    from utils.checkpoint import check_pickles, write_manifest

    m, _ = manager(tmp_path, config={"seed": 1})
    path = m.save(2, {"actor": FakeEngine(2.0)}, {})
    marker = tmp_path / "payload-ran"
    target = os.path.join(path, planted)
    assert os.path.isfile(target)
    torch.save({"w": torch.tensor([1.0]), "x": Payload(marker)}, target)
    write_manifest(path)
    again, _ = manager(tmp_path, config={"seed": 1})
    with pytest.raises(UserInputError, match=r"would import (posix|os)\.system when loaded, which can run code; "
                                              r"not resuming from it.*--trust_checkpoint"):
        again.resume({"actor": FakeEngine(0.0)})
    assert not marker.exists()
    check_pickles(str(tmp_path / "nothing-here"))  # no files: nothing to refuse


def test_deepspeeds_own_checkpoint_records_pass_the_scan(tmp_path):
    """The classes DeepSpeed's ZeRO checkpoints import (found in real ZeRO-1/2/3 files) are allowed."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    from utils.checkpoint import check_pickles

    torch.save({"loss_scaler": LossScaler(1.0), "zero_stage": ZeroStageEnum(2), "w": torch.zeros(2)},
               tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    check_pickles(str(tmp_path))


def test_resume_is_automatic_and_resume_flag_requires_a_checkpoint(tmp_path):
    m, _ = manager(tmp_path)
    assert m.resume({"actor": FakeEngine(0.0)}) is None  # fresh start
    required, _ = manager(tmp_path, require_resume=True)
    with pytest.raises(UserInputError, match="--resume: no usable checkpoint"):
        required.resume({"actor": FakeEngine(0.0)})
    m.save(2, {"actor": FakeEngine(2.0)}, {"epoch": 1})
    assert required.resume({"actor": FakeEngine(0.0)})["epoch"] == 1


def test_module_state_round_trips_parameters_and_buffers_through_a_manifest_checked_checkpoint(tmp_path):
    def model(seed):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        m[1].running_mean.uniform_()
        return m

    m, _ = manager(tmp_path)
    saved = model(1)
    m.save(5, {"actor_ema": ModuleState(saved)}, {})
    assert os.path.isfile(os.path.join(m.root, "step-00000005", "actor_ema", "state", "model.safetensors"))
    restored = model(2)
    m.load({"actor_ema": ModuleState(restored)})
    for (name, a), b in zip(saved.state_dict().items(), restored.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(UserInputError, match="do not match the model"):
        m.load({"actor_ema": ModuleState(torch.nn.Linear(3, 4))})


def test_step_done_saves_every_interval(tmp_path):
    m, _ = manager(tmp_path, save_interval=3, max_checkpoints=5)
    calls = []
    for step in range(1, 8):
        m.step_done(step, {"actor": FakeEngine(float(step))}, lambda: calls.append(step) or {})
    assert calls == [3, 6]
    assert [os.path.basename(p) for p in m.checkpoints()] == ["step-00000006", "step-00000003"]
    off, _ = manager(tmp_path / "off", save_interval=0)
    off.step_done(3, {"actor": FakeEngine(0.0)}, lambda: {})
    assert off.checkpoints() == []


def test_a_failing_write_is_a_clear_error_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    m, _ = manager(tmp_path)
    m.save(3, {"actor": FakeEngine(3.0)}, {})

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(UserInputError, match=r"cannot write checkpoint .*step-00000006: No space left on device"):
        m.save(6, {"actor": FakeEngine(6.0)}, {})
    monkeypatch.undo()
    assert sorted(os.listdir(m.root)) == ["latest", "step-00000003"]  # no partial folder left
    assert m.find_valid().endswith("step-00000003")


def test_stale_temporary_folders_are_ignored_and_cleaned(tmp_path):
    m, _ = manager(tmp_path)
    os.makedirs(os.path.join(m.root, ".tmp-step-00000009", "actor"))  # a run killed while saving
    assert m.find_valid() is None
    m.save(3, {"actor": FakeEngine(3.0)}, {})
    assert sorted(os.listdir(m.root)) == ["latest", "step-00000003"]


@pytest.mark.slow
def test_kill_hook_sigkills_at_the_named_step_only(tmp_path):
    code = ("import sys; sys.path.insert(0, %r)\n"
            "from utils.fault_injection import kill_point\n"
            "for step in range(1, 6):\n"
            "    print(step, flush=True)\n"
            "    kill_point(step)\n") % os.getcwd()
    proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **fault_injection.setting("kill", 3)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9 and proc.stdout.split() == ["1", "2", "3"]


def test_fault_injection_does_nothing_unless_set(monkeypatch):
    monkeypatch.delenv(fault_injection.ENV, raising=False)
    assert fault_injection.fault() is None and not fault_injection.nan_at(3)
    fault_injection.kill_point(3)  # returns
    monkeypatch.setenv(fault_injection.ENV, "")
    assert fault_injection.fault() is None
    monkeypatch.setenv(fault_injection.ENV, "kill@3")
    assert fault_injection.fault() == ("kill", 3) and not fault_injection.nan_at(3)
    fault_injection.kill_point(2)  # another step: returns


@pytest.mark.parametrize("value", ["3", "nan", "nan@", "nan@0", "nan@-1", "boom@3", "kill@3,nan@5", "kill@3x"])
def test_fault_injection_refuses_a_malformed_setting(monkeypatch, value):
    monkeypatch.setenv(fault_injection.ENV, value)
    with pytest.raises(UserInputError, match=r"DSCHAT_FAULT_INJECT=.*expected KIND@STEP.*nan, kill, interrupt"):
        check_finite(1, loss=1.0)
    with pytest.raises(UserInputError, match="DSCHAT_FAULT_INJECT="):
        fault_injection.kill_point(1)


# --------------------------------------------------------------------------- NaN guard

def test_check_finite_names_step_and_quantity(monkeypatch):
    check_finite(4, loss=torch.tensor(1.5), reward=2.0)
    with pytest.raises(TrainingDiverged, match=r"non-finite reward \(inf\) at step 7"):
        check_finite(7, loss=1.0, reward=float("inf"))
    with pytest.raises(TrainingDiverged, match=r"non-finite loss \(nan\) at step 2"):
        check_finite(2, loss=torch.tensor(float("nan")))
    monkeypatch.setenv(fault_injection.ENV, "nan@3")
    check_finite(2, actor_loss=1.0)
    with pytest.raises(TrainingDiverged, match=r"non-finite actor_loss \(nan\) at step 3"):
        check_finite(3, actor_loss=1.0, critic_loss=1.0)


def test_weights_holding_nan_or_inf_are_never_saved(tmp_path):
    """The loss is checked before each update, so the last update can still leave NaN weights: the save refuses."""
    from utils.finite import check_weights_finite
    from utils.model.model_utils import save_hf_format

    good, bad = torch.nn.Linear(3, 2), torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    check_weights_finite("the model", good, None)
    with torch.no_grad():
        bad[1].bias[0] = float("inf")
    with pytest.raises(TrainingDiverged, match=r"non-finite weights in the step-3 models \(first: 1.bias\)"):
        check_weights_finite("the step-3 models", good, bad)
    with pytest.raises(TrainingDiverged, match="nothing saved"):
        save_hf_format(bad, None, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- security

def _repo_calls(attr):
    """(file, line, call) for every ``<something>.<attr>(...)`` call in the repository's own code."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    for path in repo.rglob("*.py"):
        if any(part.startswith(".") for part in path.relative_to(repo).parts):
            continue  # .venv, .cache
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attr:
                yield str(path.relative_to(repo)), node.lineno, node


def test_every_torch_load_refuses_arbitrary_pickles():
    calls = [(f, line, c) for f, line, c in _repo_calls("load")
             if isinstance(c.func.value, ast.Name) and c.func.value.id == "torch"]
    assert len(calls) >= 4
    unsafe = [(f, line) for f, line, c in calls
              if not any(k.arg == "weights_only" and getattr(k.value, "value", None) is True for k in c.keywords)]
    assert not unsafe, f"torch.load without weights_only=True: {unsafe}"


def test_remote_code_is_never_switched_on_in_the_code():
    forced = [(f, line) for f, line, c in _repo_calls("from_pretrained") for k in c.keywords
              if k.arg == "trust_remote_code" and getattr(k.value, "value", None) is True]
    assert not forced
    from step1_supervised_finetuning.main import parse_args

    assert parse_args([]).trust_remote_code is False
