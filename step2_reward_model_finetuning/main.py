#!/usr/bin/env python
"""Step 2: train a pairwise reward model on (prompt, chosen, rejected) pairs.

    deepspeed main.py --model_name_or_path facebook/opt-350m --num_padding_at_beginning 1 ...
    python main.py --model_name_or_path tiny-opt --data_path builtin/preference --output_dir out/reward

parse → distributed/DeepSpeed config → tokenizer / reward model (backbone + v_head,
+LoRA) → phase-2 pairs → optimizer/scheduler → ``deepspeed.initialize`` → evaluate
(chosen score, rejected score, accuracy) → train, evaluating every ``--eval_interval``
steps and after every epoch → save a step-2 folder (:mod:`utils.model.critic`). With ``--kwise`` a training batch
holds whole prompts' pairs, each distinct answer forwarded once, and so does an eval batch (:func:`kwise_loaders`).
With
``--save_interval`` a resumable checkpoint is written every N optimizer steps; rerunning
the command resumes from it (:mod:`utils.checkpoint`).
"""
if __name__ == "__main__":  # Ctrl-C from the first second on: one line, exit 130 (utils/interrupt.py)
    from utils.interrupt import exit_quietly_on_ctrl_c

    exit_quietly_on_ctrl_c()

import time
from dataclasses import asdict

import torch

from utils.arguments import add_eval_args, add_num_padding_arg, single_model_parser
from utils.checkpoint import CheckpointManager, run_inputs
from utils.data.data_utils import (DataCollatorKwise, DataCollatorReward, create_prompt_dataset, group_by_prompt,
                                   pad_multiple)
from utils.distributed import get_all_reduce_mean
from utils.entrypoint import run_main
from utils.errors import UserInputError
from utils.finite import check_finite
from utils.lora import apply_lora
from utils.model.critic import create_critic_model, save_reward_model
from utils.model.reward_model import REWARD_LOSSES, count_leading_pads
from utils.preflight import run_step
from utils.runtime import to_device
from utils.training import (Position, check_steps_ran, epoch_batches, epochs, eval_batches, load_tokenizer,
                            make_loaders, make_step_engine, report_optimizer_step, start_step)


def parse_args(argv=None):
    parser = single_model_parser("Step 2: train a pairwise reward model.",
                                 tensorboard_path="step2_tensorboard")
    g = parser.add_argument_group("reward model")
    add_num_padding_arg(g)
    g.add_argument("--reward_loss", default="span", choices=REWARD_LOSSES,
                   help="span: DeepSpeed-Chat's pairwise loss, averaged over every token from where chosen and "
                        "rejected diverge; end: InstructGPT's, on the end scores only (better for comparisons of "
                        "answers drawn independently, e.g. collect_comparisons.py's).")
    g.add_argument("--kwise", action="store_true",
                   help="InstructGPT's K-wise batching: a prompt's pairs (collect_comparisons.py's every pair of its "
                        "K answers) train in one batch, each distinct answer forwarded once, the loss averaged per "
                        "prompt then over prompts; --per_device_train_batch_size then counts prompts. The eval too "
                        "scores each distinct answer once (the same pairs and accuracy; its loss is the K-wise one; "
                        "--per_device_eval_batch_size counts prompts).")
    add_eval_args(g)
    parser.set_defaults(learning_rate=5e-5)
    return parser.parse_args(argv)


def evaluate_reward(model, dataloader, device, eval_iters: int) -> dict:
    """Chosen / rejected mean scores, accuracy (chosen > rejected) and loss over ≤ ``eval_iters`` batches (0 = all).

    Sums are all-reduced across ranks, so every rank returns the same numbers.
    """
    model.eval()
    # correct, pairs, chosen sum, rejected sum, loss sum, batches
    sums = torch.zeros(6, dtype=torch.float64, device=device)
    with torch.no_grad():
        for batch in eval_batches(dataloader, eval_iters):
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


