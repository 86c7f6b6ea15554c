"""Crash and resume, end to end on CPU, for every step.

For each step: an uninterrupted reference run, and the same command killed with SIGKILL
right after optimizer step 7 (``DSCHAT_FAULT_INJECT=kill@7``; checkpoints every 3 steps,
so steps 3 and 6 are on disk), then rerun without the hook. The rerun must resume from
step 6 and end with final weights BITWISE equal to the reference run's (same seed,
dropout on, so the restored RNG states and data position matter). A corrupted newest
checkpoint must be reported and skipped (resume from step 3, same final weights), and a
NaN at step 7 (``DSCHAT_FAULT_INJECT=nan@7``) must stop with exit code 3, leaving
the checkpoints as they were and no final model.
"""
import os
import shutil

import pytest

from tests.conftest import run_entry
from utils import fault_injection

KILL_AT_7 = fault_injection.setting("kill", 7)
NAN_AT_7 = fault_injection.setting("nan", 7)
ENV = {"OMP_NUM_THREADS": "1"}
CHECKPOINTING = ["--save_interval", "3", "--max_steps", "8"]

COMMON = ["--data_path", "builtin/preference-small", "--max_seq_len", "64", "--per_device_train_batch_size", "8",
          "--dropout", "0.1", *CHECKPOINTING]
# step 3: sampling, EMA, unsupervised mixing and dropout on, so every piece of saved state matters;
# {rm} is an (untrained) step-2 folder of tiny-opt, {text} a small text file
PPO = ["--actor_model_name_or_path", "tiny-opt", "--critic_model_name_or_path", "{rm}",
       "--data_path", "builtin/preference-small", "--max_prompt_seq_len", "16", "--max_answer_seq_len", "8",
       "--per_device_generation_batch_size", "4", "--per_device_training_batch_size", "2", "--do_sample",
       "--enable_ema", "--actor_dropout", "0.1", "--critic_dropout", "0.1", "--num_warmup_steps", "0",
       "--actor_learning_rate", "1e-3", "--critic_learning_rate", "1e-3", "--unsupervised_dataset_name", "{text}",
       "--unsup_coef", "1.0", *CHECKPOINTING]
# critic-free step 3: GRPO groups of 2 scored by the built-in rule, with the same saved state in play
GRPO = ["--actor_model_name_or_path", "tiny-opt", "--advantage_estimator", "grpo", "--n_samples_per_prompt", "2",
        "--reward_fn", "builtin_rule", "--data_path", "builtin/preference-small", "--max_prompt_seq_len", "16",
        "--max_answer_seq_len", "8", "--per_device_generation_batch_size", "4", "--per_device_training_batch_size", "4",
        "--do_sample", "--enable_ema", "--actor_dropout", "0.1", "--num_warmup_steps", "0", "--actor_learning_rate",
        "1e-3", "--unsupervised_dataset_name", "{text}", "--unsup_coef", "1.0", *CHECKPOINTING]
# DAPO (issue 32): GRPO with clip-higher, token mean, truncated answers masked, the overlong penalty and dynamic
# sampling (a parity reward, so about half the groups score the same: rounds refill, and with a limit of 2 batches some
# are filled), a short last micro-batch, unsupervised text in LM micro-batches of 2 rows (RL ones of 3), EMA and
# dropout: the prompts each round drew must resume
DAPO = ["--actor_model_name_or_path", "tiny-opt", "--advantage_estimator", "grpo", "--n_samples_per_prompt", "2",
        "--reward_fn", "{fn}", "--cliprange_high", "0.28", "--loss_agg", "token_mean", "--mask_truncated_answers",
        "--overlong_penalty", "4", "--dynamic_sampling", "--dynamic_sampling_max_batches", "2", "--data_path",
        "builtin/preference-small", "--max_prompt_seq_len", "16", "--max_answer_seq_len", "8",
        "--per_device_generation_batch_size", "4", "--per_device_training_batch_size", "3", "--do_sample",
        "--enable_ema", "--actor_dropout", "0.1", "--num_warmup_steps", "0", "--actor_learning_rate", "1e-3",
        "--unsupervised_dataset_name", "{text}", "--unsup_coef", "1.0",
        "--per_device_unsup_batch_size", "2", *CHECKPOINTING]
# GRPO whose optimizer steps span rounds (issue 57): 8 answers a round in micro-batches of 3, 2 a step, so the
# checkpoint after round 3 holds a micro-batch (and its text) waiting for round 4's (WholeSteps): it must resume
SPANNING = GRPO[:GRPO.index("--per_device_training_batch_size")] + [
    "--per_device_training_batch_size", "3", "--gradient_accumulation_steps", "2"] + \
    GRPO[GRPO.index("--per_device_training_batch_size") + 2:]
