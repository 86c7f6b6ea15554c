#!/usr/bin/env python
"""Step 1: supervised fine-tuning of a causal LM on prompt + chosen answer.

    deepspeed main.py --model_name_or_path facebook/opt-1.3b --data_path Dahoas/rm-static ...
    python main.py --model_name_or_path tiny-opt --data_path builtin/preference --output_dir out/actor

parse → distributed/DeepSpeed config → tokenizer/model (+LoRA) → data → optimizer/
scheduler → ``deepspeed.initialize`` → perplexity before training → train, with
perplexity after every epoch → save an HF folder. With ``--save_interval`` a resumable
checkpoint is written every N optimizer steps; rerunning the command resumes from it
(:mod:`utils.checkpoint`).
"""
if __name__ == "__main__":  # Ctrl-C from the first second on: one line, exit 130 (utils/interrupt.py)
    from utils.interrupt import exit_quietly_on_ctrl_c

    exit_quietly_on_ctrl_c()

import math
import time
from dataclasses import asdict

import torch

from utils.arguments import single_model_parser
from utils.checkpoint import CheckpointManager, run_inputs
from utils.data.data_utils import DataCollatorSFT, create_prompt_dataset, packs_sequences, pad_multiple
from utils.distributed import get_all_reduce_mean
from utils.entrypoint import run_main
from utils.finite import check_finite
from utils.lora import apply_lora
from utils.model.lean_forward import label_loss
from utils.model.model_utils import create_hf_model
from utils.preflight import run_step
from utils.runtime import to_device
from utils.training import (Position, check_steps_ran, epoch_batches, epochs, load_tokenizer, make_loaders,
                            make_step_engine, report_optimizer_step, save_final_causal_lm, start_step)


def parse_args(argv=None):
    parser = single_model_parser("Step 1: supervised fine-tuning (SFT) of a causal language model.",
                                 tensorboard_path="step1_tensorboard")
    return parser.parse_args(argv)


def evaluate_perplexity(model, dataloader, device):
    """(perplexity, loss) over the eval set, averaged across ranks."""
    model.eval()
    total, batches = torch.zeros((), device=device), 0
    with torch.no_grad():
        for batch in dataloader:
            batch = to_device(batch, device)
            total += label_loss(model, batch["input_ids"], batch["attention_mask"], batch["labels"],
                                batch.get("position_ids"))
            batches += 1
    loss = get_all_reduce_mean(total / max(batches, 1)).item()
    model.train()
    return math.exp(min(loss, 50.0)), loss


def main(args):
    return run_step(run, args, phase=1)  # checks first, then the run in its output folder


def run(args, folder):
    """Set-up, training and the final save, in the output folder ``folder`` (:func:`utils.preflight.run_step`)."""
    from transformers import AutoModelForCausalLM

    # ---- set-up: distributed, precision, seed, logger, DeepSpeed config
    device, log, ds_config = start_step(args, "step1_model")

    # ---- tokenizer and model (+ LoRA)
    tokenizer = load_tokenizer(args, args.model_name_or_path)
    model = create_hf_model(AutoModelForCausalLM, args.model_name_or_path, tokenizer, ds_config,
                            dropout=args.dropout, trust_remote_code=args.trust_remote_code)
    apply_lora(model, args.lora_module_name, args.lora_dim, args.only_optimize_lora)

    # ---- data: prompt + chosen + EOS (as the reference: the SFT model must learn to emit EOS, which is
    # where generation stops; --eot_token is for the reward model's texts)
    train_dataset, eval_dataset = create_prompt_dataset(
        args.local_rank, args.data_path, args.data_split, args.data_output_path, 1, args.seed, tokenizer,
        args.max_seq_len, end_of_conversation_token=tokenizer.eos_token,
        sft_only_data_path=args.sft_only_data_path, log=log.info, apply_chat_template=args.apply_chat_template)
    collate = DataCollatorSFT(tokenizer.pad_token_id, args.max_seq_len, pad_multiple(device),
                              pack=packs_sequences(device, model))
    train_loader, eval_loader = make_loaders(train_dataset, eval_dataset, collate, args)

    # ---- engine: optimizer, schedule, deepspeed.initialize
    model, total_steps = make_step_engine(model, ds_config, train_loader, args, log)

    # ---- resume (automatic when --output_dir holds a valid checkpoint)
    ckpt = CheckpointManager.from_args(args, log, run_inputs(train_dataset, model_name_or_path=args.model_name_or_path),
                                       folder)
    resumed = ckpt.resume({"model": model})
    position = Position.resumed(resumed)

    # ---- train
    log.info(f"***** Running training: {len(train_dataset)} samples, {total_steps} optimizer steps *****")
    if resumed:
        first_ppl = ppl = resumed["first_ppl"]
        eval_loss = math.log(ppl)
    else:
        ppl, eval_loss = evaluate_perplexity(model, eval_loader, device)
        log.info(f"ppl before training: {ppl:.4f}, loss: {eval_loss:.4f}")
        log.scalars(0, "eval", perplexity=ppl, loss=eval_loss)
        first_ppl = ppl
    for epoch in epochs(position, args):
        model.train()
        accumulated = None  # sum of the current optimizer step's micro-batch losses, on the device
        tokens = 0  # real tokens of the current optimizer step's micro-batches (the throughput's unit)
        for batch in epoch_batches(train_loader, position, args, log, f"step1 epoch {epoch + 1}",
                                   args.gradient_accumulation_steps):
            start = time.time()
            tokens += int(batch["tokens"])  # read on the host, before the copy (no device sync)
            batch = to_device(batch, device)
            loss = label_loss(model, batch["input_ids"], batch["attention_mask"], batch["labels"],
                              batch.get("position_ids"))
            model.backward(loss)
            model.step()
            accumulated = loss.detach().float() + (0.0 if accumulated is None else accumulated)
            if model.global_steps == position.step:  # gradients accumulated, no optimizer step yet
                continue
            # the step's one host sync; a NaN in any micro-batch of the step stops the run before any save
            loss_value, accumulated_value = torch.stack([loss.detach().float(), accumulated]).tolist()
            accumulated = None
            check_finite(position.step + 1, loss=loss_value if math.isfinite(accumulated_value) else accumulated_value)
            step = position.step = report_optimizer_step(
                log, args, model, epoch, total_steps, f"loss = {loss_value:.4f}", tokens, time.time() - start,
                batch["input_ids"].shape[0], batch["input_ids"].shape[1], loss=loss_value)
            tokens = 0
            ckpt.step_done(step, {"model": model}, lambda: {**asdict(position), "first_ppl": first_ppl})
        ppl, eval_loss = evaluate_perplexity(model, eval_loader, device)
        log.info(f"ppl after epoch {epoch + 1}: {ppl:.4f}, loss: {eval_loss:.4f}")
        log.scalars(position.step, "eval", perplexity=ppl, loss=eval_loss)
    log.info(f"perplexity: before {first_ppl:.4f} -> after {ppl:.4f}")
    check_steps_ran("optimizer step", position.step, total_steps, [model])

    # ---- save
    save_final_causal_lm(folder, model, tokenizer, args, log)
    log.close()
    return {"perplexity_before": first_ppl, "perplexity_after": ppl, "eval_loss": eval_loss, "steps": position.step}


if __name__ == "__main__":
    run_main(main, parse_args())
