#!/usr/bin/env python
"""A real model gets measurably better: verifiable instruction following on SmolLM2-135M-Instruct, held out.

    .venv/bin/python bench/bench_real_rl.py                   # data, base eval, GRPO, eval: ~1 h on 2 CPU cores
    .venv/bin/python bench/bench_real_rl.py --rows grpo,trl,ppo --work /tmp/real-rl   # + TRL and DeepSpeed-Chat's path

Task: alpaca's instructions (``../shared/data/llama-factory-demo``) with one or two IFEval constraints each
(``bench/ifeval_data.py``, 9 types a 135M model samples a compliant answer for now and then: commas, end
phrase, keywords, forbidden words, word count, bullets, postscript, title, highlights), 220 instructions held out.
Rows:

* ``grpo``: step 3 ``--advantage_estimator grpo --reward_fn bench/ifeval_reward.py:ifeval_guarded`` from the model
  itself (its own instruct tuning is step 1): 8 prompts × 4 answers a step, 128 new tokens, β 0.04 (k3, in the
  loss), lr 4e-5; the reward (``bench/ifeval_reward.py``) is the share of constraints kept times two guards
  (``substance``, because compliance alone pays answers that are only the constraint; ``variety``, because it pays
  "P.S. … P.S. P.S." as much as one postscript), plus 0.5 × the answer's unigram F1 against
  alpaca's answer (``guarded_compliance``), because keeping constraints must not cost content;
* ``trl``: TRL's ``GRPOTrainer`` on the same data, reward, steps and settings (the peer bench's environment);
* ``ppo``: DeepSpeed-Chat's path: the model's own answers ranked by the same checker
  (``collect_comparisons.py --label_fn bench/ifeval_reward.py:ifeval_guarded``) → step 2 reward model → step 3
  PPO.

The held-out evaluation (:func:`evaluate`, greedy, the chat template, the training's 128 tokens) of each model:
strict compliance (every constraint of a prompt kept) and per type; the content guards: unigram F1 against
alpaca's own answer on the constrained and on the plain held-out instructions, mean answer length on
constraints that do not limit length, the share of answers that are little more than the constraint (fewer
than 5 words besides its required text); KL to the base model (per answer, on the model's own greedy answers);
GSM8K zero-shot on 200 test questions. Checkpoints every ``--eval_every`` steps are evaluated too (compliance
and guards, not GSM8K), for the plot. Results: ``WORK/results.json``, ``WORK/real_rl.png`` and a table.

``--seed``, ``--temperature``, ``--schedule``, ``--warmup``, ``--estimator`` (``grpo`` or ``dr_grpo``: TRL's
``scale_rewards`` group or none) and ``--dtype`` (``bf16``: step 3's bf16 weights with fp32 master weights, or
with ``--autocast`` fp32 weights under bf16 autocast (``--torch_autocast``); TRL's bf16 autocast; 1.6× step 3's
steps a minute on this CPU, which has avx512_bf16; the evaluation is fp32 either way) and ``--train_weights``
(the data builder's: some types drawn more often in the training rows, the held-out rows unchanged) change the
GRPO and TRL rows alike, ``--reward_fn`` the GRPO row; one run is one seed, and a recipe's runs spread over 10 to
20 points, so judge a recipe on several (docs/real-model.md), each in its own ``--work``, and
print them with ``--summarize WORK WORK …`` (each row's mean and range; ``--plot PNG`` draws all their curves).
The training and the evaluation run on the GPU when there is one; ``SHARED_DATA`` names the data folder where
``../shared/data`` is not beside the checkout.
"""
from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C from the first second on: one line, exit 130 (utils/interrupt.py)
    from utils.interrupt import exit_quietly_on_ctrl_c

    exit_quietly_on_ctrl_c()

import argparse
import glob
import json
import os
import re
import shlex
import subprocess
import sys
import time

from utils.errors import UserInputError

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
SHARED = os.environ.get("SHARED_DATA") or os.path.join(os.path.dirname(REPO), "shared", "data")  # ../shared/data
DEFAULT_MODEL = os.environ.get("SMOLLM2_DIR") or os.path.join(os.path.dirname(REPO), "smollm2")
# the builder's types a 135M model samples a compliant answer for now and then (GRPO learns only from those); left
# out: all lower / all capital letters and wrapping the answer in quotes (0 of 75 held-out greedy answers, and too
# rare when sampled to learn from in this budget), and the types that need a longer answer or a rigid format
TYPES = ("punctuation:no_comma", "startend:end_checker", "keywords:existence", "keywords:forbidden_words",
         "length_constraints:number_words", "detectable_format:number_bullet_lists", "detectable_content:postscript",
         "detectable_format:title", "detectable_format:number_highlighted_sections")