STEPS = {  # name: (entry point, arguments, the first quantity check_finite sees)
    "step1": ("step1_supervised_finetuning/main.py", ["--model_name_or_path", "tiny-opt", *COMMON], "loss"),
    "step2_rm": ("step2_reward_model_finetuning/main.py",
                 ["--model_name_or_path", "tiny-opt", "--num_padding_at_beginning", "1", *COMMON], "loss"),
    "step2_dpo": ("step2_dpo_finetuning/main.py", ["--model_name_or_path", "tiny-opt", *COMMON], "loss"),
    "step3": ("step3_rlhf_finetuning/main.py", PPO, "actor_loss"),
    "step3_grpo": ("step3_rlhf_finetuning/main.py", GRPO, "actor_loss"),
    "step3_dapo": ("step3_rlhf_finetuning/main.py", DAPO, "actor_loss"),
    "step3_spanning_steps": ("step3_rlhf_finetuning/main.py", SPANNING, "actor_loss"),
}
STEP1 = STEPS["step1"]


def run(step, out, data, env=None):
    script, args, _ = step
    inputs = data.parent / "inputs"
    args = [a.format(rm=inputs / "reward", text=inputs / "text.txt", fn=f"{inputs / 'parity.py'}:score") for a in args]
    return run_entry(script, *args, "--output_dir", out, "--data_output_path", data, env=dict(ENV, **(env or {})))


def make_inputs(folder):
    """The step-3 inputs: an untrained step-2 folder of tiny-opt, a text file and a reward function file."""
    from utils.model.critic import create_critic_model, save_reward_model
    from utils.model.model_utils import load_hf_tokenizer

    tokenizer = load_hf_tokenizer("tiny-opt")
    save_reward_model(create_critic_model("tiny-opt", tokenizer, None, 1), tokenizer, str(folder / "reward"))
    (folder / "text.txt").write_text("".join(f"The {n} is bright and calm, said the {n} keeper.\n" for n in range(300)))
    (folder / "parity.py").write_text("def score(prompts, answers, rows):\n"
                                      "    return [float(len(a.split()) % 2) for a in answers]\n")


def ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def final_weight_files(folder):
    """The exported models' .safetensors files (actor/, critic/, actor_ema/ for step 3), not the checkpoints'."""
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, names in os.walk(folder)
                  for f in names if f.endswith(".safetensors") and "checkpoints" not in os.path.relpath(d, folder))


def weights(folder):
    from safetensors.torch import load_file

    files = final_weight_files(folder)
    assert files, f"no weights in {folder}"
    return {f"{name}:{key}": t for name in files for key, t in load_file(os.path.join(folder, name)).items()}


def assert_bitwise_equal(a, b):
    import torch

    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    different = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def checkpoint_steps(out):
    root = os.path.join(out, "checkpoints")
    return sorted(n for n in os.listdir(root) if n.startswith("step-"))


def flip_byte(folder):
    """Flip one byte in the middle of the largest file of a checkpoint (a model/optimizer state)."""
    files = [os.path.join(d, f) for d, _, names in os.walk(folder) for f in names]
    target = max(files, key=os.path.getsize)
    with open(target, "r+b") as f:
        f.seek(os.path.getsize(target) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    return os.path.relpath(target, folder)


_PREPARED = {}


def prepared(name, tmp_path_factory):
    """(reference output, killed output, data cache) of step ``name``, made once per session."""
    if name not in _PREPARED:
        step = STEPS[name]
        base = tmp_path_factory.mktemp(f"{name}_resume")
        data = base / "data"
        if "{text}" in step[1]:
            (base / "inputs").mkdir()
            make_inputs(base / "inputs")
        ok(run(step, base / "reference", data))
        killed = run(step, base / "killed", data, env=KILL_AT_7)
        assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-3000:]
        assert checkpoint_steps(base / "killed") == ["step-00000003", "step-00000006"]
        assert not final_weight_files(base / "killed")
        _PREPARED[name] = (base / "reference", base / "killed", data)
    return _PREPARED[name]


@pytest.fixture
def step1_runs(tmp_path_factory):
    return prepared("step1", tmp_path_factory)


