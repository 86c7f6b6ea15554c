#!/usr/bin/env python
"""Samples/s with 1 and 2 CPU ranks, and peak memory per rank, for every step.

    .venv/bin/python bench/bench_scaling.py                       # tiny-opt, ZeRO 0 and 3, ~5 min on 2 cores
    .venv/bin/python bench/bench_scaling.py --model small-opt --zero_stages 0 2 3 --steps 6

Each step runs with 1 rank (plain ``python``) and with ``--ranks`` ranks
(``torchrun --standalone``), ``OMP_NUM_THREADS=--threads`` (1) per rank, at each ZeRO stage,
on ``builtin/preference``. Samples/s is end to end: the samples of the optimizer
(step 3: PPO) steps after the first, divided by the time between their
``metrics.jsonl`` rows (rank 0 writes one row per step; the first step, which pays for
warm-up, is left out). A sample is a sequence for step 1, a (chosen, rejected) pair for
step 2 and a prompt (generation + training) for step 3. Peak memory is each rank's
peak resident set size (``getrusage``), read by a thin wrapper process around the step.
Step 3 trains the 1-rank step-1/step-2 outputs of the same run of this script.
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

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
STEPS = {
    "step1": "step1_supervised_finetuning/main.py",
    "step2_rm": "step2_reward_model_finetuning/main.py",
    "step2_dpo": "step2_dpo_finetuning/main.py",
    "step3": "step3_rlhf_finetuning/main.py",
}
WRAP = "--wrap-rank"  # internal: run one rank of a step and record its peak RSS


def step_args(step: str, model: str, micro: int, seq: int, steps: int, inputs: dict) -> list:
    """Flags for one benchmark run (without stage / output folders)."""
    common = ["--data_path", "builtin/preference", "--seed", "1234", "--max_steps", str(steps)]
    if step == "step3":
        return common + ["--actor_model_name_or_path", inputs["actor"], "--critic_model_name_or_path",
                         inputs["critic"], "--per_device_generation_batch_size", str(micro),
                         "--per_device_training_batch_size", str(micro), "--max_prompt_seq_len", str(seq // 2),
                         "--max_answer_seq_len", str(seq // 2), "--num_warmup_steps", "0"]
    args = common + ["--model_name_or_path", model, "--per_device_train_batch_size", str(micro),
                     "--per_device_eval_batch_size", str(micro), "--max_seq_len", str(seq)]
    return args + (["--eval_iters", "1"] if step != "step1" else [])


def stage_args(step: str, stage: int) -> list:
    if step == "step3":
        return ["--actor_zero_stage", str(stage), "--critic_zero_stage", str(stage)]
    return ["--zero_stage", str(stage)]


def run(step: str, args: list, ranks: int, work: str, threads: int) -> dict:
    """One run; returns samples/s, per-rank peak RSS (MiB), wall seconds, or an error."""
    import time

    rss_dir = tempfile.mkdtemp(prefix="rss_", dir=work)
    wrapper = [os.path.abspath(__file__), WRAP, rss_dir, os.path.join(REPO, STEPS[step])]
    if ranks == 1:
        cmd = [sys.executable] + wrapper
    else:
        cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone",
               "--nproc_per_node", str(ranks)] + wrapper
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1")
    env.setdefault("DSCHAT_HOME", os.path.join(REPO, ".cache", "dschat"))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(key, None)
    start = time.time()
    proc = subprocess.run(cmd + args, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.time() - start
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:200], "wall": wall}
    out_dir = args[args.index("--output_dir") + 1]
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        train = [row for row in map(json.loads, f) if row["phase"] == "train"]
    rss = []
    for name in sorted(os.listdir(rss_dir)):
        with open(os.path.join(rss_dir, name)) as f:
            rss.append(json.load(f)["peak_rss_mib"])
    return {"samples_per_sec": samples_per_sec(step, train, args, ranks), "rss_mib": rss, "wall": wall}


def samples_per_sec(step: str, train_rows: list, args: list, ranks: int) -> float | None:
    """Samples of steps 2..n over the time between the first and the last step's metrics row."""
    if len(train_rows) < 2:
        return None
    flag = "--per_device_generation_batch_size" if step == "step3" else "--per_device_train_batch_size"
    per_step = int(args[args.index(flag) + 1]) * ranks  # grad-accum / generation_batches are 1 here
    seconds = train_rows[-1]["time"] - train_rows[0]["time"]
    return per_step * (len(train_rows) - 1) / seconds if seconds > 0 else None


