#!/usr/bin/env python
"""Overhead of ``--save_interval`` on step 3: checkpoint seconds vs PPO-step seconds.

    .venv/bin/python bench/bench_checkpoint.py                         # tiny-opt and small-opt, ~5 min on 2 cores
    .venv/bin/python bench/bench_checkpoint.py --models tiny-opt --steps 4

For each built-in model, step 3 runs ``--steps`` PPO steps with ``--save_interval 1``
(actor + critic engines with their optimizer states, the EMA actor, RNG and trainer
state, manifest with sha256, fsync, rename) against an untrained step-2 folder of the
same model, with ``--enable_ema``. A PPO step's time is its end-to-end latency
(``e2e_latency`` in ``metrics.jsonl``: generation + experience + training); a
checkpoint's time is what the run logs as ``saved checkpoint … (N s)``. The first step
and checkpoint (warm-up) are left out of the means. The overhead column is the share of
wall time checkpointing would take at ``--save_interval 1`` and at 10.
"""
from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C from the first second on: one line, exit 130 (utils/interrupt.py)
    from utils.interrupt import exit_quietly_on_ctrl_c

    exit_quietly_on_ctrl_c()

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
SAVED = re.compile(r"saved checkpoint (\S+) \(([\d.]+)s\)")


def make_critic(model: str, folder: str) -> None:
    from utils.model.critic import create_critic_model, save_reward_model
    from utils.model.model_utils import load_hf_tokenizer

    tokenizer = load_hf_tokenizer(model)
    save_reward_model(create_critic_model(model, tokenizer, None, 1), tokenizer, folder)


def folder_mib(path: str) -> float:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(path) for f in names) / 2 ** 20


def bench(model: str, steps: int, work: str, threads: int) -> dict:
    critic = os.path.join(work, f"{model}-reward")
    if not os.path.isdir(critic):
        make_critic(model, critic)
    out = os.path.join(work, f"{model}-step3")
    cmd = [sys.executable, os.path.join(REPO, "step3_rlhf_finetuning", "main.py"),
           "--actor_model_name_or_path", model, "--critic_model_name_or_path", critic,
           "--data_path", "builtin/preference", "--data_output_path", os.path.join(work, "data"),
           "--max_prompt_seq_len", "32", "--max_answer_seq_len", "32", "--per_device_generation_batch_size", "8",
           "--per_device_training_batch_size", "8", "--max_steps", str(steps), "--num_warmup_steps", "0",
           "--enable_ema", "--save_interval", "1", "--max_checkpoints", "2", "--output_dir", out,
           "--overwrite"]  # a reused --work folder holds the previous measurement
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    env.setdefault("DSCHAT_HOME", os.path.join(REPO, ".cache", "dschat"))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{model}: step 3 failed:\n{proc.stderr[-3000:]}")
    saves = [(path, float(sec)) for path, sec in SAVED.findall(proc.stdout + proc.stderr)]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if r["phase"] == "train"]
    step_s = statistics.mean(r["e2e_latency"] for r in rows[1:])
    ckpt_s = statistics.mean(sec for _, sec in saves[1:])
    return {"model": model, "step_s": step_s, "ckpt_s": ckpt_s, "size_mib": folder_mib(saves[-1][0]),
            "every_1": ckpt_s / (ckpt_s + step_s), "every_10": ckpt_s / (ckpt_s + 10 * step_s)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny-opt", "small-opt"])
    parser.add_argument("--steps", type=int, default=5, help="PPO steps (each followed by a checkpoint).")
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of the run.")
    parser.add_argument("--work", default=None, help="Scratch folder (default: a new temp folder).")
    args = parser.parse_args(argv)
    work = args.work or tempfile.mkdtemp(prefix="bench_checkpoint_")
    print(f"step 3, --save_interval 1, --enable_ema, {args.steps} PPO steps (first left out); work folder {work}")
    print("| model | PPO step (s) | checkpoint (s) | checkpoint size (MiB) | overhead, every step | every 10 steps |")
    print("|---|---|---|---|---|---|", flush=True)
    for model in args.models:
        r = bench(model, args.steps, work, args.threads)
        print(f"| {r['model']} | {r['step_s']:.2f} | {r['ckpt_s']:.2f} | {r['size_mib']:.1f} | "
              f"{100 * r['every_1']:.0f}% | {100 * r['every_10']:.1f}% |", flush=True)


if __name__ == "__main__":
    from utils.entrypoint import run_script

    run_script(main)
