"""Which ZeRO / offload / LoRA / dtype combinations are refused, and that every step refuses them up front.

Pure and fast: no DeepSpeed engine is started (each step's ``main`` raises before
``init_distributed``). The 2-rank runs of the accepted cells live in test_multiproc.py;
the whole matrix was run by ``scripts/gen_matrix_table.py --verify`` (docs/zero_matrix.md).
"""
import argparse
import importlib.util
import os

import pytest

from tests.conftest import REPO
from utils.compat import (Combination, all_combinations, check_zero_combination, expected_outcome, refusal)
from utils.errors import UserInputError

# (zero stage, offload, lora, dtype, accelerator) -> refusing rule (None = accepted), written out by hand
CASES = [
    (0, False, False, "fp32", "cpu", None),
    (0, False, True, "bf16", "cpu", None),
    (0, True, False, "fp32", "cpu", "offload-needs-zero"),
    (0, True, True, "bf16", "cpu", "offload-needs-zero"),
    (0, True, False, "fp16", "gpu", "offload-needs-zero"),
    (0, False, False, "fp16", "cpu", "fp16-needs-gpu"),
    (0, False, False, "fp16", "gpu", None),
    (1, True, False, "fp32", "cpu", None),
    (2, False, False, "fp16", "cpu", "fp16-needs-gpu"),
    (2, True, True, "bf16", "cpu", None),
    (2, True, False, "fp16", "gpu", None),
    (3, False, False, "fp32", "cpu", None),  # OPT + fp32 + ZeRO-3 with 2 ranks runs (checked by the sweep)
    (3, True, True, "fp32", "cpu", None),
    (3, True, True, "fp16", "cpu", "fp16-needs-gpu"),
    (3, True, True, "fp16", "gpu", None),
]


@pytest.mark.parametrize("stage,offload,lora,dtype,accelerator,rule", CASES)
def test_refusal_table(stage, offload, lora, dtype, accelerator, rule):
    found = refusal(stage, offload, lora, dtype, accelerator)
    assert (found and found[0]) == rule
    if rule == "offload-needs-zero":
        assert "--offload" in found[1] and "--zero_stage 0" in found[1]
    if rule == "fp16-needs-gpu":
        assert "--dtype bf16" in found[1]


def test_matrix_counts():
    cells = list(all_combinations())
    assert len(cells) == 4 * 4 * 2 * 2 * 3  # steps × stages × offload × LoRA × dtypes
    outcomes = [expected_outcome(c) for c in cells]
    assert outcomes.count("refused:fp16-needs-gpu") == 4 * 16  # every fp16 cell on CPU
    assert outcomes.count("refused:offload-needs-zero") == 4 * 4  # stage 0 + offload, fp32/bf16 × LoRA on/off
    assert expected_outcome(Combination("step3", 3, True, True, "bf16")) == "works"


def _ns(**kw):
    base = dict(zero_stage=2, offload=False, lora_dim=0, dtype=None)
    base.update(kw)
    return argparse.Namespace(**base)


def test_check_reads_args_and_default_dtype():
    check_zero_combination(_ns(), accelerator="cpu")  # default dtype on CPU: fp32
    with pytest.raises(UserInputError, match="fp16 needs a GPU"):
        check_zero_combination(_ns(dtype="fp16"), accelerator="cpu")
    check_zero_combination(_ns(dtype="fp16"), accelerator="gpu")
    with pytest.raises(UserInputError, match="--offload needs ZeRO stage 1, 2 or 3"):
        check_zero_combination(_ns(zero_stage=0, offload=True), accelerator="gpu")


def test_step3_checks_each_role_and_names_its_flag():
    args = argparse.Namespace(actor_zero_stage=3, critic_zero_stage=0, actor_lora_dim=0, critic_lora_dim=8,
                              offload=True, dtype="bf16")
    with pytest.raises(UserInputError, match="--critic_zero_stage 0"):
        check_zero_combination(args, accelerator="cpu")
    args.critic_zero_stage = 1
    check_zero_combination(args, accelerator="cpu")


def _load(rel_path):
    spec = importlib.util.spec_from_file_location(rel_path.replace("/", "_")[:-3], REPO / rel_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


STEP_ARGV = {
    "step1_supervised_finetuning/main.py": [],
    "step2_reward_model_finetuning/main.py": [],
    "step2_dpo_finetuning/main.py": [],
    "step3_rlhf_finetuning/main.py": ["--actor_model_name_or_path", "a", "--critic_model_name_or_path", "c",
                                      "--actor_zero_stage", "0", "--critic_zero_stage", "0"],
}


@pytest.mark.parametrize("script", sorted(STEP_ARGV))
def test_every_step_refuses_before_starting(script, tmp_path):
    """Each main raises the matrix's UserInputError before DeepSpeed or any data/model work."""
    module = _load(script)
    argv = STEP_ARGV[script] + ["--output_dir", str(tmp_path / "out"), "--data_output_path", str(tmp_path / "d")]
    with pytest.raises(UserInputError, match="--offload needs ZeRO stage 1, 2 or 3"):
        module.main(module.parse_args(argv + ["--offload", "--dtype", "bf16"]))
    with pytest.raises(UserInputError, match="fp16 needs a GPU"):
        module.main(module.parse_args(argv + ["--dtype", "fp16"]))
    assert not os.path.exists(tmp_path / "out")


def test_doc_is_generated_from_the_table():
    """docs/zero_matrix.md is exactly what the script renders; the recorded 2-rank sweep agrees with the table."""
    gen = _load("scripts/gen_matrix_table.py")
    sweep = gen.read_sweep()
    with open(gen.DOC) as f:
        assert f.read() == gen.render(gen.tested_cells(), sweep), \
            "docs/zero_matrix.md is stale: run .venv/bin/python scripts/gen_matrix_table.py"
    with open(gen.README) as f:
        assert gen.render_readme_section(gen.tested_cells(), sweep) in f.read(), \
            "the README's ZeRO matrix is stale: run .venv/bin/python scripts/gen_matrix_table.py"
    cells = sweep.get("cells", {})
    wrong = {k: v for k, v in cells.items() if v["observed"] != expected_outcome(_combo(k))}
    assert not wrong, f"the sweep saw other outcomes than the table says: {wrong}"


def _combo(key: str) -> Combination:
    step, stage, offload, lora, dtype = key.split("|")
    return Combination(step, int(stage[1:]), offload == "offload", lora == "lora", dtype)
