#!/usr/bin/env python
"""A real model gets measurably better: verifiable instruction following on SmolLM2-135M-Instruct, held out.

    .venv/bin/python bench/bench_real_rl.py                   # data, base eval, GRPO, eval: ~1 h on 2 CPU cores
    .venv/bin/python bench/bench_real_rl.py --rows grpo,trl,ppo --work /tmp/real-rl   # + TRL and DeepSpeed-Chat's path
    .venv/bin/python bench/bench_real_rl.py --rows ppo_fn,rm,ppo --work /tmp/real-rl  # PPO with a critic; the RM

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
* ``ppo_fn``: step 3 PPO with a critic (``--advantage_estimator gae``) and the GRPO row's reward, data, seed and
  budget, the critic initialised from the ``rm`` row's reward model as DeepSpeed-Chat does: step 3's PPO machinery
  apart from the reward model's quality;
* ``rm``: the reward model alone. The model's own answers (``--rm_answers`` 8 a prompt, temperature 1) to the
  training instructions, ranked by the checker (``collect_comparisons.py``, ``--rm_label``: ``kept``, the
  constraints an answer keeps past the guards, ``bench/ifeval_reward.py:ifeval_kept``, or ``guarded``, the GRPO
  row's reward with its content term; every pair of scores at least ``--rm_min_gap`` apart, ties left out),
  ``--rm_eval_prompts`` of those instructions kept for the eval pairs (:func:`rm_prompt_rows`; the held-out
  instructions never reach the collector) → step 2 (``--rm_model``, ``--rm_lr``, ``--rm_epochs``, ``--rm_steps``,
  ``--rm_kwise``, ``--num_padding_at_beginning``). Measured: pair accuracy on the eval pairs, overall and per
  type, beside step 2's eval curve; and best-of-``--best_of`` on the held-out sets (the base model's sampled
  answers, the reward model's pick of each prompt, with ``--best_of_mbr β`` pulled toward the prompt's typical
  answer: :func:`best_of_picks`), scored as the greedy answers are, beside the picks at other β
  (:data:`MBR_BETAS`); the draw is kept in ``WORK/best_of`` and reused by a rerun or, with
  ``--best_of_answers_from WORK``, by another reward model's run;
* ``ppo``: DeepSpeed-Chat's whole path: that reward model → step 3 PPO against it alone (no checker in the
  reward), evaluated every ``--eval_every`` steps, its best checkpoint named in results.json (the highest held-out
  strict compliance among the points that keep the content guards, ``best_point``), and ``WORK/ppo_proxy.png``:
  the reward model's mean score (step 3's metrics.jsonl, before any overlong penalty) and the held-out compliance
  against the step. ``--ppo_args`` adds step-3 flags to both PPO rows (GAE λ and γ, value
  clipping, ...; ``--critic_lr`` the critic's learning rate), ``--ppo_ptx C`` InstructGPT's PPO-ptx (step 3's LM
  loss, weighted C, on alpaca's answers to the training instructions: :func:`ptx_texts`).

The held-out evaluation (:func:`evaluate`, greedy, the chat template, the training's 128 tokens) of each model:
strict compliance (every constraint of a prompt kept) and per type, on the template set (``heldout.jsonl``: the
constraints in the training rows' wording) and on the reworded set (``heldout_reworded.jsonl``: the same
instructions and constraints, each in one of three other wordings no training row uses), side by side; the
content guards: unigram F1 against
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
import copy
import glob
import json
import math
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
F1_GUARD, BARE_GUARD = 0.9, 0.05  # the content guards: F1 at least 90 % of the base's, at most 5 % bare answers
RM_LABELS = {"guarded": GUARDED, "kept": "bench/ifeval_reward.py:ifeval_kept"}  # the rm row's --rm_label
EXAMPLES = 3  # answers shown before and after
MBR_BETAS = (0.0, 0.25, 0.5, 1.0, 2.0)  # the rm row's best of n also reported at these --best_of_mbr


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
    """The held-out evaluation of one model (module docstring); ``full``: also the reworded set (``"reworded"``:
    its strict compliance, per type and guards), the plain instructions, KL and GSM8K (the checkpoints' points of
    the plot leave those out)."""
    start = time.time()
    model, tokenizer, fmt = load(model_dir, weights)
    rows = data["heldout"]
    answers = greedy_answers(model, tokenizer, fmt, [r["prompt"] for r in rows], opts.answer_len)
    result = score_constrained(rows, answers)
    result["examples"] = [{"prompt": rows[i]["prompt"], "answer": answers[i]} for i in range(EXAMPLES)]
    if full:
        reworded = data["reworded"]
        result["reworded"] = score_constrained(reworded, greedy_answers(model, tokenizer, fmt,
                                                                        [r["prompt"] for r in reworded],
                                                                        opts.answer_len))
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


def evaluate_reworded(model_dir: str, data: dict, opts, weights: str | None = None) -> dict:
    """The reworded set alone (``evaluate``'s ``"reworded"``), for a model evaluated before the set existed."""
    model, tokenizer, fmt = load(model_dir, weights)
    rows = data["reworded"]
    return score_constrained(rows, greedy_answers(model, tokenizer, fmt, [r["prompt"] for r in rows],
                                                  opts.answer_len))


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


def write_jsonl(path: str, rows) -> None:
    """``rows`` (JSON objects) one a line, written whole or not at all."""
    from utils.files import atomic_write_text

    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def data_folder(work: str, train_weights: str | None = None) -> str:
    """Where the data go: ``WORK/ifeval``, or with ``--train_weights`` a folder named by their hash (the held-out
    files are the same in both; the training file differs)."""
    if not train_weights:
        return os.path.join(work, "ifeval")
    from utils.files import content_hash

    return os.path.join(work, "ifeval-" + content_hash(train_weights.encode(), digits=8))


def build_data(work: str, train_weights: str | None = None) -> dict:
    out = data_folder(work, train_weights)
    if not os.path.exists(os.path.join(out, "heldout_reworded.jsonl")):  # a folder from before it: rebuilt (the
        import train  # other files come out byte for byte the same); the steps' environment, as a bench has it

        proc = subprocess.run([sys.executable, os.path.join("bench", "ifeval_data.py"), "--alpaca",
                               os.path.join(SHARED, "llama-factory-demo", "alpaca_en_demo.json"), "--out", out,
                               "--seed", "1234", "--heldout", "220", "--types", ",".join(TYPES),
                               *(["--train_weights", train_weights] if train_weights else []), "--overwrite"],
                              cwd=REPO, env=train.child_env())
        if proc.returncode != 0:  # its own error line is above
            raise SystemExit(f"bench_real_rl: building the data in {out} failed (exit {proc.returncode})")
    with open(os.path.join(SHARED, "gsm8k", "test.jsonl")) as f:
        gsm8k = [json.loads(line) for _, line in zip(range(200), f)]
    return {"dir": out, "train": os.path.join(out, "train.jsonl"),
            "heldout": read_jsonl(os.path.join(out, "heldout.jsonl")),
            "heldout_plain": read_jsonl(os.path.join(out, "heldout_plain.jsonl")),
            "reworded": read_jsonl(os.path.join(out, "heldout_reworded.jsonl")), "gsm8k": gsm8k}


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


def step3_flags(model: str, data: dict, out: str, opts) -> list:
    """Step 3's flags that the GRPO row and the PPO rows share: the data, seed and budget (prompts and answers a
    step, steps, answer length, sampling, learning rate and schedule, KL coefficient, precision, checkpoints every
    ``--eval_every`` steps), so that the rows differ only in how they score and credit an answer. A row's folder
    with checkpoints and no final actor (a run killed, or a session ended, during training) is resumed (no
    ``--overwrite``: step 3 resumes from the newest checkpoint, and refuses one of other settings)."""
    return ["step3_rlhf_finetuning/main.py", "--actor_model_name_or_path", model, "--data_path", data["train"],
            "--data_split", "0,0,1", "--data_output_path", os.path.join(out, "data"), "--apply_chat_template",
            "--n_samples_per_prompt", str(opts.group), "--per_device_generation_batch_size", str(opts.prompts),
            "--per_device_training_batch_size", str(opts.prompts * opts.group), "--max_prompt_seq_len", "192",
            "--max_answer_seq_len", str(opts.answer_len), "--do_sample", "--temperature", str(opts.temperature),
            "--kl_ctl", str(opts.kl), "--actor_learning_rate", str(opts.lr), "--lr_scheduler_type", opts.schedule,
            "--num_warmup_steps", str(opts.warmup), "--num_train_epochs", "10", "--max_steps", str(opts.steps),
            "--dtype", opts.dtype, "--seed", str(opts.seed), "--save_interval", str(opts.eval_every),
            "--max_checkpoints", "100", "--output_dir", out, *([] if checkpoint_weights(out) else ["--overwrite"]),
            "--adam_betas", *map(str, opts.adam_betas), *(["--torch_autocast"] if opts.autocast else []),
            *(["--generation_dtype", opts.generation_dtype] if opts.generation_dtype else []), *overlong_flags(opts)]


def grpo_command(model: str, data: dict, out: str, opts) -> list:
    return [*step3_flags(model, data, out, opts), "--advantage_estimator", opts.estimator, "--loss_agg", "token_mean",
            "--reward_fn", opts.reward_fn]


def ppo_command(model: str, data: dict, out: str, reward: str, opts, reward_fn: str | None = None) -> list:
    """Step 3 PPO with a critic (``--advantage_estimator gae``: GAE, value clipping, the KL in the reward) on the
    GRPO row's data, seed and budget (:func:`step3_flags`), the critic initialised from the step-2 folder ``reward``
    as DeepSpeed-Chat does; scored by ``reward_fn`` (the ``ppo_fn`` row: the checker, the reward model's score
    unused) or, without one, by that reward model alone (the ``ppo`` row). ``--ppo_args`` come last: they override
    any flag before them (step 3's parser keeps a flag's last value)."""
    return [*step3_flags(model, data, out, opts), "--advantage_estimator", "gae", "--critic_model_name_or_path",
            reward, "--num_padding_at_beginning", str(opts.num_padding_at_beginning), "--critic_learning_rate",
            str(opts.critic_lr), *(["--reward_fn", reward_fn] if reward_fn else []), *ptx_flags(model, data, opts),
            *shlex.split(opts.ppo_args)]


def ptx_flags(model: str, data: dict, opts) -> list:
    """The PPO rows' PPO-ptx flags (``--ppo_ptx C``): step 3's LM loss, weighted C, on alpaca's answers to the
    training instructions (:func:`write_ptx`); none when C is 0."""
    if not opts.ppo_ptx:
        return []
    return ["--unsupervised_dataset_name", write_ptx(data, model), "--unsup_coef", str(opts.ppo_ptx)]


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


def ptx_texts(train_rows: list, fmt) -> list:
    """The PPO rows' PPO-ptx text (``--ppo_ptx``): each training row's instruction without its constraints and
    alpaca's answer to it, one conversation a text as the chat template writes it (the prompt, then the answer turn
    up to its end-of-turn token). Only ``train.jsonl``'s rows: never a held-out instruction."""
    texts = []
    for row in train_rows:
        turn = [{"role": "user", "content": row["instruction"]}]
        texts.append(fmt.prompt(turn) + fmt.answer(turn, row["reference_output"]))
    return texts


def write_ptx(data: dict, model: str) -> str:
    """``ptx-<hash>.jsonl`` (column ``text``: :func:`ptx_texts`) beside the data, named by its content (the texts
    as ``model``'s chat template writes them: another template, another file) and written once; its path (step 3's
    ``--unsupervised_dataset_name``)."""
    from utils.data.chat_template import chat_format
    from utils.files import content_hash
    from utils.model.model_utils import load_hf_tokenizer

    texts = ptx_texts(read_jsonl(data["train"]), chat_format(load_hf_tokenizer(model, apply_chat_template=True)))
    path = os.path.join(data["dir"], f"ptx-{content_hash(json.dumps(texts).encode(), digits=8)}.jsonl")
    if not os.path.exists(path):
        write_jsonl(path, ({"text": t} for t in texts))
    return path


def rm_paths(work: str) -> dict:
    """The reward model's folders (the ``rm`` row's, which the ``ppo_fn`` and ``ppo`` rows reuse): the prompts the
    collector answers, its comparisons, the step-2 reward model."""
    folder = os.path.join(work, "rm")
    return {name: os.path.join(folder, name) for name in ("prompts", "comparisons", "reward", "data")}


def rm_prompt_rows(train_rows: list, eval_prompts: int, seed: int) -> tuple:
    """``(train, eval)``: the training rows (``train.jsonl``'s: never a held-out instruction) split for the reward
    model, the ``eval_prompts`` first in the order of ``sha256(seed:instruction)`` giving the eval comparisons, the
    rest the training ones, both in the file's order: pair accuracy is measured on instructions none of the
    training pairs came from."""
    from utils.files import content_hash

    ranked = sorted(train_rows, key=lambda r: content_hash(f"{seed}:{r['instruction']}".encode(), digits=None))
    held = {r["instruction"] for r in ranked[:eval_prompts]}
    return [r for r in train_rows if r["instruction"] not in held], [r for r in train_rows if r["instruction"] in held]


def write_rm_prompts(data: dict, folder: str, opts) -> None:
    """``folder/train.jsonl`` and ``folder/eval.jsonl`` (:func:`rm_prompt_rows`), the collector's ``--data_path``."""
    os.makedirs(folder, exist_ok=True)
    for name, rows in zip(("train.jsonl", "eval.jsonl"),
                          rm_prompt_rows(read_jsonl(data["train"]), opts.rm_eval_prompts, opts.seed)):
        write_jsonl(os.path.join(folder, name), rows)


def rm_commands(model: str, paths: dict, opts) -> list:
    """DeepSpeed-Chat's step 2 on the model's own answers: ``--rm_answers`` sampled answers to each prompt of
    ``paths["prompts"]`` (:func:`write_rm_prompts`), ranked by the checker's reward, every pair of differently
    scored answers (ties left out) → a reward model started from ``--rm_model`` (the model itself by default),
    InstructGPT's loss on the end scores, evaluated on the eval prompts' pairs every ``--rm_eval_interval`` steps.
    With ``--rm_answers_from``, the answers another run sampled are labelled again instead (no sampling)."""
    common = ["--apply_chat_template", "--seed", str(opts.seed), "--data_output_path", paths["data"]]
    labelling = ["--label_fn", RM_LABELS[opts.rm_label], "--min_gap", str(opts.rm_min_gap), "--short_answers",
                 str(opts.rm_short_answers), "--output_dir", paths["comparisons"], "--overwrite"]
    if opts.rm_answers_from:
        collect = ["--from_answers", rm_paths(opts.rm_answers_from)["comparisons"], *labelling, *common]
    else:
        collect = ["--actor_model_name_or_path", model, "--data_path", paths["prompts"], "--data_split", "0,1,0",
                   "--num_answers", str(opts.rm_answers), "--max_new_tokens", str(opts.answer_len), "--temperature",
                   "1.0", "--max_prompts", str(opts.rm_prompts), "--max_eval_prompts", "0", "--batch_size",
                   str(opts.rm_collect_batch), *labelling,
                   *(["--dtype", opts.generation_dtype] if opts.generation_dtype else []), *common]
    return [
        ["step2_reward_model_finetuning/collect_comparisons.py", *collect],
        ["step2_reward_model_finetuning/main.py", "--model_name_or_path", opts.rm_model or model, "--data_path",
         paths["comparisons"], "--data_split", "0,1,0", "--num_padding_at_beginning",
         str(opts.num_padding_at_beginning), "--max_seq_len", str(opts.rm_max_seq_len),
         "--per_device_train_batch_size", str(opts.rm_batch), "--learning_rate", str(opts.rm_lr),
         "--lr_scheduler_type", opts.rm_scheduler,
         "--num_train_epochs", str(opts.rm_epochs), "--max_steps", str(opts.rm_steps), "--reward_loss", "end",
         "--eval_interval", str(opts.rm_eval_interval), "--eval_iters", "0", *rm_dtype_flags(opts),
         "--adam_betas", *map(str, opts.adam_betas), "--output_dir", paths["reward"], "--overwrite", *common,
         *(["--kwise"] if opts.rm_kwise else [])],
    ]


def rm_dtype_flags(opts) -> list:
    """Step 2's precision flags for ``--rm_dtype``: fp32, or bf16 autocast over fp32 weights (what is saved stays
    fp32), about twice as fast on a CPU with bf16 instructions."""
    return ["--dtype", "fp32"] if opts.rm_dtype == "fp32" else ["--dtype", "bf16", "--torch_autocast"]


def rm_autocast(opts):
    """The context the bench scores with the reward model in: bf16 autocast when step 2 trained under it."""
    import contextlib

    import torch

    if opts.rm_dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device().type, dtype=torch.bfloat16)


