"""The per-size training scripts (``step*/training_scripts/...``), run for real with a fake ``deepspeed`` (and
``python``) first on PATH that records its command line instead of training: every script passes its extra
flags through, last (so they win); the multi-node scripts take the hostfile from ``HOSTFILE`` (default
DeepSpeed's ``/job/hostfile``); ``train.py`` hands ``--stepN-args``, ``--overwrite`` and ``--hostfile`` to the
script of each step x deployment x size; and the scripts carry DeepSpeed-Chat's hyper-parameters."""
import os
import subprocess

import pytest

import train
from tests.conftest import REPO

SCRIPTS = sorted(str(p.relative_to(REPO)) for p in REPO.glob("step*/training_scripts/**/*.sh"))
EXTRA = ["--num_train_epochs", "3", "--overwrite"]

FAKE_LAUNCHER = r"""#!/bin/bash
# Fake deepspeed / python: record the command line (NUL-separated, one file per call) and "save" a model
# in the last --output_dir, as the real step would.
n=$(ls "$LAUNCH_RECORD" | wc -l)
printf '%s\0' "$(basename "$0")" "$@" > "$LAUNCH_RECORD/$(printf %03d "$n")"
out=; prev=
for a in "$@"; do [ "$prev" = --output_dir ] && out=$a; prev=$a; done
if [ -n "$out" ]; then mkdir -p "$out" && echo '{}' > "$out/config.json" && : > "$out/model.safetensors"; fi
echo "fake launch done"
"""


@pytest.fixture
def launcher(tmp_path):
    """``(env, launches)``: an environment whose ``deepspeed`` and ``$PYTHON`` are the fake launcher, and a
    function returning the command lines recorded so far (each a list: launcher name, its arguments)."""
    bin_dir, record = tmp_path / "bin", tmp_path / "launches"
    bin_dir.mkdir()
    record.mkdir()
    fake = bin_dir / "deepspeed"
    fake.write_text(FAKE_LAUNCHER)
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHON=str(fake),
               LAUNCH_RECORD=str(record))
    env.pop("HOSTFILE", None)

    def launches():
        return [(record / name).read_bytes().decode().split("\0")[:-1] for name in sorted(os.listdir(record))]

    return env, launches


def split_launch(argv):
    """(launcher arguments, the main.py it starts, main.py's flags)."""
    i = next(i for i, a in enumerate(argv) if a.endswith("main.py"))
    return argv[1:i], argv[i], argv[i + 1:]


def value(flags, name):
    """The value(s) after the LAST ``name`` (argparse: the last one wins), space-joined ("" for a switch); None
    when absent."""
    if name not in flags:
        return None
    values = []
    for flag in flags[len(flags) - flags[::-1].index(name):]:
        if flag.startswith("--"):
            break
        values.append(flag)
    return " ".join(values)


def positional(script, out):
    if script.startswith("step3"):
        return ["/models/actor", "/models/critic", "", "", out]  # ACTOR CRITIC [ZERO ZERO] OUTPUT
    if script.startswith("step2_dpo"):
        return [out, "", "/models/policy"]  # OUTPUT [ZERO] MODEL
    return [out, ""]  # OUTPUT [ZERO]


