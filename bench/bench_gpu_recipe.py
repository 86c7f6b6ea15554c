#!/usr/bin/env python
"""DeepSpeed-Chat's single-GPU OPT recipe on one GPU, offline: steps 1, 2, DPO and 3 in one table.

    python3 bench/bench_gpu_recipe.py --work /tmp/recipe                       # everything (~8 min on an H100)
    python3 bench/bench_gpu_recipe.py --work /tmp/recipe --steps 2 --repo /path/to/other/checkout

Nothing is downloaded. ``prepare`` builds, under ``--work``:

* ``data/train.json`` / ``data/eval.json``: the Anthropic HH-RLHF harmless-base test split
  (``--hh``, default ``../shared/data/hh-rlhf/harmless-base-test.jsonl.gz``) cut into
  ``{"prompt", "chosen", "rejected"}`` rows at the last "Assistant:" turn, 2000 train / 300
  eval rows, read as ``--data_path local/jsonfile`` (runs start in ``--work``);
* ``tokenizer/``: an 8192-token byte-level BPE trained on that text, in facebook/opt's
  layout (``<s>`` 0, ``<pad>`` 1, ``</s>`` 2 = BOS = EOS prepended to every text, ``<unk>`` 3);
* ``actor-init/``: a random-initialised OPT-1.3B-shaped model (hidden 2048, 24 layers,
  32 heads, ffn 8192; 1.3 B parameters with this vocabulary) and ``rm-init/``: an
  OPT-350m-shaped one (hidden 1024, 24 layers, 16 heads, ffn 4096, word_embed_proj_dim 512,
  post-LayerNorm), saved in bf16.

Then each step runs with ``python -m deepspeed.launcher.runner --num_gpus 1`` and the
reference's flags (bf16, seed 1234, ``--data_split 2,4,4``): step 1 (ZeRO-2, micro-batch 8,
seq 512, lr 9.65e-6, one epoch), step 2 (ZeRO-2, 8 pairs, seq 512, lr 5e-5, wd 0.1,
dropout 0, ``--num_padding_at_beginning 1``), DPO (ZeRO-3, 4 pairs, 10 steps) and step 3
(actor/critic ZeRO-0, actor LoRA 128 + gradient checkpointing + dropout 0, generation /
training batch 16/16, prompt/answer 256/256, ``--enable_hybrid_engine``, ``--max_steps``
``--step3_steps``) on the step-1 actor and the step-2 reward model. Peak GPU memory is
nvidia-smi's ``memory.used`` polled every 0.2 s (the whole process, CUDA context included).
"""
from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C from the first second on: one line, exit 130 (utils/interrupt.py)
    from utils.interrupt import exit_quietly_on_ctrl_c

    exit_quietly_on_ctrl_c()

import argparse
import gzip
import json
import os
import re
import subprocess
import sys
import threading
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
HH = os.path.join(REPO, os.path.pardir, "shared", "data", "hh-rlhf", "harmless-base-test.jsonl.gz")
MARK = "\n\nAssistant:"



# --------------------------------------------------------------------------- assets

def split_conversation(text: str):
    """``(prompt ending in "Assistant:", answer)`` at the last assistant turn, or None."""
    cut = text.rfind(MARK)
    return None if cut < 0 else (text[:cut + len(MARK)], text[cut + len(MARK):].lstrip(" "))


def write_data(hh_path: str, out_dir: str, train_rows: int = 2000, eval_rows: int = 300) -> list:
    rows = []
    with gzip.open(hh_path, "rt") as f:
        for line in f:
            pair = json.loads(line)
            chosen, rejected = split_conversation(pair["chosen"]), split_conversation(pair["rejected"])
            if chosen and rejected and chosen[0] == rejected[0] and chosen[1] and rejected[1]:
                rows.append({"prompt": chosen[0], "chosen": chosen[1], "rejected": rejected[1]})
    if len(rows) < train_rows + eval_rows:
        raise SystemExit(f"{hh_path}: only {len(rows)} usable pairs, need {train_rows + eval_rows}")
    os.makedirs(out_dir, exist_ok=True)
    for name, part in (("train", rows[:train_rows]), ("eval", rows[train_rows:train_rows + eval_rows])):
        with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
            json.dump(part, f)
    return rows[:train_rows]