def step2_has_kwise() -> bool:
    """Does this checkout's step 2 take ``--kwise`` (InstructGPT's batching: all pairs of a prompt together)?"""
    import contextlib
    import io

    from step2_reward_model_finetuning.main import parse_args

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            parse_args(["--model_name_or_path", "m", "--kwise"])
    except SystemExit:
        return False
    return True


# --------------------------------------------------------------------------- the reward model's measures

def metrics_curve(path: str, phase: str, key: str) -> dict:
    """``{step: value}`` of ``key`` in a step's ``metrics.jsonl`` rows of ``phase`` (step 2's ``eval`` accuracy
    ``acc``, step 3's ``train`` mean ``reward``); ``{}`` without the file."""
    if not os.path.exists(path):
        return {}
    return {str(r["step"]): r[key] for r in read_jsonl(path) if r.get("phase") == phase and key in r}


def proxy_curve(path: str, row: str) -> tuple:
    """``({step: reward}, label)``: the proxy a PPO row's step 3 trained on (its ``metrics.jsonl`` at ``path``), the
    reward model's score (``ppo``) or the checker's (``ppo_fn``), before any ``--overlong_penalty`` (its
    ``task_reward``, which step 3 logs whenever the penalty is on); a log without that metric had no penalty, and
    its ``reward`` is the same thing."""
    label = "reward model's mean score" if row == "ppo" else "checker's mean reward"
    return metrics_curve(path, "train", "task_reward") or metrics_curve(path, "train", "reward"), label


