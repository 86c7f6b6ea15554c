#!/usr/bin/env python
"""One TRL trainer on the peer bench's data, timed step by step: run by ``bench/bench_peers.py`` inside the peer
virtual environment (TRL is never a dependency of this project; this file imports it and nothing of the project
except the pure-Python rewards: gsm8k, through ``PYTHONPATH``, and the real-model bench's ``ifeval_guarded``, by
its file).

    python bench/peers/trl_run.py grpo --model DIR --data FILE --out DIR --steps 8 [--batch 16 ...]

Writes ``OUT/steps.jsonl``: one line per optimizer step, ``{"step", "time", "tokens", "samples"}`` (``time``: wall
clock at the step's end; ``tokens``: the real (not padding) tokens of the step's sequences; ``samples``:
completions for GRPO and SFT sequences, pairs for the reward model and DPO).
"""
from __future__ import annotations

import argparse
import json
import os
import time

# the real-model bench's reward, by the file hook step 3's --reward_fn takes (utils.reward_functions.load_reward_fn)
GUARDED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ifeval_reward.py") + \
    ":ifeval_guarded"


def read_jsonl(path: str) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def mask_tokens(inputs: dict, counted: tuple) -> int:
    """Real tokens of a batch: the sums of its attention masks named in ``counted`` (key, weight)."""
    return int(sum(weight * inputs[key].sum().item() for key, weight in counted if key in inputs))


class StepLog:
    """A ``TrainerCallback`` writing one line per optimizer step (tokens counted by the wrapped training step)."""

    def __init__(self, path: str, samples: int):
        from transformers import TrainerCallback

        self.path, self.samples, self.tokens, self.lines = path, samples, 0, []
        log = self

        class Callback(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                log.lines.append({"step": state.global_step, "time": time.time(), "tokens": log.tokens,
                                  "samples": log.samples})
                log.tokens = 0
                with open(log.path, "w") as f:
                    f.writelines(json.dumps(line) + "\n" for line in log.lines)

            def on_log(self, args, state, control, logs=None, **kwargs):  # GRPO: cumulative num_tokens
                if logs and "num_tokens" in logs:
                    log.num_tokens.append(logs["num_tokens"])

        self.callback = Callback()
        self.num_tokens = []


def on_gpu() -> bool:
    """Train on the GPU when there is one (the real-model bench's seed sweep), else on the CPU."""
    import torch

    return torch.cuda.is_available()


def common_args(args) -> dict:
    return dict(output_dir=os.path.join(args.out, "trl"), max_steps=args.steps, logging_steps=1,
                learning_rate=args.lr, lr_scheduler_type=args.lr_scheduler, warmup_steps=args.warmup,
                use_cpu=not on_gpu(), bf16=args.dtype == "bf16", fp16=False, report_to=[], save_strategy="no",
                eval_strategy="no", seed=args.seed,
                gradient_checkpointing=False, gradient_accumulation_steps=1, dataloader_num_workers=0,
                adam_beta1=args.adam_betas[0], adam_beta2=args.adam_betas[1], model_init_kwargs={"dtype": "float32"})


def grpo_task(args):
    """``(dataset, reward function)`` of ``--task``: GSM8K questions scored by the last number (our ``gsm8k``), or
    IFEval-format rows scored by the real-model bench's ``ifeval_guarded`` (the rows' instruction ids and kwargs reach
    it as columns), loaded as step 3 loads it: ``--reward_fn bench/ifeval_reward.py:ifeval_guarded``."""
    from datasets import Dataset

    from utils import reward_functions

    rows = read_jsonl(args.data)

    def texts(completions):
        return [c[0]["content"] if isinstance(c, list) else c for c in completions]

    if args.task == "gsm8k":
        data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["question"]}], "answer": r["answer"]}
                                  for r in rows])

        def reward(prompts, completions, answer, **kwargs):
            return reward_functions.gsm8k([""] * len(answer), texts(completions),
                                          [{"reference_answer": a} for a in answer])
    else:
        data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}],
                                   "row": json.dumps({k: r[k] for k in ("instruction_id_list", "kwargs",
                                                                        "reference_output") if k in r})}
                                  for r in rows])

        guarded = reward_functions.load_reward_fn(GUARDED)

        def reward(prompts, completions, row, **kwargs):
            return guarded([""] * len(row), texts(completions), [json.loads(r) for r in row])
    return data, reward


