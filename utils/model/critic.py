"""Step-2 folders: build a reward/critic model, save it, load it back exactly.

Saved step-2 folder (:func:`save_reward_model`; written atomically, LoRA fused, ZeRO-3
parameters gathered)::

    config.json           the backbone's config (an ``AutoModel`` config)
    model.safetensors     RewardModel.state_dict(): ``rwtransformer.*`` + ``v_head.weight``
    reward_model.json     marker: {"format": "dschat-reward-model", "version": 1,
                                   "num_padding_at_beginning": …, "model_type": …}
    tokenizer files

Load it for scoring with::

    from utils.model.critic import load_reward_model
    model, tokenizer = load_reward_model("out/reward")        # eval mode, CPU, fp32
    batch = tokenizer([prompt + answer + "<|endoftext|>"], return_tensors="pt")
    P = len(tokenizer(prompt)["input_ids"])
    score = model.forward_value(**batch, prompt_length=P)["chosen_end_scores"]   # [1]

(``step2_reward_model_finetuning/rw_eval.py`` does exactly this from the command
line.) Step 3 loads the same folder with ``create_critic_model(folder, tokenizer,
ds_config, npab, rlhf_training=True, zero_stage=...)`` for both critic and reward
model. The load is strict: a folder that is not a step-2 output, or whose weights do
not match the model (keys or shapes), is a :class:`UserInputError` naming the folder
and the keys (DeepSpeed-Chat loads non-strictly and silently keeps random weights).
Checkpoints written by the reference (``pytorch_model.bin`` with ``rwtransformer.`` keys, or
``rwtranrsformer.`` ones when saved before its October 2023 typo fix, #749) load too.
"""
from __future__ import annotations

import json
import os

import torch
from torch import nn

from utils.errors import UserInputError
from utils.model.reward_model import RewardModel

MARKER_FILE = "reward_model.json"
MARKER_FORMAT = "dschat-reward-model"
MARKER_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
LEGACY_WEIGHTS_FILE = "pytorch_model.bin"
LEGACY_PREFIX = "rwtranrsformer."  # DeepSpeed-Chat's attribute name (sic) until October 2023 (#749)
PREFIX = "rwtransformer."


# --------------------------------------------------------------------------- folders

