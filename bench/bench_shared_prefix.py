#!/usr/bin/env python
"""The reward model's and critic's passes with each prompt run once against the plain passes, on step 2's ``--kwise``
batch and step 3's critic and reward model (issue 54: the whole path's time).

    .venv/bin/python bench/bench_shared_prefix.py                                   # tiny-llama, seconds
    .venv/bin/python bench/bench_shared_prefix.py --model /work/rl55/smollm2 --data WORK/ifeval-*/train.jsonl

Batches as the real-model bench's (``bench/bench_real_rl.py``) makes them: ``--prompts`` prompts a batch, each with
``--answers`` answers; prompt lengths those of ``--data``'s prompts in the model's chat template (else 68 tokens,
their mean for SmolLM2's), answer lengths drawn from 20 to ``--answer_len`` with a quarter cut at the cap (the
collection's answers). Token ids are random (the work does not depend on them). Cases:

* step 2, ``--kwise`` fwd + bwd: the batch's distinct answers (prompts × answers rows), every differently ranked pair;
* step 3, critic or reward model forward (no grad): prompts × answers rows, left-padded prompts;
* step 3, critic fwd + bwd: a micro-batch of ``--micro`` rows (whole groups).

Each case runs plain (``share_prefix`` off) and shared, alternating, ``--repeats`` times after one
warm-up; the table gives the medians, the tokens through the backbone and the largest difference of the results.
"""
from __future__ import annotations

if __name__ == "__main__":
    from utils.interrupt import exit_quietly_on_ctrl_c

    exit_quietly_on_ctrl_c()

import argparse
import contextlib
import json
import os
import random
import statistics
import time

import torch


def prompt_lengths(tokenizer, data: str | None) -> list:
    """The chat-template token lengths of ``data``'s prompts (column ``prompt``), or [68]."""
    if not data:
        return [68]
    with open(data) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [len(tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                                        add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False)["input_ids"]) for r in rows]


def answer_lengths(rng: random.Random, n: int, cap: int) -> list:
    return [cap if rng.random() < 0.25 else rng.randint(min(20, cap), cap) for _ in range(n)]


