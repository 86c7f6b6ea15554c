"""Which ZeRO stage × offload × LoRA × dtype combinations the steps accept.

Every step calls :func:`check_zero_combination` right after its argument checks,
so a combination DeepSpeed (or the hardware) cannot run is refused up front with
one clear :class:`UserInputError` instead of a crash deep inside DeepSpeed.

The same rules render the table in ``docs/zero_matrix.md``
(``scripts/gen_matrix_table.py``; ``--verify`` runs every combination with two
CPU ranks and records what happened) and drive ``tests/test_zero_matrix.py``;
:data:`TWO_RANK_CELLS` lists the cells ``tests/test_multiproc.py`` runs with two ranks.

Pure module: no torch / DeepSpeed imports at load time.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from utils.arguments import DTYPES, ZERO_STAGES
from utils.errors import UserInputError

# step id -> entry point (relative to the repository root)
STEPS = {
    "step1": "step1_supervised_finetuning/main.py",
    "step2_rm": "step2_reward_model_finetuning/main.py",
    "step2_dpo": "step2_dpo_finetuning/main.py",
    "step3": "step3_rlhf_finetuning/main.py",
}
OFFLOAD = (False, True)
LORA = (False, True)
ACCELERATORS = ("cpu", "gpu")


@dataclass(frozen=True)
class Combination:
    """One cell of the matrix: a step run at one ZeRO stage / offload / LoRA / dtype."""

    step: str
    zero_stage: int
    offload: bool
    lora: bool
    dtype: str

    @property
    def key(self) -> str:
        """Stable text id, e.g. ``step1|z3|offload|lora|bf16`` (used by the doc and the sweep)."""
        return "|".join([self.step, f"z{self.zero_stage}", "offload" if self.offload else "-",
                         "lora" if self.lora else "-", self.dtype])

    def flags(self) -> List[str]:
        """The step's command-line flags for this cell (step 3: the same stage / LoRA for actor and critic).

        LoRA cells train rank-4 adapters only (``--lora_dim 4 --only_optimize_lora``). Used by the
        sweep (``scripts/gen_matrix_table.py``) and the 2-rank tests (``tests/test_multiproc.py``).
        """
        if self.step == "step3":
            flags = ["--actor_zero_stage", str(self.zero_stage), "--critic_zero_stage", str(self.zero_stage)]
            if self.lora:
                flags += ["--actor_lora_dim", "4", "--critic_lora_dim", "4", "--only_optimize_lora"]
        else:
            flags = ["--zero_stage", str(self.zero_stage)]
            if self.lora:
                flags += ["--lora_dim", "4", "--only_optimize_lora"]
        if self.offload:
            flags.append("--offload")
        return flags + ["--dtype", self.dtype]


# The cells tests/test_multiproc.py runs with 2 ranks, and the test that checks each (the "T" marks of
# docs/zero_matrix.md; test_multiproc.py checks that its runs are exactly these).
TWO_RANK_CELLS: Dict[Combination, str] = {
    Combination("step1", 2, False, False, "fp32"): "test_step1_two_ranks",
    Combination("step1", 3, False, True, "bf16"): "test_step1_two_ranks",
    Combination("step2_rm", 2, False, False, "fp32"): "test_reward_model_two_ranks",
    Combination("step2_rm", 3, False, True, "bf16"): "test_reward_model_two_ranks",
    Combination("step2_dpo", 2, False, False, "fp32"): "test_dpo_two_ranks",
    Combination("step2_dpo", 3, False, False, "bf16"): "test_dpo_two_ranks",
    Combination("step3", 2, False, False, "fp32"): "test_step3_two_ranks",
    Combination("step3", 3, False, False, "fp32"): "test_step3_two_ranks",
}


@dataclass(frozen=True)
class Rule:
    """A refusal: ``applies(stage, offload, lora, dtype, accelerator)`` → refuse with ``message``."""

    rule_id: str
    applies: Callable[[int, bool, bool, str, str], bool]
    message: str  # formatted with stage_flag, stage, accelerator


RULES: Tuple[Rule, ...] = (
    Rule("fp16-needs-gpu",
         lambda stage, offload, lora, dtype, acc: dtype == "fp16" and acc == "cpu",
         "--dtype fp16 needs a GPU (DeepSpeed's fp16 optimizer and loss scaling do not run on CPU); "
         "use --dtype bf16 or --dtype fp32"),
    Rule("offload-needs-zero",
         lambda stage, offload, lora, dtype, acc: offload and stage == 0,
         "--offload needs ZeRO stage 1, 2 or 3 (got {stage_flag} {stage}): DeepSpeed offloads only "
         "ZeRO-partitioned optimizer state (and parameters at stage 3); at stage 0 it ignores the offload "
         "setting, and DeepSpeedCPUAdam then rejects GPU parameters. Use {stage_flag} 1/2/3 with --offload, "
         "or drop --offload"),
)


def refusal(zero_stage: int, offload: bool, lora: bool, dtype: str, accelerator: str = "cpu",
            stage_flag: str = "--zero_stage") -> Optional[Tuple[str, str]]:
    """``(rule_id, message)`` of the first rule refusing this combination, or None when it is accepted."""
    if accelerator not in ACCELERATORS:
        raise ValueError(f"accelerator must be one of {ACCELERATORS}, got {accelerator!r}")
    for rule in RULES:
        if rule.applies(zero_stage, offload, lora, dtype, accelerator):
            return rule.rule_id, rule.message.format(stage_flag=stage_flag, stage=zero_stage,
                                                     accelerator=accelerator)
    return None


def expected_outcome(combo: Combination, accelerator: str = "cpu") -> str:
    """``"works"`` or ``"refused:<rule_id>"`` for one matrix cell."""
    found = refusal(combo.zero_stage, combo.offload, combo.lora, combo.dtype, accelerator)
    return "works" if found is None else f"refused:{found[0]}"


def all_combinations(steps=tuple(STEPS)) -> Iterator[Combination]:
    """Every matrix cell, in table order (step, stage, offload, LoRA, dtype)."""
    for step, stage, offload, lora, dtype in itertools.product(steps, ZERO_STAGES, OFFLOAD, LORA, DTYPES):
        yield Combination(step, stage, offload, lora, dtype)


def _roles(args) -> List[Tuple[str, int, bool]]:
    """``(stage flag, stage, lora on)`` of each trained model: one for steps 1/2, actor and critic for step 3."""
    if hasattr(args, "actor_zero_stage"):
        return [(f"--{role}_zero_stage", getattr(args, f"{role}_zero_stage"),
                 getattr(args, f"{role}_lora_dim", 0) > 0) for role in ("actor", "critic")]
    return [("--zero_stage", args.zero_stage, getattr(args, "lora_dim", 0) > 0)]


def check_zero_combination(args, accelerator: str | None = None) -> None:
    """Refuse (``UserInputError``) a ZeRO / offload / LoRA / dtype combination that cannot run.

    Reads ``--zero_stage`` (step 3: ``--actor_zero_stage`` and ``--critic_zero_stage``),
    ``--offload``, ``--lora_dim`` (step 3: per role) and ``--dtype`` (its default when
    unset: fp32 on CPU, fp16 on a GPU; ``--torch_autocast`` needs bf16). ``accelerator`` defaults to DeepSpeed's.
    Call before ``init_distributed`` so every rank refuses before any collective.
    """
    if accelerator is None:
        from utils.runtime import on_cpu

        accelerator = "cpu" if on_cpu() else "gpu"
    dtype = args.dtype or ("fp32" if accelerator == "cpu" else "fp16")
    if getattr(args, "torch_autocast", False) and dtype != "bf16":
        raise UserInputError(f"--torch_autocast runs the forward passes in bf16 over fp32 weights: it needs "
                             f"--dtype bf16 (got {dtype})")
    for stage_flag, stage, lora in _roles(args):
        found = refusal(stage, bool(getattr(args, "offload", False)), lora, dtype, accelerator, stage_flag)
        if found is not None:
            raise UserInputError(found[1])
