#!/usr/bin/env python
"""Step 2 (alternative): Direct Preference Optimisation of the step-1 model on preference pairs.

    deepspeed main.py --model_name_or_path out/actor --data_path Dahoas/rm-static ...
    python main.py --model_name_or_path out/actor --data_path builtin/preference --output_dir out/dpo

Instead of a reward model + PPO, the policy (a causal LM, usually the step-1 output) is
trained directly on the phase-2 pairs against a frozen copy of itself (the reference
model, a DeepSpeed eval engine):

    z = β·((log π(c) − log π(r)) − (log π_ref(c) − log π_ref(r))),  loss = −log σ(z)   (label smoothing optional)

where ``log π(·)`` sums the log-probabilities of the ANSWER tokens, EOS included (see
:func:`dpo_loss_mask`). Logged: loss, implicit rewards β·(log π − log π_ref) of chosen
and rejected, their margin and the accuracy (chosen reward > rejected reward). The
result is a plain Hugging Face causal-LM folder: use it directly or as the step-3 actor.
With ``--save_interval`` a resumable checkpoint of the policy is written every N optimizer
steps; rerunning the command resumes from it (:mod:`utils.checkpoint`).
"""
if __name__ == "__main__":  # Ctrl-C from the first second on: one line, exit 130 (utils/interrupt.py)
    from utils.interrupt import exit_quietly_on_ctrl_c

    exit_quietly_on_ctrl_c()

import time
from dataclasses import asdict

import torch

from utils.arguments import add_eval_args, add_offload_reference_arg, single_model_parser
from utils.checkpoint import CheckpointManager, run_inputs
from utils.data.data_utils import DataCollatorReward, create_prompt_dataset, pad_multiple
from utils.distributed import get_all_reduce_mean
from utils.entrypoint import run_main
from utils.finite import check_finite
from utils.lora import apply_lora
from utils.model.model_utils import create_hf_model
from utils.preflight import run_step
from utils.model.lean_forward import pair_log_probs
from utils.rl_math import dpo_loss
from utils.runtime import to_device
from utils.training import (Position, check_steps_ran, epoch_batches, epochs, eval_batches, frozen_ds_config,
                            load_tokenizer, make_engine, make_loaders, make_step_engine, report_optimizer_step,
                            save_final_causal_lm, start_step)


def parse_args(argv=None):
    parser = single_model_parser("Step 2 (DPO): direct preference optimisation of a causal LM.",
                                 tensorboard_path="step2_tensorboard")
    g = parser.add_argument_group("dpo")
    g.add_argument("--beta", type=float, default=0.1,
                   help="DPO temperature β (typically 0.1-0.5; the reference model matters less as β → 0).")
    g.add_argument("--label_smoothing", type=float, default=0.0,
                   help="Conservative DPO: assumed probability that a preference label is flipped.")
    add_offload_reference_arg(g)
    add_eval_args(g)
    parser.set_defaults(eval_iters=0)  # DeepSpeed-Chat's DPO evaluates the whole eval split (its step 2: 100 batches)
    return parser.parse_args(argv)


