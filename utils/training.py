"""The plumbing every training entry point shares; each ``main.py`` keeps its own loop.

Steps 1, 2 and DPO and step 3's engines are built from these pieces:

- :func:`start_run`: process group, precision, seed and the run's logger; :func:`load_tokenizer`;
- :func:`train_ds_config` / :func:`frozen_ds_config`: DeepSpeed configs with the batch sizes set,
  and :func:`frozen_stage`, the one rule for a frozen copy's ZeRO stage;
- :func:`make_loaders`: the resumable, shuffled train loader and the sharded eval loader (:func:`make_eval_loader`);
- the one loop of every step (1, 2, DPO and 3): :func:`epochs` and :func:`epoch_batches` walk a run from a
  :class:`Position` (fresh, or a checkpoint's) to its end, ``--max_steps`` included;
- :func:`count_optimizer_steps`: the length of the learning-rate schedule, and the shared checks that a run makes
  an optimizer step (:func:`refuse_no_optimizer_step` up front, :func:`check_steps_ran` before saving);
- :class:`OptimConfig` and :func:`make_engine`: optimizer, schedule and ``deepspeed.initialize``.

LoRA is applied with :func:`utils.lora.apply_lora`; saving gathers with
:func:`utils.model.model_utils.gather_for_saving`. DeepSpeed and transformers are
imported inside the functions, so importing this module stays light (torch only).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from torch.utils.data import DataLoader, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from utils.arguments import ADAM_BETAS
from utils.checkpoint import resumable_loader
from utils.distributed import get_world_size, init_distributed
from utils.logger import TrainLogger
from utils.runtime import cpu_bf16_warning, resolve_dtype, set_random_seed


def start_run(args, name: str):
    """``(device, log)``: the process group (sets ``args.local_rank`` / ``global_rank``), ``--dtype``'s
    device default, the seed, and a :class:`~utils.logger.TrainLogger` called ``name``; bf16 on a CPU without bf16
    instructions is one warning line naming the faster setting (:func:`utils.runtime.cpu_bf16_warning`)."""
    device = init_distributed(args)
    resolve_dtype(args)
    set_random_seed(args.seed)
    log = TrainLogger(name, args.enable_tensorboard, args.tensorboard_path, metrics_dir=args.output_dir)
    slow = cpu_bf16_warning(args, device)  # bf16 on a CPU without bf16 instructions: say why the steps crawl
    if slow:
        log.warning(slow)
    return device, log


def start_step(args, name: str):
    """``(device, log, ds_config)`` of steps 1, 2 and DPO: :func:`start_run`, and the trained model's DeepSpeed
    config (:func:`step_ds_config`) with ``name`` as its TensorBoard job."""
    device, log = start_run(args, name)
    return device, log, step_ds_config(args, name)


def load_tokenizer(args, name_or_path: str):
    """The run's tokenizer: ``name_or_path``'s, plus ``--eot_token`` as a special token with ``--add_eot_token``;
    with ``--apply_chat_template`` it must have a chat template, and pads with a token the template never writes."""
    from utils.model.model_utils import load_hf_tokenizer

    eot = args.eot_token if args.add_eot_token else None
    return load_hf_tokenizer(name_or_path, add_special_tokens=eot, trust_remote_code=args.trust_remote_code,
                             apply_chat_template=getattr(args, "apply_chat_template", False))


def answer_end_token(args, tokenizer, name_or_path: str) -> str | None:
    """The token that ends an answer besides the EOS (step 3's ``GenerationConfig.eot_token``): the chat
    template's end-of-turn token of the run's ``tokenizer`` (:func:`load_tokenizer` of ``name_or_path``) with
    ``--apply_chat_template``, ``--eot_token`` with ``--add_eot_token``, else None."""
    if getattr(args, "apply_chat_template", False):
        from utils.data.chat_template import chat_format

        return chat_format(tokenizer, name_or_path).eot
    return args.eot_token if args.add_eot_token else None


# --------------------------------------------------------------------------- DeepSpeed configs

def frozen_stage(trained_stage: int) -> int:
    """ZeRO stage of a frozen copy (DPO's and PPO's reference, the EMA actor, the reward model): ZeRO-3 if
    the model it accompanies is partitioned, else 0 (a model that is never trained fits unpartitioned)."""
    return 3 if trained_stage == 3 else 0


def train_ds_config(dtype: str, stage: int, offload: bool, micro_batch: int, grad_accum: int,
                    tensorboard_path: str | None = None, tb_name: str = "", **extra) -> dict:
    """A trained model's DeepSpeed config; ``tensorboard_path`` turns on DeepSpeed's own tensorboard logs,
    ``extra`` goes to :func:`utils.ds_utils.get_train_ds_config` (hybrid-engine fields, ``autocast``)."""
    from deepspeed.accelerator import get_accelerator

    from utils.ds_utils import get_train_ds_config, set_batch_sizes

    config = get_train_ds_config(offload=offload, dtype=dtype, stage=stage,
                                 enable_tensorboard=tensorboard_path is not None, tb_path=tensorboard_path or "",
                                 tb_name=tb_name, world_size=get_world_size(),
                                 devices_per_node=get_accelerator().device_count(), **extra)
    return set_batch_sizes(config, micro_batch, get_world_size(), grad_accum)


def frozen_ds_config(dtype: str, trained_stage: int, offload: bool, micro_batch: int, grad_accum: int,
                     autocast: bool = False) -> dict:
    """The eval config of a frozen copy of a model trained with ZeRO ``trained_stage`` (see :func:`frozen_stage`);
    ``autocast``: ``--torch_autocast`` (:func:`utils.ds_utils.get_train_ds_config`)."""
    from utils.ds_utils import get_eval_ds_config, set_batch_sizes

    config = get_eval_ds_config(offload, dtype, frozen_stage(trained_stage), autocast=autocast)
    return set_batch_sizes(config, micro_batch, get_world_size(), grad_accum)


def step_ds_config(args, tb_name: str) -> dict:
    """The trained model's config of steps 1, 2 and DPO, from their shared flags."""
    return train_ds_config(args.dtype, args.zero_stage, args.offload, args.per_device_train_batch_size,
                           args.gradient_accumulation_steps,
                           tensorboard_path=args.tensorboard_path if args.enable_tensorboard else None,
                           tb_name=tb_name, autocast=args.torch_autocast)


# --------------------------------------------------------------------------- data

def make_loaders(train_dataset, eval_dataset, collate, args):
    """``(train, eval)`` loaders: train shuffled per (seed, epoch) and resumable mid-epoch
    (:func:`utils.checkpoint.resumable_loader`), eval in order and sharded across ranks."""
    train = resumable_loader(train_dataset, args.per_device_train_batch_size, args.seed, collate_fn=collate)
    return train, make_eval_loader(eval_dataset, collate, args.per_device_eval_batch_size)


def make_eval_loader(dataset, collate, batch_size: int):
    """The eval loader: ``dataset`` in order, ``batch_size`` samples a batch, sharded across ranks."""
    sampler = DistributedSampler(dataset, shuffle=False) if get_world_size() > 1 else SequentialSampler(dataset)
    return DataLoader(dataset, collate_fn=collate, batch_size=batch_size, sampler=sampler)


def micro_batches_to_run(batches: int, max_steps: int = 0, step: int = 0, grad_accum: int = 1) -> int:
    """Micro-batches an epoch of ``batches`` runs: all, unless ``--max_steps`` ends the run first (``step``
    optimizer steps done, ``grad_accum`` micro-batches each)."""
    return max(0, min(batches, (max_steps - step) * grad_accum)) if max_steps else batches


@dataclass
class Position:
    """Where a training loop stands: what a checkpoint saves to resume it (:func:`epochs`, :func:`epoch_batches`).
    ``step`` is the loop's own count (optimizer steps; RL steps in step 3), which the caller advances."""
    epoch: int = 0
    batches_in_epoch: int = 0  # batches of ``epoch`` consumed
    step: int = 0

    @classmethod
    def resumed(cls, state: dict | None) -> "Position":
        """A fresh start (``state`` None) or a checkpoint's position (its ``epoch``, ``batches_in_epoch``, ``step``)."""
        return cls(state["epoch"], state["batches_in_epoch"], state["step"]) if state else cls()


def _finished(position, max_steps: int) -> bool:
    return bool(max_steps) and position.step >= max_steps


def epochs(position, args):
    """The run's epochs from ``position.epoch`` on (a new epoch starts at batch 0), until ``--num_train_epochs`` or
    ``--max_steps`` steps are done."""
    for epoch in range(position.epoch, args.num_train_epochs):
        if _finished(position, args.max_steps):
            return
        if epoch != position.epoch:
            position.epoch, position.batches_in_epoch = epoch, 0
        yield epoch


def epoch_batches(loaders, position, args, log, desc: str, per_step: int):
    """The batches of ``position.epoch`` behind a progress bar, after the ``position.batches_in_epoch`` already
    consumed (a resumed run). ``loaders``: one loader (its batches come) or a tuple of them (tuples of one batch of
    each come, None for a None loader); each (:func:`utils.checkpoint.resumable_loader`) is set to the epoch's
    order. The epoch ends early once the caller's ``position.step`` reaches ``--max_steps`` (checked after each batch:
    a step may take more batches than ``per_step``, as step 3's dynamic sampling does); the bar counts the batches
    of the steps left at ``per_step`` a step. ``position.batches_in_epoch`` counts each batch as it is handed out."""
    single = not isinstance(loaders, (list, tuple))
    group = [loaders] if single else list(loaders)
    live = [loader for loader in group if loader is not None]
    skip = position.batches_in_epoch
    for loader in live:
        loader.sampler.set_epoch(position.epoch, skip_batches=skip, batch_size=loader.batch_size)
    available = min(len(loader) for loader in live)
    total = micro_batches_to_run(available, args.max_steps, position.step, per_step)
    log.info(f"Beginning of Epoch {position.epoch + 1}/{args.num_train_epochs}, Total Micro Batches {available}"
             + (f" ({total} of them run: --max_steps {args.max_steps})" if total < available else ""))
    # a None loader stands in as an endless None: the pairs end with the shortest real loader
    batches = live[0] if single else zip(*(itertools.repeat(None) if loader is None else loader for loader in group))
    for position.batches_in_epoch, batch in enumerate(log.progress(batches, desc=desc, total=total), start=skip + 1):
        yield batch
        if _finished(position, args.max_steps):
            return


def report_optimizer_step(log, args, model, epoch: int, total_steps: int, line: str, tokens: int, seconds: float,
                          rows: int, seq_len: int, **scalars) -> int:
    """Steps 1, 2 and DPO after an optimizer step of ``model`` (an engine): the ``--print_loss`` line (``line``: the
    step's numbers as text), the step's scalars with the learning rate and its real ``tokens``, and the throughput
    line when due (the last micro-batch: ``rows`` × ``seq_len`` in ``seconds``). Returns the step's number."""
    from utils.perf import throughput_due, throughput_line

    step = model.global_steps
    if args.print_loss:
        log.info(f"Epoch: {epoch}, Step: {step}, Rank: {args.global_rank}, {line}")
    log.scalars(step, "train", lr=model.get_lr()[0], tokens=tokens, **scalars)
    if throughput_due(step, total_steps):
        log.info(throughput_line(model.module, model.module.config, seconds, rows, seq_len, get_world_size(),
                                 args.gradient_checkpointing))
    return step


def eval_batches(loader, eval_iters: int):
    """The first ``eval_iters`` batches of ``loader``; all of them for 0 (``--eval_iters 0``, as DeepSpeed-Chat)."""
    return itertools.islice(loader, eval_iters or None)


def refuse_no_optimizer_step(micro_batches: int, grad_accum: int, how: str) -> None:
    """The one up-front check of every step (1, 2, DPO, 3): a run of ``micro_batches`` micro-batches (``how``
    they come about, for the message) with ``grad_accum`` of them per optimizer step must make at least one;
    otherwise :class:`~utils.errors.UserInputError`, with the numbers: the "trained" model would be its input."""
    from utils.errors import UserInputError

    if micro_batches < grad_accum:
        raise UserInputError(f"--gradient_accumulation_steps {grad_accum} needs {grad_accum} micro-batches per "
                             f"optimizer step, but the run has {micro_batches} ({how}): no optimizer step would run; "
                             "lower it, or the batch size, or add data or epochs")


def count_optimizer_steps(micro_batches_per_epoch: int, grad_accum: int, epochs: int, max_steps: int = 0) -> int:
    """Optimizer steps of a run (the schedule's length): whole epochs, capped by ``max_steps`` (0 = no cap).

    Refuses (:func:`refuse_no_optimizer_step`) a run with fewer micro-batches than one accumulation needs.
    """
    refuse_no_optimizer_step(micro_batches_per_epoch * epochs, grad_accum,
                             f"{epochs} epoch(s) of {micro_batches_per_epoch} per rank")
    total = epochs * math.ceil(micro_batches_per_epoch / grad_accum)
    return min(total, max_steps) if max_steps else total


def schedule_note(lr_scheduler_type: str, num_warmup_steps: int, total_steps: int) -> str | None:
    """What the run's learning-rate schedule does with ``--num_warmup_steps`` when that is not what the flag
    suggests (a warm-up longer than the run; a warm-up the constant schedule ignores), with the numbers; else
    None. Every step logs it as a warning (DeepSpeed-Chat's step 3 warms up for 100 steps: a short run never
    reaches its learning rate)."""
    if num_warmup_steps and lr_scheduler_type == "constant":
        return (f"--num_warmup_steps {num_warmup_steps} is not used: --lr_scheduler_type constant has no warm-up "
                "(constant_with_warmup has)")
    if lr_scheduler_type != "constant" and num_warmup_steps > total_steps > 0:
        return (f"--num_warmup_steps {num_warmup_steps} is more than the run's {total_steps} optimizer steps: the "
                f"learning rate rises the whole run and ends at {total_steps / num_warmup_steps:.0%} of its peak")
    return None


def check_steps_ran(what: str, steps: int, steps_planned: int, engines=(), why: str = "") -> None:
    """After training, before saving (every step): refuse a model no optimizer step has changed.

    ``steps``: the run's step counter now (a resumed run's includes its checkpoint's steps: that model was
    trained); ``steps_planned``: the steps it was to make. None although some were due (step 3: every answer
    dropped, ``why`` says so), or every step skipped by the fp16 loss scaler (DeepSpeed counts a skipped step as a
    step: ``engines``' ``skipped_steps``), leaves the input model, which must not be saved as a result.
    """
    from utils.errors import TrainingDiverged, UserInputError

    if steps == 0 < steps_planned:
        raise UserInputError(f"no {what} ran{f' ({why})' if why else ''}: the model is unchanged, so nothing is "
                             "saved")
    for engine in engines:
        steps, skipped = getattr(engine, "global_steps", 0), getattr(engine, "skipped_steps", 0)
        if isinstance(steps, int) and isinstance(skipped, int) and steps > 0 and skipped >= steps:
            raise TrainingDiverged(f"the fp16 loss scale overflowed at every one of the {steps} optimizer steps, so "
                                   "each was skipped and the model is unchanged; nothing is saved (use --dtype bf16, "
                                   "or run more steps for the loss scale to settle)")


# --------------------------------------------------------------------------- engines

@dataclass(frozen=True)
class OptimConfig:
    """What a trained model's optimizer and learning-rate schedule are made of."""
    learning_rate: float
    weight_decay: float
    lora_learning_rate: float
    offload: bool
    lr_scheduler_type: str
    num_warmup_steps: int
    betas: tuple = ADAM_BETAS  # AdamW's (--adam_betas)

    @classmethod
    def from_args(cls, args, role: str | None = None) -> "OptimConfig":
        """From the shared flags (``--learning_rate`` …) or a step-3 role's (``--actor_learning_rate`` …)."""
        prefix = f"{role}_" if role else ""
        return cls(learning_rate=getattr(args, f"{prefix}learning_rate"),
                   weight_decay=getattr(args, f"{prefix}weight_decay"),
                   lora_learning_rate=getattr(args, f"{prefix}lora_learning_rate"), offload=args.offload,
                   lr_scheduler_type=args.lr_scheduler_type, num_warmup_steps=args.num_warmup_steps,
                   betas=tuple(getattr(args, "adam_betas", None) or ADAM_BETAS))


def skips_identity_allreduce(engine) -> bool:
    """Whether ``engine``'s gradient all-reduce is an identity we can skip: one data-parallel rank, ZeRO stage 0,
    fp32 or bf16 (fp16's loss-scaled path is left to DeepSpeed, untested), no ``BF16_Optimizer`` (which
    accumulates its fp32 gradients around it; bf16 at ZeRO 0 has the plain wrapper of
    :func:`utils.ds_utils.fuse_bf16_step`). DeepSpeed still runs it there, flattening every gradient into one new
    buffer and copying it back (a transient copy of all gradients, 200 MB for a 50 M-parameter model, and its
    time): averaging over one rank changes nothing, so skipping it leaves every result bit-identical."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    return (engine.dp_world_size == 1 and engine.zero_optimization_stage() == 0 and not engine.fp16_enabled()
            and not isinstance(engine.optimizer, BF16_Optimizer) and not getattr(engine, "has_moe_layers", False))


def make_engine(model, ds_config: dict, optim: OptimConfig | None = None, total_steps: int = 0,
                gradient_checkpointing: bool = False):
    """``deepspeed.initialize`` of ``model``; with ``optim``, a trained engine (AdamW groups of
    :func:`utils.ds_utils.create_optimizer` and a schedule of ``total_steps``; bf16 at ZeRO 0 with a multi-tensor
    step, :func:`utils.ds_utils.fuse_bf16_step`), else a frozen one."""
    import deepspeed
    from transformers import get_scheduler

    from utils.ds_utils import create_optimizer, fuse_bf16_step
    from utils.model.model_utils import enable_activation_checkpointing

    optimizer = lr_scheduler = None
    if optim is not None:
        optimizer = create_optimizer(model, optim.weight_decay, optim.learning_rate, optim.lora_learning_rate,
                                     optim.offload, optim.betas)
        lr_scheduler = get_scheduler(optim.lr_scheduler_type, optimizer=optimizer,
                                     num_warmup_steps=optim.num_warmup_steps, num_training_steps=total_steps)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler,
                                      config=ds_config, dist_init_required=True)
    if optim is None:
        engine.eval()
    else:
        fuse_bf16_step(engine)
        if skips_identity_allreduce(engine):
            engine.enable_backward_allreduce = False
    if gradient_checkpointing:
        enable_activation_checkpointing(engine.module)
    return engine


def save_final_causal_lm(folder, model, tokenizer, args, log) -> None:
    """Steps 1 and DPO's end: the trained model as a plain HF causal-LM folder in the run's output folder (with the
    note of its training format, so that chat.py answers in it), saved last (:meth:`RunFolder.save_final`)."""
    from utils.data.chat_template import training_format_file
    from utils.model.model_utils import save_hf_format

    if args.output_dir is None:
        return
    log.info(f"saving the final model to {args.output_dir}")
    trained_in = training_format_file(args.apply_chat_template)
    folder.save_final([(None, lambda path: save_hf_format(model, tokenizer, path, zero_stage=args.zero_stage,
                                                          extra_files=trained_in))])


def make_step_engine(model, ds_config: dict, train_loader, args, log):
    """``(engine, total_steps)`` of steps 1, 2 and DPO's trained model: the optimizer steps the run takes (its epochs,
    or ``--max_steps``), ``deepspeed.initialize`` with its optimizer and schedule, and a warning when the schedule
    cannot show in so few steps (:func:`schedule_note`)."""
    total_steps = count_optimizer_steps(len(train_loader), args.gradient_accumulation_steps, args.num_train_epochs,
                                        args.max_steps)
    engine = make_engine(model, ds_config, OptimConfig.from_args(args), total_steps, args.gradient_checkpointing)
    if note := schedule_note(args.lr_scheduler_type, args.num_warmup_steps, total_steps):
        log.warning(note)
    return engine, total_steps