def check_padding_at_beginning(dataset, pad_token_id: int, npab: int) -> None:
    """Refuse a ``--num_padding_at_beginning`` the tokenised data contradict (a difference from DeepSpeed-Chat,
    which trains on): with OPT-style tokenizers (BOS = pad) and 0, every score is read at position 0 and the
    reward model learns nothing (accuracy 0, loss ln 2 throughout); other values read it in the wrong place."""
    leading = {count_leading_pads(chosen, pad_token_id) for chosen, _ in dataset.samples[:32]}
    if leading and leading != {npab}:
        found = "/".join(map(str, sorted(leading)))
        raise UserInputError(f"--num_padding_at_beginning {npab}, but this tokenizer starts every text with {found} "
                             f"pad token(s): pass --num_padding_at_beginning {found} (OPT-style tokenizers, whose "
                             "BOS is the pad token, need 1; most others 0)")


def kwise_loaders(train_dataset, eval_dataset, collate: DataCollatorReward, args, log):
    """``--kwise``'s ``(train, eval)`` loaders: :func:`~utils.training.make_loaders` over the pairs grouped by
    prompt (:func:`~utils.data.data_utils.group_by_prompt`), each distinct answer of a batch forwarded once. Train:
    ``--per_device_train_batch_size`` prompts a batch, shuffled and resumable like the pairwise loader. Eval:
    ``--per_device_eval_batch_size`` prompts a batch, in order and sharded like the pairwise one, with the same
    pairs, scores and accuracy, a prompt's K answers forwarded K times instead of twice per pair
    (collect_comparisons.py's 8 answers a prompt: ~3× fewer rows)."""
    prompts = group_by_prompt(train_dataset)
    sizes = sorted(len(group) for group in prompts.samples)
    log.info(f"K-wise batches: {len(train_dataset)} pairs of {len(prompts)} prompts (pairs per prompt: "
             f"{sizes[0]}-{sizes[-1]}, median {sizes[len(sizes) // 2]}), {args.per_device_train_batch_size} prompts "
             "a batch")
    if sizes[-1] == 1:
        log.warning("--kwise: no two pairs share a prompt's answer, so every prompt has one pair and the loss is "
                    "the ordinary one")
    return make_loaders(prompts, group_by_prompt(eval_dataset),
                        DataCollatorKwise(collate.pad_token_id, collate.max_seq_len, collate.multiple), args)


def format_eval(metrics: dict) -> str:
    return (f"chosen_last_scores (higher is better): {metrics['chosen']:.4f}, "
            f"rejected_last_scores (lower is better): {metrics['rejected']:.4f}, acc: {metrics['acc']:.4f}, "
            f"loss: {metrics['loss']:.4f}")


def main(args):
    return run_step(run, args, phase=2)  # checks first, then the run in its output folder