def dpo_loss_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``[2B, T]`` mask of the tokens whose log-probabilities DPO sums: the answers.

    Rows are ``[chosen_1..B; rejected_1..B]``. As in DeepSpeed-Chat, a pair's tokens before
    the first position where chosen and rejected differ are dropped: that is the shared
    prompt (plus any shared start of the answers, whose log-probabilities would cancel in
    the loss anyway). Everything after it that is not padding counts, the EOS included
    (``attention_mask`` marks real tokens even when pad = eos; the reference used
    ``ids != pad`` and so never trained the EOS of OPT-style models).
    """
    B = input_ids.shape[0] // 2
    chosen, rejected = input_ids[:B], input_ids[B:]
    T = input_ids.shape[1]
    positions = torch.arange(T, device=input_ids.device).expand(B, T)
    differs = chosen != rejected
    divergence = torch.where(differs, positions, torch.full_like(positions, T)).min(dim=1).values
    after_prefix = (positions >= divergence[:, None]).repeat(2, 1)
    return attention_mask.long() * after_prefix.long()


def dpo_batch(model, ref_model, batch, beta: float, label_smoothing: float, share_prompt: bool | None = None) -> dict:
    """Loss (with gradient) and detached per-pair statistics for one ``[chosen; rejected]`` batch; ``share_prompt``:
    :func:`~utils.model.lean_forward.pair_log_probs`'s (None: by device, the shared prefix on a CPU only)."""
    ids, att = batch["input_ids"], batch["attention_mask"]
    B = ids.shape[0] // 2
    mask = dpo_loss_mask(ids, att)
    logps = pair_log_probs(model, ids, att, mask, share_prompt)  # the LM head on the answers alone
    with torch.no_grad():
        ref_logps = pair_log_probs(ref_model, ids, att, mask, share_prompt)
    loss, chosen_rewards, rejected_rewards = dpo_loss(logps[:B], logps[B:], ref_logps[:B], ref_logps[B:], beta,
                                                      label_smoothing)
    return {"loss": loss, "chosen_rewards": chosen_rewards, "rejected_rewards": rejected_rewards}


def summarize(out: dict) -> dict:
    """Scalars of one batch: loss, mean chosen/rejected reward, margin, accuracy."""
    c, r = out["chosen_rewards"].float(), out["rejected_rewards"].float()
    return {"loss": out["loss"].item(), "chosen_reward": c.mean().item(), "rejected_reward": r.mean().item(),
            "margin": (c - r).mean().item(), "acc": (c > r).float().mean().item()}


def evaluate_dpo(model, ref_model, dataloader, device, eval_iters: int, beta: float, label_smoothing: float) -> dict:
    """Eval-set means of the :func:`summarize` statistics (per pair; loss per batch), all-reduced across ranks."""
    model.eval()
    # loss sum, batches, chosen sum, rejected sum, correct, pairs
    sums = torch.zeros(6, dtype=torch.float64, device=device)
    with torch.no_grad():
        for batch in eval_batches(dataloader, eval_iters):
            out = dpo_batch(model, ref_model, to_device(batch, device), beta, label_smoothing)
            c, r = out["chosen_rewards"].double(), out["rejected_rewards"].double()
            sums += torch.tensor([out["loss"].item(), 1.0, c.sum().item(), r.sum().item(), (c > r).sum().item(),
                                  float(len(c))], dtype=torch.float64, device=device)
    loss_sum, batches, chosen_sum, rejected_sum, correct, pairs = get_all_reduce_mean(sums).tolist()
    model.train()
    pairs, batches = max(pairs, 1e-12), max(batches, 1e-12)
    return {"loss": loss_sum / batches, "chosen_reward": chosen_sum / pairs, "rejected_reward": rejected_sum / pairs,
            "margin": (chosen_sum - rejected_sum) / pairs, "acc": correct / pairs}


def format_metrics(m: dict) -> str:
    return (f"loss {m['loss']:.4f}, chosen reward {m['chosen_reward']:+.4f}, rejected reward "
            f"{m['rejected_reward']:+.4f}, margin {m['margin']:+.4f}, acc {m['acc']:.4f}")


def main(args):
    return run_step(run, args, phase=2)  # checks first, then the run in its output folder