def read_marker(folder: str) -> dict | None:
    """The folder's ``reward_model.json`` (None when absent)."""
    path = os.path.join(folder, MARKER_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            marker = json.load(f)
    except (OSError, ValueError) as e:
        raise UserInputError(f"reward model folder {folder}: cannot read {MARKER_FILE}: {e}") from None
    if marker.get("format") != MARKER_FORMAT or marker.get("version", 0) > MARKER_VERSION:
        raise UserInputError(f"reward model folder {folder}: {MARKER_FILE} is not a version ≤ {MARKER_VERSION} "
                             f"{MARKER_FORMAT!r} marker: {marker}")
    return marker


def _weights_file(folder: str) -> str | None:
    for name in (WEIGHTS_FILE, LEGACY_WEIGHTS_FILE):
        if os.path.isfile(os.path.join(folder, name)):
            return os.path.join(folder, name)
    return None


def check_reward_model_folder(folder: str) -> str:
    """``folder`` if it looks like a step-2 output (a marker, or reward weights with a value head), else a clear
    error."""
    if not os.path.isdir(folder):
        raise UserInputError(f"reward model folder {folder!r} does not exist (give the --output_dir of step 2)")
    marker = read_marker(folder)
    weights = _weights_file(folder)
    if weights is None:
        what = f"{MARKER_FILE} and " if marker is None else ""
        raise UserInputError(f"{folder} is not a step-2 reward model folder: missing {what}{WEIGHTS_FILE} "
                             "(give the --output_dir of step2_reward_model_finetuning)")
    if marker is None and weights.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(weights, framework="pt") as f:
            if "v_head.weight" not in f.keys():
                raise UserInputError(f"{folder} is not a step-2 reward model folder: its {WEIGHTS_FILE} has no "
                                     "value head (v_head.weight; is it a step-1 / plain HF folder?)")
    return folder


def _read_state_dict(path: str) -> dict:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        state = load_file(path)
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    return {(PREFIX + k[len(LEGACY_PREFIX):] if k.startswith(LEGACY_PREFIX) else k): v for k, v in state.items()}


def _describe(folder: str) -> str:
    """What the folder's config says it is (e.g. "a OPTForCausalLM model")."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            archs = json.load(f).get("architectures") or []
    except (OSError, ValueError):
        archs = []
    return f"a {'/'.join(archs)} model" if archs else "no architecture in config.json"


def _shape(tensor) -> tuple:
    return tuple(tensor.ds_shape) if hasattr(tensor, "ds_shape") else tuple(tensor.shape)


def _mismatch_report(model: nn.Module, state: dict) -> list:
    """Human-readable problems between ``model``'s state-dict keys/shapes and ``state``."""
    expected = {name: _shape(t) for name, t in model.named_parameters()}
    for name, buf in model.state_dict().items():  # persistent buffers (and params, already there)
        expected.setdefault(name, _shape(buf))
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [f"{k}: checkpoint {tuple(state[k].shape)} vs model {expected[k]}"
              for k in sorted(set(expected) & set(state)) if tuple(state[k].shape) != expected[k]]

    def some(keys):
        return ", ".join(keys[:5]) + (f" … ({len(keys)} in all)" if len(keys) > 5 else "")

    problems = []
    if missing:
        problems.append(f"missing {some(missing)}")
    if unexpected:
        problems.append(f"unexpected {some(unexpected)}")
    if shapes:
        problems.append(f"shape mismatch {some(shapes)}")
    return problems


def load_reward_state_dict(model: RewardModel, folder: str, zero_stage: int = 0) -> RewardModel:
    """Load ``folder``'s weights into ``model`` exactly (strict keys and shapes), ZeRO-3 aware.

    Under ZeRO-3 each partitioned parameter is gathered, written on rank 0, and
    re-partitioned (``GatheredParameters(modifier_rank=0)``). Anything that does not
    match is a :class:`UserInputError` naming the folder and the keys.
    """
    path = _weights_file(check_reward_model_folder(folder))
    state = _read_state_dict(path)
    if "v_head.weight" not in state and read_marker(folder) is None:
        raise UserInputError(f"{folder} is not a step-2 reward model folder: it has no {MARKER_FILE} and its weights "
                             f"have no v_head.weight ({_describe(folder)}); give the --output_dir of "
                             "step2_reward_model_finetuning")
    problems = _mismatch_report(model, state)
    if problems:
        hint = "" if read_marker(folder) else f" (no {MARKER_FILE}: is it a step-1 / plain HF folder?)"
        raise UserInputError(f"{folder} is not a step-2 reward model matching this backbone{hint}: "
                             + "; ".join(problems))
    partitioned = zero_stage == 3 or any(hasattr(p, "ds_id") for p in model.parameters())
    if not partitioned:
        model.load_state_dict(state, strict=True)
        return model
    import deepspeed

    from utils.distributed import is_rank_0

    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if name not in state:
                continue  # non-persistent buffer
            if hasattr(tensor, "ds_id"):
                with deepspeed.zero.GatheredParameters([tensor], modifier_rank=0):
                    if is_rank_0():
                        tensor.data.copy_(state[name].to(tensor.dtype))
            else:
                tensor.data.copy_(state[name].to(dtype=tensor.dtype, device=tensor.device))
    return model


def create_critic_model(model_name_or_path: str, tokenizer, ds_config: dict | None, num_padding_at_beginning: int = 0,
                        rlhf_training: bool = False, dropout=None, zero_stage: int = 0,
                        trust_remote_code: bool = False) -> RewardModel:
    """A :class:`RewardModel` on ``model_name_or_path``'s backbone.

    ``rlhf_training=False`` (step 2): backbone weights from the (pretrained / step-1)
    model, fresh ``v_head``. ``rlhf_training=True`` (step 3, rw_eval): architecture from
    the step-2 folder's config, then every weight from its checkpoint, strictly
    (:func:`load_reward_state_dict`). Under ZeRO-3 (``ds_config`` stage 3) the backbone is
    built partitioned and loaded through gathered parameters.
    """
    from transformers import AutoModel

    from utils.model.model_utils import create_hf_model, resolve_model_name_or_path

    if rlhf_training:
        folder = resolve_model_name_or_path(model_name_or_path)
        check_reward_model_folder(folder)
        marker = read_marker(folder) or {}
        saved = marker.get("num_padding_at_beginning")
        if saved is not None and saved != num_padding_at_beginning:
            import warnings

            warnings.warn(f"{folder} was trained with num_padding_at_beginning={saved}, "
                          f"loading it with {num_padding_at_beginning}")
    backbone = create_hf_model(AutoModel, model_name_or_path, tokenizer, ds_config, rlhf_training, dropout,
                               trust_remote_code=trust_remote_code)
    if ds_config is not None and ds_config["zero_optimization"]["stage"] == 3:
        import deepspeed

        with deepspeed.zero.Init(config_dict_or_path=ds_config):  # v_head partitioned, in the backbone's dtype
            model = RewardModel(backbone, tokenizer, num_padding_at_beginning)
    else:
        model = RewardModel(backbone, tokenizer, num_padding_at_beginning)
    if rlhf_training:
        load_reward_state_dict(model, folder, zero_stage)
    return model


def zero_value_head(model: RewardModel) -> RewardModel:
    """``model`` with its value head's weight set to 0 (every value 0 until the critic learns; the backbone kept):
    step 3's ``--critic_value_head zero``. A ZeRO-3 partitioned weight is gathered, zeroed and partitioned again
    (an empty gather otherwise, as :mod:`utils.checkpoint` does)."""
    import deepspeed

    weight = model.v_head.weight
    with deepspeed.zero.GatheredParameters([weight] if hasattr(weight, "ds_id") else [], modifier_rank=0), \
            torch.no_grad():
        weight.zero_()
    return model


def save_reward_model(model, tokenizer, output_dir: str, zero_stage: int = 0) -> None:
    """Write a step-2 folder (layout in the module docstring). Collective under ZeRO-3; rank 0 writes."""
    from safetensors.torch import save_file

    from utils.distributed import is_rank_0
    from utils.files import atomic_directory
    from utils.finite import check_weights_finite
    from utils.model.model_utils import gather_for_saving

    check_weights_finite("the reward model", model)
    model, state = gather_for_saving(model, zero_stage)
    if is_rank_0():
        marker = {"format": MARKER_FORMAT, "version": MARKER_VERSION,
                  "num_padding_at_beginning": model.num_padding_at_beginning,
                  "model_type": getattr(model.config, "model_type", None),
                  "backbone": type(model.rwtransformer).__name__}
        with atomic_directory(output_dir) as tmp:
            model.config.architectures = [type(model.rwtransformer).__name__]
            model.config.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(tmp, WEIGHTS_FILE),
                      metadata={"format": "pt"})
            with open(os.path.join(tmp, MARKER_FILE), "w") as f:
                json.dump(marker, f, indent=2)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def load_reward_model(path: str, device: str | torch.device = "cpu", num_padding_at_beginning: int | None = None,
                      apply_chat_template: bool = False):
    """``(model, tokenizer)`` from a step-2 folder, in eval mode on ``device`` (fp32).

    ``num_padding_at_beginning`` defaults to the value stored in the folder's marker; ``apply_chat_template``:
    texts will be formatted with the folder's chat template (:func:`~utils.model.model_utils.load_hf_tokenizer`).
    """
    from utils.model.model_utils import load_hf_tokenizer, resolve_model_name_or_path

    folder = check_reward_model_folder(resolve_model_name_or_path(path))
    if num_padding_at_beginning is None:
        num_padding_at_beginning = (read_marker(folder) or {}).get("num_padding_at_beginning", 0)
    tokenizer = load_hf_tokenizer(folder, apply_chat_template=apply_chat_template)
    model = create_critic_model(folder, tokenizer, None, num_padding_at_beginning, rlhf_training=True)
    return model.to(device).eval(), tokenizer