def best_of_settings(model: str, prompts: list, opts) -> dict:
    """What a draw of best-of-n answers depends on (not the reward model): the sampling model (its weights'
    content hash), the prompts, n, temperature, answer length, seed and sampling precision. A kept draw
    (:func:`sampled_answers`) is reused only when every one matches."""
    from utils.files import content_hash
    from utils.model.critic import WEIGHTS_FILE

    weights = os.path.join(model, WEIGHTS_FILE)
    return {"model": content_hash(weights, sample=1 << 20) if os.path.isfile(weights) else os.path.abspath(model),
            "prompts": content_hash(json.dumps(prompts).encode()), "n": opts.best_of,
            "temperature": opts.best_of_temperature, "answer_len": opts.answer_len, "seed": opts.seed,
            "dtype": opts.generation_dtype or "fp32"}


def sampled_answers(paths: list, settings: dict, sample) -> list:
    """The ``[P][N]`` answers of a best-of-n draw: the ones kept in the first of ``paths`` (JSON files
    ``{"settings", "answers"}``) drawn with these ``settings``, else ``sample()``'s, kept in ``paths[0]``
    (atomically) before they are scored. The draw is most of the rm row's evaluation (~30 min for 8 answers to 220
    prompts on 2 CPU cores), is the same for any reward model, and survives a crash or a killed session this way.
    ``paths`` empty: nothing kept."""
    from utils.files import atomic_write_text

    def kept(path: str):
        if not os.path.isfile(path):
            return None
        with open(path) as f:
            draw = json.load(f)
        return draw["answers"] if draw.get("settings") == settings else None

    for path in paths:
        answers = kept(path)
        if answers is not None:
            print(f"    best of {settings['n']}: the draw kept in {path}", flush=True)
            if path == paths[0]:
                return answers
            break  # another run's: kept in this run's folder too
    else:
        answers = sample()
    if paths:
        os.makedirs(os.path.dirname(paths[0]), exist_ok=True)
        atomic_write_text(paths[0], json.dumps({"settings": settings, "answers": answers}, ensure_ascii=False))
    return answers


def best_of_n_answers(actor, tokenizer, fmt, reward_model, reward_tokenizer, prompts: list, opts,
                      keep: tuple | list = ()) -> tuple:
    """``(answers, scores, sampled)``: for each user prompt, ``--best_of`` answers sampled from ``actor`` (at
    ``--best_of_temperature``, the training's answer length, seeded with ``--seed``), the one the reward model
    picks (:func:`best_of_picks`, ``--best_of_mbr``), its ``[P, N]`` scores and the ``[P][N]`` sampled answers.
    The reward model reads them as the collector wrote its pairs: the prompt in DeepSpeed-Chat's text (the
    loader's own wrapping), the answer after a space, in its chat template. ``keep``: the files the draw is reused
    from, the first also where it is kept (:func:`sampled_answers`; the actor is ``--model``)."""
    import torch

    from utils.answers import generate_answers
    from utils.data.chat_template import chat_format
    from utils.data.local_datasets import normalize_prompt
    from utils.model.scoring import score_answers

    n, wrapped = opts.best_of, [normalize_prompt(p) for p in prompts]

    done = 0

    def progress(batch: int) -> None:  # generate_answers reports each batch's prompts (tqdm's update)
        nonlocal done
        done += batch
        print(f"    best of {n}: {done}/{len(prompts)} prompts sampled", flush=True)

    def sample() -> list:
        sampler = copy.deepcopy(actor).to(torch.bfloat16) if opts.generation_dtype else actor  # as the collector's
        flat = generate_answers(sampler, tokenizer, wrapped, opts.answer_len,
                                {"temperature": opts.best_of_temperature, "top_k": 0, "top_p": 1.0}, per_prompt=n,
                                seed=opts.seed, batch_size=8, chat=fmt, progress=progress)
        return [flat[i * n:(i + 1) * n] for i in range(len(prompts))]  # [P][N]

    answers = sampled_answers(list(keep), best_of_settings(opts.model, prompts, opts) if keep else {}, sample)
    with rm_autocast(opts):
        scores = score_answers(reward_model, reward_tokenizer, wrapped, [[" " + a for a in row] for row in answers],
                               opts.rm_max_seq_len, "", device=device(), chat=chat_format(reward_tokenizer))  # [P,N]
    best = best_of_picks(answers, scores, opts.best_of_mbr)  # [P]
    return [row[int(b)] for row, b in zip(answers, best)], scores, answers