def run(args, folder):
    """Set-up, training and the final save, in the output folder ``folder`` (:func:`utils.preflight.run_step`)."""
    # ---- set-up: distributed, precision, seed, logger, DeepSpeed config
    device, log, ds_config = start_step(args, "step2_model")

    # ---- tokenizer and reward model: backbone + v_head (+ LoRA; the value head always trains)
    tokenizer = load_tokenizer(args, args.model_name_or_path)
    model = create_critic_model(args.model_name_or_path, tokenizer, ds_config, args.num_padding_at_beginning,
                                dropout=args.dropout, zero_stage=args.zero_stage,
                                trust_remote_code=args.trust_remote_code)
    model.loss = args.reward_loss
    apply_lora(model, args.lora_module_name, args.lora_dim, args.only_optimize_lora, force_optimize=["v_head"])

    # ---- data: (chosen, rejected) pairs, collated as [chosen…; rejected…]
    train_dataset, eval_dataset = create_prompt_dataset(
        args.local_rank, args.data_path, args.data_split, args.data_output_path, 2, args.seed, tokenizer,
        args.max_seq_len, end_of_conversation_token=args.eot_token, sft_only_data_path=args.sft_only_data_path,
        log=log.info, apply_chat_template=args.apply_chat_template)
    check_padding_at_beginning(train_dataset, tokenizer.pad_token_id, args.num_padding_at_beginning)
    collate = DataCollatorReward(tokenizer.pad_token_id, args.max_seq_len, pad_multiple(device))
    if args.kwise:  # batches of whole prompts, each distinct answer forwarded once, in training and in the eval
        train_loader, eval_loader = kwise_loaders(train_dataset, eval_dataset, collate, args, log)
    else:
        train_loader, eval_loader = make_loaders(train_dataset, eval_dataset, collate, args)

    # ---- engine: optimizer, schedule, deepspeed.initialize
    model, total_steps = make_step_engine(model, ds_config, train_loader, args, log)

    last = {}  # the latest evaluation: {"step", "metrics"}

    def evaluate(step: int, when: str) -> dict:
        if last.get("step") == step:  # an epoch ending where --eval_interval just evaluated: the same model
            log.info(f"eval {when}: as at step {step}")
            return last["metrics"]
        metrics = evaluate_reward(model, eval_loader, device, args.eval_iters)
        log.info(f"eval {when}: {format_eval(metrics)}")
        log.scalars(step, "eval", **metrics)
        last.update(step=step, metrics=metrics)
        return metrics

    # ---- resume (automatic when --output_dir holds a valid checkpoint)
    ckpt = CheckpointManager.from_args(args, log, run_inputs(train_dataset, model_name_or_path=args.model_name_or_path),
                                       folder)
    resumed = ckpt.resume({"model": model})
    position = Position.resumed(resumed)

    # ---- train
    log.info(f"***** Running training: {len(train_dataset)} pairs, {total_steps} optimizer steps *****")
    first = metrics = resumed["first_eval"] if resumed else evaluate(0, "before training")
    for epoch in epochs(position, args):
        model.train()
        mid_epoch = position.batches_in_epoch > 0  # a resumed run: the epoch's loss so far comes from the checkpoint
        loss_sum, loss_count = (resumed["epoch_loss_sum"], resumed["epoch_loss_count"]) if mid_epoch else (0.0, 0)
        tokens = 0  # real tokens of the current optimizer step's micro-batches (the throughput's unit)
        for batch in epoch_batches(train_loader, position, args, log, f"step2 epoch {epoch + 1}",
                                   args.gradient_accumulation_steps):
            start = time.time()
            batch = to_device(batch, device)
            loss = model(**batch, use_cache=False)["loss"]
            model.backward(loss)
            model.step()
            loss_value = loss.item()  # the micro-step's one host sync (a NaN stops the run before any save)
            check_finite(position.step + 1, loss=loss_value)
            loss_sum, loss_count = loss_sum + loss_value, loss_count + 1
            tokens += int(batch["attention_mask"].sum())
            if model.global_steps == position.step:  # gradients accumulated, no optimizer step yet
                continue
            step = position.step = report_optimizer_step(
                log, args, model, epoch, total_steps, f"loss = {loss_value:.4f}", tokens, time.time() - start,
                batch["input_ids"].shape[0], batch["input_ids"].shape[1], loss=loss_value)
            tokens = 0
            if args.eval_interval and step % args.eval_interval == 0 and step < total_steps:
                evaluate(step, f"at step {step}")
            ckpt.step_done(step, {"model": model}, lambda: {**asdict(position), "first_eval": first,
                                                            "epoch_loss_sum": loss_sum, "epoch_loss_count": loss_count})
        log.info(f"Epoch {epoch + 1}/{args.num_train_epochs} with loss {loss_sum / max(loss_count, 1):.4f}")
        metrics = evaluate(position.step, f"after epoch {epoch + 1}")
    log.info(f"accuracy: before {first['acc']:.4f} -> after {metrics['acc']:.4f}")
    check_steps_ran("optimizer step", position.step, total_steps, [model])

    # ---- save
    if args.output_dir is not None:
        log.info(f"saving the final reward model to {args.output_dir}")
        folder.save_final([(None, lambda path: save_reward_model(model, tokenizer, path, zero_stage=args.zero_stage))])
    log.close()
    return {"accuracy_before": first["acc"], "accuracy": metrics["acc"], "chosen_mean_score": metrics["chosen"],
            "rejected_mean_score": metrics["rejected"], "eval_loss": metrics["loss"], "steps": position.step}


if __name__ == "__main__":
    run_main(main, parse_args())
