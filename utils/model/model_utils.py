"""Tokenizer and model loading, and saving in Hugging Face format.

* :func:`load_hf_tokenizer` resolves built-in names (``tiny-opt`` …), reads a
  local folder with ``local_files_only=True`` (no hub round trip, reference issue
  #460) and applies DeepSpeed-Chat's padding rule: right padding; Llama-family
  models without a pad token get ``[PAD]``; other models use pad = eos. With
  ``apply_chat_template`` the tokenizer must have a chat template, and never pads with a token the
  template writes (:func:`utils.data.chat_template.use_distinct_pad`).
* :func:`create_hf_model` applies the dropout override, resizes embeddings to a
  multiple of 8, sets pad/end ids, and under ZeRO-3 builds the model inside a live
  ``HfDeepSpeedConfig`` so parameters are partitioned while loading.
* :func:`save_hf_format` writes a folder plain ``from_pretrained`` loads: LoRA
  fused, ZeRO-3 parameters gathered, safetensors, written atomically.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import logging
import math
import os

import torch

from utils.errors import UserInputError
from utils.model.tiny import resolve_model_path
from utils.lora import LinearLayer_LoRA, convert_lora_to_linear_layer, unfuse_lora_weight
from utils.distributed import is_rank_0
from utils.files import atomic_directory
from utils.finite import check_weights_finite

LLAMA_FAMILY = ("llama", "mistral", "qwen", "gemma")


def cache_kwarg(model) -> str:
    """The keyword ``model.forward`` takes its KV cache by: ``cache`` from transformers 5.24 on
    (``past_key_values`` is then a deprecated alias, warned about and removed in 5.40),
    ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def enable_activation_checkpointing(model, **kwargs) -> None:
    """Turn on activation (gradient) checkpointing: ``activation_checkpointing_enable`` where transformers has
    it (``gradient_checkpointing_enable`` is deprecated there, to be removed in v6), the old name elsewhere
    (older transformers, and :class:`~utils.model.reward_model.RewardModel`, which forwards to its backbone)."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable(**kwargs)


def disable_activation_checkpointing(model) -> None:
    """The inverse of :func:`enable_activation_checkpointing`, by the same naming rule."""
    disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
    disable()


def resolve_model_name_or_path(name_or_path: str) -> str:
    """Built-in names -> their folder; a path-looking name that does not exist -> clear error."""
    path = resolve_model_path(name_or_path)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise UserInputError(f"model folder {path} has no config.json: not a Hugging Face model folder")
        return path
    if os.path.exists(path):
        raise UserInputError(f"model {name_or_path!r}: is a file, not a model folder (give the folder that holds "
                             "config.json and the weights)")
    looks_local = path.startswith((".", "/", "~")) or path.count("/") > 1  # hub ids: "gpt2", "org/name"
    if looks_local:
        raise UserInputError(f"model {name_or_path!r}: no such folder (and not a hub name like "
                             "'facebook/opt-1.3b' or a built-in name like 'tiny-opt')")
    return path


def _model_type(path: str) -> str:
    config = os.path.join(path, "config.json")
    if os.path.isfile(config):
        try:
            with open(config) as f:
                found = json.load(f)
        except (OSError, ValueError) as e:
            raise UserInputError(f"{path}: config.json cannot be read ({e}); copy or save the model again") from None
        return found.get("model_type", "") if isinstance(found, dict) else ""
    return ""


def load_hf_tokenizer(model_name_or_path: str, fast_tokenizer: bool = True, add_special_tokens=None,
                      trust_remote_code: bool = False, apply_chat_template: bool = False):
    from transformers import AutoTokenizer

    from utils.data.chat_template import use_distinct_pad

    path = resolve_model_name_or_path(model_name_or_path)
    local = os.path.isdir(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, use_fast=fast_tokenizer, local_files_only=local,
                                                  trust_remote_code=trust_remote_code)
    except OSError as e:
        where = "the folder" if local else "the Hugging Face hub (is it reachable? use a local folder offline)"
        raise UserInputError(f"cannot load a tokenizer for {model_name_or_path!r} from {where}: {e}") from None
    except Exception as e:  # noqa: BLE001 - a damaged tokenizer.json / tokenizer_config.json: JSON, tokenizers' own
        if not local:
            raise
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise UserInputError(f"cannot load a tokenizer for {model_name_or_path!r}: its files in {path} are damaged "
                             f"({type(e).__name__}: {first}); copy or save the model again") from None
    if not tokenizer("hello world", add_special_tokens=False)["input_ids"]:  # transformers 5 builds an
        # empty tokenizer (that encodes nothing) for a folder with a config.json but no tokenizer files
        raise UserInputError(f"model {model_name_or_path!r}: no usable tokenizer in {path} (it encodes text to "
                             "nothing; expected tokenizer.json or the model's vocabulary files)")
    kind = (_model_type(path) or path).lower()
    if any(name in kind for name in LLAMA_FAMILY):
        if tokenizer.pad_token is None:
            tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    else:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    if add_special_tokens:
        tokens = [add_special_tokens] if isinstance(add_special_tokens, str) else list(add_special_tokens)
        tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    if apply_chat_template:
        use_distinct_pad(tokenizer, model_name_or_path)
    return tokenizer


DROPOUT_KEYS = ("dropout", "attention_dropout", "hidden_dropout", "activation_dropout", "resid_pdrop", "embd_pdrop",
                "attn_pdrop")  # the config fields transformers' models read their dropout probabilities from


def configure_dropout(config, dropout):
    if dropout is not None:
        for key in DROPOUT_KEYS:
            if hasattr(config, key):
                setattr(config, key, dropout)
    return config


def has_dropout(model) -> bool:
    """Does ``model`` drop anything in train mode? An ``nn.Dropout`` with p > 0, or a dropout probability > 0 in
    its config (attention dropout is often functional, with no module to see)."""
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    return any(isinstance(getattr(config, key, None), (int, float)) and getattr(config, key) > 0
               for key in DROPOUT_KEYS)


def create_hf_model(model_class, model_name_or_path: str, tokenizer, ds_config: dict | None = None,
                    rlhf_training: bool = False, dropout=None, trust_remote_code: bool = False):
    """Build ``model_class`` (e.g. ``AutoModelForCausalLM``) for ``model_name_or_path``.

    ``rlhf_training=True`` builds from the config only (weights are loaded later
    from a step-2 checkpoint). Under ZeRO-3 (``ds_config`` stage 3) construction
    happens inside a live ``HfDeepSpeedConfig``.
    """
    from transformers import AutoConfig
    from transformers.integrations import HfDeepSpeedConfig

    path = resolve_model_name_or_path(model_name_or_path)
    local = os.path.isdir(path)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=local, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise UserInputError(f"cannot load a model config for {model_name_or_path!r}: {e}") from None
    configure_dropout(config, dropout)
    dschf = None  # must stay alive while the model is built
    if ds_config is not None and ds_config["zero_optimization"]["stage"] == 3:
        dschf = HfDeepSpeedConfig(ds_config)  # noqa: F841
    if rlhf_training:
        model = model_class.from_config(config, trust_remote_code=trust_remote_code)
    else:
        try:
            with _without_load_report():  # said in a line below instead (describe_loading_info)
                model, info = model_class.from_pretrained(path, config=config, dtype=torch.float32,
                                                          local_files_only=local, trust_remote_code=trust_remote_code,
                                                          output_loading_info=True)
        except OSError as e:  # no weight files in the folder, hub unreachable
            raise UserInputError(f"cannot load the model weights for {model_name_or_path!r}: {e}") from None
        if is_rank_0():
            for line in describe_loading_info(info, model_name_or_path):
                print(line, flush=True)
    model.config.end_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.resize_token_embeddings(int(8 * math.ceil(len(tokenizer) / 8.0)))
    del dschf
    return model


def describe_loading_info(info: dict, name: str, shown: int = 3) -> list:
    """``from_pretrained``'s loading info in a line or two, instead of transformers' multi-line load report.

    A backbone built from a causal-LM checkpoint (step 2: the reward model's, from a step-1 folder or
    ``facebook/opt-350m``) leaves the LM head out by design: one plain line. Weights the model has but
    the checkpoint lacks (initialised randomly) and other unused checkpoint weights are warnings.
    """
    def some(keys):
        keys = sorted(keys)
        return ", ".join(keys[:shown]) + (f" and {len(keys) - shown} more" if len(keys) > shown else "")

    lines = []
    unexpected = set(info.get("unexpected_keys") or ())
    head = {k for k in unexpected if k.split(".")[0] in ("lm_head", "embed_out")}
    if head:
        lines.append(f"{name}: its LM head ({some(head)}) is not part of this model and is left out")
    unused = unexpected - head
    if unused:
        lines.append(f"warning: {name}: {len(unused)} checkpoint weights unused: {some(unused)}")
    missing = set(info.get("missing_keys") or ())
    if missing:
        lines.append(f"warning: {name}: {len(missing)} weights not in the checkpoint, initialised randomly: "
                     f"{some(missing)}")
    return lines


class _LoadReportFilter(logging.Filter):
    """Drops transformers' load report, except one naming size mismatches or conversion errors (an error
    follows it that points to the report)."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return "LOAD REPORT" not in text or "MISMATCH" in text or "CONVERSION" in text


