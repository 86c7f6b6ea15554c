#!/usr/bin/env python
"""This project against TRL, the trainer a user would pick instead: the same model, data and settings, side by side.

    make bench-peers                                           # all four trainers, ~35 min on 2 CPU cores
    .venv/bin/python bench/bench_peers.py --trainers grpo --steps 8
    .venv/bin/python bench/bench_peers.py --model /path/to/smollm2 --peer-venv /tmp/peers

Trainers (ours → TRL's):

* ``grpo``: step 3 ``--advantage_estimator grpo --reward_fn gsm8k`` → ``GRPOTrainer`` (``loss_type="grpo"``): the first
  256 GSM8K train questions in the model's chat template, 4 prompts × 4 answers a step, 48 new tokens sampled at
  temperature 1, β 0.04 (k3, in the loss), lr 1e-6 constant, one optimizer step per rollout;
* ``sft``: step 1 → ``SFTTrainer``; ``rm``: step 2 → ``RewardTrainer``; ``dpo``: DPO → ``DPOTrainer`` (β 0.1): HH-RLHF's
  harmless-base pairs (``../shared/data/hh-rlhf``) in the chat template, 512 tokens at most, 4 rows (pairs) a step,
  the loss on the answer turn.

Everything fp32 on the CPU, no gradient checkpointing (TRL's default is on: turned off on both sides), one process.
TRL runs in its own virtual environment (``--peer-venv``, built on first use with a pinned TRL and this
environment's torch and transformers; never a dependency of the project) through ``bench/peers/trl_run.py``.

Each trainer's two runs are separate processes, one after the other, ``--steps`` optimizer steps each. Per run:
seconds per step (the median wall time between consecutive step ends, after ``--warmup`` steps), samples/s and
tokens/s over those steps, real (not padding) tokens per step, and the process's peak RSS (``wait4``). The model
is ``--model``, else ``$SMOLLM2_DIR``, else ``../smollm2`` (``make smollm2`` (scripts/make_smollm2.py) builds it
offline); without it the bench says so in one line and exits 0.
"""
from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C from the first second on: one line, exit 130 (utils/interrupt.py)
    from utils.interrupt import exit_quietly_on_ctrl_c

    exit_quietly_on_ctrl_c()

import argparse
import datetime
import gzip
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
SHARED = os.path.join(os.path.dirname(REPO), "shared", "data")
DEFAULT_MODEL = os.environ.get("SMOLLM2_DIR") or os.path.join(os.path.dirname(REPO), "smollm2")
DEFAULT_VENV = os.path.join(REPO, ".venv-peers")
TRL_VERSION = "1.16.0"
TRAINERS = ("grpo", "sft", "rm", "dpo")
NAMES = {"grpo": ("step 3 --advantage_estimator grpo", "GRPOTrainer"), "sft": ("step 1", "SFTTrainer"),
         "rm": ("step 2", "RewardTrainer"), "dpo": ("step2_dpo_finetuning", "DPOTrainer")}


# --------------------------------------------------------------------------- the peer environment

def ensure_peer_env(venv: str, trl_version: str, log=print) -> str:
    """The peer environment's python: a virtual environment with ``trl==trl_version`` and this environment's torch
    and transformers (pinned, so both sides run the same kernels and models), built once (a stamp file)."""
    import torch
    import transformers

    python = os.path.join(venv, "bin", "python")
    stamp = os.path.join(venv, f".bench-peers-trl-{trl_version}-torch-{torch.__version__.split('+')[0]}"
                               f"-transformers-{transformers.__version__}")
    if os.path.exists(stamp):
        return python
    log(f"building the peer environment {venv} (trl=={trl_version}; once)")
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    packages = [f"torch=={torch.__version__.split('+')[0]}", f"trl=={trl_version}",
                f"transformers=={transformers.__version__}", "datasets", "accelerate"]
    subprocess.run([python, "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", *packages], check=True)
    open(stamp, "w").close()
    return python