def run_grpo(args, log: StepLog):
    from trl import GRPOConfig, GRPOTrainer

    data, reward = grpo_task(args)

    rewards, weights = [reward], [1.0]
    if args.overlong_penalty:  # DAPO's soft overlong punishment, weighted and summed with the task's reward as step 3
        from trl.rewards import get_soft_overlong_punishment

        rewards.append(get_soft_overlong_punishment(args.answer_len, args.overlong_penalty))
        weights.append(args.overlong_penalty_weight)
    config = GRPOConfig(**common_args(args), per_device_train_batch_size=args.batch, num_generations=args.group,
                        max_completion_length=args.answer_len, temperature=args.temperature, top_p=1.0, top_k=0,
                        beta=args.beta, loss_type=args.loss_type, scale_rewards=args.scale_rewards, epsilon=0.2,
                        num_iterations=1, reward_weights=weights)
    trainer = GRPOTrainer(model=args.model, reward_funcs=rewards, args=config, train_dataset=data)
    trainer.add_callback(log.callback)
    if args.save and args.save_at:
        trainer.add_callback(save_at_steps(trainer, args.save_at, args.save))
    trainer.train()
    if args.save:
        trainer.save_model(args.save)
        trainer.processing_class.save_pretrained(args.save)
    # tokens per step from TRL's own cumulative count (prompt + completion tokens, padding excluded)
    counts = [0] + log.num_tokens
    for line, (before, after) in zip(log.lines, zip(counts, counts[1:])):
        line["tokens"] = int(after - before)