def run_script(script, args, env):
    proc = subprocess.run(["bash", str(REPO / script), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_passes_extra_flags_last_and_multi_node_reads_hostfile(script, tmp_path, launcher):
    env, launches = launcher
    out = str(tmp_path / "out")
    run_script(script, positional(script, out) + EXTRA, dict(env, HOSTFILE="/my/hosts"))
    (argv,) = launches()
    launcher_args, main_py, flags = split_launch(argv)
    assert main_py == str(REPO / script.split("/")[0] / "main.py")
    assert flags[-len(EXTRA):] == EXTRA  # last: they win over the script's own --num_train_epochs
    assert value(flags, "--output_dir") == out
    if "/multi_node/" in script:
        assert launcher_args[:2] == ["--hostfile", "/my/hosts"]
    else:
        assert "--hostfile" not in launcher_args
    assert "fake launch done" in (tmp_path / "out" / "training.log").read_text()  # the script tees its log


@pytest.mark.parametrize("script", [s for s in SCRIPTS if "/multi_node/" in s])
def test_multi_node_scripts_default_to_deepspeeds_hostfile(script, tmp_path, launcher):
    env, launches = launcher
    run_script(script, positional(script, str(tmp_path / "out")), env)  # no HOSTFILE, no extra flags
    launcher_args, _, flags = split_launch(launches()[0])
    assert launcher_args[:2] == ["--hostfile", "/job/hostfile"]
    assert flags[-2:] == ["--output_dir", str(tmp_path / "out")]


# DeepSpeed-Chat's values of the flags these scripts differ in across deployments (None: not passed, so the
# step's default: DeepSpeed-Chat's single_gpu scripts give only a few flags). Step 3's Llama script passes
# --num_padding_at_beginning 0 where DeepSpeed-Chat's passes 1 (its step-2 Llama script 0): a Llama tokenizer
# starts with no pad token (README, "Differences from DeepSpeed-Chat").
REFERENCE = {
    "step1_supervised_finetuning/training_scripts/opt/multi_node/run_66b.sh": {
        "--data_path": "Dahoas/rm-static Dahoas/full-hh-rlhf Dahoas/synthetic-instruct-gptj-pairwise "
                       "yitingxie/rlhf-reward-datasets", "--per_device_train_batch_size": "4"},
    "step2_reward_model_finetuning/training_scripts/opt/multi_node/run_350m.sh": {
        "--per_device_train_batch_size": "2", "--per_device_eval_batch_size": "2", "--learning_rate": "5e-5"},
    "step2_reward_model_finetuning/training_scripts/opt/single_node/run_350m.sh": {
        "--per_device_train_batch_size": "4", "--per_device_eval_batch_size": "4", "--learning_rate": "5e-5"},
    "step2_reward_model_finetuning/training_scripts/opt/single_gpu/run_350m.sh": {
        "--data_path": None, "--per_device_train_batch_size": None, "--gradient_accumulation_steps": "4",
        "--gradient_checkpointing": None},
    "step2_dpo_finetuning/training_scripts/opt/multi_node/run_350m.sh": {
        "--per_device_train_batch_size": "2", "--learning_rate": "5e-5"},
    "step2_dpo_finetuning/training_scripts/opt/single_node/run_350m.sh": {
        "--per_device_train_batch_size": "4", "--learning_rate": "5e-5"},
    # the one deliberate change: DeepSpeed-Chat's script keeps main.py's 1e-3; its other two DPO scripts use 5e-5
    "step2_dpo_finetuning/training_scripts/opt/single_gpu/run_350m.sh": {
        "--data_path": None, "--per_device_train_batch_size": None, "--learning_rate": "5e-5"},
    "step3_rlhf_finetuning/training_scripts/llama2/run_llama2_7b.sh": {"--num_padding_at_beginning": "0"},
}


@pytest.mark.parametrize("script", sorted(REFERENCE))
def test_scripts_carry_the_references_hyper_parameters(script, tmp_path, launcher):
    env, launches = launcher
    run_script(script, positional(script, str(tmp_path / "out")), env)
    _, _, flags = split_launch(launches()[0])
    assert {name: value(flags, name) for name in REFERENCE[script]} == REFERENCE[script]


# every per-size script train.py picks (OPT actor sizes; the 350m reward model)
PLANS = [("single_gpu", "1.3b"), ("single_node", "1.3b"), ("single_node", "6.7b"), ("single_node", "13b"),
         ("multi_node", "66b")]


@pytest.mark.parametrize("deployment,actor", PLANS)
def test_train_py_hands_step_args_overwrite_and_hostfile_to_each_per_size_script(deployment, actor, tmp_path,
                                                                                launcher, monkeypatch):
    env, launches = launcher
    monkeypatch.setattr(train, "gpu_count", lambda: 8)  # per-size scripts are used on GPUs only
    real_env = train.child_env
    monkeypatch.setattr(train, "child_env", lambda *a: dict(real_env(*a), PATH=env["PATH"],
                                                            LAUNCH_RECORD=env["LAUNCH_RECORD"]))
    hostfile = tmp_path / "hosts"
    hostfile.write_text("worker-1 slots=8\nworker-2 slots=8\n")
    out = tmp_path / "out"
    argv = ["--actor-model", actor, "--reward-model", "350m", "--deployment-type", deployment,
            "--output-dir", str(out), "--overwrite"]
    if deployment == "multi_node":  # elsewhere --hostfile is refused (it would not be used)
        argv += ["--hostfile", str(hostfile)]
    for n in (1, 2, 3):
        argv += [f"--step{n}-args", f"--num_train_epochs {n + 2} --seed {n}"]
    args = train.parse_args(argv)
    plan = train.make_plan(args, 8)
    assert all(launch.cmd[0] == "bash" for launch in plan)  # a per-size script for each step
    assert train.main(args) == 0

    recorded = launches()
    assert len(recorded) == 3
    for n, argv in zip((1, 2, 3), recorded):
        launcher_args, main_py, flags = split_launch(argv)
        assert main_py == str(REPO / train.STEPS[n].folder / "main.py")
        assert flags[-5:] == ["--overwrite", "--num_train_epochs", str(n + 2), "--seed", str(n)]
        assert value(flags, "--num_train_epochs") == str(n + 2)  # the user's, after the script's own
        assert value(flags, "--output_dir") == train.step_output_dir(args, n)
        if deployment == "multi_node":
            assert launcher_args[:2] == ["--hostfile", str(hostfile)]
        else:
            assert "--hostfile" not in launcher_args
    if deployment == "multi_node":
        assert all(launch.command_line.startswith(f"HOSTFILE={hostfile} bash ") for launch in plan)


# --------------------------------------------------------------------------- DeepSpeed-Chat's step-3 sweep

def sweep_flags(zero, hybrid_engine, offload, lora, mixed_precision_lora, output="out"):
    """The main.py flags DeepSpeed-Chat's step-3 sweep (training_scripts/opt/single_node/sweep/run_single.sh)
    passes in test mode, as its tests/test_training.py runs it (test_stop_step 5)."""
    flags = ["--data_path", "Dahoas/rm-static", "--data_split", "2,4,4", "--actor_model_name_or_path", "actor",
             "--critic_model_name_or_path", "critic", "--num_padding_at_beginning", "1",
             "--per_device_generation_batch_size", "4", "--per_device_training_batch_size", "4",
             "--generation_batches", "1", "--ppo_epochs", "1", "--max_answer_seq_len", "256",
             "--max_prompt_seq_len", "256", "--actor_learning_rate", "9.65e-6", "--critic_learning_rate", "5e-6",
             "--num_train_epochs", "1", "--lr_scheduler_type", "cosine", "--gradient_accumulation_steps", "1",
             "--actor_weight_decay", "0", "--critic_weight_decay", "0", "--num_warmup_steps", "100", "--deepspeed",
             "--seed", "1234", "--actor_dropout", "0.0", "--print_answers", "--actor_zero_stage", str(zero),
             "--critic_zero_stage", str(zero), "--output_dir", output]
    flags += ["--enable_hybrid_engine"] if hybrid_engine else []
    flags += ["--offload"] if offload else []
    flags += ["--enable_mixed_precision_lora"] if mixed_precision_lora else []
    flags += ["--actor_lora_dim", "128", "--actor_lora_module_name", "decoder.layers."] if lora else \
        ["--actor_lora_dim", "0"]
    return flags + ["--enable_test_mode", "--test_stop_step", "5"]


SWEEP = [(z, he, off, lora, False) for z in (2, 3) for he in (True, False) for off in (True, False)
         for lora in (True, False)] + [(3, he, False, True, True) for he in (True, False)]


@pytest.mark.parametrize("zero,hybrid_engine,offload,lora,mixed_precision_lora", SWEEP)
def test_step3_accepts_the_reference_sweep_in_test_mode(zero, hybrid_engine, offload, lora, mixed_precision_lora):
    from step3_rlhf_finetuning.main import parse_args, validate_step3
    from utils.compat import check_zero_combination
    from utils.errors import UserInputError

    flags = sweep_flags(zero, hybrid_engine, offload, lora, mixed_precision_lora)
    args = parse_args(flags)
    # test mode is --max_steps N --num_train_epochs 1: the same arguments otherwise
    plain = parse_args([f for f in flags if f not in ("--enable_test_mode", "--test_stop_step", "5")]
                       + ["--max_steps", "5"])
    assert (args.max_steps, args.num_train_epochs) == (5, 1)
    def others(a):
        return {k: v for k, v in vars(a).items() if k not in ("enable_test_mode", "test_stop_step")}

    assert others(args) == others(plain)
    if (zero, hybrid_engine, offload, lora) == (2, True, True, False):  # the combination its test skips too
        with pytest.raises(UserInputError, match="unsupported"):
            validate_step3(args)
        return
    validate_step3(args)
    check_zero_combination(args)


def test_test_mode_flags():
    from step3_rlhf_finetuning.main import parse_args, validate_step3
    from utils.errors import UserInputError

    base = ["--actor_model_name_or_path", "a", "--critic_model_name_or_path", "c", "--output_dir", "o"]
    args = parse_args(base + ["--enable_test_mode", "--num_train_epochs", "3"])  # no stop step: one epoch
    assert (args.max_steps, args.num_train_epochs) == (0, 1)
    args = parse_args(base + ["--enable_test_mode", "--test_stop_step", "7", "--max_steps", "4"])
    assert args.max_steps == 4  # the smaller limit
    args = parse_args(base + ["--num_train_epochs", "3"])
    assert (args.max_steps, args.num_train_epochs) == (0, 3)  # off by default
    for flags, message in ((["--test_stop_step", "5"], "needs --enable_test_mode"),
                           (["--enable_test_mode", "--test_stop_step", "-1"], "must be ≥ 0"),
                           (["--enable_test_mode", "--test_stop_step", "1", "--generation_batches", "2"],
                            "fewer than one round of --generation_batches 2, so no RL step would run")):
        with pytest.raises(UserInputError, match=message):
            validate_step3(parse_args(base + flags))


@pytest.mark.parametrize("stop, generation_batches, rl_steps", [(5, 1, 5), (5, 2, 2), (6, 3, 2), (4, 4, 1)])
def test_test_stop_step_counts_generation_batches_as_deepspeed_chat_does(stop, generation_batches, rl_steps):
    """DeepSpeed-Chat's step 3 counts --test_stop_step in its loop's generation batches (a training round every
    --generation_batches of them), not in rounds: N batches complete N // G rounds (the batches of an unfinished
    round train nothing there either)."""
    from step3_rlhf_finetuning.main import parse_args, validate_step3

    args = parse_args(["--actor_model_name_or_path", "a", "--critic_model_name_or_path", "c", "--output_dir", "o",
                       "--enable_test_mode", "--test_stop_step", str(stop), "--generation_batches",
                       str(generation_batches)])
    assert (args.max_steps, args.num_train_epochs) == (rl_steps, 1)
    validate_step3(args)
