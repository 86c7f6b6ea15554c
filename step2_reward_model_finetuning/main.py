#!/usr/bin/env python
"""Step 2: train a pairwise reward model on (prompt, chosen, rejected) pairs.

    deepspeed main.py --model_name_or_path facebook/opt-350m --num_padding_at_beginning 1 ...
    python main.py --model_name_or_path tiny-opt --data_path builtin/preference --output_dir out/reward

parse → distributed/DeepSpeed config → tokenizer / reward model (backbone + v_head,
+LoRA) → phase-2 pairs → optimizer/scheduler → ``deepspeed.initialize`` → evaluate
(chosen score, rejected score, accuracy) → train, evaluating every ``--eval_interval``
steps and after every epoch → save a step-2 folder (:mod:`utils.model.critic`). With
``--save_interval`` a resumable checkpoint is written every N optimizer steps; rerunning
the command resumes from it (:mod:`utils.checkpoint`).
"""
import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

import torch  # noqa: E402

from utils.arguments import (HelpFormatter, add_checkpoint_args, add_data_args, add_deepspeed_args,  # noqa: E402
                             add_logging_args, add_lora_args, add_model_args, add_training_args, validate_common)
from utils.utils import run_main  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        formatter_class=HelpFormatter, description="Step 2: train a pairwise reward model.")
    add_data_args(parser)
    add_model_args(parser)
    add_training_args(parser)
    add_lora_args(parser)
    add_deepspeed_args(parser)
    add_logging_args(parser, tensorboard_path="step2_tensorboard")
    add_checkpoint_args(parser)
    g = parser.add_argument_group("reward model")
    g.add_argument("--num_padding_at_beginning", type=int, default=1,
                   help="Pad-id tokens every sequence starts with: 1 for OPT (its BOS = pad), 0 for most others.")
    g.add_argument("--eval_interval", type=int, default=0,
                   help="Evaluate every this many optimizer steps (0 = only before training and after each epoch).")
    g.add_argument("--eval_iters", type=int, default=100, help="Maximum eval batches per evaluation.")
    parser.set_defaults(learning_rate=5e-5)
    return parser.parse_args(argv)


def evaluate_reward(model, dataloader, device, eval_iters: int) -> dict:
    """Chosen / rejected mean scores, accuracy (chosen > rejected) and loss over ≤ ``eval_iters`` batches.

    Sums are all-reduced across ranks, so every rank returns the same numbers.
    """
    from utils.utils import get_all_reduce_mean, to_device

    model.eval()
    # correct, pairs, chosen sum, rejected sum, loss sum, batches
    sums = torch.zeros(6, dtype=torch.float64, device=device)
    with torch.no_grad():
        for i, batch in enumerate(dataloader):
            if i == eval_iters:
                break
            out = model(**to_device(batch, device), use_cache=False)
            chosen, rejected = out["chosen_mean_scores"].double(), out["rejected_mean_scores"].double()
            sums += torch.stack([(chosen > rejected).sum().double(), torch.tensor(float(len(chosen)), device=device,
                                                                                  dtype=torch.float64),
                                 chosen.sum(), rejected.sum(), out["loss"].double(),
                                 torch.ones((), device=device, dtype=torch.float64)])
    correct, pairs, chosen_sum, rejected_sum, loss_sum, batches = get_all_reduce_mean(sums).tolist()
    model.train()
    pairs, batches = max(pairs, 1e-12), max(batches, 1e-12)
    return {"acc": correct / pairs, "chosen": chosen_sum / pairs, "rejected": rejected_sum / pairs,
            "loss": loss_sum / batches}


def check_padding_at_beginning(dataset, pad_token_id: int, npab: int, log) -> None:
    """Warn when the data's leading pad-id tokens disagree with ``--num_padding_at_beginning``.

    With OPT-style tokenizers (BOS = pad) and npab 0 every score would be read at position 0.
    """
    from utils.model.reward_model import count_leading_pads

    leading = {count_leading_pads(chosen, pad_token_id) for chosen, _ in dataset.samples[:32]}
    if leading != {npab}:
        log.warning(f"--num_padding_at_beginning is {npab} but the tokenised sequences start with "
                    f"{'/'.join(map(str, sorted(leading)))} pad-id token(s); scores may be read at the wrong "
                    "position (OPT-style tokenizers whose BOS is the pad token need 1, most others 0)")


