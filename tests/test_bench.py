"""The GPU recipe benchmark (bench/bench_gpu_recipe.py) runs only on a GPU; its flags are checked here.

Each step's flag list must still be accepted by that step's own parser and checks, so that the
benchmark does not rot unseen between GPU sessions (a renamed or removed flag fails here, on CPU).
"""
import importlib
import importlib.util
from argparse import Namespace
from pathlib import Path

import pytest

from step3_rlhf_finetuning.main import validate_step3
from utils.arguments import validate_common
from utils.compat import check_zero_combination

REPO = Path(__file__).resolve().parent.parent
MAINS = {"1": "step1_supervised_finetuning.main", "2": "step2_reward_model_finetuning.main",
         "dpo": "step2_dpo_finetuning.main", "3": "step3_rlhf_finetuning.main"}


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_gpu_recipe", REPO / "bench" / "bench_gpu_recipe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("step", list(MAINS))
def test_gpu_recipe_flags_are_accepted_by_each_step(step, tmp_path):
    bench = load_bench()
    options = Namespace(step1_out=str(tmp_path / "step1"), step2_out=str(tmp_path / "step2"), step3_steps=8,
                        generation_backend="cuda-graph")
    script, flags = bench.step_flags(step, str(tmp_path), str(tmp_path / "out"), options)
    assert script == MAINS[step].replace(".", "/") + ".py" and (REPO / script).is_file()
    args = importlib.import_module(MAINS[step]).parse_args([str(f) for f in flags])
    args.dtype = args.dtype or "bf16"
    assert (args.dtype, args.seed, args.data_split) == ("bf16", 1234, "2,4,4")  # the reference's settings
    if step == "3":
        validate_step3(args)
        assert args.enable_hybrid_engine and args.actor_lora_dim == 128 and args.max_steps == 8
    else:
        validate_common(args)
        check_zero_combination(args)


def load_real_model_bench():
    spec = importlib.util.spec_from_file_location("bench_real_model", REPO / "bench" / "bench_real_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


STEP_OF = {"step 1": "1", "step 2": "2", "DPO": "dpo", "step 3": "3"}


@pytest.mark.parametrize("fmt", ["dschat", "template"])
def test_real_model_bench_commands_are_accepted_by_each_step(fmt, tmp_path):
    """bench/bench_real_model.py needs a SmolLM2 folder (~100 MB, never in the test run): its commands are
    checked here against the steps' parsers, so it does not rot unseen."""
    bench = load_real_model_bench()
    options = Namespace(max_seq_len=192, max_answer_len=64, sft_steps=20, rm_steps=30, ppo_steps=4, dpo_steps=10)
    plan = bench.step_commands(fmt, "model", "data.jsonl", str(tmp_path), options)
    assert list(plan) == ["step 1", "step 2", "step 3", "DPO"]  # steps 2 and 3 read the folders written before
    for name, cmd in plan.items():
        module = MAINS[STEP_OF[name]]
        assert cmd[1] == module.replace(".", "/") + ".py"
        args = importlib.import_module(module).parse_args(cmd[2:])
        assert args.apply_chat_template == (fmt == "template")
        args.dtype = "fp32"
        if name == "step 3":
            validate_step3(args)
            assert args.max_prompt_seq_len + args.max_answer_seq_len == 192 and args.max_steps == 4
        else:
            validate_common(args)


def test_real_model_bench_skips_in_one_line_without_the_model(tmp_path, capsys):
    assert load_real_model_bench().main(["--model", str(tmp_path / "absent")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith(f"skipped: no model folder at {tmp_path / 'absent'}")


def load_algorithms_bench():
    spec = importlib.util.spec_from_file_location("bench_algorithms", REPO / "bench" / "bench_algorithms.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["gae", "grpo", "dr_grpo", "rloo", "reinforce_baseline", "reinforce", "dapo", "gspo",
                                  "cispo"])
def test_algorithms_bench_commands_are_accepted_by_step_3(name, tmp_path):
    """bench/bench_algorithms.py takes ~20 minutes and the demo's models: each row's quality commands (both rewards)
    and speed command are checked here against step 3's parser and flag checks, so the rows do not rot unseen."""
    from step3_rlhf_finetuning.main import parse_args, validate_flags

    bench = load_algorithms_bench()
    assert list(bench.RUNS)[-3:] == ["dapo", "gspo", "cispo"]
    base = bench.demo_step3(str(tmp_path / "demo"))
    commands = [bench.quality_command(base, name, reward, str(tmp_path / "q"), 0.1)
                for reward in ("reward model", "builtin_rule")]
    commands.append(bench.speed_command(name, "tiny-opt", str(tmp_path / "reward"), str(tmp_path), 8))
    for cmd in commands:
        assert cmd[1].endswith("step3_rlhf_finetuning/main.py")
        args = parse_args([str(a) for a in cmd[2:]])
        validate_flags(args)
        assert args.per_device_generation_batch_size * args.n_samples_per_prompt == 16  # 16 answers a step
        assert (args.advantage_estimator, args.policy_loss) == {
            "dapo": ("grpo", "ppo"), "gspo": ("grpo", "gspo"), "cispo": ("grpo", "cispo")}.get(name, (name, "ppo"))
        if name == "dapo":
            assert (args.cliprange, args.cliprange_high, args.dynamic_sampling, args.loss_agg) == \
                (0.2, 0.28, True, "token_mean")