@contextlib.contextmanager
def _without_load_report():
    handlers = logging.getLogger("transformers").handlers
    report_filter = _LoadReportFilter()
    for handler in handlers:
        handler.addFilter(report_filter)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(report_filter)


def check_tokenizer_fits_model(tokenizer, model) -> None:
    """Every token id must have an embedding row (a tokenizer/model vocabulary mismatch is an error)."""
    rows = model.get_input_embeddings().weight
    rows = rows.ds_shape[0] if hasattr(rows, "ds_shape") else rows.shape[0]
    if len(tokenizer) > rows:
        raise UserInputError(f"the tokenizer has {len(tokenizer)} tokens but the model only {rows} embedding rows")


def _unwrap(model):
    return model.module if hasattr(model, "module") else model


def release_zero3_params(engine, zero_stage: int) -> None:
    """ZeRO-3: wait for and release the parameters DeepSpeed prefetched for a forward that never came.

    After an evaluation pass the next layers' parameters can be left "in flight";
    gathering them (saving, LoRA fusion) then fails with "Cannot partition a param in
    flight" (seen with small-opt, 1 and 2 ranks). A no-op for other stages and plain modules.
    """
    if zero_stage == 3 and hasattr(engine, "empty_partition_cache"):
        engine.empty_partition_cache()