def peer_versions(python: str) -> dict:
    code = "import trl, transformers, torch; print(trl.__version__, transformers.__version__, torch.__version__)"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    return dict(zip(("trl", "transformers", "torch"), out))


# --------------------------------------------------------------------------- data

def write_data(work: str, gsm8k_rows: int, hh_rows: int, hh_eval_rows: int) -> dict:
    """The bench's files under ``work``: GSM8K questions (both sides read the same jsonl), HH-RLHF pairs as
    DeepSpeed-Chat text for us (a folder with train/eval files) and the same rows as chat messages for TRL."""
    from utils.data.local_datasets import LocalPathDataset

    os.makedirs(work, exist_ok=True)
    gsm8k = os.path.join(work, "gsm8k.jsonl")
    with open(os.path.join(SHARED, "gsm8k", "train.jsonl")) as src, open(gsm8k, "w") as out:
        out.writelines(line for _, line in zip(range(gsm8k_rows), src))
    with gzip.open(os.path.join(SHARED, "hh-rlhf", "harmless-base-test.jsonl.gz"), "rt") as f:
        rows = [json.loads(line) for line in f]
    hh = os.path.join(work, "hh")
    os.makedirs(hh, exist_ok=True)
    for name, part in (("train", rows[:hh_rows]), ("eval", rows[hh_rows:hh_rows + hh_eval_rows])):
        with open(os.path.join(hh, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
    raw = LocalPathDataset(os.path.join(work, "cache"), 1234, -1, hh)
    trl_rows = []
    for sample in raw.get_train_data():
        prompt, chosen, rejected = raw.get_prompt_messages(sample), raw.get_chosen(sample), raw.get_rejected(sample)
        if prompt and chosen and rejected:
            trl_rows.append({"prompt": prompt, "chosen": chosen.strip(), "rejected": rejected.strip()})
    hh_trl = os.path.join(work, "hh_trl.jsonl")
    with open(hh_trl, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in trl_rows)
    return {"gsm8k": gsm8k, "hh": hh, "hh_trl": hh_trl}


# --------------------------------------------------------------------------- commands

def our_command(trainer: str, model: str, data: dict, out: str, opts) -> list:
    common = ["--dtype", "fp32", "--seed", "1234", "--apply_chat_template", "--lr_scheduler_type", "constant",
              "--num_warmup_steps", "0", "--max_steps", str(opts.steps), "--output_dir", out, "--overwrite",
              "--data_output_path", os.path.join(out, "data")]
    if trainer == "grpo":
        return ["step3_rlhf_finetuning/main.py", "--actor_model_name_or_path", model, "--data_path", data["gsm8k"],
                "--data_split", "0,0,1", "--advantage_estimator", "grpo", "--reward_fn", "gsm8k",
                "--n_samples_per_prompt", str(opts.group), "--per_device_generation_batch_size",
                str(opts.grpo_batch // opts.group), "--per_device_training_batch_size", str(opts.grpo_batch),
                "--max_prompt_seq_len", "256", "--max_answer_seq_len", str(opts.answer_len), "--do_sample",
                "--temperature", "1.0", "--kl_ctl", "0.04", "--actor_learning_rate", "1e-6",
                "--loss_agg", "seq_mean_token_mean", *common]  # TRL's loss_type="grpo": per answer, then the batch
    lm = ["--model_name_or_path", model, "--data_path", data["hh"], "--max_seq_len", str(opts.max_len),
          "--per_device_train_batch_size", str(opts.batch), *common]
    if trainer == "sft":
        return ["step1_supervised_finetuning/main.py", *lm, "--data_split", "1,0,0", "--learning_rate", "1e-5"]
    if trainer == "rm":
        return ["step2_reward_model_finetuning/main.py", *lm, "--data_split", "0,1,0", "--learning_rate", "2e-5",
                "--num_padding_at_beginning", "0", "--eval_iters", "1"]
    return ["step2_dpo_finetuning/main.py", *lm, "--data_split", "0,1,0", "--learning_rate", "1e-6",
            "--beta", "0.1", "--eval_iters", "1"]


def trl_command(trainer: str, model: str, data: dict, out: str, opts) -> list:
    cmd = ["bench/peers/trl_run.py", trainer, "--model", model, "--out", out, "--steps", str(opts.steps)]
    if trainer == "grpo":
        return cmd + ["--data", data["gsm8k"], "--batch", str(opts.grpo_batch), "--group", str(opts.group),
                      "--answer_len", str(opts.answer_len), "--beta", "0.04", "--lr", "1e-6"]
    lr = {"sft": "1e-5", "rm": "2e-5", "dpo": "1e-6"}[trainer]
    return cmd + ["--data", data["hh_trl"], "--batch", str(opts.batch), "--max_len", str(opts.max_len), "--lr", lr]


def run(python: str, cmd: list, log_path: str) -> dict:
    """Run ``python cmd`` from the repository; wall time, peak RSS (bytes) and exit status."""
    import train  # the steps' environment: the repository before the caller's PYTHONPATH, this python first

    env = dict(train.child_env("2"), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    start = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([python, *cmd], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    return {"wall": time.time() - start, "peak_rss": usage.ru_maxrss * 1024, "rc": os.waitstatus_to_exitcode(status)}


# --------------------------------------------------------------------------- results

def our_steps(out: str) -> list:
    """``[{"time", "tokens", "samples"}]`` per optimizer step from the run's metrics.jsonl."""
    path = os.path.join(out, "metrics.jsonl")
    steps = []
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if row.get("phase") == "train" and "tokens" in row:
                steps.append({"time": row["time"], "tokens": row["tokens"], "samples": row.get("samples")})
    return steps


def trl_steps(out: str) -> list:
    with open(os.path.join(out, "steps.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def summarize(steps: list, warmup: int, samples_per_step: int) -> dict:
    """Median seconds per step (between consecutive step ends, after ``warmup`` steps), samples/s and tokens/s over
    those steps, mean real tokens per step."""
    timed = [(b["time"] - a["time"], b) for a, b in zip(steps, steps[1:])][max(warmup - 1, 0):]
    if not timed:
        raise SystemExit(f"only {len(steps)} steps logged; need more than --warmup {warmup}")
    seconds = sum(d for d, _ in timed)
    tokens = sum(s["tokens"] for _, s in timed)
    samples = sum((s.get("samples") or samples_per_step) for _, s in timed)
    return {"s_per_step": statistics.median(d for d, _ in timed), "samples_per_s": samples / seconds,
            "tokens_per_s": tokens / seconds, "tokens_per_step": tokens / len(timed), "timed_steps": len(timed)}


def table(trainer: str, rows: dict, opts, trl_version: str) -> str:
    ours, peer = rows.get("ours"), rows.get("trl")
    lines = [f"### {trainer}: {NAMES[trainer][0]} vs TRL {trl_version} {NAMES[trainer][1]}", "",
             f"| | s / step (median of {opts.steps - opts.warmup} after {opts.warmup}) | samples/s | tokens/s "
             "| tokens / step | peak RSS |", "|---|---|---|---|---|---|"]
    for name, r in (("this project", ours), (f"TRL {trl_version}", peer)):
        if r is not None:
            lines.append(f"| {name} | {r['s_per_step']:.2f} | {r['samples_per_s']:.3f} | {r['tokens_per_s']:.1f} | "
                         f"{r['tokens_per_step']:.0f} | {r['peak_rss'] / 2**30:.2f} GiB |")
    if ours and peer:
        lines.append(f"| ours / TRL | {ours['s_per_step'] / peer['s_per_step']:.2f}× | "
                     f"**{ours['samples_per_s'] / peer['samples_per_s']:.2f}×** | "
                     f"**{ours['tokens_per_s'] / peer['tokens_per_s']:.2f}×** | "
                     f"{ours['tokens_per_step'] / peer['tokens_per_step']:.2f}× | "
                     f"**{ours['peak_rss'] / peer['peak_rss']:.2f}×** |")
    return "\n".join(lines)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the SmolLM2-135M-Instruct folder")
    parser.add_argument("--trainers", default=",".join(TRAINERS), help=f"comma-separated, of {', '.join(TRAINERS)}")
    parser.add_argument("--sides", default="ours,trl", help="ours, trl or both (comma-separated)")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the timing")
    parser.add_argument("--batch", type=int, default=4, help="sft / rm / dpo: sequences or pairs per step")
    parser.add_argument("--grpo_batch", type=int, default=16, help="grpo: answers per step")
    parser.add_argument("--group", type=int, default=4, help="grpo: answers per prompt")
    parser.add_argument("--answer_len", type=int, default=48, help="grpo: new tokens per answer")
    parser.add_argument("--max_len", type=int, default=512, help="sft / rm / dpo: tokens per sequence at most")
    parser.add_argument("--peer-venv", dest="peer_venv", default=DEFAULT_VENV)
    parser.add_argument("--trl", default=TRL_VERSION, help="the pinned TRL version")
    parser.add_argument("--work", default=None, help="work folder (default: a new one under /tmp)")
    opts = parser.parse_args(argv)
    if not os.path.isdir(opts.model):
        print(f"bench_peers: no model folder at {opts.model} (build it with scripts/make_smollm2.py "
              "--out ../smollm2 --dtype fp32, or pass --model); skipped")
        return 0
    if not os.path.isdir(SHARED):
        print(f"bench_peers: {SHARED} is absent (GSM8K and HH-RLHF are read from it); skipped")
        return 0
    trainers = [t.strip() for t in opts.trainers.split(",") if t.strip()]
    unknown = [t for t in trainers if t not in TRAINERS]
    if unknown or opts.steps <= opts.warmup + 1:
        parser.error(f"unknown trainer(s) {unknown}" if unknown else "--steps must exceed --warmup + 1")
    sides = [s.strip() for s in opts.sides.split(",")]
    work = opts.work or os.path.join("/tmp", f"bench-peers-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    data = write_data(work, 256, 600, 16)
    python = ensure_peer_env(opts.peer_venv, opts.trl) if "trl" in sides else None

    import deepspeed
    import torch
    import transformers

    versions = peer_versions(python) if python else {"trl": opts.trl}
    print(f"{datetime.date.today()}, {machine()}; ours: torch {torch.__version__}, transformers "
          f"{transformers.__version__}, deepspeed {deepspeed.__version__}; peer: TRL {versions['trl']} (torch "
          f"{versions.get('torch', '?')}, transformers {versions.get('transformers', '?')}); model {opts.model}; "
          f"work {work}\n")
    results = {}
    for trainer in trainers:
        rows = {}
        for side in sides:
            out = os.path.join(work, f"{trainer}-{side}")
            os.makedirs(out, exist_ok=True)
            if side == "ours":
                cmd, interpreter = our_command(trainer, opts.model, data, out, opts), sys.executable
            else:
                cmd, interpreter = trl_command(trainer, opts.model, data, out, opts), python
            print(f"$ {shlex.join([os.path.relpath(interpreter, REPO), *cmd])}", flush=True)
            proc = run(interpreter, cmd, os.path.join(work, f"{trainer}-{side}.log"))
            if proc["rc"] != 0:
                print(f"  failed (exit {proc['rc']}): see {os.path.join(work, f'{trainer}-{side}.log')}")
                continue
            steps = our_steps(out) if side == "ours" else trl_steps(out)
            per_step = opts.grpo_batch if trainer == "grpo" else opts.batch
            rows[side] = {**summarize(steps, opts.warmup, per_step), "peak_rss": proc["peak_rss"],
                          "wall": proc["wall"]}
            print(f"  {rows[side]['s_per_step']:.2f} s/step, peak RSS {proc['peak_rss'] / 2**30:.2f} GiB, "
                  f"{proc['wall']:.0f} s in all", flush=True)
        results[trainer] = rows
        print("\n" + table(trainer, rows, opts, versions["trl"]) + "\n", flush=True)
    with open(os.path.join(work, "results.json"), "w") as f:
        json.dump({"versions": versions, "machine": machine(), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    from utils.entrypoint import run_script

    run_script(main)