def format_eval(metrics: dict) -> str:
    return (f"chosen_last_scores (higher is better): {metrics['chosen']:.4f}, "
            f"rejected_last_scores (lower is better): {metrics['rejected']:.4f}, acc: {metrics['acc']:.4f}, "
            f"loss: {metrics['loss']:.4f}")


def main(args):
    # ---- fail fast on bad flags, model paths and data, before any set-up
    from utils.compat import check_zero_combination
    from utils.preflight import preflight

    validate_common(args)
    check_zero_combination(args)
    preflight(args, causal_lms={"--model_name_or_path": args.model_name_or_path}, phase=2)

    import deepspeed
    from torch.utils.data import DataLoader, SequentialSampler
    from torch.utils.data.distributed import DistributedSampler
    from transformers import get_scheduler

    from utils.checkpoint import CheckpointManager, resumable_loader
    from utils.data.data_utils import DataCollatorReward, create_prompt_dataset, pad_multiple
    from utils.ds_utils import create_optimizer, get_train_ds_config, set_batch_sizes
    from utils.errors import check_finite
    from utils.logger import TrainLogger
    from utils.model.critic import create_critic_model, save_reward_model
    from utils.model.model_utils import load_hf_tokenizer
    from utils.module.lora import (convert_linear_layer_to_lora, make_model_gradient_checkpointing_compatible,
                                   only_optimize_lora_parameters)
    from utils.perf import throughput_due, throughput_line
    from utils.utils import barrier, get_world_size, init_distributed, resolve_dtype, set_random_seed, to_device

    # ---- set-up: distributed, precision, DeepSpeed config
    device = init_distributed(args)
    resolve_dtype(args)
    set_random_seed(args.seed)
    log = TrainLogger("step2_model", args.enable_tensorboard, args.tensorboard_path, metrics_dir=args.output_dir)
    ds_config = get_train_ds_config(offload=args.offload, dtype=args.dtype, stage=args.zero_stage,
                                    enable_tensorboard=args.enable_tensorboard,
                                    tb_path=args.tensorboard_path, tb_name="step2_model")
    set_batch_sizes(ds_config, args.per_device_train_batch_size, get_world_size(), args.gradient_accumulation_steps)
    barrier()

    # ---- tokenizer and reward model
    eot = args.eot_token if args.add_eot_token else None
    tokenizer = load_hf_tokenizer(args.model_name_or_path, add_special_tokens=eot,
                                  trust_remote_code=args.trust_remote_code)
    model = create_critic_model(args.model_name_or_path, tokenizer, ds_config, args.num_padding_at_beginning,
                                dropout=args.dropout, zero_stage=args.zero_stage,
                                trust_remote_code=args.trust_remote_code)
    if args.lora_dim > 0:
        convert_linear_layer_to_lora(model, args.lora_module_name, args.lora_dim)
        if args.only_optimize_lora:
            only_optimize_lora_parameters(model, force_optimize_params=["v_head"])
            make_model_gradient_checkpointing_compatible(model.rwtransformer)

    # ---- data: (chosen, rejected) pairs, collated as [chosen…; rejected…]
    train_dataset, eval_dataset = create_prompt_dataset(
        args.local_rank, args.data_path, args.data_split, args.data_output_path, 2, args.seed, tokenizer,
        args.max_seq_len, end_of_conversation_token=args.eot_token, sft_only_data_path=args.sft_only_data_path,
        log=log.info)
    check_padding_at_beginning(train_dataset, tokenizer.pad_token_id, args.num_padding_at_beginning, log)
    distributed = get_world_size() > 1
    collate = DataCollatorReward(tokenizer.pad_token_id, args.max_seq_len, pad_multiple(device))
    train_loader = resumable_loader(train_dataset, args.per_device_train_batch_size, args.seed, collate_fn=collate)
    eval_loader = DataLoader(eval_dataset, collate_fn=collate, batch_size=args.per_device_eval_batch_size,
                             sampler=DistributedSampler(eval_dataset, shuffle=False) if distributed
                             else SequentialSampler(eval_dataset))

    # ---- optimizer, schedule, engine
    optimizer = create_optimizer(model, args.weight_decay, args.learning_rate, args.lora_learning_rate, args.offload)
    steps_per_epoch = math.ceil(len(train_loader) / args.gradient_accumulation_steps)
    total_steps = args.num_train_epochs * steps_per_epoch
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)
    lr_scheduler = get_scheduler(args.lr_scheduler_type, optimizer=optimizer, num_warmup_steps=args.num_warmup_steps,
                                 num_training_steps=total_steps)
    model, optimizer, _, lr_scheduler = deepspeed.initialize(model=model, optimizer=optimizer, args=args,
                                                             config=ds_config, lr_scheduler=lr_scheduler,
                                                             dist_init_required=True)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()

    def evaluate(step: int, when: str) -> dict:
        metrics = evaluate_reward(model, eval_loader, device, args.eval_iters)
        log.info(f"eval {when}: {format_eval(metrics)}")
        log.scalars(step, "eval", **metrics)
        return metrics

    # ---- resume (automatic when --output_dir holds a valid checkpoint)
    ckpt = CheckpointManager.from_args(args, log)
    resumed = ckpt.resume({"model": model})

    # ---- train
    log.info(f"***** Running training: {len(train_dataset)} pairs, {total_steps} optimizer steps *****")
    if resumed:
        step, start_epoch, skip_batches = resumed["step"], resumed["epoch"], resumed["batches_in_epoch"]
        first = metrics = resumed["first_eval"]
    else:
        step, start_epoch, skip_batches = 0, 0, 0
        first = metrics = evaluate(0, "before training")
    for epoch in range(start_epoch, args.num_train_epochs):
        skip = skip_batches if epoch == start_epoch else 0
        train_loader.sampler.set_epoch(epoch, skip_batches=skip, batch_size=args.per_device_train_batch_size)
        log.info(f"Beginning of Epoch {epoch + 1}/{args.num_train_epochs}, Total Micro Batches {len(train_loader)}")
        model.train()
        loss_sum, loss_count = (resumed["epoch_loss_sum"], resumed["epoch_loss_count"]) if skip else (0.0, 0)
        for micro_step, batch in enumerate(log.progress(train_loader, desc=f"step2 epoch {epoch + 1}"), start=skip):
            if args.max_steps and step >= args.max_steps:
                break
            start = time.time()
            batch = to_device(batch, device)
            loss = model(**batch, use_cache=False)["loss"]
            model.backward(loss)
            model.step()
            loss_value = loss.item()  # the micro-step's one host sync (a NaN stops the run before any save)
            check_finite(step + 1, loss=loss_value)
            loss_sum, loss_count = loss_sum + loss_value, loss_count + 1
            if model.global_steps == step:  # gradients accumulated, no optimizer step yet
                continue
            step = model.global_steps
            if args.print_loss:
                log.info(f"Epoch: {epoch}, Step: {step}, Rank: {args.global_rank}, loss = {loss_value:.4f}")
            log.scalars(step, "train", loss=loss_value, lr=lr_scheduler.get_last_lr()[0])
            if throughput_due(step, total_steps):
                log.info(throughput_line(model.module, model.module.config, time.time() - start,
                                         2 * args.per_device_train_batch_size, batch["input_ids"].shape[1],
                                         get_world_size(), args.gradient_checkpointing))
            if args.eval_interval and step % args.eval_interval == 0 and step < total_steps:
                evaluate(step, f"at step {step}")
            ckpt.step_done(step, {"model": model},
                           lambda: {"epoch": epoch, "batches_in_epoch": micro_step + 1, "first_eval": first,
                                    "epoch_loss_sum": loss_sum, "epoch_loss_count": loss_count})
        log.info(f"Epoch {epoch + 1}/{args.num_train_epochs} with loss {loss_sum / max(loss_count, 1):.4f}")
        metrics = evaluate(step, f"after epoch {epoch + 1}")
        if args.max_steps and step >= args.max_steps:
            break
    log.info(f"accuracy: before {first['acc']:.4f} -> after {metrics['acc']:.4f}")

    # ---- save
    if args.output_dir is not None:
        log.info(f"saving the final reward model to {args.output_dir}")
        save_reward_model(model, tokenizer, args.output_dir, zero_stage=args.zero_stage)
    log.close()
    return {"accuracy_before": first["acc"], "accuracy": metrics["acc"], "chosen_mean_score": metrics["chosen"],
            "rejected_mean_score": metrics["rejected"], "eval_loss": metrics["loss"], "steps": step}


if __name__ == "__main__":
    run_main(main, parse_args())
