#!/usr/bin/env python
"""What PPO's first update is told: GAE advantages from a critic, against the reward they should carry.

    .venv/bin/python bench/bench_ppo_advantages.py --answers WORK/rm/comparisons --critic WORK/rm/reward
    # a few minutes on 2 CPU cores for 40 prompts × 8 answers (a bench_real_rl.py --rows rm run's folders)

Step 3's PPO (``--advantage_estimator gae``) credits each token of an answer with a GAE advantage built from the
critic's values; DeepSpeed-Chat starts that critic from the step-2 reward model. Whether those advantages carry
the reward at all decides whether the actor can learn, and it can be measured before an hour of RL: this bench
takes a collection's answers (``collect_comparisons.py``'s ``answers.jsonl``: several answers to each prompt,
sampled from the actor), scores them with ``--reward_fn`` (the reward step 3 would give them), runs the critic
over them and computes the advantages of step 3's first update (the actor is the reference then, so the KL
reward is 0 and the score sits on the last action), for each GAE λ and for two critics: the step-2 weights
(DeepSpeed-Chat's start) and values of 0 (a value head that has not learned yet).

It prints, per critic and λ, the Pearson correlation between each token's advantage and its answer's
group-centred score (the score minus the mean score of that prompt's answers: the signal GRPO's advantages are
made of, so 1.0 for GRPO at every token), by token position, and the advantages' spread. A correlation near 0
means the gradient is mostly the critic's noise: the actor moves, but not towards the reward.

With ``--head_lrs``, a second table asks whether the critic could learn the rest, a baseline for each prompt (what
GRPO's group mean gives it): a value head from 0 on the step-2 backbone's states (frozen here; step 3 trains the
whole critic at its ``--critic_learning_rate``), trained as step 3 trains its critic (the value loss, AdamW with
betas 0.9 0.95, one update a batch of ``--batch_prompts`` prompts, each prompt seen once), with returns of λ = γ = 1.
Each batch's advantages are scored before the update on it (so the head never scores what it has learned from), in
four stretches of the run: a head that learns a baseline climbs from the zero values' correlation towards 1.
"""
from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C from the first second on: one line, exit 130 (utils/interrupt.py)
    from utils.interrupt import exit_quietly_on_ctrl_c

    exit_quietly_on_ctrl_c()

import argparse
import os
import time

import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
GUARDED = "bench/ifeval_reward.py:ifeval_guarded"  # the real-model bench's reward (bench_real_rl.py)
BUCKETS = ((0, 8), (8, 32), (32, 64), (64, None))  # token positions of an answer, [start, end)


def centred_scores(scores: list) -> list:
    """``scores``: one list of scores per prompt → each score minus the mean of its prompt's scores."""
    return [[s - sum(group) / len(group) for s in group] for group in scores]


def step0_advantages(values: torch.Tensor, score: float, lam: float, gamma: float = 1.0) -> torch.Tensor:
    """The GAE advantages ``[A]`` of one answer of ``A`` actions at step 3's first update: ``values`` ``[A]`` (the
    critic's, before each action), the reward 0 on every action but the last, which gets ``score`` (the KL
    reward is 0 while the actor is the reference)."""
    from utils.rl_math import gae_advantages_and_returns

    rewards = torch.zeros(1, values.shape[0])
    rewards[0, -1] = score
    return gae_advantages_and_returns(values[None].float(), rewards, torch.ones_like(rewards), gamma, lam)[0][0]


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson's correlation of two 1-D tensors (0 when either is constant)."""
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    norm = x.norm() * y.norm()
    return float((x * y).sum() / norm) if norm > 0 else 0.0


def signal_by_position(advantages: list, centred: list, buckets=BUCKETS) -> list:
    """How much of the reward the advantages carry, by token position. ``advantages``: one ``[A_i]`` tensor per
    answer; ``centred``: each answer's group-centred score. Returns, per ``(start, end)`` bucket (``end`` None: to
    the answer's end) and then over every token, the correlation between each token's advantage in that range and
    its answer's centred score (NaN where no answer reaches the bucket)."""
    cells = []
    for start, end in (*buckets, (0, None)):
        parts = [(a[start:end], torch.full((len(a[start:end]),), float(c))) for a, c in zip(advantages, centred)]
        xs = torch.cat([p[0].double() for p in parts]) if parts else torch.zeros(0)
        ys = torch.cat([p[1].double() for p in parts]) if parts else torch.zeros(0)
        cells.append(pearson(xs, ys) if len(xs) > 1 else float("nan"))
    return cells


def answer_ids(tokenizer, chat, prompt: str, answer: str) -> tuple:
    """``(prompt ids, answer ids)`` as step 3 sees an answer: the chat template's turn (its end-of-turn token last)
    or, without ``chat``, the text's tokens and EOS."""
    from utils.data.chat_template import dschat_messages

    if chat is not None:
        return chat.conversation_ids(dschat_messages(prompt), answer)
    ids = tokenizer(prompt).input_ids
    return ids, tokenizer(" " + answer.strip(), add_special_tokens=False).input_ids + [tokenizer.eos_token_id]