def gather_full_state_dict(model, zero_stage: int = 0) -> dict:
    """A CPU state dict with full tensors (ZeRO-3 partitions gathered); LoRA factors left out.

    Call on every rank (ZeRO-3 gathering is collective); non-zero ranks get ``{}``.
    """
    release_zero3_params(model, zero_stage)
    model = _unwrap(model)
    state = {}
    if zero_stage == 3:
        import deepspeed

        # the keys of state_dict(), tied weights (lm_head.weight = embed_tokens.weight) included,
        # so a ZeRO-3 save has exactly the names and shapes of a ZeRO-0/1/2 save
        tensors = dict(model.named_parameters(remove_duplicate=False))
        tensors.update(model.named_buffers(remove_duplicate=False))
        first = {}  # id(tensor) -> its first name: a tied tensor is gathered once
        for name in model.state_dict().keys():
            tensor = tensors[name]
            if id(tensor) in first:
                if is_rank_0():
                    state[name] = state[first[id(tensor)]].clone()
                continue
            first[id(tensor)] = name
            params = [tensor] if hasattr(tensor, "ds_id") else []
            with deepspeed.zero.GatheredParameters(params, enabled=bool(params)):
                if is_rank_0():
                    state[name] = tensor.detach().cpu().clone()
    elif is_rank_0():
        state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return {k: v for k, v in state.items() if "lora" not in k}


def gather_for_saving(model, zero_stage: int = 0):
    """``(module, state dict)`` of an engine or module as it should be saved: LoRA fused into the base
    weights (and unfused again afterwards), ZeRO-3 partitions gathered, no ``lora`` keys.

    Collective under ZeRO-3: call on every rank; the state dict is complete on rank 0 only.
    """
    release_zero3_params(model, zero_stage)
    model = _unwrap(model)
    has_lora = any(isinstance(m, LinearLayer_LoRA) for m in model.modules())
    if has_lora:
        convert_lora_to_linear_layer(model, zero_stage == 3)
    state = gather_full_state_dict(model, zero_stage)
    if has_lora:
        unfuse_lora_weight(model, zero_stage == 3)
    return model, state


def save_hf_format(model, tokenizer, output_dir: str, zero_stage: int = 0, extra_files: dict | None = None) -> None:
    """Save ``model`` (LoRA fused, ZeRO-3 gathered) + ``tokenizer`` as an HF folder, atomically.

    Collective under ZeRO-3: call on every rank; only rank 0 writes.
    ``extra_files`` maps file names to text written beside the model. Weights holding NaN or inf are not
    saved (:func:`~utils.finite.check_weights_finite`).
    """
    check_weights_finite("the model", model)
    model, state = gather_for_saving(model, zero_stage)
    if is_rank_0():
        with atomic_directory(output_dir) as tmp:
            model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            for name, text in (extra_files or {}).items():
                with open(os.path.join(tmp, name), "w") as f:
                    f.write(text)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