LENGTH_TYPES = ("length_constraints:number_words",)  # constraints that limit length (left out of the length guard)
# the tuned reward (GRPO, TRL and the PPO path's labeller): a file's function, from the repository's root, where the
# steps run (utils.reward_functions.load_reward_fn)
GUARDED = "bench/ifeval_reward.py:ifeval_guarded"
EXAMPLES = 3  # answers shown before and after


# --------------------------------------------------------------------------- metrics (pure)

def score_constrained(rows: list, answers: list) -> dict:
    """Strict compliance, per type, and the content guards on the constrained held-out answers."""
    from ifeval_reward import BARE_WORDS, other_words, unigram_f1  # beside this script
    from utils.ifeval import check, instructions_of

    strict, per_type, f1, lengths, bare = [], {}, [], [], []
    for row, answer in zip(rows, answers):
        pairs = instructions_of(row)
        kept = [check(i, k, answer) for i, k in pairs]
        strict.append(all(kept))
        for (i, _), ok in zip(pairs, kept):
            per_type.setdefault(i, []).append(ok)
        f1.append(unigram_f1(answer, row["reference_output"]))
        if not any(i in LENGTH_TYPES for i, _ in pairs):
            lengths.append(len(answer.split()))
        bare.append(other_words(row, answer) < BARE_WORDS)
    mean = lambda xs: sum(xs) / max(len(xs), 1)  # noqa: E731
    return {"strict": mean(strict), "per_type": {t: mean(v) for t, v in sorted(per_type.items())},
            "type_counts": {t: len(v) for t, v in sorted(per_type.items())}, "f1": mean(f1),
            "length": mean(lengths), "bare": mean(bare)}


# --------------------------------------------------------------------------- generation and KL