def run_grpo_loss(args, log: StepLog):
    """TRL's GRPO loss and gradient on a batch step 3 sampled (``bench/bench_trl_parity.py``): ``--data`` is its
    ``batch.pt`` (prompt and completion ids and masks, scores, reference log-probs); writes ``OUT/grads.pt``
    (``loss``, ``logprobs``, ``advantages``, ``grads`` of every weight, the ``optimizer`` settings TRL would step
    with). The advantages are TRL's own formula (``scale_rewards="group"``: the group's sample std + 1e-4), the
    loss TRL's ``compute_loss`` as ``run_grpo`` configures it (``loss_type="dapo"``), in fp32."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    batch = torch.load(args.data, weights_only=True)
    B, G = len(batch["scores"]), batch["group"]
    args.steps, args.dtype = 1, "fp32"
    config = GRPOConfig(**common_args(args), per_device_train_batch_size=B, num_generations=G,
                        max_completion_length=batch["completion_ids"].shape[1], beta=batch["beta"],
                        loss_type="dapo", scale_rewards="group", epsilon=0.2, num_iterations=1)
    data = Dataset.from_list([{"prompt": "unused"}] * B)
    trainer = GRPOTrainer(model=args.model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          args=config, train_dataset=data)
    model = trainer.model.train()
    scores = batch["scores"].view(-1, G)
    advantages = ((scores - scores.mean(dim=1, keepdim=True)) / (scores.std(dim=1, keepdim=True) + 1e-4)).flatten()
    inputs = {k: batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask",
                                    "ref_per_token_logps")}
    inputs.update(advantages=advantages, old_per_token_logps=None,
                  num_items_in_batch=batch["completion_mask"].sum().float())
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which this bypasses
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    with torch.no_grad():
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        logprobs, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, ids.shape[1] -
                                                                    inputs["prompt_ids"].shape[1])
    optimizer = {"optimizer": f"{config.optim}", "betas": str((config.adam_beta1, config.adam_beta2)),
                 "eps": str(config.adam_epsilon), "weight decay": str(config.weight_decay),
                 "gradient clipping (max norm)": str(config.max_grad_norm)}
    torch.save({"loss": float(loss), "logprobs": logprobs * inputs["completion_mask"], "advantages": advantages,
                "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None},
                "optimizer": optimizer}, os.path.join(args.out, "grads.pt"))


def save_at_steps(trainer, steps: str, final: str):
    """A callback saving the model and tokenizer after each optimizer step of ``steps`` ("11" or "5,11") to
    ``FINAL-step-N`` (the held-out curve of the real-model bench)."""
    from transformers import TrainerCallback

    wanted = {int(s) for s in steps.split(",") if s.strip()}

    class Save(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step in wanted:
                path = f"{final}-step-{state.global_step}"
                trainer.model.save_pretrained(path)
                trainer.processing_class.save_pretrained(path)

    return Save()


def _wrap_counting(trainer, log: StepLog, counted: tuple):
    step = trainer.training_step

    def training_step(model, inputs, *rest, **kwargs):
        log.tokens += mask_tokens(inputs, counted)
        return step(model, inputs, *rest, **kwargs)

    trainer.training_step = training_step


def run_sft(args, log: StepLog):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    data = Dataset.from_list([{"prompt": r["prompt"], "completion": [{"role": "assistant", "content": r["chosen"]}]}
                              for r in read_jsonl(args.data)])
    config = SFTConfig(**common_args(args), per_device_train_batch_size=args.batch, max_length=args.max_len,
                       packing=False, padding_free=False)
    trainer = SFTTrainer(model=args.model, args=config, train_dataset=data)
    _wrap_counting(trainer, log, (("attention_mask", 1),))
    trainer.add_callback(log.callback)
    trainer.train()


def _pairs(path):
    from datasets import Dataset

    return Dataset.from_list([{"prompt": r["prompt"], "chosen": [{"role": "assistant", "content": r["chosen"]}],
                               "rejected": [{"role": "assistant", "content": r["rejected"]}]}
                              for r in read_jsonl(path)])


def run_rm(args, log: StepLog):
    from trl import RewardConfig, RewardTrainer

    config = RewardConfig(**common_args(args), per_device_train_batch_size=args.batch, max_length=args.max_len)
    trainer = RewardTrainer(model=args.model, args=config, train_dataset=_pairs(args.data))
    _wrap_counting(trainer, log, (("attention_mask", 1), ("chosen_attention_mask", 1),
                                  ("rejected_attention_mask", 1)))
    trainer.add_callback(log.callback)
    trainer.train()


def run_dpo(args, log: StepLog):
    from trl import DPOConfig, DPOTrainer

    config = DPOConfig(**common_args(args), per_device_train_batch_size=args.batch, max_length=args.max_len,
                       beta=0.1, loss_type="sigmoid", precompute_ref_log_probs=False)
    trainer = DPOTrainer(model=args.model, args=config, train_dataset=_pairs(args.data))
    # [prompt + chosen; prompt + rejected]: the prompt's tokens count twice, as they are processed twice
    _wrap_counting(trainer, log, (("attention_mask", 1), ("prompt_attention_mask", 2),
                                  ("chosen_attention_mask", 1), ("rejected_attention_mask", 1),
                                  ("completion_attention_mask", 1)))
    trainer.add_callback(log.callback)
    trainer.train()


RUNNERS = {"grpo": run_grpo, "sft": run_sft, "rm": run_rm, "dpo": run_dpo, "grpo_loss": run_grpo_loss}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trainer", choices=sorted(RUNNERS))
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True, help="the bench's jsonl (written by bench_peers.py)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4, help="samples per step (GRPO: completions)")
    parser.add_argument("--group", type=int, default=4, help="GRPO: completions per prompt")
    parser.add_argument("--answer_len", type=int, default=48)
    parser.add_argument("--max_len", type=int, default=512)
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--adam_betas", type=float, nargs=2, default=[0.9, 0.95],
                        help="AdamW's betas: the project's (DeepSpeed-Chat's) by default, not transformers' 0.999")
    parser.add_argument("--lr_scheduler", default="constant", help="TRL's lr_scheduler_type (constant, cosine, …)")
    parser.add_argument("--warmup", type=int, default=0, help="warm-up steps of the learning rate")
    parser.add_argument("--temperature", type=float, default=1.0, help="grpo: sampling temperature")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="fp32, or bf16 autocast over the fp32 weights (transformers' bf16=True)")
    parser.add_argument("--task", choices=("gsm8k", "ifeval"), default="gsm8k", help="grpo: data and reward")
    parser.add_argument("--loss_type", default="grpo",
                        help="grpo: TRL's loss_type (dapo = the token mean over the batch, step 3's default)")
    parser.add_argument("--scale_rewards", choices=("group", "batch", "none"), default="group",
                        help="grpo: TRL's scale_rewards (group: GRPO's division by the group's std; none: Dr. GRPO's)")
    parser.add_argument("--overlong_penalty", type=int, default=0, metavar="L",
                        help="grpo: add DAPO's soft overlong punishment over the last L tokens (0: off)")
    parser.add_argument("--overlong_penalty_weight", type=float, default=1.0, metavar="W",
                        help="grpo: the overlong punishment's weight in TRL's reward_weights (the task's reward: 1)")
    parser.add_argument("--save", default=None, help="grpo: save the trained model to this folder")
    parser.add_argument("--save_at", default="", help="grpo: also save after these steps (\"11\"), to SAVE-step-N")
    return parser.parse_args(argv)


def main():
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    log = StepLog(os.path.join(args.out, "steps.jsonl"), args.batch)
    RUNNERS[args.trainer](args, log)
    with open(log.path, "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in log.lines)


if __name__ == "__main__":
    main()