def build_tokenizer(texts: list, out_dir: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8192, special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="</s> $A", pair="</s> $A </s> $B",
                                                       special_tokens=[("</s>", 2)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="</s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", model_max_length=2048)
    fast.save_pretrained(out_dir)
    return fast


def build_model(shape: str, out_dir: str, seed: int) -> int:
    """Save a random-initialised model of ``shape`` (bench_generation.SHAPES) in bf16; its parameter count."""
    import torch

    from bench_generation import build_model as build_shape

    torch.manual_seed(seed)
    model = build_shape(shape, torch.bfloat16, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    model.save_pretrained(out_dir)
    return sum(p.numel() for p in model.parameters())


def prepare(work: str, hh_path: str) -> None:
    if all(os.path.isfile(os.path.join(work, p)) for p in
           ("data/eval.json", "tokenizer/tokenizer.json", "actor-init/config.json", "rm-init/config.json")):
        return
    start = time.time()
    rows = write_data(hh_path, os.path.join(work, "data"))
    tokenizer = build_tokenizer([r["prompt"] + " " + r["chosen"] for r in rows], os.path.join(work, "tokenizer"))
    for name, shape, seed in (("actor-init", "opt-1.3b", 1), ("rm-init", "opt-350m", 2)):
        n = build_model(shape, os.path.join(work, name), seed)
        tokenizer.save_pretrained(os.path.join(work, name))
        print(f"built {name}: {n / 1e9:.3f} B parameters", flush=True)
    print(f"prepared {work} in {time.time() - start:.0f}s", flush=True)


# --------------------------------------------------------------------------- runs

class GpuMemoryPeak:
    """Peak of nvidia-smi's memory.used (MiB) while the block runs."""

    def __enter__(self):
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self):
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=5).stdout
                self.peak = max([self.peak] + [int(x) for x in out.split()])
            except (OSError, ValueError, subprocess.SubprocessError):
                pass
            self._stop.wait(0.2)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def launch(repo: str, script: str, flags: list, work: str, port: int, log_path: str) -> tuple[int, float, int]:
    """Run one step with the DeepSpeed launcher; (return code, wall seconds, peak GPU MiB)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([repo] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port", str(port),
           os.path.join(repo, script), *map(str, flags)]
    start = time.time()
    with open(log_path, "w") as log, GpuMemoryPeak() as mem:
        code = subprocess.run(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    return code, time.time() - start, mem.peak


def metrics(out_dir: str) -> list:
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def last_float(pattern: str, text: str):
    found = re.findall(pattern, text)
    return float(found[-1]) if found else None


def loop_seconds(rows: list) -> float | None:
    """From the evaluation before training to the last training row."""
    evals = [r for r in rows if r["phase"] == "eval"]
    train = [r for r in rows if r["phase"] == "train"]
    return train[-1]["time"] - evals[0]["time"] if evals and train else None


COMMON = ["--data_path", "local/jsonfile", "--data_split", "2,4,4", "--dtype", "bf16", "--seed", "1234",
          "--data_output_path", "data_files"]


def step_flags(step: str, work: str, out: str, args) -> tuple[str, list]:
    if step == "1":
        return "step1_supervised_finetuning/main.py", COMMON + [
            "--model_name_or_path", os.path.join(work, "actor-init"), "--per_device_train_batch_size", 8,
            "--per_device_eval_batch_size", 8, "--max_seq_len", 512, "--learning_rate", 9.65e-6,
            "--weight_decay", 0.0, "--num_train_epochs", 1, "--lr_scheduler_type", "cosine",
            "--num_warmup_steps", 0, "--zero_stage", 2, "--output_dir", out]
    if step == "2":
        return "step2_reward_model_finetuning/main.py", COMMON + [
            "--model_name_or_path", os.path.join(work, "rm-init"), "--per_device_train_batch_size", 8,
            "--per_device_eval_batch_size", 8, "--max_seq_len", 512, "--learning_rate", 5e-5,
            "--weight_decay", 0.1, "--dropout", 0.0, "--num_padding_at_beginning", 1, "--num_train_epochs", 1,
            "--zero_stage", 2, "--output_dir", out]
    if step == "dpo":
        return "step2_dpo_finetuning/main.py", COMMON + [
            "--model_name_or_path", args.step1_out or os.path.join(work, "actor-init"),
            "--per_device_train_batch_size", 4, "--per_device_eval_batch_size", 4, "--max_seq_len", 512,
            "--learning_rate", 5e-6, "--max_steps", 10, "--eval_iters", 10, "--zero_stage", 3, "--output_dir", out]
    return "step3_rlhf_finetuning/main.py", COMMON + [
        "--actor_model_name_or_path", args.step1_out or os.path.join(work, "actor-init"),
        "--critic_model_name_or_path", args.step2_out, "--num_padding_at_beginning", 1,
        "--per_device_generation_batch_size", 16, "--per_device_training_batch_size", 16,
        "--generation_batches", 1, "--ppo_epochs", 1, "--max_prompt_seq_len", 256, "--max_answer_seq_len", 256,
        "--actor_learning_rate", 9.65e-6, "--critic_learning_rate", 5e-6, "--actor_weight_decay", 0.0,
        "--critic_weight_decay", 0.0, "--num_warmup_steps", 0, "--actor_zero_stage", 0, "--critic_zero_stage", 0,
        "--actor_lora_dim", 128, "--actor_gradient_checkpointing", "--actor_dropout", 0.0,
        "--enable_hybrid_engine", "--max_steps", args.step3_steps, "--output_dir", out,
        *(["--generation_backend", args.generation_backend] if args.generation_backend else [])]


def summarize(step: str, rows: list, log: str) -> dict:
    """samples/s, TFLOPs and the quality line of one run."""
    train = [r for r in rows if r["phase"] == "train"]
    evals = [r for r in rows if r["phase"] == "eval"]
    r = {"loop": loop_seconds(rows), "samples": None, "tflops": last_float(r"TFLOPs: ([0-9.]+)", log), "quality": ""}
    if step == "1" and evals:
        r["quality"] = f"ppl {evals[0]['perplexity']:.1f} -> {evals[-1]['perplexity']:.1f}"
        r["samples"] = last_float(r"Samples/sec: ([0-9.]+)", log)
    elif step == "2" and evals:
        r["quality"] = (f"acc {evals[0]['acc']:.3f} -> {evals[-1]['acc']:.3f}, chosen {evals[-1]['chosen']:.3f} / "
                        f"rejected {evals[-1]['rejected']:.3f}, loss {evals[-1]['loss']:.4f}")
        r["samples"] = last_float(r"Samples/sec: ([0-9.]+)", log)
    elif step == "dpo" and evals:
        r["quality"] = f"margin {evals[0]['margin']:+.3f} -> {evals[-1]['margin']:+.3f}, acc {evals[-1]['acc']:.3f}"
        r["samples"] = last_float(r"Samples/sec: ([0-9.]+)", log)
    elif step == "3" and train:
        later = train[1:] or train
        mean = lambda k: sum(t[k] for t in later) / len(later)  # noqa: E731
        r["samples"], r["tflops"] = mean("samples_per_sec"), mean("e2e_tflops")
        r["loop"] = train[-1]["time"] - train[0]["time"] + train[0]["e2e_latency"]
        per_token = last_float(r"Per-token Latency ([0-9.]+) ms", log)
        r["quality"] = (f"reward {train[0]['reward']:.3f} -> {train[-1]['reward']:.3f}; {mean('e2e_latency'):.2f} "
                        f"s/step, generation {mean('gen_latency'):.2f} s ({per_token} ms/token), training "
                        f"{mean('train_latency'):.2f} s (means after step 1)")
    return r


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", default="/tmp/dschat-gpu-recipe")
    parser.add_argument("--hh", default=HH, help="HH-RLHF jsonl.gz (chosen/rejected conversations)")
    parser.add_argument("--repo", default=REPO, help="checkout whose step scripts run (default: this one)")
    parser.add_argument("--steps", nargs="+", default=["1", "2", "dpo", "3"], choices=["1", "2", "dpo", "3"])
    parser.add_argument("--step3_steps", type=int, default=8)
    parser.add_argument("--generation_backend", default=None, help="step 3's --generation_backend (default: its own)")
    parser.add_argument("--tag", default="", help="suffix of the output folders (compare two checkouts)")
    parser.add_argument("--step1_out", default=None, help="actor for DPO/step 3 (default: this run's step 1)")
    parser.add_argument("--step2_out", default=None, help="reward model for step 3 (default: this run's step 2)")
    args = parser.parse_args()

    import torch

    work = os.path.abspath(args.work)
    prepare(work, args.hh)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    import deepspeed
    import transformers

    header = (f"{gpu}; torch {torch.__version__}, deepspeed {deepspeed.__version__}, transformers "
              f"{transformers.__version__}; {time.strftime('%Y-%m-%d')}; repo {args.repo}")
    rows = []
    for i, step in enumerate(args.steps):
        out = os.path.join(work, "out", f"step{step}{args.tag}")
        if step == "1":
            args.step1_out = out
        if step == "2":
            args.step2_out = out
        if step == "3" and not args.step2_out:
            from utils.errors import UserInputError

            raise UserInputError("--steps 3 needs a reward model: run step 2 too, or pass --step2_out")
        subprocess.run(["rm", "-rf", out])
        script, flags = step_flags(step, work, out, args)
        log_path = os.path.join(work, f"step{step}{args.tag}.log")
        code, wall, peak = launch(args.repo, script, flags, work, 29500 + i, log_path)
        with open(log_path) as f:
            log = f.read()
        if code != 0:
            print(f"step {step} failed (exit {code}); the end of {log_path}:\n{log[-4000:]}", flush=True)
        r = summarize(step, metrics(out), log)
        fmt = lambda v, spec: "—" if v is None else format(v, spec)  # noqa: E731
        rows.append(f"| {step} | {'ok' if code == 0 else f'exit {code}'} | {wall:.0f} | {fmt(r['loop'], '.1f')} | "
                    f"{fmt(r['samples'], '.2f')} | {fmt(r['tflops'], '.1f')} | {peak / 1024:.1f} | {r['quality']} |")
        print(rows[-1], flush=True)
    print("\n" + header + "\n\n| step | result | wall (s) | loop (s) | samples/s | TFLOPs | peak GPU memory (GiB) | "
          "quality |\n|---|---|---|---|---|---|---|---|\n" + "\n".join(rows))


if __name__ == "__main__":
    from utils.entrypoint import run_script

    run_script(main)