def kwise_batch(tokenizer, rng, lengths, opts) -> dict:
    """A ``--kwise`` batch: each prompt's answers (ending in the EOS) right padded, all pairs of different rank."""
    pad, eos, V = tokenizer.pad_token_id, tokenizer.eos_token_id, len(tokenizer)
    texts, chosen, rejected, group = [], [], [], []
    for g in range(opts.prompts):
        prompt = [rng.randrange(5, V) for _ in range(rng.choice(lengths))]
        first = len(texts)
        for n in answer_lengths(rng, opts.answers, opts.answer_len):
            texts.append(prompt + [rng.randrange(5, V) for _ in range(n - 1)] + [eos])
        ranks = [rng.randrange(3) for _ in range(opts.answers)]
        for i in range(opts.answers):
            for j in range(opts.answers):
                if ranks[i] > ranks[j]:
                    chosen.append(first + i), rejected.append(first + j), group.append(g)
    L = max(map(len, texts))
    L = -(-L // 8) * 8
    ids = torch.full((len(texts), L), pad)
    mask = torch.zeros_like(ids)
    for i, t in enumerate(texts):
        ids[i, :len(t)], mask[i, :len(t)] = torch.tensor(t), 1
    return {"input_ids": ids, "attention_mask": mask, "chosen_index": torch.tensor(chosen),
            "rejected_index": torch.tensor(rejected), "pair_group": torch.tensor(group)}


def step3_batch(tokenizer, rng, lengths, opts) -> tuple:
    """(ids, mask, P): prompts left padded to the longest (a multiple of 8), each with its answers right padded."""
    pad, eos, V = tokenizer.pad_token_id, tokenizer.eos_token_id, len(tokenizer)
    prompts = [[rng.randrange(5, V) for _ in range(rng.choice(lengths))] for _ in range(opts.prompts)]
    answers = [[rng.randrange(5, V) for _ in range(n - 1)] + [eos]
               for _ in prompts for n in answer_lengths(rng, opts.answers, opts.answer_len)]
    P = -(-max(map(len, prompts)) // 8) * 8
    A = max(map(len, answers))
    ids = torch.full((len(answers), P + A), pad)
    mask = torch.zeros_like(ids)
    for r, answer in enumerate(answers):
        prompt = prompts[r // opts.answers]
        ids[r, P - len(prompt):P], mask[r, P - len(prompt):P] = torch.tensor(prompt), 1
        ids[r, P:P + len(answer)], mask[r, P:P + len(answer)] = torch.tensor(answer), 1
    return ids, mask, P


def timed(fn, repeats: int):
    """(median seconds, tokens through the backbone, result) of ``fn()`` → (result, tokens)."""
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llama", help="A built-in tiny model or a model folder.")
    p.add_argument("--data", default=None, help="A train.jsonl whose prompts give the prompt lengths.")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--answers", type=int, default=8)
    p.add_argument("--micro", type=int, default=16, help="Step 3's critic training micro-batch (rows).")
    p.add_argument("--answer_len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--autocast", action="store_true", help="bf16 autocast over fp32 weights (the 106-min command's).")
    p.add_argument("--seed", type=int, default=0)
    opts = p.parse_args(argv)
    if opts.micro % opts.answers:
        p.error("--micro must hold whole groups (a multiple of --answers)")

    from utils.model.critic import create_critic_model
    from utils.model.model_utils import load_hf_tokenizer
    from utils.model.tiny import resolve_model_path

    torch.manual_seed(opts.seed)
    rng = random.Random(opts.seed)
    path = resolve_model_path(opts.model)
    chat = os.path.isfile(os.path.join(path, "tokenizer_config.json")) and bool(opts.data)
    tokenizer = load_hf_tokenizer(path, apply_chat_template=chat)
    model = create_critic_model(path, tokenizer, None, num_padding_at_beginning=0)
    model.loss = "end"
    lengths = prompt_lengths(tokenizer, opts.data)
    counted = {"tokens": 0}
    model.rwtransformer.register_forward_pre_hook(
        lambda m, a, k: counted.__setitem__("tokens", counted["tokens"] + (a[0] if a else k["input_ids"]).numel()),
        with_kwargs=True)
    cast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if opts.autocast else contextlib.nullcontext

    kwise = kwise_batch(tokenizer, rng, lengths, opts)
    ids, mask, P = step3_batch(tokenizer, rng, lengths, opts)
    G = opts.answers

    def step2(share):
        model.share_prefix = share
        model.zero_grad()
        with cast():
            out = model(**kwise)
        out["loss"].backward()
        return torch.cat([out["chosen_mean_scores"], out["rejected_mean_scores"]]).detach()

    def forward(share):
        model.share_prefix = share
        with torch.no_grad(), cast():
            out = model.forward_value(ids, mask, prompt_length=P, group_size=G)
        return out["values"][:, P - 1:].detach()

    def critic_train(share):
        model.share_prefix = share
        model.zero_grad()
        rows = slice(0, opts.micro)
        with cast():
            values = model.forward_value(ids[rows], mask[rows], prompt_length=P, return_value_only=True,
                                         group_size=G)[:, P - 1:-1]
        (values * mask[rows, P:]).sum().backward()
        return values.detach()

    cases = [(f"step 2 --kwise fwd+bwd ({kwise['input_ids'].shape[0]} texts, {len(kwise['chosen_index'])} pairs)",
              step2),
             (f"step 3 critic / reward forward ({len(ids)} rows, P {P})", forward),
             (f"step 3 critic fwd+bwd ({opts.micro} rows)", critic_train)]
    print(f"model {opts.model}, {'bf16 autocast' if opts.autocast else 'fp32'}, {torch.get_num_threads()} threads, "
          f"prompt lengths: {'mean ' + format(statistics.mean(lengths), '.1f') if opts.data else '68'}")
    print("| case | plain s | shared s | speed-up | tokens plain / shared | largest difference |")
    print("|---|---|---|---|---|---|")
    for name, fn in cases:
        fn(False), fn(True)  # warm-up
        results = {}
        for share in (False, True):
            counted["tokens"] = 0
            fn(share)
            tokens = counted["tokens"]
            seconds, out = timed(lambda: fn(share), opts.repeats)
            results[share] = (seconds, tokens, out)
        (t0, n0, r0), (t1, n1, r1) = results[False], results[True]
        print(f"| {name} | {t0:.3f} | {t1:.3f} | {t0 / t1:.2f}× | {n0} / {n1} | {(r0 - r1).abs().max().item():.1e} |")
    return 0


if __name__ == "__main__":
    from utils.entrypoint import run_script

    run_script(main)