def critic_states(critic, tokenizer, chat, records: list) -> list:
    """The critic backbone's last hidden states ``[A, H]`` (fp32) of each answer of ``records`` (answers.jsonl
    lines), in order: the states before each action (the last prompt token's to the answer's last but one), whose
    values (``critic.v_head``) step 3 reads."""
    states = []
    for record in records:
        for answer in record["answers"]:
            prompt, answer = answer_ids(tokenizer, chat, record["prompt"], answer)
            ids = torch.tensor([prompt + answer])
            with torch.no_grad():
                hidden = critic.rwtransformer(ids, attention_mask=torch.ones_like(ids))[0][0, :-1]
            states.append(hidden[len(prompt) - 1:].float())
    return states


STRETCHES = 4  # --head_lrs: the runs of batches whose correlations are averaged, start to end


def head_learning(states: list, scores: list, lr: float, batch_prompts: int = 4, stretches: int = STRETCHES) -> dict:
    """A value head from 0 trained on frozen ``states`` as step 3 trains its critic. ``states``: one list per
    prompt of its answers' ``[A_i, H]`` states; ``scores``: the answers' scores, alike. The prompts go in batches
    of ``batch_prompts``, in order (a collection's are in its data's shuffled order). On each batch the advantages
    ``G − V_t`` (λ = γ = 1 at the first update: every action's return is the score) are correlated with the
    group-centred scores, then one AdamW step (betas 0.9 0.95, no weight decay) is taken on step 3's value loss
    (old values = the current ones: its clip is idle).

    Returns ``{"corr": [the mean correlation in each of ``stretches`` runs of batches], "spans": [each run's
    ``(first, end)`` batch indices, end excluded], "loss": [each batch's value loss, before its update], "weight":
    [H] the head at the end}``."""
    from utils.rl_math import critic_loss

    batches = [range(i, i + batch_prompts) for i in range(0, len(states) - batch_prompts + 1, batch_prompts)]
    weight = torch.zeros(states[0][0].shape[1], requires_grad=True)
    optimizer = torch.optim.AdamW([weight], lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    corrs, losses = [], []
    for batch in batches:
        answers = [(h, s, c) for p in batch for h, s, c in zip(states[p], scores[p], centred_scores([scores[p]])[0])]
        values = torch.nn.utils.rnn.pad_sequence([h @ weight for h, _, _ in answers], batch_first=True)
        mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(h)) for h, _, _ in answers], batch_first=True)
        returns = torch.tensor([s for _, s, _ in answers])[:, None].expand_as(mask)
        advantages = [(s - v)[:len(h)].detach() for (h, s, _), v in zip(answers, values)]
        corrs.append(signal_by_position(advantages, [c for _, _, c in answers], buckets=())[0])
        loss = critic_loss(values, values.detach(), returns, mask, cliprange_value=0.2)
        losses.append(float(loss.detach()))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    size = -(-len(corrs) // stretches)
    spans = [(i, min(i + size, len(corrs))) for i in range(0, len(corrs), size)]
    return {"corr": [sum(corrs[i:j]) / (j - i) for i, j in spans], "spans": spans, "loss": losses,
            "weight": weight.detach()}


def head_table(states: list, scores: list, lrs: list, batch_prompts: int) -> str:
    """The markdown table of :func:`head_learning` for each learning rate of ``lrs``."""
    sizes = [len(group) for group in scores]
    grouped = [states[sum(sizes[:i]):sum(sizes[:i + 1])] for i in range(len(sizes))]
    runs = [head_learning(grouped, scores, lr, batch_prompts) for lr in lrs]
    spans = runs[0]["spans"]  # the same batches for every learning rate
    names = " / ".join(f"{i + 1}–{j}" for i, j in spans)
    lines = [f"| value head lr | corr(G − V, centred score), batches {names} | value loss, first / last stretch |",
             "|---|---|---|"]
    for lr, run in zip(lrs, runs):
        first, last = (run["loss"][slice(*span)] for span in (spans[0], spans[-1]))
        lines.append(f"| {lr:g} | " + " / ".join(f"{c:.2f}" for c in run["corr"])
                     + f" | {sum(first) / len(first):.3f} / {sum(last) / len(last):.3f} |")
    return "\n".join(lines)


def table(values: list, scores: list, lams: list, gamma: float) -> str:
    """The markdown table: per critic (its values; zeros) and λ, the correlation by position and the spread."""
    centred = [c for group in centred_scores(scores) for c in group]
    flat = [s for group in scores for s in group]
    names = " / ".join(f"{s}–{e - 1}" if e else f"{s}+" for s, e in BUCKETS)
    lines = [f"| critic | GAE λ | corr(advantage, centred score) by token: {names} / all | advantage std |",
             "|---|---|---|---|"]
    for name, critic in (("step-2 weights (DeepSpeed-Chat's start)", values),
                         ("values 0 (an untrained value head)", [torch.zeros_like(v) for v in values])):
        for lam in lams:
            advantages = [step0_advantages(v, s, lam, gamma) for v, s in zip(critic, flat)]
            cells = signal_by_position(advantages, centred)
            lines.append(f"| {name} | {lam:g} | " + " / ".join(f"{c:.2f}" for c in cells)
                         + f" | {torch.cat(advantages).std():.3f} |")
    every = torch.cat(values)
    last = torch.stack([v[-1] for v in values])
    sizes = [len(group) for group in scores]
    last_centred = torch.cat([g - g.mean() for g in last.split(sizes)])  # each minus its prompt's mean
    lines += ["", f"{len(flat)} answers to {len(scores)} prompts; scores: mean {sum(flat) / len(flat):.3f}, "
              f"group-centred std {torch.tensor(centred).std():.3f}; the critic's values: mean {every.mean():.3f}, "
              f"std {every.std():.3f} (within an answer {torch.stack([v.std() for v in values]).mean():.3f}); its "
              f"value at the last action against the score: corr {pearson(last, torch.tensor(flat)):.2f} "
              f"(within a prompt {pearson(last_centred, torch.tensor(centred)):.2f})"]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--answers", required=True, help="a collect_comparisons.py output folder (its answers.jsonl)")
    parser.add_argument("--critic", required=True, help="a step-2 folder: the critic's start, as step 3 builds it")
    parser.add_argument("--reward_fn", default=GUARDED, help="step 3's --reward_fn: the score of each answer")
    parser.add_argument("--split", choices=("train", "eval", "all"), default="train",
                        help="answers.jsonl's prompts (all: train, then eval)")
    parser.add_argument("--prompts", type=int, default=40, help="the first this many prompts of the split")
    parser.add_argument("--lams", type=float, nargs="+", default=[0.95, 1.0], help="GAE λ values (step 3's --lam)")
    parser.add_argument("--gamma", type=float, default=1.0, help="step 3's --gamma")
    parser.add_argument("--apply_chat_template", action=argparse.BooleanOptionalAction, default=True,
                        help="the answers' prompts in the critic's chat template (as the collection and step 3 had "
                             "them with --apply_chat_template)")
    parser.add_argument("--head_lrs", type=float, nargs="*", default=[], metavar="LR",
                        help="also train a value head from 0 on the backbone's states at each of these learning "
                             "rates (0 included for the untrained head) and show whether a baseline forms")
    parser.add_argument("--batch_prompts", type=int, default=4, help="prompts a critic update (--head_lrs; step 3's "
                        "--per_device_generation_batch_size)")
    args = parser.parse_args(argv)
    from step2_reward_model_finetuning.collect_comparisons import earlier_answers
    from utils.data.chat_template import chat_format
    from utils.errors import UserInputError
    from utils.model.critic import load_reward_model
    from utils.reward_functions import call_reward_fn, load_reward_fn

    if args.prompts < 1:
        raise UserInputError("--prompts must be ≥ 1")
    if args.head_lrs and args.prompts < args.batch_prompts:
        raise UserInputError(f"--head_lrs needs --prompts ≥ --batch_prompts ({args.batch_prompts})")
    if not os.path.isfile(os.path.join(args.answers, "answers.jsonl")):
        raise UserInputError(f"--answers {args.answers}: no answers.jsonl (a collect_comparisons.py folder)")
    found = earlier_answers(args.answers)
    records = [r for split in (("train", "eval") if args.split == "all" else (args.split,)) for r in found[split]]
    records = records[:args.prompts]
    if not records:
        raise UserInputError(f"--answers {args.answers}: no {args.split} answers")
    path, _, name = args.reward_fn.rpartition(":")
    if path and not os.path.isfile(path) and os.path.isfile(os.path.join(REPO, path)):  # the bench's own file
        args.reward_fn = f"{os.path.join(REPO, path)}:{name}"
    fn = load_reward_fn(args.reward_fn)
    scores = [call_reward_fn(fn, args.reward_fn, [r["prompt"]] * len(r["answers"]), r["answers"],
                             [r["row"]] * len(r["answers"])) for r in records]
    start = time.time()
    critic, tokenizer = load_reward_model(args.critic, "cpu", apply_chat_template=args.apply_chat_template)
    chat = chat_format(tokenizer) if args.apply_chat_template else None
    states = critic_states(critic, tokenizer, chat, records)
    with torch.no_grad():
        values = [critic.v_head(h).squeeze(-1) for h in states]
    print(table(values, scores, args.lams, args.gamma))
    if args.head_lrs:
        print("\n" + head_table(states, scores, args.head_lrs, args.batch_prompts))
    print(f"({time.time() - start:.0f} s; critic {args.critic}, reward {args.reward_fn})")
    return 0


if __name__ == "__main__":
    from utils.entrypoint import run_script

    run_script(main)