def run(args, folder):
    """Set-up, training and the final save, in the output folder ``folder`` (:func:`utils.preflight.run_step`)."""
    from transformers import AutoModelForCausalLM

    # ---- set-up: distributed, precision, seed, logger, DeepSpeed configs (policy: train; reference: frozen)
    device, log, ds_config = start_step(args, "step2_dpo")
    ref_ds_config = frozen_ds_config(args.dtype, args.zero_stage, args.offload_reference_model,
                                     args.per_device_train_batch_size, args.gradient_accumulation_steps,
                                     autocast=args.torch_autocast)

    # ---- tokenizer, policy (+ LoRA), reference
    tokenizer = load_tokenizer(args, args.model_name_or_path)
    model = create_hf_model(AutoModelForCausalLM, args.model_name_or_path, tokenizer, ds_config,
                            dropout=args.dropout, trust_remote_code=args.trust_remote_code)
    ref_model = create_hf_model(AutoModelForCausalLM, args.model_name_or_path, tokenizer, ref_ds_config,
                                dropout=args.dropout, trust_remote_code=args.trust_remote_code)
    apply_lora(model, args.lora_module_name, args.lora_dim, args.only_optimize_lora)

    # ---- data: (chosen, rejected) pairs, collated as [chosen…; rejected…]
    train_dataset, eval_dataset = create_prompt_dataset(
        args.local_rank, args.data_path, args.data_split, args.data_output_path, 2, args.seed, tokenizer,
        args.max_seq_len, end_of_conversation_token=args.eot_token, sft_only_data_path=args.sft_only_data_path,
        log=log.info, apply_chat_template=args.apply_chat_template)
    collate = DataCollatorReward(tokenizer.pad_token_id, args.max_seq_len, pad_multiple(device))
    train_loader, eval_loader = make_loaders(train_dataset, eval_dataset, collate, args)

    # ---- engines: the policy's optimizer, schedule and deepspeed.initialize; the frozen reference
    model, total_steps = make_step_engine(model, ds_config, train_loader, args, log)
    ref_model = make_engine(ref_model, ref_ds_config)

    def evaluate(step: int, when: str) -> dict:
        metrics = evaluate_dpo(model, ref_model, eval_loader, device, args.eval_iters, args.beta,
                               args.label_smoothing)
        log.info(f"eval {when}: {format_metrics(metrics)}")
        log.scalars(step, "eval", **metrics)
        return metrics

    # ---- train
    log.info(f"***** Running DPO training: {len(train_dataset)} pairs, {total_steps} optimizer steps, "
             f"beta {args.beta} *****")
    ckpt = CheckpointManager.from_args(args, log, run_inputs(train_dataset, model_name_or_path=args.model_name_or_path),
                                       folder)
    resumed = ckpt.resume({"model": model})  # the reference model is frozen: nothing to save
    position = Position.resumed(resumed)
    first = metrics = resumed["first_eval"] if resumed else evaluate(0, "before training")
    for epoch in epochs(position, args):
        model.train()
        tokens = 0  # real tokens of the current optimizer step's micro-batches (the throughput's unit)
        for batch in epoch_batches(train_loader, position, args, log, f"dpo epoch {epoch + 1}",
                                   args.gradient_accumulation_steps):
            start = time.time()
            tokens += int(batch["attention_mask"].sum())  # on the host, before the copy (no device sync)
            batch = to_device(batch, device)
            out = dpo_batch(model, ref_model, batch, args.beta, args.label_smoothing)
            check_finite(position.step + 1, loss=out["loss"])
            model.backward(out["loss"])
            model.step()
            if model.global_steps == position.step:  # gradients accumulated, no optimizer step yet
                continue
            stats = summarize(out)
            step = position.step = report_optimizer_step(
                log, args, model, epoch, total_steps, format_metrics(stats), tokens, time.time() - start,
                2 * args.per_device_train_batch_size, batch["input_ids"].shape[1], **stats)
            tokens = 0
            if args.eval_interval and step % args.eval_interval == 0 and step < total_steps:
                evaluate(step, f"at step {step}")
            ckpt.step_done(step, {"model": model}, lambda: {**asdict(position), "first_eval": first})
        metrics = evaluate(position.step, f"after epoch {epoch + 1}")
    log.info(f"reward margin: before {first['margin']:+.4f} -> after {metrics['margin']:+.4f}; "
             f"accuracy {first['acc']:.4f} -> {metrics['acc']:.4f}")
    check_steps_ran("optimizer step", position.step, total_steps, [model])

    # ---- save (a plain HF causal-LM folder)
    save_final_causal_lm(folder, model, tokenizer, args, log)
    log.close()
    return {"margin_before": first["margin"], "margin": metrics["margin"], "accuracy_before": first["acc"],
            "accuracy": metrics["acc"], "eval_loss": metrics["loss"], "steps": position.step}


if __name__ == "__main__":
    run_main(main, parse_args())
