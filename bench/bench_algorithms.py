#!/usr/bin/env python
"""PPO against the critic-free estimators (GRPO, Dr. GRPO, RLOO, REINFORCE++-baseline, REINFORCE++) and the policy
losses of issue 32 (DAPO, GSPO, CISPO, each on GRPO): what each does to the model, how fast it runs and how much
memory it takes.

    .venv/bin/python bench/bench_algorithms.py --demo_dir output          # after `make demo`, ~20 min on 2 cores
    .venv/bin/python bench/bench_algorithms.py --demo_dir output --skip_speed
    .venv/bin/python bench/bench_algorithms.py --demo_dir output --runs gae grpo dapo gspo cispo

Two tables.

1. **Quality, on the built-in task.** The demo's step-1 actor and step-2 reward model (``--demo_dir``, a
   ``train.py --demo`` output) and the demo's step-3 flags (same seed, sampling, learning rate, 80 steps of
   16 answers: PPO answers 16 prompts once, the group estimators 4 prompts 4 times) but DeepSpeed-Chat's KL
   coefficient, 0.1 (``--kl_ctl``; the demo's 1.0 shields its learned reward model's blind spot, and would
   hold back every estimator here); each estimator once with the learned reward model and once with the
   rule as the reward (``--reward_fn builtin_rule``). Judged by the held-out check (:mod:`utils.heldout`),
   never by the reward: the rule-score gain over the step-1 actor, greedy and sampled.
2. **Speed and memory, on small-opt-sized models** (50 M parameters; random weights: speed does not depend on
   them). Actor and reward model ``small-opt``; each estimator with the reward model as its reward, so the
   only difference is the critic (PPO) or none; 16 answers a step, prompt 32 + answer 24 tokens, one CPU
   process. samples/s is the mean of the throughput rows after the first step; peak RSS is the step-3
   process's maximum resident set (``wait4``).

The rows (:data:`RUNS`): each estimator with PPO's loss as before, and GRPO with DAPO's pieces (clip-higher
0.2 / 0.28, dynamic sampling, the token-mean loss), with GSPO's loss and with CISPO's loss (each at its own default
ε). Dynamic sampling draws more prompt batches a step when groups all score the same: its samples/s counts every
answer generated.

Targets (issue 22, CPU): every critic-free estimator ≥ 1.3× PPO's samples/s and ≥ 25 % lower peak RSS on the
small-opt-sized models; GRPO with ``builtin_rule`` raises the held-out rule score by ≥ 0.10. The policy-loss rows have
no target: they are measured beside GRPO.
"""
from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C from the first second on: one line, exit 130 (utils/interrupt.py)
    from utils.interrupt import exit_quietly_on_ctrl_c

    exit_quietly_on_ctrl_c()

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

from step3_rlhf_finetuning.algorithms import ESTIMATORS  # the specs are torch-free

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))

GROUP = 4  # answers per prompt of the group estimators (and of reinforce, for the same batch of 16)
# row name: (estimator, its step-3 flags besides the estimator's)
RUNS = {**{name: (name, []) for name in ESTIMATORS},
        "dapo": ("grpo", ["--cliprange", "0.2", "--cliprange_high", "0.28", "--dynamic_sampling", "--loss_agg",
                          "token_mean"]),
        "gspo": ("grpo", ["--policy_loss", "gspo"]),
        "cispo": ("grpo", ["--policy_loss", "cispo"])}