def best_of_prefixes(n: int) -> list:
    """The n's of the best-of-n curve one draw of ``n`` answers a prompt gives: 1, 2, 4, … below ``n``, and ``n``
    (the first m answers of n independent ones are m independent ones, so best of m is their best)."""
    return sorted({2 ** i for i in range(n.bit_length()) if 2 ** i < n} | {n})


def consensus(sampled: list) -> list:
    """``[P][N]``: each answer's mean unigram F1 (``ifeval_reward.unigram_f1``) against the other answers to its
    prompt, how typical of them it is (0 for a prompt's only answer): :func:`best_of_picks`' regulariser. It uses
    no reference answer, only the prompt's own sampled ones."""
    from ifeval_reward import unigram_f1  # beside this script

    out = []
    for answers in sampled:
        n = len(answers)
        sim = [[0.0] * n for _ in range(n)]
        for i in range(n):
            for j in range(i + 1, n):  # symmetric: each pair once
                sim[i][j] = sim[j][i] = unigram_f1(answers[i], answers[j])
        out.append([sum(row) / (n - 1) if n > 1 else 0.0 for row in sim])
    return out


def best_of_picks(sampled: list, scores, beta: float):
    """``[P]`` indices: each prompt's pick among its ``sampled`` answers (``[P][N]``, ``scores`` ``[P, N]``): the
    reward model's favourite at β 0, else the largest ``z(score) + β · z(consensus)`` (``regularized_best_of_n``,
    Jinnai et al. 2024's MBR-regularised best of n; :func:`consensus`)."""
    import torch

    from utils.model.scoring import best_of_n, regularized_best_of_n

    if not beta:
        return best_of_n(scores)
    width = scores.shape[1]
    similar = torch.tensor([row + [0.0] * (width - len(row)) for row in consensus(sampled)], dtype=scores.dtype)
    return regularized_best_of_n(scores, similar, beta)


def picked_metrics(rows: list, sampled: list, picks) -> dict:
    """``{strict, f1, length, bare}`` of each prompt's picked answer, scored as the greedy answers are."""
    r = score_constrained(rows, [row[int(b)] for row, b in zip(sampled, picks)])
    return {k: r[k] for k in ("strict", "f1", "length", "bare")}


def best_of_curve(rows: list, sampled: list, scores, beta: float = 0.0) -> dict:
    """``{m: strict, F1, length, bare}`` of best of m for each m of :func:`best_of_prefixes`: the pick
    (:func:`best_of_picks` at ``beta``) among each prompt's first m ``sampled`` answers (``[P][N]``; ``scores``
    ``[P, N]``), scored as the greedy answers are; m = 1 is the sampled answer with no choice."""
    return {str(m): picked_metrics(rows, sampled, best_of_picks([row[:m] for row in sampled], scores[:, :m], beta))
            for m in best_of_prefixes(scores.shape[1])}


def mbr_sweep(rows: list, sampled: list, scores) -> dict:
    """``{β: strict, F1, length, bare}``: best of all N answers picked at each β of :data:`MBR_BETAS`."""
    return {f"{beta:g}": picked_metrics(rows, sampled, best_of_picks(sampled, scores, beta)) for beta in MBR_BETAS}


def best_of_n_kl_bound(n: int, temperature: float):
    """The bound ``log n − (n−1)/n`` on best-of-n's KL to the model it samples from (Stiennon et al. 2020); that
    model is the base only at temperature 1, so at any other there is no bound to the base: ``None``."""
    return math.log(n) - (n - 1) / n if temperature == 1.0 else None


def rm_row_stale(stored: dict, opts) -> bool:
    """Whether an ``rm`` row kept in results.json was measured with another ``--best_of``,
    ``--best_of_temperature``, sampling precision or ``--best_of_mbr`` than this run's (a row from before a flag
    sampled at 1.0, in fp32, and picked at β 0)."""
    return ((stored.get("best_of"), stored.get("best_of_temperature", 1.0), stored.get("generation_dtype", "fp32"),
             stored.get("best_of_mbr", 0.0))
            != (opts.best_of, opts.best_of_temperature, opts.generation_dtype or "fp32", opts.best_of_mbr))


def short_answer_pairs(lines: list, label, k: int) -> list:
    """The pairs a short answer is in, on the eval prompts: each line of the collector's answers.jsonl (its eval
    split: ``prompt``, ``row``, ``answers``, ``scores``) gives its first ``k`` sampled answers and their
    :func:`~utils.data.comparisons.short_cuts` (up to k), the cuts scored by ``label(prompts, answers, rows)``
    (the collector's labeller), and every pair of differently scored answers with a cut in it, the better one
    chosen. A reward model that ranks these right is not paid by PPO's first hack, the short answer."""
    from utils.data.comparisons import ranked_pairs, short_cuts

    pairs = []
    for line in lines:
        originals = line["answers"][:k]
        cuts = short_cuts(originals, k)
        if not cuts:
            continue
        scores = list(line["scores"][:k]) + list(label([line["prompt"]] * len(cuts), cuts, [line["row"]] * len(cuts)))
        cut = {" " + c for c in cuts}
        pairs += [p for p in ranked_pairs(line["prompt"], originals + cuts, scores)
                  if p["chosen"] in cut or p["rejected"] in cut]
    return pairs


def short_pair_accuracy(paths: dict, opts, reward_model, reward_tokenizer) -> dict:
    """The reward model's accuracy on the eval prompts' :func:`short_answer_pairs` (``{"pairs", "correct",
    "accuracy", "short_chosen"}``: the last, pairs where the cut is the better answer), scored as the pair
    accuracy is."""
    from utils.data.chat_template import chat_format
    from utils.model.scoring import pair_accuracy_by_group, score_pair_sides
    from utils.reward_functions import load_reward_fn

    lines = [r for r in read_jsonl(os.path.join(paths["comparisons"], "answers.jsonl")) if r["split"] == "eval"]
    label = load_reward_fn(os.path.join(REPO, RM_LABELS[opts.rm_label]), flag="--rm_label")
    pairs = short_answer_pairs(lines, label, opts.rm_answers)
    with rm_autocast(opts):
        scored = score_pair_sides(reward_model, reward_tokenizer, pairs, opts.rm_max_seq_len,
                                  device=device(), chat=chat_format(reward_tokenizer))
    result = pair_accuracy_by_group(*scored, [None] * len(pairs))["overall"]
    sampled = {line["prompt"]: {a.strip() for a in line["answers"][:opts.rm_answers]} for line in lines}
    result["short_chosen"] = sum(p["chosen"].strip() not in sampled[p["prompt"]] for p in pairs)
    return result


