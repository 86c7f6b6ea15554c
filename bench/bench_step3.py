#!/usr/bin/env python
"""Step-3 (PPO) throughput: samples/s, generation tokens/s and training TFLOPs.

    .venv/bin/python bench/bench_step3.py                          # tiny-opt and small-opt, ~3-6 min on 2 cores
    .venv/bin/python bench/bench_step3.py --models tiny-opt --steps 5 --batch 16
    .venv/bin/python bench/bench_step3.py --models tiny-llama --zero_stages 0 3   # ZeRO-3's generation vs ZeRO-0's

With ``--zero_stages 0 3`` each model runs at both stages (actor and critic) and the table adds ZeRO-3's
generation time over ZeRO-0's (issue 55's target: ≤ 1.5; ZeRO-3 generates from a whole-weight copy gathered once
per rollout, the log line ``generation: ZeRO-3 actor: ...`` says so). OPT + fp32 + ZeRO-3 fails inside DeepSpeed
on one CPU rank: compare stages on a Llama-style model there.

For each built-in model the actor is the model itself and the critic/reward model is a
``RewardModel`` on the same backbone saved as a step-2 folder (weights do not matter
for speed; a random actor rarely emits EOS, so every answer has the full length).
``step3_rlhf_finetuning/main.py`` then runs ``1 + --steps`` PPO steps with greedy
generation (one rank, ``--zero_stages``, ``--dtype``); the first step pays for warm-up and is left
out. Numbers are the means of the other steps' ``metrics.jsonl`` rows, computed by the
trainer exactly as its throughput lines (DeepSpeed-Chat's formulas):

* samples/s   = prompts / (experience time + training time)
* gen tok/s   = prompts × generated tokens / generation time
* train TFLOPs = (actor + critic training FLOPs) / training time
"""
from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C from the first second on: one line, exit 130 (utils/interrupt.py)
    from utils.interrupt import exit_quietly_on_ctrl_c

    exit_quietly_on_ctrl_c()

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
KEYS = ("samples_per_sec", "gen_tokens_per_sec", "train_tflops", "gen_tflops", "e2e_latency")


def make_critic(model: str, out_dir: str) -> str:
    """A step-2 folder holding a RewardModel on ``model``'s backbone."""
    from utils.model.critic import create_critic_model, save_reward_model
    from utils.model.model_utils import load_hf_tokenizer

    tokenizer = load_hf_tokenizer(model)
    save_reward_model(create_critic_model(model, tokenizer, None, num_padding_at_beginning=1), tokenizer, out_dir)
    return out_dir


def run_model(model: str, args, work: str, stage: int = 0) -> dict:
    """Run step 3 on ``model`` at ZeRO ``stage``; the mean metrics of the steps after the first, and the log's
    generation lines."""
    from utils.model.tiny import resolve_model_path

    actor = resolve_model_path(model)
    critic = os.path.join(work, f"{model}-critic")
    if not os.path.isdir(critic):
        make_critic(model, critic)
    out = os.path.join(work, f"{model}-z{stage}-step3")
    cmd = [sys.executable, os.path.join(REPO, "step3_rlhf_finetuning/main.py"),
           "--actor_model_name_or_path", actor, "--critic_model_name_or_path", critic,
           "--data_path", "builtin/preference", "--data_output_path", os.path.join(work, "data"),
           "--output_dir", out, "--overwrite", "--max_steps", str(args.steps + 1), "--num_warmup_steps", "0",
           "--per_device_generation_batch_size", str(args.batch), "--per_device_training_batch_size", str(args.batch),
           "--max_prompt_seq_len", str(args.prompt_len), "--max_answer_seq_len", str(args.answer_len),
           "--dtype", args.dtype, "--actor_learning_rate", "1e-5", "--critic_learning_rate", "1e-5",
           "--actor_zero_stage", str(stage), "--critic_zero_stage", str(stage),
           "--generation_backend", args.generation_backend,
           *(["--generation_dtype", args.generation_dtype] if args.generation_dtype else [])]
    start = time.time()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"step 3 on {model} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if '"phase": "train"' in line][1:]
    result = {k: sum(r[k] for r in rows) / len(rows) for k in KEYS}
    result.update(steps=len(rows), wall=time.time() - start,
                  generation=[line.split("generation: ", 1)[1] for line in (proc.stdout + proc.stderr).splitlines()
                              if "generation: " in line])
    return result


def zero3_over_zero0(results: dict, model: str) -> float | None:
    """ZeRO-3's generation time over ZeRO-0's for ``model`` (the ratio of their generation tokens/s), or None."""
    z0, z3 = results.get((model, 0)), results.get((model, 3))
    if not (z0 and z3 and z3["gen_tokens_per_sec"]):
        return None
    return z0["gen_tokens_per_sec"] / z3["gen_tokens_per_sec"]


def render(results: dict, args) -> str:
    """``results``: (model, ZeRO stage) → :func:`run_model`'s numbers."""
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    copy = f", --generation_dtype {args.generation_dtype}" if args.generation_dtype else ""
    lines = [f"step 3 (PPO) on {device}, 1 rank, --dtype {args.dtype}, --generation_backend "
             f"{args.generation_backend}{copy}: {args.batch} prompts of {args.prompt_len} + {args.answer_len} "
             f"tokens per step, mean of {args.steps} steps after 1 warm-up",
             "",
             "| model | ZeRO | samples/s | generation tokens/s | training TFLOPs | generation TFLOPs | s/step |",
             "|---|---|---|---|---|---|---|"]
    for (model, stage), r in results.items():
        lines.append(f"| {model} | {stage} | {r['samples_per_sec']:.2f} | {r['gen_tokens_per_sec']:.0f} | "
                     f"{r['train_tflops']:.4f} | {r['gen_tflops']:.4f} | {r['e2e_latency']:.2f} |")
    for model in dict.fromkeys(model for model, _ in results):
        ratio = zero3_over_zero0(results, model)
        if ratio is not None:
            lines.append(f"\n{model}: ZeRO-3 generation takes {ratio:.2f}× ZeRO-0's time (target ≤ 1.5); its path: "
                         + "; ".join(results[(model, 3)]["generation"]))
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny-opt", "small-opt"])
    parser.add_argument("--steps", type=int, default=3, help="Measured PPO steps (after one warm-up step).")
    parser.add_argument("--batch", type=int, default=8, help="Prompts per step (generation = training batch).")
    parser.add_argument("--prompt_len", type=int, default=32)
    parser.add_argument("--answer_len", type=int, default=32)
    parser.add_argument("--zero_stages", type=int, nargs="+", default=[0], choices=[0, 1, 2, 3],
                        help="ZeRO stages of the actor and critic, one run each (0 3: ZeRO-3's generation vs "
                             "ZeRO-0's).")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--generation_backend", default="auto", choices=["auto", "cuda-graph", "static", "hf"])
    parser.add_argument("--generation_dtype", default=None, choices=["bf16"])
    args = parser.parse_args()
    os.environ.setdefault("DSCHAT_HOME", os.path.join(REPO, ".cache", "dschat"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="bench_step3_") as work:
        results = {(model, stage): run_model(model, args, work, stage) for model in args.models
                   for stage in args.zero_stages}
    print(render(results, args))


if __name__ == "__main__":
    from utils.entrypoint import run_script

    run_script(main)