def device():
    """Where the evaluation runs: the GPU when there is one (a recipe sweep, docs/real-model.md), else the CPU."""
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load(model_dir: str, weights: str | None = None):
    """``(model, tokenizer, chat format)``, fp32, eval mode, on :func:`device`; ``weights``: a DeepSpeed checkpoint's
    model states to load over the folder's (a step-3 checkpoint of the run)."""
    import torch
    from transformers import AutoModelForCausalLM

    from utils.data.chat_template import chat_format
    from utils.model.model_utils import load_hf_tokenizer

    tokenizer = load_hf_tokenizer(model_dir, apply_chat_template=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if weights:
        state = torch.load(weights, map_location="cpu", weights_only=True)["module"]
        model.load_state_dict(state)
    return model.to(device()), tokenizer, chat_format(tokenizer)


def greedy_answers(model, tokenizer, fmt, prompts: list, max_new_tokens: int, batch_size: int = 32) -> list:
    """Greedy answers to user ``prompts`` in the chat template, batched by length (left padded)."""
    import torch

    texts = [fmt.prompt([{"role": "user", "content": p}]) for p in prompts]
    encoded = [fmt.encode(t) for t in texts]
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
    answers = [""] * len(prompts)
    pad = tokenizer.pad_token_id
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        P = max(len(encoded[i]) for i in chunk)
        ids = torch.full((len(chunk), P), pad)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(chunk):
            ids[row, P - len(encoded[i]):], mask[row, P - len(encoded[i]):] = torch.tensor(encoded[i]), 1
        with torch.no_grad():
            out = model.generate(ids.to(model.device), attention_mask=mask.to(model.device), do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=list(fmt.stop_ids), pad_token_id=pad,
                                 temperature=None, top_p=None, top_k=None)
        for row, i in enumerate(chunk):
            answers[i] = tokenizer.decode(out[row, P:].tolist(), skip_special_tokens=True).strip()
        print(f"    {min(start + batch_size, len(order))}/{len(order)} answers", flush=True)
    return answers


def kl_to_base(model, base, fmt, prompts: list, answers: list, batch_size: int = 16) -> float:
    """Mean over answers of Σ_t KL(π(·|…) ‖ π_base(·|…)) over the answer's tokens (exact per position)."""
    import torch

    total, n = 0.0, 0
    for start in range(0, len(prompts), batch_size):
        rows = []
        for p, a in zip(prompts[start:start + batch_size], answers[start:start + batch_size]):
            prompt_ids, answer_ids = fmt.conversation_ids([{"role": "user", "content": p}], a)
            rows.append((prompt_ids, answer_ids))
        T = max(len(p) + len(a) for p, a in rows)
        ids = torch.zeros(len(rows), T, dtype=torch.long)
        mask = torch.zeros_like(ids)
        keep = torch.zeros_like(ids, dtype=torch.bool)  # positions whose next token is an answer token
        for r, (p, a) in enumerate(rows):
            ids[r, :len(p) + len(a)], mask[r, :len(p) + len(a)] = torch.tensor(p + a), 1
            keep[r, len(p) - 1:len(p) + len(a) - 1] = True
        ids, mask, keep = ids.to(model.device), mask.to(model.device), keep.to(model.device)
        with torch.no_grad():
            lp = torch.log_softmax(model(ids, attention_mask=mask).logits.float(), -1)
            lq = torch.log_softmax(base(ids, attention_mask=mask).logits.float(), -1)
            kl = (lp.exp() * (lp - lq)).sum(-1)
        total += float((kl * keep).sum())
        n += len(rows)
    return total / max(n, 1)


def gsm8k_accuracy(model, tokenizer, fmt, questions: list, max_new_tokens: int) -> float:
    from utils.reward_functions import gsm8k

    answers = greedy_answers(model, tokenizer, fmt, [q["question"] for q in questions], max_new_tokens)
    scores = gsm8k([""] * len(answers), answers, [{"reference_answer": q["answer"]} for q in questions])
    return sum(scores) / len(scores)


def evaluate(model_dir: str, data: dict, opts, weights: str | None = None, full: bool = True, base=None) -> dict:
    """The held-out evaluation of one model (module docstring); ``full``: also the plain instructions, KL and
    GSM8K (the checkpoints' points of the plot leave those out)."""
    start = time.time()
    model, tokenizer, fmt = load(model_dir, weights)
    rows = data["heldout"]
    answers = greedy_answers(model, tokenizer, fmt, [r["prompt"] for r in rows], opts.answer_len)
    result = score_constrained(rows, answers)
    result["examples"] = [{"prompt": rows[i]["prompt"], "answer": answers[i]} for i in range(EXAMPLES)]
    if full:
        plain = data["heldout_plain"]
        plain_answers = greedy_answers(model, tokenizer, fmt, [r["prompt"] for r in plain], opts.answer_len)
        from ifeval_reward import unigram_f1  # beside this script

        f1 = [unigram_f1(a, r["reference_output"]) for a, r in zip(plain_answers, plain)]
        result["plain_f1"] = sum(f1) / len(plain)
        result["plain_length"] = sum(len(a.split()) for a in plain_answers) / len(plain)
        result["gsm8k"] = gsm8k_accuracy(model, tokenizer, fmt, data["gsm8k"], opts.gsm8k_tokens)
        if base is not None:
            result["kl"] = kl_to_base(model, base, fmt, [r["prompt"] for r in rows], answers)
    result["seconds"] = time.time() - start
    return result


# --------------------------------------------------------------------------- runs

def read_results(path: str) -> dict:
    """A run's ``results.json``; one that is not a JSON object (cut short by a full disk or a kill) is the user's to
    fix: one line naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            results = json.load(f)
    except (OSError, ValueError) as e:
        raise UserInputError(f"{path}: not a readable results file ({type(e).__name__}: {e}); rerun that --work "
                             "folder's bench, or move the file away to start its evaluation afresh") from None
    if not isinstance(results, dict):
        raise UserInputError(f"{path}: a {type(results).__name__}, not a results object; move it away to start "
                             "afresh")
    return results


def read_jsonl(path: str) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def data_folder(work: str, train_weights: str | None = None) -> str:
    """Where the data go: ``WORK/ifeval``, or with ``--train_weights`` a folder named by their hash (the held-out
    files are the same in both; the training file differs)."""
    if not train_weights:
        return os.path.join(work, "ifeval")
    from utils.files import content_hash

    return os.path.join(work, "ifeval-" + content_hash(train_weights.encode(), digits=8))


def build_data(work: str, train_weights: str | None = None) -> dict:
    out = data_folder(work, train_weights)
    if not os.path.exists(os.path.join(out, "heldout.jsonl")):
        import train  # the steps' environment: the repository first on PYTHONPATH, as a bench script has it

        proc = subprocess.run([sys.executable, os.path.join("bench", "ifeval_data.py"), "--alpaca",
                               os.path.join(SHARED, "llama-factory-demo", "alpaca_en_demo.json"), "--out", out,
                               "--seed", "1234", "--heldout", "220", "--types", ",".join(TYPES),
                               *(["--train_weights", train_weights] if train_weights else [])],
                              cwd=REPO, env=train.child_env())
        if proc.returncode != 0:  # its own error line is above
            raise SystemExit(f"bench_real_rl: building the data in {out} failed (exit {proc.returncode})")
    with open(os.path.join(SHARED, "gsm8k", "test.jsonl")) as f:
        gsm8k = [json.loads(line) for _, line in zip(range(200), f)]
    return {"dir": out, "train": os.path.join(out, "train.jsonl"),
            "heldout": read_jsonl(os.path.join(out, "heldout.jsonl")),
            "heldout_plain": read_jsonl(os.path.join(out, "heldout_plain.jsonl")), "gsm8k": gsm8k}


def run(cmd: list, log_path: str, python: str = sys.executable) -> float:
    import train  # the steps' environment: the repository before the caller's PYTHONPATH, this python first

    env = dict(train.child_env("2"), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    print(f"$ {shlex.join(cmd)}", flush=True)
    start = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.run([python, *cmd], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"failed (exit {proc.returncode}); see {log_path}")
    return time.time() - start


# The GRPO row's --advantage_estimator and the TRL row's scale_rewards that makes the same advantages
TRL_SCALE_REWARDS = {"grpo": "group", "dr_grpo": "none"}


def overlong_flags(opts) -> list:
    """The length penalty's flags, the same on step 3's row and TRL's (none when it is off)."""
    if not opts.overlong_penalty:
        return []
    return ["--overlong_penalty", str(opts.overlong_penalty),
            "--overlong_penalty_weight", str(opts.overlong_penalty_weight)]


def grpo_command(model: str, data: dict, out: str, opts) -> list:
    return ["step3_rlhf_finetuning/main.py", "--actor_model_name_or_path", model, "--data_path", data["train"],
            "--data_split", "0,0,1", "--data_output_path", os.path.join(out, "data"), "--apply_chat_template",
            "--advantage_estimator", opts.estimator, "--loss_agg", "token_mean", "--reward_fn", opts.reward_fn,
            "--n_samples_per_prompt", str(opts.group), "--per_device_generation_batch_size", str(opts.prompts),
            "--per_device_training_batch_size", str(opts.prompts * opts.group), "--max_prompt_seq_len", "192",
            "--max_answer_seq_len", str(opts.answer_len), "--do_sample", "--temperature", str(opts.temperature),
            "--kl_ctl", str(opts.kl), "--actor_learning_rate", str(opts.lr), "--lr_scheduler_type", opts.schedule,
            "--num_warmup_steps", str(opts.warmup), "--num_train_epochs", "10", "--max_steps", str(opts.steps),
            "--dtype", opts.dtype, "--seed", str(opts.seed), "--save_interval", str(opts.eval_every),
            "--max_checkpoints", "100", "--output_dir", out, "--overwrite",
            "--adam_betas", *map(str, opts.adam_betas), *(["--torch_autocast"] if opts.autocast else []),
            *(["--generation_dtype", opts.generation_dtype] if opts.generation_dtype else []), *overlong_flags(opts)]


def trl_command(model: str, data: dict, out: str, opts) -> list:
    return ["bench/peers/trl_run.py", "grpo", "--task", "ifeval", "--model", model, "--data", data["train"], "--out",
            out, "--steps", str(opts.steps), "--batch", str(opts.prompts * opts.group), "--group", str(opts.group),
            "--answer_len", str(opts.answer_len), "--beta", str(opts.kl), "--lr", str(opts.lr), "--lr_scheduler",
            opts.schedule, "--warmup", str(opts.warmup), "--temperature", str(opts.temperature), "--seed",
            str(opts.seed), "--save",
            os.path.join(out, "actor"), "--save_at", ",".join(str(s) for s in range(opts.eval_every, opts.steps,
                                                                                     opts.eval_every)),
            "--scale_rewards", TRL_SCALE_REWARDS[opts.estimator], "--dtype", opts.dtype,
            "--loss_type", "dapo",  # TRL's token mean over the batch: step 3's loss
            "--adam_betas", *map(str, opts.adam_betas),  # step 3's AdamW, not transformers' default (0.9, 0.999)
            *overlong_flags(opts)]


def ppo_commands(model: str, data: dict, out: str, opts) -> list:
    """DeepSpeed-Chat's path on the same task: the model's own answers to the train instructions, ranked by the same
    checker, → a reward model → PPO against it (the model's instruct tuning is its step 1)."""
    comparisons, reward = os.path.join(out, "comparisons"), os.path.join(out, "reward")
    common = ["--apply_chat_template", "--seed", "1234", "--data_output_path", os.path.join(out, "data")]
    return [
        ["step2_reward_model_finetuning/collect_comparisons.py", "--actor_model_name_or_path", model, "--data_path",
         data["train"], "--data_split", "0,1,0", "--label_fn", GUARDED, "--num_answers", "4",
         "--max_new_tokens", str(opts.answer_len), "--max_prompts", "120", "--max_eval_prompts", "16",
         "--batch_size", "16", "--output_dir", comparisons, "--overwrite", *common],
        ["step2_reward_model_finetuning/main.py", "--model_name_or_path", model, "--data_path", comparisons,
         "--data_split", "0,1,0", "--num_padding_at_beginning", "0", "--max_seq_len", "320",
         "--per_device_train_batch_size", "8", "--learning_rate", "2e-5", "--reward_loss", "end", "--max_steps", "40",
         "--dtype", "fp32", "--adam_betas", *map(str, opts.adam_betas), "--output_dir", reward, "--overwrite",
         *common],
        ["step3_rlhf_finetuning/main.py", "--actor_model_name_or_path", model, "--critic_model_name_or_path", reward,
         "--data_path", data["train"], "--data_split", "0,0,1", "--num_padding_at_beginning", "0",
         "--per_device_generation_batch_size", str(opts.prompts), "--per_device_training_batch_size",
         str(opts.prompts), "--max_prompt_seq_len", "192", "--max_answer_seq_len", str(opts.answer_len),
         "--do_sample", "--temperature", "1.0", "--kl_ctl", str(opts.kl), "--actor_learning_rate", str(opts.lr),
         "--critic_learning_rate", "5e-6", "--lr_scheduler_type", "constant", "--num_warmup_steps", "0",
         "--num_train_epochs", "10", "--max_steps", str(opts.steps), "--dtype", "fp32", "--adam_betas",
         *map(str, opts.adam_betas), "--output_dir", os.path.join(out, "step3"), "--overwrite", *common],
    ]


def trl_checkpoints(out: str) -> dict:
    """``{step: (model folder, None)}`` of the TRL run's saves during training (``--save_at``)."""
    found = {}
    for path in glob.glob(os.path.join(out, "actor-step-*")):
        found[int(path.rsplit("-", 1)[1])] = (path, None)
    return found


def checkpoint_weights(out: str) -> dict:
    """``{step: the actor's model-states file}`` of a step-3 run's checkpoints."""
    found = {}
    for path in glob.glob(os.path.join(out, "**", "actor", "**", "mp_rank_00_model_states.pt"), recursive=True):
        match = re.search(r"(\d+)", os.path.relpath(path, out).split(os.sep)[0] + os.sep +
                          os.path.relpath(path, out).split(os.sep)[1])
        if match:
            found[int(match.group(1))] = path
    return found


ROW_NAMES = {"base": "SmolLM2-135M-Instruct", "grpo": "+ step 3 GRPO (this project)", "trl": "+ TRL GRPOTrainer",
             "ppo": "+ comparisons → step 2 → step 3 PPO"}


def metric_cells(r: dict) -> str:
    """One evaluated model's cells of both tables: strict | F1 constrained / plain | length | bare | KL | GSM8K."""
    nan = float("nan")
    return (f"{r['strict']:.3f} | {r['f1']:.3f} / {r.get('plain_f1', nan):.3f} | {r['length']:.1f} | "
            f"{100 * r['bare']:.1f} % | {r.get('kl', 0.0):.2f} | {100 * r.get('gsm8k', nan):.1f} %")


def table(results: dict) -> str:
    """The held-out table (markdown): one row per model, the base first."""
    rows = [name for name in ("base", "grpo", "trl", "ppo") if name in results]
    head = ("| model | strict compliance | F1 constrained / plain | length (words) | bare answers | KL to base "
            "| GSM8K | wall |")
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for name in rows:
        r = results[name]
        wall = results.get("wall", {}).get(name)
        lines.append(f"| {ROW_NAMES[name]} | {metric_cells(r)} | {f'{wall / 60:.0f} min' if wall else '—'} |")
    types = sorted(results["base"]["per_type"])
    lines += ["", "| type (held-out count) | " + " | ".join(ROW_NAMES[n].split(" (")[0] for n in rows) + " |",
              "|---|" + "---|" * len(rows)]
    for t in types:
        n = results["base"]["type_counts"][t]
        lines.append(f"| `{t.split(':')[1]}` ({n}) | " + " | ".join(
            f"{results[name]['per_type'].get(t, float('nan')):.2f}" for name in rows) + " |")
    return "\n".join(lines)


def seeds_table(runs: dict) -> str:
    """``runs``: ``{name: results.json of one bench run}`` (a recipe's seeds, each in its own ``--work``). One line
    per trained row of each run, with the types that fell more than 3 points below that run's base, then each
    row's mean strict compliance, its gain over the base and its range: a recipe judged on several seeds."""
    head = ("| run | row | strict | F1 constrained / plain | length | bare | KL | GSM8K | types falling > 3 points |")
    lines, strict = [head, "|---|---|---|---|---|---|---|---|---|"], {}
    for name, results in runs.items():
        base = results["base"]
        for row in ("grpo", "trl", "ppo"):
            if row not in results:
                continue
            r = results[row]
            falls = [f"{t.split(':')[1]} {100 * (r['per_type'][t] - b):+.0f}"
                     for t, b in base["per_type"].items() if r["per_type"][t] < b - 0.03 - 1e-9]
            strict.setdefault(row, []).append((r["strict"], base["strict"]))
            lines.append(f"| {name} | {row} | {metric_cells(r)} | {', '.join(falls) or 'none'} |")
    lines.append("")
    for row, pairs in strict.items():
        mean = sum(s for s, _ in pairs) / len(pairs)
        gain = mean - sum(b for _, b in pairs) / len(pairs)
        lines.append(f"{row}: mean strict {mean:.3f} ({100 * gain:+.1f} points) over {len(pairs)} run(s), "
                     f"range {min(s for s, _ in pairs):.3f} – {max(s for s, _ in pairs):.3f}")
    return "\n".join(lines)


def plot(curves: dict, path: str) -> list:
    """Strict compliance and the content guards against the RL step. ``curves``: ``{label: {step: {"strict",
    "f1", "bare", ...}}}``, one line each (a run's held-out curve); a label ending in ``, <run>`` shares its colour
    with the other runs of its row and takes a line style of its own. Grey: the issue's target and guards, from the
    first curve's step 0 (the base). Returns the labels in the order drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    colours, drawn = {}, {}  # per row: its colour, and how many of its runs are drawn (the line style)
    for label, curve in curves.items():
        row = label.partition(", ")[0]
        colour = colours.setdefault(row, f"C{len(colours)}")
        style = ("-", "--", ":", "-.")[drawn.get(row, 0) % 4]
        drawn[row] = drawn.get(row, 0) + 1
        steps = sorted(curve, key=int)
        x = [int(s) for s in steps]
        for ax, key in zip(axes, ("strict", "f1", "bare")):
            ax.plot(x, [curve[s][key] for s in steps], marker="o", color=colour, linestyle=style, label=label)
    base = next((curve["0"] for curve in curves.values() if "0" in curve), None)
    if base is not None:  # the targets, grey: what each panel's lines must clear
        for ax, level, text in ((axes[0], base["strict"] + 0.20, "target: base + 20 points"),
                                (axes[1], 0.9 * base["f1"], "guard: 90 % of the base"),
                                (axes[2], 0.05, "guard: at most 5 %")):
            ax.axhline(level, color="grey", linestyle="--", linewidth=1)
            ax.annotate(text, (0, level), textcoords="offset points", xytext=(2, 3), fontsize=7, color="grey")
    for ax, title in zip(axes, ("strict compliance (held out)", "unigram F1 vs alpaca's answer",
                                "bare answers (only the constraint)")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return list(curves)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--work", default="/tmp/real-rl")
    parser.add_argument("--rows", default="grpo", help="comma-separated: grpo, trl, ppo")
    parser.add_argument("--steps", type=int, default=22)
    parser.add_argument("--eval_every", type=int, default=11)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group", type=int, default=4, help="answers per prompt")
    parser.add_argument("--answer_len", type=int, default=128)
    parser.add_argument("--gsm8k_tokens", type=int, default=192)
    parser.add_argument("--lr", type=float, default=4e-5)
    parser.add_argument("--kl", type=float, default=0.04)
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (GRPO and TRL rows)")
    parser.add_argument("--schedule", default="constant", help="learning-rate schedule (constant, cosine, linear)")
    parser.add_argument("--warmup", type=int, default=0, help="warm-up steps of the learning rate")
    parser.add_argument("--seed", type=int, default=1234, help="the GRPO and TRL rows' seed (sampling, data order)")
    parser.add_argument("--estimator", choices=sorted(TRL_SCALE_REWARDS), default="grpo",
                        help="the GRPO row's --advantage_estimator: grpo divides a group's centred scores by their "
                        "std, dr_grpo does not (TRL's row: scale_rewards group / none); both rows take the token mean")
    parser.add_argument("--reward_fn", default=GUARDED, help="the GRPO row's --reward_fn (a path from the "
                        "repository's root: the steps run there)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="the GRPO and TRL rows' training precision (step 3's --dtype; TRL's bf16 autocast); "
                             "the evaluation is fp32 either way")
    parser.add_argument("--autocast", action="store_true",
                        help="with --dtype bf16, the GRPO row keeps fp32 weights and runs its forward passes under "
                             "bf16 autocast (step 3's --torch_autocast), as TRL's bf16 does")
    parser.add_argument("--generation_dtype", choices=("bf16",), default=None,
                        help="the GRPO row generates from a bf16 copy of its actor (step 3's --generation_dtype): "
                             "with --autocast, the same answers' distribution in less time; TRL's row has no "
                             "such setting and generates under its autocast")
    parser.add_argument("--overlong_penalty", type=int, default=0, metavar="L",
                        help="DAPO's soft overlong penalty over the last L tokens before --answer_len, added to the "
                             "reward (step 3's --overlong_penalty; TRL's get_soft_overlong_punishment); 0: off")
    parser.add_argument("--overlong_penalty_weight", type=float, default=1.0, metavar="W",
                        help="the overlong penalty's weight: −W at --answer_len (step 3's --overlong_penalty_weight; "
                             "TRL's reward_weights); DAPO's 1 by default")
    parser.add_argument("--adam_betas", type=float, nargs=2, default=[0.9, 0.95], metavar=("BETA1", "BETA2"),
                        help="AdamW's betas on every row (steps' --adam_betas; TRL's adam_beta1/2): DeepSpeed-Chat's "
                             "0.9 0.95 by default (TRL's own default is 0.9 0.999)")
    parser.add_argument("--train_weights", default=None, metavar="TYPE=W,...",
                        help="the data builder's --train_weights: these types W times as often in the training rows "
                             "(GRPO and TRL rows alike); the held-out rows unchanged")
    parser.add_argument("--peer-venv", dest="peer_venv", default=os.path.join(REPO, ".venv-peers"))
    parser.add_argument("--summarize", nargs="+", metavar="WORK", help="print the table of finished runs (one "
                        "--work folder each: the seeds of a recipe) with each row's mean, and stop")
    parser.add_argument("--plot", metavar="PNG", help="with --summarize: draw every run's held-out curves in one "
                        "figure (a colour per row, a line style per run)")
    opts = parser.parse_args(argv)
    if opts.plot and not opts.summarize:
        parser.error("--plot goes with --summarize (a single run draws WORK/real_rl.png itself)")
    if opts.autocast and opts.dtype != "bf16":
        parser.error("--autocast needs --dtype bf16")
    if opts.generation_dtype and opts.dtype == "bf16" and not opts.autocast:
        parser.error("--generation_dtype bf16 with bf16 weights copies nothing new: add --autocast")
    if opts.train_weights:  # the data builder's check, before any model or data: one error line, exit 2
        from ifeval_data import parse_weights  # beside this script

        parse_weights(opts.train_weights, TYPES)
    rows = [r.strip() for r in opts.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ("grpo", "trl", "ppo")]
    if unknown or not rows:
        raise UserInputError(f"--rows {opts.rows}: {', '.join(map(repr, unknown)) or 'none given'}; give grpo, trl "
                             "or ppo (comma-separated)")
    if opts.summarize:
        folders = [os.path.normpath(work) for work in opts.summarize]
        twice = sorted({work for work in folders if folders.count(work) > 1})
        if twice:
            raise UserInputError(f"--summarize: {', '.join(twice)} given twice")
        runs = {}
        for work in folders:
            path = os.path.join(work, "results.json")
            if not os.path.exists(path):
                raise UserInputError(f"--summarize: no {path}: not a finished run's --work folder")
            results = read_results(path)
            if "base" not in results:
                raise UserInputError(f"--summarize: {path} has no base model's evaluation: not a finished run")
            name = os.path.basename(work)
            if name in runs:  # another parent's folder of the same name: keep both, named by their parents
                name = os.path.join(os.path.basename(os.path.dirname(work)), name)
            runs[name] = results
        print(seeds_table(runs))
        if opts.plot:
            short = {"grpo": "step 3 GRPO", "trl": "TRL GRPOTrainer", "ppo": "step 3 PPO"}
            plot({f"{short[row]}, {name}": results["curve"][row] for row in short
                  for name, results in runs.items() if row in results.get("curve", {})}, opts.plot)
            print(f"plot: {opts.plot}")
        return 0
    if not os.path.isdir(opts.model) or not os.path.isdir(SHARED):
        print(f"bench_real_rl: needs the model folder {opts.model} and {SHARED}; skipped")
        return 0
    import torch

    from utils.runtime import cpu_capability, cpu_flags, slow_bf16_warning

    slow = None if torch.cuda.is_available() else slow_bf16_warning(
        opts.dtype, opts.autocast, opts.generation_dtype, cpu_capability(), cpu_flags())
    if slow:  # the GRPO and TRL rows would crawl: say so before the hour starts
        print(f"warning: {slow.replace('--torch_autocast', '--autocast')}", file=sys.stderr, flush=True)
    os.makedirs(opts.work, exist_ok=True)
    data = build_data(opts.work, opts.train_weights)
    results_path = os.path.join(opts.work, "results.json")
    results = read_results(results_path) if os.path.exists(results_path) else {}

    def save():
        with open(results_path, "w") as f:
            json.dump(results, f, indent=1)

    base_model = load(opts.model)[0]
    if "base" not in results:
        print("evaluating the base model", flush=True)
        results["base"] = evaluate(opts.model, data, opts)
        save()
    for row in rows:
        out = os.path.join(opts.work, row)
        if row == "grpo":
            if not os.path.exists(os.path.join(out, "actor")):
                results.setdefault("wall", {})[row] = run(grpo_command(opts.model, data, out, opts),
                                                          os.path.join(opts.work, f"{row}.log"))
                save()
            final = os.path.join(out, "actor")
            points = {step: (opts.model, weights) for step, weights in checkpoint_weights(out).items()}
        elif row == "trl":
            final = os.path.join(out, "actor")
            if not os.path.exists(final):
                results.setdefault("wall", {})[row] = run(trl_command(opts.model, data, out, opts),
                                                          os.path.join(opts.work, f"{row}.log"),
                                                          python=os.path.join(opts.peer_venv, "bin", "python"))
                save()
            points = trl_checkpoints(out)
        elif row == "ppo":
            final, points = os.path.join(out, "step3", "actor"), {}
            if not os.path.exists(final):
                walls = [run(cmd, os.path.join(opts.work, f"{row}-{i}.log"))
                         for i, cmd in enumerate(ppo_commands(opts.model, data, out, opts))]
                results.setdefault("wall", {})[row] = sum(walls)
                save()
        curve = results.setdefault("curve", {}).setdefault(row, {"0": {k: results["base"][k] for k in
                                                                       ("strict", "f1", "length", "bare")}})
        for step, (model_dir, weights) in sorted(points.items()):
            if str(step) not in curve and step < opts.steps:
                print(f"evaluating {row} at step {step}", flush=True)
                r = evaluate(model_dir, data, opts, weights=weights, full=False)
                curve[str(step)] = {k: r[k] for k in ("strict", "f1", "length", "bare")}
                save()
        if row not in results:
            print(f"evaluating {row}", flush=True)
            results[row] = evaluate(final, data, opts, base=base_model)
            curve[str(opts.steps)] = {k: results[row][k] for k in ("strict", "f1", "length", "bare")}
            save()
    print("\n" + table(results) + "\n")
    plot({ROW_NAMES[name]: curve for name, curve in results.get("curve", {}).items()},
         os.path.join(opts.work, "real_rl.png"))
    for name in ("base", "grpo"):
        for e in results.get(name, {}).get("examples", []):
            print(f"{name}: {e['prompt']!r}\n  -> {e['answer']!r}")
    print(f"plot: {os.path.join(opts.work, 'real_rl.png')}; numbers: {results_path}")
    return 0


if __name__ == "__main__":
    from utils.entrypoint import run_script

    run_script(main)