def evaluate_rm(paths: dict, data: dict, opts) -> dict:
    """The ``rm`` row: the reward model alone, before any RL. Pair accuracy on the eval prompts' comparisons
    (``"pair_accuracy"``, overall and per type; ``"step2_curve"``: step 2's own eval accuracy against its steps),
    and best-of-``--best_of`` on the held-out sets: the base model's sampled answers, the reward model's pick of
    each prompt, scored as the greedy answers are (strict, per type, guards; ``"reworded"``: the other set)."""
    from utils.data.chat_template import chat_format
    from utils.model.critic import load_reward_model
    from utils.model.scoring import pair_accuracy_by_group, score_pair_sides

    start = time.time()
    reward_model, reward_tokenizer = load_reward_model(paths["reward"], device(), apply_chat_template=True)
    pairs = read_jsonl(os.path.join(paths["comparisons"], "eval.jsonl"))

    with rm_autocast(opts):
        chosen, rejected = score_pair_sides(reward_model, reward_tokenizer, pairs, opts.rm_max_seq_len,
                                            device=device(), chat=chat_format(reward_tokenizer))
    # the collector's pairs carry their prompt's constraint types: a pair of two counts for both
    accuracy = pair_accuracy_by_group(chosen, rejected, [p.get("instruction_id_list") for p in pairs])
    print(f"reward model: pair accuracy {accuracy['overall']['accuracy']:.3f} on {accuracy['overall']['pairs']} "
          "eval pairs", flush=True)
    short = short_pair_accuracy(paths, opts, reward_model, reward_tokenizer)
    actor, tokenizer, fmt = load(opts.model)
    rows = data["heldout"]
    # the draws, kept in WORK/best_of and reused by any reward model (another run's too: --best_of_answers_from)
    keep = [os.path.join(work, "best_of") for work in (opts.work, opts.best_of_answers_from) if work]
    answers, picked, sampled = best_of_n_answers(actor, tokenizer, fmt, reward_model, reward_tokenizer,
                                                 [r["prompt"] for r in rows], opts,
                                                 [os.path.join(k, "heldout.json") for k in keep])
    result = score_constrained(rows, answers)
    result["examples"] = [{"prompt": rows[i]["prompt"], "answer": answers[i]} for i in range(EXAMPLES)]
    result["best_of_curve"] = best_of_curve(rows, sampled, picked, opts.best_of_mbr)
    result["mbr_sweep"] = mbr_sweep(rows, sampled, picked)
    reworded, picked, sampled = best_of_n_answers(actor, tokenizer, fmt, reward_model, reward_tokenizer,
                                                  [r["prompt"] for r in data["reworded"]], opts,
                                                  [os.path.join(k, "reworded.json") for k in keep])
    result["reworded"] = score_constrained(data["reworded"], reworded)
    result["reworded"]["best_of_curve"] = best_of_curve(data["reworded"], sampled, picked, opts.best_of_mbr)
    result["reworded"]["mbr_sweep"] = mbr_sweep(data["reworded"], sampled, picked)
    n, temperature = opts.best_of, opts.best_of_temperature
    bound = best_of_n_kl_bound(n, temperature)
    if bound is not None:
        result["kl_bound"] = bound
    result.update(pair_accuracy=accuracy, short_pair_accuracy=short, best_of=n, best_of_temperature=temperature,
                  best_of_mbr=opts.best_of_mbr,
                  rm_dtype=opts.rm_dtype,
                  generation_dtype=opts.generation_dtype or "fp32",
                  step2_curve=metrics_curve(os.path.join(paths["reward"], "metrics.jsonl"), "eval", "acc"),
                  seconds=time.time() - start)
    return result


def guards_hold(point: dict, base: dict) -> bool:
    """Whether a held-out point keeps the content guards against the base model's (step 0): F1 at least
    ``F1_GUARD`` of the base's and at most ``BARE_GUARD`` bare answers."""
    return point["f1"] >= F1_GUARD * base["f1"] and point["bare"] <= BARE_GUARD


def best_point(curve: dict) -> dict:
    """``{"step", "strict", "guards"}`` of a row's best held-out point after step 0 (the first of equals), or ``{}``:
    the highest strict compliance among the points that keep the guards against step 0 (``"guards": True``); when
    none does, or there is no step 0 to judge by, the highest of all (``"guards"`` False or None)."""
    steps = sorted((int(s) for s in curve if int(s) > 0))
    if not steps:
        return {}
    base = curve.get("0")
    held = [s for s in steps if base is not None and guards_hold(curve[str(s)], base)]
    step = max(held or steps, key=lambda s: (curve[str(s)]["strict"], -s))
    return {"step": step, "strict": curve[str(step)]["strict"], "guards": bool(held) if base is not None else None}


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


ROWS = ("grpo", "trl", "ppo_fn", "rm", "ppo")  # --rows, in the tables' order
ROW_NAMES = {"base": "SmolLM2-135M-Instruct", "grpo": "+ step 3 GRPO (this project)", "trl": "+ TRL GRPOTrainer",
             "ppo_fn": "+ step 3 PPO with a critic, checker as reward",
             "rm": "+ reward model's best of n (no RL)", "ppo": "+ comparisons → step 2 → step 3 PPO"}


def row_label(name: str, r: dict) -> str:
    """A row's name in the held-out table; the ``rm`` row's says its n, its sampling temperature when not 1 and
    its ``--best_of_mbr`` β when not 0."""
    if name != "rm" or "best_of" not in r:
        return ROW_NAMES[name]
    temperature, beta = r.get("best_of_temperature", 1.0), r.get("best_of_mbr", 0.0)
    at = f" at temperature {temperature:g}" if temperature != 1.0 else ""
    at += f", consensus β {beta:g}" if beta else ""
    return ROW_NAMES["rm"].replace("best of n", f"best of {r['best_of']}{at}")  # the name kept in one place