def estimator_flags(estimator: str, answers: int) -> list:
    """16 answers a step for every estimator: PPO 16 prompts × 1, the others 4 prompts × 4."""
    if estimator == "gae":
        return ["--per_device_generation_batch_size", str(answers)]
    return ["--advantage_estimator", estimator, "--n_samples_per_prompt", str(GROUP),
            "--per_device_generation_batch_size", str(answers // GROUP)]


def run_flags(name: str, answers: int) -> list:
    """The step-3 flags of row ``name`` of :data:`RUNS`."""
    estimator, extra = RUNS[name]
    return estimator_flags(estimator, answers) + extra


def run(cmd: list, log_path: str) -> dict:
    """Run ``cmd``; its wall time and peak RSS (MiB, from ``wait4``). Exits on failure."""
    start = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2")))
        _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {shlex.join(cmd)}\n  log: {log_path}")
    return {"wall": time.time() - start, "peak_rss_mib": usage.ru_maxrss / 1024}


def train_rows(out: str) -> list:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r.get("phase") == "train"]


# --------------------------------------------------------------------------- 1. quality

def demo_step3(demo_dir: str) -> list:
    """The demo's step-3 command (train.py's plan for ``--demo --output-dir demo_dir --step 3``), without its
    estimator-specific flags."""
    import train

    args = train.parse_args(["--demo", "--output-dir", demo_dir, "--step", "3"])
    return train.make_plan(args, gpus=0)[-1].cmd


def without(cmd: list, names) -> list:
    import train

    return train.drop_flags(cmd, [n.lstrip("-") for n in names])


def quality_command(base: list, name: str, reward: str, out: str, kl_ctl: float) -> list:
    """The demo's step-3 command ``base`` turned into row ``name``'s with ``reward`` ("reward model" or
    "builtin_rule")."""
    from step3_rlhf_finetuning.config import CRITIC_ONLY_FLAGS

    estimator = RUNS[name][0]
    cmd = without(base, ["--output_dir", "--per_device_generation_batch_size"])
    if not ESTIMATORS[estimator].critic:
        cmd = without(cmd, CRITIC_ONLY_FLAGS)
        if reward != "reward model":  # a function alone: no critic, no reward model
            cmd = without(cmd, ["--critic_model_name_or_path"])
    cmd += run_flags(name, 16) + ["--output_dir", out, "--overwrite", "--kl_ctl", str(kl_ctl)]
    if reward != "reward model":
        cmd += ["--reward_fn", "builtin_rule"]
    return cmd


def quality_runs(demo_dir: str, work: str, kl_ctl: float, names) -> list:
    from utils.heldout import heldout_check

    import train

    base = demo_step3(demo_dir)
    sampling = train.step3_sampling(train.parse_args(["--demo", "--step", "3"]))
    sft = heldout_check({1: os.path.join(demo_dir, "actor-models", "tiny-llama")}, None, "builtin/demonstrations",
                        sampling)["actors"]["1"]
    rows = []
    for reward in ("reward model", "builtin_rule"):
        for estimator in names:
            out = os.path.join(work, f"quality-{estimator}-{reward.replace(' ', '_')}")
            cmd = quality_command(base, estimator, reward, out, kl_ctl)
            print(f"quality: {estimator} with {reward} ...", flush=True)
            stats = run(cmd, out + ".log")
            actor = heldout_check({3: os.path.join(out, "actor")}, None, "builtin/demonstrations",
                                  sampling)["actors"]["3"]
            samples = [r["samples_per_sec"] for r in train_rows(out)[1:]]
            rows.append({"estimator": estimator, "reward": reward, **stats,
                         "samples_per_sec": sum(samples) / len(samples),
                         "gain_greedy": actor["rule_score"] - sft["rule_score"],
                         "gain_sampled": actor["sampled"]["rule_score"] - sft["sampled"]["rule_score"],
                         "greedy": actor["rule_score"], "sampled": actor["sampled"]["rule_score"]})
    return [{"sft": {"greedy": sft["rule_score"], "sampled": sft["sampled"]["rule_score"]}}] + rows


# --------------------------------------------------------------------------- 2. speed and memory

def speed_command(name: str, model_path: str, reward: str, work: str, steps: int) -> list:
    """Row ``name``'s step-3 command of the speed table (``reward``: the step-2 folder, the reward model)."""
    cmd = [sys.executable, os.path.join(REPO, "step3_rlhf_finetuning/main.py"),
           "--actor_model_name_or_path", model_path, "--critic_model_name_or_path", reward,
           "--data_path", "builtin/preference", "--data_output_path", os.path.join(work, "data"),
           "--output_dir", os.path.join(work, f"speed-{name}"), "--overwrite", "--max_steps", str(steps + 1),
           "--num_warmup_steps", "0", "--per_device_training_batch_size", "16", "--max_prompt_seq_len", "32",
           "--max_answer_seq_len", "24", "--do_sample", "--dtype", "fp32", "--actor_learning_rate", "1e-5",
           *run_flags(name, 16)]
    if ESTIMATORS[RUNS[name][0]].critic:
        cmd += ["--critic_learning_rate", "1e-5"]
    return cmd


def speed_runs(work: str, steps: int, model: str, names) -> list:
    from utils.model.critic import create_critic_model, save_reward_model
    from utils.model.model_utils import load_hf_tokenizer
    from utils.model.tiny import resolve_model_path

    tokenizer = load_hf_tokenizer(model)
    reward = os.path.join(work, f"{model}-reward")
    if not os.path.isdir(reward):
        save_reward_model(create_critic_model(model, tokenizer, None, num_padding_at_beginning=1), tokenizer, reward)
    rows = []
    for estimator in names:
        out = os.path.join(work, f"speed-{estimator}")
        cmd = speed_command(estimator, resolve_model_path(model), reward, work, steps)
        print(f"speed: {estimator} on {model} ...", flush=True)
        stats = run(cmd, out + ".log")
        later = train_rows(out)[1:]
        rows.append({"estimator": estimator, **stats,
                     "samples_per_sec": sum(r["samples_per_sec"] for r in later) / len(later),
                     "step_seconds": sum(r["e2e_latency"] for r in later) / len(later)})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--demo_dir", default=os.path.join(REPO, "output"),
                        help="A `train.py --demo` output folder (its step-1 actor and step-2 reward model).")
    parser.add_argument("--work", default=None, help="Output folder (default: a new temporary one).")
    parser.add_argument("--kl_ctl", type=float, default=0.1, help="KL coefficient of the quality runs.")
    parser.add_argument("--skip_quality", action="store_true")
    parser.add_argument("--skip_speed", action="store_true")
    parser.add_argument("--speed_model", default="small-opt", help="Actor and reward model of the speed table.")
    parser.add_argument("--speed_steps", type=int, default=8, help="Timed RL steps (after one warm-up step).")
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS),
                        help="The rows to run (default: all; the speed table's first row is its baseline, gae).")
    parser.add_argument("--json", default=None, help="Also write the results here.")
    args = parser.parse_args(argv)
    names = ["gae"] + [name for name in args.runs if name != "gae"]  # PPO is every table's reference
    work = args.work or tempfile.mkdtemp(prefix="bench-algorithms-")
    os.makedirs(work, exist_ok=True)
    results, ok = {}, True

    if not args.skip_quality:
        sft, *rows = quality_runs(os.path.abspath(args.demo_dir), work, args.kl_ctl, names)
        results["quality"] = {"sft": sft["sft"], "runs": rows}
        print(f"\nheld-out rule score gain over the step-1 actor (greedy {sft['sft']['greedy']:.3f}, sampled "
              f"{sft['sft']['sampled']:.3f}); the demo's actor, reward model and step-3 flags with --kl_ctl {args.kl_ctl}, "
              "80 steps of 16 answers")
        print("| estimator | reward | gain greedy | gain sampled | rule score greedy / sampled | samples/s | "
              "peak RSS (MiB) | wall (s) |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['estimator']} | {r['reward']} | {r['gain_greedy']:+.3f} | {r['gain_sampled']:+.3f} | "
                  f"{r['greedy']:.3f} / {r['sampled']:.3f} | {r['samples_per_sec']:.1f} | {r['peak_rss_mib']:.0f} | "
                  f"{r['wall']:.0f} |")
        grpo_rule = next((r for r in rows if r["estimator"] == "grpo" and r["reward"] == "builtin_rule"), None)
        if grpo_rule is not None:
            target = grpo_rule["gain_greedy"] >= 0.10 and grpo_rule["gain_sampled"] >= 0.10
            ok = ok and target
            print(f"target: GRPO with builtin_rule gains ≥ 0.10 greedy and sampled: {'ok' if target else 'FAIL'}")

    if not args.skip_speed:
        rows = speed_runs(work, args.speed_steps, args.speed_model, names)
        results["speed"] = rows
        ppo = rows[0]
        print(f"\nspeed and memory on {args.speed_model}-sized actor and reward model (16 answers a step, prompt 32 + "
              f"answer 24, fp32, one CPU process, mean of {args.speed_steps} steps after a warm-up step)")
        print("| estimator | samples/s | × PPO | s per step | peak RSS (MiB) | vs PPO | wall (s) | target |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            speedup, rss = r["samples_per_sec"] / ppo["samples_per_sec"], r["peak_rss_mib"] / ppo["peak_rss_mib"] - 1
            target = "" if r is ppo or r["estimator"] not in ESTIMATORS else \
                ("ok" if speedup >= 1.3 and rss <= -0.25 else "FAIL")
            ok = ok and target != "FAIL"
            print(f"| {r['estimator']} | {r['samples_per_sec']:.2f} | {speedup:.2f}× | {r['step_seconds']:.2f} | "
                  f"{r['peak_rss_mib']:.0f} | {rss:+.0%} | {r['wall']:.0f} | {target} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(f"\nruns kept in {work}")
    return 0 if ok else 1


if __name__ == "__main__":
    from utils.entrypoint import run_script

    run_script(main)
