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
