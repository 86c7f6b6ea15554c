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

On the CPU everything is fp32, on a GPU (``--device``, default: cuda when there is one) bf16 on both sides: ours
twice, ``--dtype bf16`` (bf16 weights, DeepSpeed's bf16 mode) and ``--dtype bf16 --torch_autocast`` (fp32 weights,
bf16 autocast), TRL once, ``bf16=True`` (autocast over fp32 weights, what a TRL user gets). No gradient
checkpointing (TRL's default is on: turned off on both sides), one process. We evaluate before training at the
training batch size (``--per_device_eval_batch_size`` = ``--batch``; TRL does not evaluate), so neither side's peak
memory is an evaluation's. TRL runs in its own virtual environment (``--peer-venv``, built on first use with a
pinned TRL and this environment's torch and transformers; never a dependency of the project), or with
``--peer-python`` (an interpreter that imports TRL already: the GPU machine, which has no package index), through
``bench/peers/trl_run.py``.

Each trainer's runs are separate processes, one after the other, ``--steps`` optimizer steps each. Per run:
seconds per step (the median wall time between consecutive step ends, after ``--warmup`` steps), samples/s and
tokens/s over those steps, real (not padding) tokens per step, and peak memory: on the CPU the process's peak RSS
(``wait4``), on a GPU the GPU's used memory (``nvidia-smi --query-gpu=memory.used``, polled every 0.2 s from
outside the run, minus what was used before it started: the CUDA context, the weights, the optimizer and the
activations of the run alike, for either side). The model is ``--model``, else ``$SMOLLM2_DIR``, else
``../smollm2`` (``make smollm2`` (scripts/make_smollm2.py) builds it offline); where that folder is absent,
``--shape smollm2-135m`` or ``--shape llama-1b`` builds a random-initialised model of that shape with a chat-template
tokenizer whose answers never end (bench/peers/shapes.py: both sides generate to the cap); without either the bench
says so in one line and exits 0. ``--data`` is the folder with ``gsm8k/train.jsonl`` and
``hh-rlhf/harmless-base-test.jsonl.gz`` (default ``../shared/data``). docs/benchmarks.md has the GPU machine's
commands (scripts/gpu_bench_55.sh).
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
# the runs of each side by device: (side, precision); ours twice on a GPU (bf16 weights; fp32 weights + autocast)
RUNS = {"cpu": (("ours", "fp32"), ("trl", "fp32")),
        "cuda": (("ours", "bf16"), ("ours", "bf16-autocast"), ("trl", "bf16"))}
PRECISION_FLAGS = {"fp32": ["--dtype", "fp32"], "bf16": ["--dtype", "bf16"],
                   "bf16-autocast": ["--dtype", "bf16", "--torch_autocast"]}
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

def write_data(work: str, gsm8k_rows: int, hh_rows: int, hh_eval_rows: int, shared: str = SHARED) -> dict:
    """The bench's files under ``work``: GSM8K questions (both sides read the same jsonl), HH-RLHF pairs as
    DeepSpeed-Chat text for us (a folder with train/eval files) and the same rows as chat messages for TRL; read
    from ``shared`` (``gsm8k/train.jsonl``, ``hh-rlhf/harmless-base-test.jsonl.gz``)."""
    from utils.data.local_datasets import LocalPathDataset

    os.makedirs(work, exist_ok=True)
    gsm8k = os.path.join(work, "gsm8k.jsonl")
    with open(os.path.join(shared, "gsm8k", "train.jsonl")) as src, open(gsm8k, "w") as out:
        out.writelines(line for _, line in zip(range(gsm8k_rows), src))
    with gzip.open(os.path.join(shared, "hh-rlhf", "harmless-base-test.jsonl.gz"), "rt") as f:
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