def wrap_rank(rss_dir: str, script: str, argv: list) -> None:
    """Run ``script`` as ``__main__`` in this process; record its peak RSS at exit (one file per rank). The steps'
    scripts import the project's packages only (never a module beside them), so ``sys.path`` stays as it is."""
    import atexit
    import resource
    import runpy

    def record():
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        with open(os.path.join(rss_dir, f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
            json.dump({"peak_rss_mib": round(peak_kib / 1024, 1)}, f)

    atexit.register(record)
    sys.argv = [script] + argv
    runpy.run_path(script, run_name="__main__")


def fmt(result: dict) -> tuple:
    if "error" in result:
        return "error", "-", result["error"]
    sps = result["samples_per_sec"]
    return (f"{sps:.1f}" if sps else "n/a"), " / ".join(f"{r:.0f}" for r in result["rss_mib"]), ""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-opt", help="Built-in model (tiny-opt, small-opt) or a folder.")
    parser.add_argument("--zero_stages", type=int, nargs="+", default=[0, 3], choices=[0, 1, 2, 3])
    parser.add_argument("--ranks", type=int, default=2, help="Ranks of the multi-rank runs.")
    parser.add_argument("--micro_batch", type=int, default=8, help="Per-rank micro batch (step 3: prompts).")
    parser.add_argument("--seq", type=int, default=64, help="max_seq_len (step 3: prompt + answer).")
    parser.add_argument("--steps", type=int, default=6, help="Optimizer (PPO) steps per run.")
    parser.add_argument("--only", nargs="*", default=list(STEPS), choices=list(STEPS), help="Steps to run.")
    parser.add_argument("--threads", type=int, default=1,
                        help="OMP_NUM_THREADS of every rank (1: n ranks use n cores; more threads than free cores "
                             "slow a rank down many times on a busy machine).")
    parser.add_argument("--work", default=None, help="Scratch folder (default: a new temp folder).")
    args = parser.parse_args(argv)

    work = args.work or tempfile.mkdtemp(prefix="bench_scaling_")
    os.makedirs(work, exist_ok=True)
    inputs = {"actor": os.path.join(work, "step1_r1_z0"), "critic": os.path.join(work, "step2_rm_r1_z0")}
    if "step3" in args.only:  # step 3 needs a step-1 actor and a step-2 critic
        for step, key in (("step1", "actor"), ("step2_rm", "critic")):
            if not os.path.isfile(os.path.join(inputs[key], "config.json")):
                prep = step_args(step, args.model, args.micro_batch, args.seq, 1, inputs)
                result = run(step, prep + stage_args(step, 0) + ["--data_output_path", os.path.join(work, "data"),
                                                                 "--output_dir", inputs[key]], 1, work, args.threads)
                if "error" in result:
                    sys.exit(f"preparing step 3's {key} failed: {result['error']}")

    print(f"model {args.model}, micro batch {args.micro_batch}, seq {args.seq}, {args.steps} steps, "
          f"{args.threads} thread(s) per rank; work folder {work}", flush=True)
    header = "| step | ZeRO | ranks | samples/s | speed-up | peak RSS per rank (MiB) | wall (s) |"
    print(header + "\n|---|---|---|---|---|---|---|", flush=True)
    for step in args.only:
        for stage in args.zero_stages:
            base = None
            for ranks in (1, args.ranks):
                name = f"{step}_r{ranks}_z{stage}_bench"
                run_args = (step_args(step, args.model, args.micro_batch, args.seq, args.steps, inputs)
                            + stage_args(step, stage) + ["--data_output_path", os.path.join(work, "data"),
                                                         "--output_dir", os.path.join(work, name), "--overwrite"])
                result = run(step, run_args, ranks, work, args.threads)
                sps, rss, error = fmt(result)
                if ranks == 1:
                    base = result.get("samples_per_sec")
                speedup = (f"{result['samples_per_sec'] / base:.2f}×" if ranks > 1 and base
                           and result.get("samples_per_sec") else "")
                line = f"| {step} | {stage} | {ranks} | {sps} | {speedup} | {rss} | {result['wall']:.0f} |"
                print(line + (f" {error}" if error else ""), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == WRAP:  # a rank of a measured run: the step script's own run_main
        wrap_rank(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        from utils.entrypoint import run_script

        run_script(main)