def _cell(value, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def metric_cells(r: dict) -> str:
    """One evaluated model's cells of both tables: strict (template / reworded set) | F1 constrained / plain |
    length | bare | KL | GSM8K; "—" where a row has no such measure (a run from before the reworded set, the
    best-of-n row's plain answers and GSM8K; its KL is the bound ``log n − (n−1)/n``)."""
    kl = _cell(r.get("kl"), ".2f") if "kl_bound" not in r else f"≤ {r['kl_bound']:.2f}"
    gsm8k = "—" if r.get("gsm8k") is None else f"{100 * r['gsm8k']:.1f} %"
    return (f"{r['strict']:.3f} / {_cell(r.get('reworded', {}).get('strict'), '.3f')} | {r['f1']:.3f} / "
            f"{_cell(r.get('plain_f1'), '.3f')} | {r['length']:.1f} | {100 * r['bare']:.1f} % | {kl} | {gsm8k}")


def type_cell(r: dict, t: str) -> str:
    """A model's compliance on type ``t``: template set / reworded set (the template's alone for older runs)."""
    template = f"{r['per_type'].get(t, float('nan')):.2f}"
    reworded = r.get("reworded", {}).get("per_type", {}).get(t)
    return template if reworded is None else f"{template} / {reworded:.2f}"


def rm_lines(r: dict) -> list:
    """The reward model's own measures (the ``rm`` row): pair accuracy on the eval pairs, overall and per type,
    beside step 2's eval accuracy against its steps."""
    acc, curve = r["pair_accuracy"], r.get("step2_curve", {})
    trained = " → ".join(f"{curve[s]:.2f}" for s in sorted(curve, key=int))
    return [f"reward model: pair accuracy {acc['overall']['accuracy']:.3f} on {acc['overall']['pairs']} eval pairs "
            f"(instructions none of its training pairs came from); step 2's eval accuracy by step: {trained or '—'}",
            "per type: " + ", ".join(f"{t.split(':')[1]} {g['accuracy']:.2f} ({g['pairs']})"
                                     for t, g in acc["groups"].items()),
            *short_pair_line(r), *best_of_curve_lines(r), *mbr_sweep_lines(r)]


def short_pair_line(r: dict) -> list:
    """The rm row's accuracy on short-answer pairs (:func:`short_answer_pairs`), if it was measured."""
    short = r.get("short_pair_accuracy")
    if not short:
        return []
    return [f"short answers: pair accuracy {short['accuracy']:.3f} on {short['pairs']} eval pairs with a short answer "
            f"cut from a sampled one ({short['short_chosen']} with the cut the better)"]


def best_of_curve_lines(r: dict) -> list:
    """The rm row's best-of-m curve (:func:`best_of_curve`), a line per held-out set: strict compliance and F1 at
    each m; none for a row measured before the curve."""
    sets = [("template", r.get("best_of_curve")), ("reworded", r.get("reworded", {}).get("best_of_curve"))]
    return [f"best of m, {name}: " + ", ".join(f"m {m}: strict {p['strict']:.3f} F1 {p['f1']:.3f}"
                                                for m, p in curve.items()) for name, curve in sets if curve]


def mbr_sweep_lines(r: dict) -> list:
    """The rm row's best of n at each β of :data:`MBR_BETAS` (:func:`mbr_sweep`), a line per held-out set."""
    sets = [("template", r.get("mbr_sweep")), ("reworded", r.get("reworded", {}).get("mbr_sweep"))]
    return [f"best of {r.get('best_of')} against β (z(score) + β z(consensus)), {name}: "
            + ", ".join(f"β {b}: strict {p['strict']:.3f} F1 {p['f1']:.3f}" for b, p in sweep.items())
            for name, sweep in sets if sweep]


def table(results: dict) -> str:
    """The held-out table (markdown): one row per model, the base first; then per type, and the reward model's
    pair accuracy and each PPO row's best point when there are."""
    rows = [name for name in ("base", *ROWS) if name in results]
    head = ("| model | strict compliance: template / reworded | F1 constrained / plain | length (words) | bare answers "
            "| KL to base | GSM8K | wall |")
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for name in rows:
        r = results[name]
        wall, rm = results.get("wall", {}).get(name), results.get("wall", {}).get("rm")
        path = f" + rm {rm / 60:.0f}" if wall and rm and name in ("ppo_fn", "ppo") else ""  # the reward model's too
        spent = f"{wall / 60:.0f}{path} min" if wall else "—"
        lines.append(f"| {row_label(name, r)} | {metric_cells(r)} | {spent} |")
    hosts = results.get("host", {})  # the machine each row's wall time was measured on
    if hosts:
        lines += [""] + [f"wall time of {', '.join(row for row in hosts if hosts[row] == host)}: {host}"
                         for host in sorted(set(hosts.values()))]
    types = sorted(results["base"]["per_type"])
    lines += ["", "| type (held-out count): template / reworded | "
              + " | ".join(ROW_NAMES[n].split(" (")[0] for n in rows) + " |", "|---|" + "---|" * len(rows)]
    for t in types:
        n = results["base"]["type_counts"][t]
        lines.append(f"| `{t.split(':')[1]}` ({n}) | " + " | ".join(type_cell(results[name], t) for name in rows)
                     + " |")
    if "rm" in results:
        lines += [""] + rm_lines(results["rm"])
    for name in rows:
        best = results[name].get("best")
        if best:
            guards = {True: ", guards held", False: "; no point held the guards"}.get(best.get("guards"), "")
            lines.append(f"{name}: best held-out point step {best['step']} (strict {best['strict']:.3f}{guards}): "
                         f"{best['checkpoint']}")
    return "\n".join(lines)


def seeds_table(runs: dict) -> str:
    """``runs``: ``{name: results.json of one bench run}`` (a recipe's seeds, each in its own ``--work``). One line
    per trained row of each run, with the types that fell more than 3 points below that run's base (template set),
    then each row's mean strict compliance, its gain over the base and its range, on the template set and (where
    every run has it) the reworded one, and the reward model's mean pair accuracy: a recipe judged on several
    seeds."""
    head = ("| run | row | strict: template / reworded | F1 constrained / plain | length | bare | KL | GSM8K "
            "| types falling > 3 points |")
    lines, strict, pairs_acc = [head, "|---|---|---|---|---|---|---|---|---|"], {}, {}
    for name, results in runs.items():
        base = results["base"]
        for row in ROWS:
            if row not in results:
                continue
            r = results[row]
            falls = [f"{t.split(':')[1]} {100 * (r['per_type'][t] - b):+.0f}"
                     for t, b in base["per_type"].items() if r["per_type"][t] < b - 0.03 - 1e-9]
            reworded = (r.get("reworded", {}).get("strict"), base.get("reworded", {}).get("strict"))
            strict.setdefault(row, []).append((r["strict"], base["strict"], *reworded))
            if "pair_accuracy" in r:
                pairs_acc.setdefault(row, []).append(r["pair_accuracy"]["overall"]["accuracy"])
            lines.append(f"| {name} | {row} | {metric_cells(r)} | {', '.join(falls) or 'none'} |")
    lines.append("")
    for row, points in strict.items():
        mean = sum(p[0] for p in points) / len(points)
        gain = mean - sum(p[1] for p in points) / len(points)
        line = (f"{row}: mean strict {mean:.3f} ({100 * gain:+.1f} points) over {len(points)} run(s), "
                f"range {min(p[0] for p in points):.3f} – {max(p[0] for p in points):.3f}")
        if all(p[2] is not None and p[3] is not None for p in points):
            mean = sum(p[2] for p in points) / len(points)
            line += f"; reworded {mean:.3f} ({100 * (mean - sum(p[3] for p in points) / len(points)):+.1f} points)"
        if row in pairs_acc:
            line += f"; pair accuracy {sum(pairs_acc[row]) / len(pairs_acc[row]):.3f}"
        lines.append(line)
    return "\n".join(lines)


def proxy_plot(reward: dict, label: str, curve: dict, path: str) -> list:
    """The proxy against the target: step 3's mean training reward (``reward``, ``{step: score}``, and its ``label``:
    :func:`proxy_curve`) on the left axis; on the right, the held-out strict compliance and the constrained answers'
    F1 (``curve``: the row's ``{step: {"strict", "f1", ...}}``) with the F1 guard (``F1_GUARD`` of step 0's), against
    the RL step. Where the reward rises and compliance does not, PPO has found what the reward model pays for beyond
    what the checker does; where F1 falls under its guard, it pays for answers that say less. Returns the labels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, left = plt.subplots(figsize=(6, 3.4))
    steps = sorted(reward, key=int)
    left.plot([int(s) for s in steps], [reward[s] for s in steps], color="C0", label=label)
    left.set_xlabel("RL step")
    left.set_ylabel(label, color="C0", fontsize=9)
    right = left.twinx()
    steps = sorted(curve, key=int)
    right.plot([int(s) for s in steps], [curve[s]["strict"] for s in steps], color="C1", marker="o",
               label="held-out strict compliance")
    right.plot([int(s) for s in steps], [curve[s]["f1"] for s in steps], color="C2", marker="s", linestyle="--",
               label="held-out F1, constrained")
    if "0" in curve:
        right.axhline(F1_GUARD * curve["0"]["f1"], color="grey", linestyle=":", label="F1 guard")
    right.set_ylabel("held-out strict compliance / F1", fontsize=9)
    left.grid(alpha=0.3)
    handles = [h for axis in (left, right) for h in axis.get_legend_handles_labels()[0]]
    right.legend(handles=handles, fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [h.get_label() for h in handles]


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
    if base is not None:  # the issue's targets, grey: what each panel's lines must clear
        for ax, level, text in ((axes[0], base["strict"] + 0.20, "target: base + 20 points"),
                                (axes[1], F1_GUARD * base["f1"], f"guard: {F1_GUARD:.0%} of the base"),
                                (axes[2], BARE_GUARD, f"guard: at most {BARE_GUARD:.0%}")):
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--work", default="/tmp/real-rl")
    parser.add_argument("--rows", default="grpo", help="comma-separated: " + ", ".join(ROWS))
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
                        help="the GRPO and PPO rows generate from a bf16 copy of their actor (step 3's "
                             "--generation_dtype): with --autocast, the same answers' distribution in less time; "
                             "TRL's row has no such setting and generates under its autocast. The rm row's "
                             "collector and its best of n sample from bf16 weights too")
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
    g = parser.add_argument_group("the reward model and PPO rows (rm, ppo_fn, ppo)")
    g.add_argument("--rm_prompts", type=int, default=200,
                   help="training prompts the collector answers (0: every training instruction not kept for the "
                        "eval pairs: 294; 200 gave pair accuracy 0.792, 100 gave 0.740; on seed 3, one epoch, fp32: "
                        "0 gave 0.764, 200 gave 0.724; seed 1234: 0.797 and 0.805)")
    g.add_argument("--rm_collect_batch", type=int, default=32, help="the collector's prompts a generate call")
    g.add_argument("--rm_eval_prompts", type=int, default=64,
                   help="training instructions kept apart for the reward model's eval pairs (never trained on)")
    g.add_argument("--rm_answers", type=int, default=8, help="answers sampled a prompt (K: up to K(K-1)/2 pairs)")
    g.add_argument("--rm_label", choices=sorted(RM_LABELS), default="kept",
                   help="the collector's --label_fn: kept (the constraints kept by an answer past the guards: "
                        "ifeval_kept) or guarded (the GRPO row's reward, with its content term: ifeval_guarded)")
    g.add_argument("--rm_short_answers", type=int, default=0, metavar="M",
                   help="the collector's --short_answers: M short answers cut from each train prompt's sampled "
                        "ones (a last line, a first sentence), labelled like the rest, so the reward model sees "
                        "what the labeller's substance guard costs a short answer (PPO's first hack)")
    g.add_argument("--rm_answers_from", metavar="WORK", default=None,
                   help="label the answers another run's rm row sampled (WORK/rm/comparisons/answers.jsonl) instead "
                        "of sampling: another --rm_label, --rm_min_gap or --rm_short_answers without the sampling's "
                        "cost (the prompts and the sampling are that run's)")
    g.add_argument("--rm_min_gap", type=float, default=0.0,
                   help="the collector's --min_gap: closer scores are a tie (no pair)")
    g.add_argument("--rm_model", default=None, help="the model the reward model starts from (default: --model)")
    g.add_argument("--rm_lr", type=float, default=1e-4, help="step 2's learning rate")
    g.add_argument("--rm_scheduler", default="constant", help="step 2's --lr_scheduler_type")
    g.add_argument("--rm_epochs", type=int, default=2, help="step 2's epochs over the comparisons")
    g.add_argument("--rm_steps", type=int, default=0, help="step 2's --max_steps (0: the epochs decide)")
    g.add_argument("--rm_batch", type=int, default=4, help="step 2's batch: prompts (with --rm_kwise) or pairs")
    g.add_argument("--rm_eval_interval", type=int, default=22, help="step 2 evaluates every this many steps")
    g.add_argument("--rm_dtype", choices=("fp32", "bf16"), default="fp32",
                   help="step 2's precision (bf16: autocast over fp32 weights, about twice as fast on a CPU with "
                        "bf16 instructions) and the bench's when it scores with the reward model; with "
                        "--generation_dtype bf16 the collector and best of n sample from bf16 weights too")
    g.add_argument("--rm_max_seq_len", type=int, default=320, help="step 2's --max_seq_len (prompt and answer)")
    g.add_argument("--rm_kwise", action=argparse.BooleanOptionalAction, default=True,
                   help="step 2's --kwise: all pairs of one prompt in one batch (InstructGPT's K-wise batching)")
    g.add_argument("--num_padding_at_beginning", type=int, default=0,
                   help="steps 2 and 3's (0 for a Llama-style tokenizer, 1 for OPT's)")
    g.add_argument("--best_of", type=int, default=8, help="the rm row's answers sampled a held-out prompt")
    g.add_argument("--best_of_answers_from", metavar="WORK", default=None,
                   help="score the best-of-n answers another run drew (WORK/best_of/*.json) when drawn with this "
                        "run's model, n, temperature, answer length, seed and precision: the draw is most of the rm "
                        "row's evaluation and the same for any reward model (each run keeps its own draw in "
                        "--work/best_of)")
    g.add_argument("--best_of_temperature", type=float, default=1.0,
                   help="the rm row's sampling temperature for those answers (lower: closer to the greedy answer's "
                        "content, less to choose from)")
    g.add_argument("--best_of_mbr", type=float, default=0.0, metavar="BETA",
                   help="the rm row's pick: the largest z(reward score) + BETA z(consensus), the consensus an "
                        "answer's mean unigram F1 against the prompt's other answers (Jinnai et al. 2024, against "
                        "a reward model's gamed favourites); 0: the reward model's favourite")
    g.add_argument("--critic_lr", type=float, default=5e-6, help="the PPO rows' critic learning rate "
                   "(DeepSpeed-Chat's 5e-6)")
    g.add_argument("--ppo_ptx", type=float, default=0.0, metavar="C",
                   help="both PPO rows mix step 3's LM loss (InstructGPT's PPO-ptx, DeepSpeed-Chat's unsupervised "
                        "data), weighted C, on alpaca's answers to the training instructions, their constraints "
                        "left out (WORK/ifeval*/ptx-<hash>.jsonl; never a held-out instruction); 0: off")
    g.add_argument("--ppo_args", default="", metavar="FLAGS",
                   help="more step-3 flags for both PPO rows, last on the line (they override the bench's): e.g. "
                        "'--lam 0.9 --cliprange_value 0.5'")
    parser.add_argument("--peer-venv", dest="peer_venv", default=os.path.join(REPO, ".venv-peers"))
    parser.add_argument("--summarize", nargs="+", metavar="WORK", help="print the table of finished runs (one "
                        "--work folder each: the seeds of a recipe) with each row's mean, and stop")
    parser.add_argument("--plot", metavar="PNG", help="with --summarize: draw every run's held-out curves in one "
                        "figure (a colour per row, a line style per run)")
    return parser


def main(argv=None):
    parser = build_parser()
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
    unknown = [r for r in rows if r not in ROWS]
    if unknown or not rows:
        raise UserInputError(f"--rows {opts.rows}: {', '.join(map(repr, unknown)) or 'none given'}; give "
                             f"{', '.join(ROWS[:-1])} or {ROWS[-1]} (comma-separated)")
    if (opts.best_of < 1 or opts.rm_answers < 2 or opts.rm_eval_prompts < 1 or opts.best_of_temperature <= 0
            or opts.rm_collect_batch < 1 or not (math.isfinite(opts.best_of_mbr) and opts.best_of_mbr >= 0)):
        raise UserInputError("--best_of must be ≥ 1, --rm_answers ≥ 2, --rm_eval_prompts ≥ 1, "
                             "--best_of_temperature > 0, --rm_collect_batch ≥ 1 and --best_of_mbr ≥ 0")
    if not (math.isfinite(opts.ppo_ptx) and opts.ppo_ptx >= 0):
        raise UserInputError(f"--ppo_ptx {opts.ppo_ptx}: give a finite weight ≥ 0 (0: no LM loss)")
    if opts.rm_answers_from:
        kept = os.path.join(rm_paths(opts.rm_answers_from)["comparisons"], "answers.jsonl")
        if not os.path.isfile(kept):
            raise UserInputError(f"--rm_answers_from {opts.rm_answers_from}: no {kept} (an rm row's collection keeps "
                                 "its answers there)")
        if os.path.realpath(opts.rm_answers_from) == os.path.realpath(opts.work):
            raise UserInputError(f"--rm_answers_from {opts.rm_answers_from} is the --work folder: give another run's")
    if opts.best_of_answers_from and not os.path.isdir(os.path.join(opts.best_of_answers_from, "best_of")):
        raise UserInputError(f"--best_of_answers_from {opts.best_of_answers_from}: no best_of folder there (an rm "
                             "row's evaluation keeps its draws in WORK/best_of)")
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
            short = {"grpo": "step 3 GRPO", "trl": "TRL GRPOTrainer", "ppo_fn": "step 3 PPO, checker",
                     "ppo": "step 3 PPO, reward model"}
            plot({f"{short[row]}, {name}": results["curve"][row] for row in short
                  for name, results in runs.items() if row in results.get("curve", {})}, opts.plot)
            print(f"plot: {opts.plot}")
        return 0
    if not os.path.isdir(opts.model) or not os.path.isdir(SHARED):
        print(f"bench_real_rl: needs the model folder {opts.model} and {SHARED}; skipped")
        return 0
    import torch

    from utils.runtime import cpu_capability, cpu_flags, slow_bf16_warning, this_host

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
    if "reworded" not in results["base"]:  # a run from before the reworded set: that set's numbers added
        results["base"]["reworded"] = evaluate_reworded(opts.model, data, opts)
        save()

    def trained(row: str, walls: dict) -> None:
        """A row just trained: its wall times kept, an earlier evaluation of that folder (stale) dropped."""
        results.setdefault("wall", {})[row] = sum(walls.values())
        results.setdefault("wall_parts", {})[row] = walls
        results.setdefault("host", {})[row] = this_host()
        results.pop(row, None)
        results.get("curve", {}).pop(row, None)
        save()

    paths = rm_paths(opts.work)

    def reward_model() -> str:
        """The ``rm`` row's step-2 folder, collected and trained first when it is not there yet."""
        from utils.model.critic import WEIGHTS_FILE

        if not os.path.exists(os.path.join(paths["reward"], WEIGHTS_FILE)):
            if opts.rm_kwise and not step2_has_kwise():
                raise UserInputError("--rm_kwise: this checkout's step 2 has no --kwise flag")
            write_rm_prompts(data, paths["prompts"], opts)
            collect, step2 = rm_commands(opts.model, paths, opts)
            walls = {"collect": run(collect, os.path.join(opts.work, "rm-collect.log"))}
            walls["step2"] = run(step2, os.path.join(opts.work, "rm-step2.log"))
            trained("rm", walls)
        return paths["reward"]

    for row in rows:
        out = os.path.join(opts.work, row)
        final = os.path.join(out, "actor")
        if row == "rm":
            reward_model()
            if row not in results or rm_row_stale(results[row], opts):
                print("evaluating the reward model (pair accuracy, best of n)", flush=True)
                results[row] = evaluate_rm(paths, data, opts)
                save()
            elif "short_pair_accuracy" not in results[row]:  # measured before it was: that number added
                from utils.model.critic import load_reward_model

                results[row]["short_pair_accuracy"] = short_pair_accuracy(
                    paths, opts, *load_reward_model(paths["reward"], device(), apply_chat_template=True))
                save()
            continue
        if row == "trl":
            if not os.path.exists(final):
                trained(row, {"trl": run(trl_command(opts.model, data, out, opts), os.path.join(opts.work,
                                                                                                  f"{row}.log"),
                                         python=os.path.join(opts.peer_venv, "bin", "python"))})
            points = trl_checkpoints(out)
        else:
            if not os.path.exists(final):
                if row == "grpo":
                    cmd = grpo_command(opts.model, data, out, opts)
                else:  # PPO with a critic from the reward model's folder: the checker's reward, or the model's
                    cmd = ppo_command(opts.model, data, out, reward_model(), opts,
                                      reward_fn=GUARDED if row == "ppo_fn" else None)
                trained(row, {"step3": run(cmd, os.path.join(opts.work, f"{row}.log"))})
            points = {step: (opts.model, weights) for step, weights in checkpoint_weights(out).items()}
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
        elif "reworded" not in results[row]:  # evaluated before the reworded set: that set added
            results[row]["reworded"] = evaluate_reworded(final, data, opts)
            save()
        if row != "trl":  # the best held-out point, and where its weights are (kept: --max_checkpoints 100)
            best = best_point(curve)
            if best:
                best["checkpoint"] = final if best["step"] >= opts.steps else points[best["step"]][1]
                results[row]["best"] = best
                save()
        if row in ("ppo_fn", "ppo"):  # the proxy (step 3's mean reward) against the target (held-out compliance)
            proxy_plot(*proxy_curve(os.path.join(out, "metrics.jsonl"), row), curve,
                       os.path.join(opts.work, f"{row}_proxy.png"))
    print("\n" + table(results) + "\n")
    plot({ROW_NAMES[name]: curve for name, curve in results.get("curve", {}).items()},
         os.path.join(opts.work, "real_rl.png"))
    for name in ("base", *rows):
        for e in results.get(name, {}).get("examples", []):
            print(f"{name}: {e['prompt']!r}\n  -> {e['answer']!r}")
    print(f"plot: {os.path.join(opts.work, 'real_rl.png')}; numbers: {results_path}")
    return 0


if __name__ == "__main__":
    from utils.entrypoint import run_script

    run_script(main)