def our_command(trainer: str, model: str, data: dict, out: str, opts, precision: str = "fp32") -> list:
    """Our step's command line (``precision``: a key of :data:`PRECISION_FLAGS`)."""
    common = [*PRECISION_FLAGS[precision], "--seed", "1234", "--apply_chat_template", "--lr_scheduler_type",
              "constant", "--num_warmup_steps", "0", "--max_steps", str(opts.steps), "--output_dir", out,
              "--overwrite", "--data_output_path", os.path.join(out, "data")]
    if trainer == "grpo":
        return ["step3_rlhf_finetuning/main.py", "--actor_model_name_or_path", model, "--data_path", data["gsm8k"],
                "--data_split", "0,0,1", "--advantage_estimator", "grpo", "--reward_fn", "gsm8k",
                "--n_samples_per_prompt", str(opts.group), "--per_device_generation_batch_size",
                str(opts.grpo_batch // opts.group), "--per_device_training_batch_size", str(opts.grpo_batch),
                "--max_prompt_seq_len", "256", "--max_answer_seq_len", str(opts.answer_len), "--do_sample",
                "--temperature", "1.0", "--kl_ctl", "0.04", "--actor_learning_rate", "1e-6",
                "--loss_agg", "seq_mean_token_mean", *common]  # TRL's loss_type="grpo": per answer, then the batch
    lm = ["--model_name_or_path", model, "--data_path", data["hh"], "--max_seq_len", str(opts.max_len),
          "--per_device_train_batch_size", str(opts.batch), "--per_device_eval_batch_size", str(opts.batch), *common]
    if trainer == "sft":
        return ["step1_supervised_finetuning/main.py", *lm, "--data_split", "1,0,0", "--learning_rate", "1e-5"]
    if trainer == "rm":
        return ["step2_reward_model_finetuning/main.py", *lm, "--data_split", "0,1,0", "--learning_rate", "2e-5",
                "--num_padding_at_beginning", "0", "--eval_iters", "1"]
    return ["step2_dpo_finetuning/main.py", *lm, "--data_split", "0,1,0", "--learning_rate", "1e-6",
            "--beta", "0.1", "--eval_iters", "1"]


def trl_command(trainer: str, model: str, data: dict, out: str, opts, precision: str = "fp32") -> list:
    """TRL's command line (bench/peers/trl_run.py); ``precision`` bf16: ``bf16=True``."""
    cmd = ["bench/peers/trl_run.py", trainer, "--model", model, "--out", out, "--steps", str(opts.steps),
           "--dtype", "bf16" if precision.startswith("bf16") else "fp32"]
    if trainer == "grpo":
        return cmd + ["--data", data["gsm8k"], "--batch", str(opts.grpo_batch), "--group", str(opts.group),
                      "--answer_len", str(opts.answer_len), "--beta", "0.04", "--lr", "1e-6"]
    lr = {"sft": "1e-5", "rm": "2e-5", "dpo": "1e-6"}[trainer]
    return cmd + ["--data", data["hh_trl"], "--batch", str(opts.batch), "--max_len", str(opts.max_len), "--lr", lr]


def gpu_memory_used() -> int | None:
    """The GPU's used memory now, bytes (``nvidia-smi --query-gpu=memory.used``, the first GPU), None without it."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=10).stdout
        return int(out.split()[0]) * 2**20
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


class GpuMemoryPeak:
    """``with GpuMemoryPeak() as mem: ...``: ``mem.peak``, the most the GPU's used memory rose above its level at the
    start while the block ran (bytes, polled every ``interval`` s; None without nvidia-smi)."""

    def __init__(self, interval: float = 0.2, read=gpu_memory_used):
        self.interval, self.read, self.peak = interval, read, None

    def __enter__(self):
        import threading

        self.base = self.read()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        if self.base is not None:
            self.peak = 0
            self._thread.start()
        return self

    def _poll(self):
        while not self._stop.is_set():
            used = self.read()
            if used is not None:
                self.peak = max(self.peak, used - self.base)
            self._stop.wait(self.interval)

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def run(python: str, cmd: list, log_path: str, gpu: bool = False) -> dict:
    """Run ``python cmd`` from the repository; wall time, peak RSS (bytes), exit status and, with ``gpu``, the peak
    GPU memory the run added (:class:`GpuMemoryPeak`, bytes)."""
    import contextlib

    import train  # the steps' environment: the repository before the caller's PYTHONPATH, this python first

    env = dict(train.child_env("2"), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    start = time.time()
    with open(log_path, "w") as log, (GpuMemoryPeak() if gpu else contextlib.nullcontext()) as mem:
        proc = subprocess.Popen([python, *cmd], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    return {"wall": time.time() - start, "peak_rss": usage.ru_maxrss * 1024, "rc": os.waitstatus_to_exitcode(status),
            "peak_gpu": mem.peak if mem is not None else None}


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


def run_name(side: str, precision: str, trl_version: str) -> str:
    """A run's row name: "this project", "this project, bf16", "this project, bf16 autocast", "TRL 1.16.0, bf16"."""
    name = "this project" if side == "ours" else f"TRL {trl_version}"
    return name if precision == "fp32" else f"{name}, {precision.replace('-', ' ')}"


def table(trainer: str, rows: dict, opts, trl_version: str) -> str:
    """The trainer's table: a row per run (``rows``: ``{(side, precision): summary}``), then ours / TRL per ours-run.
    The memory column is the peak GPU memory where the runs have it, else the peak RSS."""
    gpu = any(r.get("peak_gpu") is not None for r in rows.values())
    key, memory = ("peak_gpu", "peak GPU memory") if gpu else ("peak_rss", "peak RSS")
    lines = [f"### {trainer}: {NAMES[trainer][0]} vs TRL {trl_version} {NAMES[trainer][1]}", "",
             f"| | s / step (median of {opts.steps - opts.warmup} after {opts.warmup}) | samples/s | tokens/s "
             f"| tokens / step | {memory} |", "|---|---|---|---|---|---|"]
    for (side, precision), r in rows.items():
        lines.append(f"| {run_name(side, precision, trl_version)} | {r['s_per_step']:.2f} | {r['samples_per_s']:.3f} | "
                     f"{r['tokens_per_s']:.1f} | {r['tokens_per_step']:.0f} | {(r.get(key) or 0) / 2**30:.2f} GiB |")
    peer = next((r for (side, _), r in rows.items() if side == "trl"), None)
    for (side, precision), ours in rows.items():
        if side != "ours" or peer is None:
            continue
        label = "ours / TRL" if precision == "fp32" else f"ours ({precision.replace('-', ' ')}) / TRL"
        memory_ratio = f"{ours[key] / peer[key]:.2f}×" if ours.get(key) and peer.get(key) else "—"
        lines.append(f"| {label} | {ours['s_per_step'] / peer['s_per_step']:.2f}× | "
                     f"**{ours['samples_per_s'] / peer['samples_per_s']:.2f}×** | "
                     f"**{ours['tokens_per_s'] / peer['tokens_per_s']:.2f}×** | "
                     f"{ours['tokens_per_step'] / peer['tokens_per_step']:.2f}× | **{memory_ratio}** |")
    return "\n".join(lines)


def machine(device: str = "cpu") -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    if device == "cuda":
        import torch

        return f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda}), {cpu}, {os.cpu_count()} cores"
    return f"{cpu}, {os.cpu_count()} cores"