def fresh_copy(src, tmp_path, name):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(STEPS))
def test_killed_run_stops_on_nan_then_resumes_to_bitwise_equal_weights(name, tmp_path, tmp_path_factory):
    reference, killed, data = prepared(name, tmp_path_factory)
    step = STEPS[name]
    out = fresh_copy(killed, tmp_path, "resumed")

    # a NaN at step 7 of the rerun: exit 3 naming the step, checkpoints untouched, no final model
    manifests = {n: (out / "checkpoints" / n / "MANIFEST.json").read_bytes() for n in checkpoint_steps(out)}
    proc = run(step, out, data, env=NAN_AT_7)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert f"error: non-finite {step[2]} (nan) at step 7" in proc.stderr and "Traceback" not in proc.stderr
    assert {n: (out / "checkpoints" / n / "MANIFEST.json").read_bytes() for n in checkpoint_steps(out)} == manifests
    assert not final_weight_files(out)

    # the plain rerun resumes from step 6 and ends where the uninterrupted run ended, bit for bit
    proc = ok(run(step, out, data))
    assert f"resumed from {out / 'checkpoints' / 'step-00000006'} (step 6)" in proc.stdout
    assert "before training" not in proc.stdout  # no fresh start (no initial evaluation)
    assert_bitwise_equal(reference, out)
    last = [last_train_row(folder) for folder in (reference, out)]  # e.g. step 3's reward EMA and KL
    assert last[0] == last[1] and last[0]["step"] == 8


def last_train_row(folder):
    """The last training metrics row, without wall-clock fields."""
    import json

    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    row = [r for r in rows if r["phase"] == "train"][-1]
    timing = ("time", "latency", "tflops", "per_sec")
    return {k: v for k, v in row.items() if not any(t in k for t in timing)}


@pytest.mark.slow
def test_step1_corrupt_latest_checkpoint_falls_back_to_the_previous_one(step1_runs, tmp_path):
    reference, killed, data = step1_runs
    out = fresh_copy(killed, tmp_path, "corrupt")
    damaged = flip_byte(out / "checkpoints" / "step-00000006")
    proc = ok(run(STEP1, out, data))
    assert (f"checkpoint {out / 'checkpoints' / 'step-00000006'} is unusable (checksum mismatch in {damaged})"
            in proc.stderr)
    assert "(step 3)" in proc.stdout
    assert (out / "checkpoints" / "step-00000006.corrupt").is_dir()
    assert_bitwise_equal(reference, out)


@pytest.mark.slow
@pytest.mark.multiproc
def test_two_rank_zero2_run_resumes_across_an_epoch_boundary(tmp_path):
    """2 CPU ranks, ZeRO 2 (per-rank optimizer partitions and RNG files, rank 0 picks the checkpoint):
    killed after step 7 of 10 (epoch 2 of 2), resumed from step 6 (start of epoch 2), bitwise equal."""
    import subprocess
    import sys

    from tests.conftest import REPO

    args = ["--model_name_or_path", "tiny-opt", "--data_path", "builtin/preference-small", "--max_seq_len", "64",
            "--per_device_train_batch_size", "8", "--num_train_epochs", "2", "--save_interval", "3",
            "--dropout", "0.1", "--zero_stage", "2", "--data_output_path", tmp_path / "data"]

    def torchrun(out, env=None):
        full_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        full_env.update(ENV, **(env or {}))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(REPO / STEPS["step1"][0]), *map(str, args), "--output_dir", str(out)]
        return subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=600)

    ok(torchrun(tmp_path / "reference"))
    killed = torchrun(tmp_path / "run", env=KILL_AT_7)
    assert killed.returncode != 0
    state = tmp_path / "run" / "checkpoints" / "step-00000006"
    assert {"rng-rank0.pt", "rng-rank1.pt"} <= set(os.listdir(state))
    assert len([f for f in os.listdir(state / "model" / "state") if f.startswith("zero_pp_rank_")]) == 2
    proc = ok(torchrun(tmp_path / "run"))
    assert f"resumed from {state} (step 6)" in proc.stdout
    assert "Beginning of Epoch 2/2, Total Micro Batches 4" in proc.stdout  # 80 samples / 2 ranks / 8 = 5 batches
    assert_bitwise_equal(tmp_path / "reference", tmp_path / "run")


@pytest.mark.slow
@pytest.mark.parametrize("folders_saved", [1, 2])
def test_step3_killed_between_its_final_saves_resumes_not_refused_as_finished(folders_saved, tmp_path,
                                                                              tmp_path_factory):
    """Issue 25, rule 1: step 3 saves critic/, actor_ema/, then actor/ (the completion marker). A SIGKILL after
    the first or second folder leaves a run that is not finished: the rerun resumes from its last checkpoint
    (not "already holds a finished run") and ends bit-identical to the uninterrupted run."""
    reference, _, data = prepared("step3", tmp_path_factory)
    out = tmp_path / "run"
    killed = run(STEPS["step3"], out, data, env=fault_injection.setting("killsave", folders_saved))
    assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-3000:]
    written = sorted(p.name for p in out.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert written == {1: ["checkpoints", "critic"], 2: ["actor_ema", "checkpoints", "critic"]}[folders_saved]
    proc = ok(run(STEPS["step3"], out, data))
    assert "finished run" not in proc.stderr
    assert f"resumed from {out / 'checkpoints' / 'step-00000006'} (step 6)" in proc.stdout
    assert_bitwise_equal(reference, out)