def pick_device(choice: str) -> str:
    """``--device``: cpu, cuda, or auto (cuda when torch sees a GPU)."""
    if choice != "auto":
        return choice
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def planned_runs(device: str, sides: str) -> list:
    """``[(side, precision)]`` of :data:`RUNS` for ``device``, of the ``sides`` asked for (comma-separated)."""
    wanted = {s.strip() for s in sides.split(",") if s.strip()}
    return [(side, precision) for side, precision in RUNS[device] if side in wanted]


def resolve_model(opts, work: str, log=print) -> str | None:
    """The model folder: ``--model`` when it exists, else ``--shape``'s, built once under ``work`` (or ``--shape_dir``);
    None when neither."""
    if os.path.isdir(opts.model):
        return opts.model
    if not opts.shape:
        return None
    from peers.shapes import build_shape  # beside this script

    folder = opts.shape_dir or os.path.join(work, f"shape-{opts.shape}")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        build_shape(opts.shape, folder, opts.tokenizer, log=log)
    return folder


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the SmolLM2-135M-Instruct folder")
    parser.add_argument("--shape", default=None, choices=("smollm2-135m", "llama-1b"),
                        help="where --model is absent: a random-initialised model of this shape, built in the work "
                             "folder (bench/peers/shapes.py; answers never end)")
    parser.add_argument("--shape_dir", default=None, help="where --shape's model is built (or found, if built)")
    parser.add_argument("--tokenizer", default=None,
                        help="--shape's tokenizer folder (with a chat template; default: --model's, else the project's "
                             "offline BPE)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="cpu: fp32 on both sides; cuda: bf16 (ours twice: --dtype bf16, and with --torch_autocast)")
    parser.add_argument("--data", default=SHARED, help="the folder with gsm8k/ and hh-rlhf/ (default ../shared/data)")
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
    parser.add_argument("--peer-python", dest="peer_python", default=None,
                        help="run TRL with this interpreter (it imports trl already) instead of --peer-venv's")
    parser.add_argument("--trl", default=TRL_VERSION, help="the pinned TRL version")
    parser.add_argument("--work", default=None, help="work folder (default: a new one under /tmp)")
    opts = parser.parse_args(argv)
    if not os.path.isdir(opts.model) and not opts.shape:
        print(f"bench_peers: no model folder at {opts.model} (build it with scripts/make_smollm2.py "
              "--out ../smollm2 --dtype fp32, pass --model, or --shape smollm2-135m); skipped")
        return 0
    if not os.path.isdir(opts.data):
        print(f"bench_peers: {opts.data} is absent (GSM8K and HH-RLHF are read from it; --data); skipped")
        return 0
    trainers = [t.strip() for t in opts.trainers.split(",") if t.strip()]
    unknown = [t for t in trainers if t not in TRAINERS]
    if unknown or opts.steps <= opts.warmup + 1:
        parser.error(f"unknown trainer(s) {unknown}" if unknown else "--steps must exceed --warmup + 1")
    device = pick_device(opts.device)
    runs = planned_runs(device, opts.sides)
    work = opts.work or os.path.join("/tmp", f"bench-peers-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    data = write_data(work, 256, 600, 16, opts.data)
    model = resolve_model(opts, work)
    wants_trl = any(side == "trl" for side, _ in runs)
    python = (opts.peer_python or ensure_peer_env(opts.peer_venv, opts.trl)) if wants_trl else None

    import deepspeed
    import torch
    import transformers

    versions = peer_versions(python) if python else {"trl": opts.trl}
    print(f"{datetime.date.today()}, {machine(device)}; ours: torch {torch.__version__}, transformers "
          f"{transformers.__version__}, deepspeed {deepspeed.__version__}; peer: TRL {versions['trl']} (torch "
          f"{versions.get('torch', '?')}, transformers {versions.get('transformers', '?')}); model {model}; "
          f"work {work}\n")
    results = {}
    for trainer in trainers:
        rows = {}
        for side, precision in runs:
            name = f"{trainer}-{side}-{precision}"
            out = os.path.join(work, name)
            os.makedirs(out, exist_ok=True)
            if side == "ours":
                cmd, interpreter = our_command(trainer, model, data, out, opts, precision), sys.executable
            else:
                cmd, interpreter = trl_command(trainer, model, data, out, opts, precision), python
            print(f"$ {shlex.join([os.path.relpath(interpreter, REPO), *cmd])}", flush=True)
            proc = run(interpreter, cmd, os.path.join(work, f"{name}.log"), gpu=device == "cuda")
            if proc["rc"] != 0:
                with open(os.path.join(work, f"{name}.log"), errors="replace") as f:
                    tail = "".join(f.readlines()[-12:])
                print(f"  failed (exit {proc['rc']}): see {os.path.join(work, f'{name}.log')}, which ends:\n{tail}")
                continue
            steps = our_steps(out) if side == "ours" else trl_steps(out)
            per_step = opts.grpo_batch if trainer == "grpo" else opts.batch
            r = rows[side, precision] = {**summarize(steps, opts.warmup, per_step), "peak_rss": proc["peak_rss"],
                                         "peak_gpu": proc["peak_gpu"], "wall": proc["wall"]}
            gpu = f", peak GPU memory {r['peak_gpu'] / 2**30:.2f} GiB" if r["peak_gpu"] is not None else ""
            print(f"  {r['s_per_step']:.2f} s/step, peak RSS {r['peak_rss'] / 2**30:.2f} GiB{gpu}, "
                  f"{r['wall']:.0f} s in all", flush=True)
        results[trainer] = {f"{side}-{precision}": r for (side, precision), r in rows.items()}
        print("\n" + table(trainer, rows, opts, versions["trl"]) + "\n", flush=True)
    with open(os.path.join(work, "results.json"), "w") as f:
        json.dump({"versions": versions, "machine": machine(device), "device": device, "model": model,
                   "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    from utils.entrypoint import run_script

    run_script(main)
