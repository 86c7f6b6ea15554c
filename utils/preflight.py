"""Input checks every entry point runs first: bad input fails in about a second, with one
:class:`~utils.errors.UserInputError`, before distributed set-up, DeepSpeed, any model
is built, and before anything is written; the output folder is taken last (:class:`~utils.run_folder.RunFolder`).

    folder = preflight(args, causal_lms={"--model_name_or_path": args.model_name_or_path})
    with folder:
        ...

checks the output folder can be written, that each causal-LM path exists and is not a
step-2 reward-model folder (and, with ``--apply_chat_template``, has a chat template), that
each reward-model path is a step-2 folder, and reads and validates local data files (hub
data sets are only resolved: reading them would mean downloading).
"""
from __future__ import annotations

import os
import tempfile
from typing import Mapping, Optional

from utils.errors import UserInputError
from utils.files import loaded_weight_files
from utils.run_folder import RunFolder


def check_output_dir_writable(out_dir: Optional[str], flag: str = "--output_dir") -> None:
    """``out_dir`` (or, while it does not exist, its nearest existing parent) accepts a new file.

    Probes by creating and removing a temporary file, which also catches read-only
    file systems and full quotas that permission bits do not show (and works as root).
    """
    if not out_dir:
        return
    path = os.path.abspath(out_dir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserInputError(f"{flag} {out_dir}: exists and is not a folder")
    probe_dir = path
    while not os.path.exists(probe_dir):
        probe_dir = os.path.dirname(probe_dir)
    if not os.path.isdir(probe_dir):
        raise UserInputError(f"{flag} {out_dir}: cannot create it, {probe_dir} is a file, not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".dschat-write-test-", dir=probe_dir)
        try:
            os.write(fd, b"x")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.remove(probe)
    except OSError as e:
        raise UserInputError(f"{flag} {out_dir}: cannot write in {probe_dir} ({e.strerror or e})") from None


def check_causal_lm_path(flag: str, name_or_path: str) -> str:
    """A causal-LM name/folder: exists (local paths), and is not a step-2 reward model folder."""
    from utils.model.critic import MARKER_FILE
    from utils.model.model_utils import resolve_model_name_or_path

    path = resolve_model_name_or_path(name_or_path)
    if os.path.isfile(os.path.join(path, MARKER_FILE)):
        raise UserInputError(f"{flag} {name_or_path}: this is a step-2 reward model folder (it has {MARKER_FILE}), "
                             "not a causal language model; give the step-1 output (or a base model) here")
    check_model_folder(flag, path)
    check_weights_readable(flag, path)
    names = weight_names(path)
    if "v_head.weight" in names or any(n.startswith(("rwtransformer.", "rwtranrsformer.")) for n in names):
        raise UserInputError(f"{flag} {name_or_path}: its weights are a reward model's (a value head, v_head, on "
                             "rwtransformer.*: DeepSpeed-Chat's step-2 layout), not a causal language model's; its "
                             "LM weights would be made up at random. Give the step-1 output (or a base model) here")
    return path


def weight_names(folder: str) -> set:
    """The tensor names in the first weights file a local folder's loader reads (:func:`loaded_weight_files`;
    safetensors header, or a ``.bin``'s pickle with its tensors memory-mapped, not read); empty for a hub name or
    a folder without weights."""
    files = [n for n in loaded_weight_files(folder) if not n.endswith(".index.json")]
    if not files or not os.path.isfile(os.path.join(folder, files[0])):
        return set()
    if files[0].endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(os.path.join(folder, files[0]), framework="pt") as f:
            return set(f.keys())
    import torch

    state = torch.load(os.path.join(folder, files[0]), weights_only=True, mmap=True, map_location="cpu")
    return set(state) if isinstance(state, dict) else set()


def check_chat_template(flag: str, name_or_path: str, trust_remote_code: bool = False) -> None:
    """``--apply_chat_template`` needs a tokenizer with a chat template that formats a conversation."""
    from utils.data.chat_template import chat_format
    from utils.model.model_utils import load_hf_tokenizer

    chat_format(load_hf_tokenizer(name_or_path, trust_remote_code=trust_remote_code), f"{flag} {name_or_path}")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model",
                   "spiece.model", "sentencepiece.bpe.model")


def check_model_folder(flag: str, folder: str) -> None:
    """A local model folder holds what loading it needs: a config whose ``model_type`` this transformers
    knows (or code it names: ``auto_map``), weights, and tokenizer files. Each missing piece is one line here,
    not a traceback from deep inside ``from_pretrained`` (or, for the weights, one after DeepSpeed's set-up)."""
    import json

    config_file = os.path.join(folder, "config.json")
    if not os.path.isdir(folder) or not os.path.isfile(config_file):
        return  # a hub name, or reported by the callers' own checks
    try:
        with open(config_file) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise UserInputError(f"{flag} {folder}: config.json cannot be read ({e})") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not config.get("auto_map"):
        from transformers import CONFIG_MAPPING, __version__

        if model_type not in CONFIG_MAPPING:
            raise UserInputError(f"{flag} {folder}: its config.json says model_type {model_type!r}, which "
                                 f"transformers {__version__} does not know (a newer transformers, or a folder with "
                                 "its own code and --trust_remote_code, may)")
    names = os.listdir(folder)
    if not loaded_weight_files(folder):
        raise UserInputError(f"{flag} {folder}: no weights in it (model.safetensors, pytorch_model.bin or a "
                             "sharded index); copy them beside its config.json")
    if not any(n in TOKENIZER_FILES for n in names):
        raise UserInputError(f"{flag} {folder}: no tokenizer files in it ({', '.join(TOKENIZER_FILES[:3])} ...); "
                             "copy them from the model it was trained from")


def check_bin_weights(flag: str, folder: str, name: str) -> None:
    """A pickled ``*.bin`` weights file imports nothing beyond tensors and plain data (transformers loads it
    with ``weights_only`` and would stop with a traceback; this says it in one line). Reads its pickle only."""
    import torch

    path = os.path.join(folder, name)
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception as e:  # noqa: BLE001 - not a zip file: truncated, or the old tar format
        raise UserInputError(f"{flag} {folder}: {name} cannot be read as PyTorch weights ({type(e).__name__}); "
                             "copy or save the model again") from None
    if unsafe:
        raise UserInputError(f"{flag} {folder}: {name} would import {', '.join(sorted(unsafe))} when loaded, which "
                             "can run code; not loading it (use a trusted copy, ideally in safetensors)")


def check_weights_readable(flag: str, folder: str) -> None:
    """Every weights file that loading the folder reads (:func:`loaded_weight_files`, not any other file beside
    them: a user's ``backup_of_old_model.bin`` is never read) is there and readable: a ``*.safetensors`` file has a
    complete header that covers the file, a ``*.bin`` imports nothing but tensors (:func:`check_bin_weights`).

    A truncated copy (an interrupted download or ``cp``) otherwise fails deep inside
    ``from_pretrained`` with a SafetensorError traceback. Reads headers only.
    """
    if not os.path.isdir(folder):
        return
    from safetensors import safe_open

    for name in loaded_weight_files(folder):
        path = os.path.join(folder, name)
        if name.endswith(".index.json"):
            continue
        if not os.path.isfile(path):
            raise UserInputError(f"{flag} {folder}: {name}, a shard its weights index names, is missing; copy or "
                                 "save the model again")
        if name.endswith(".bin"):
            check_bin_weights(flag, folder, name)
        if not name.endswith(".safetensors"):
            continue
        try:
            with safe_open(path, framework="pt"):
                pass
        except Exception as e:  # noqa: BLE001 - SafetensorError is not importable by name
            reason = str(e).split(": ", 1)[-1]
            raise UserInputError(f"{flag} {folder}: {name} is damaged ({reason}); it was probably truncated by "
                                 "an interrupted copy or save: copy or train the model again") from None


def model_positions(path: str) -> Optional[int]:
    """The longest sequence a local model folder's config allows (None: unknown, e.g. a hub name)."""
    import json

    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return None
    try:
        with open(config) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    for key in ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length"):
        if isinstance(config.get(key), int) and config[key] > 0:
            return config[key]
    return None


def check_sequence_fits(flag: str, name_or_path: str, length: int, length_flags: str) -> None:
    """``length`` tokens (``length_flags`` names the flags that make it) fit the model's position table.

    Checked up front for every run, not only when a long row happens to come along
    (a learned position table then fails with ``IndexError: index out of range``).
    """
    from utils.model.model_utils import resolve_model_name_or_path

    positions = model_positions(resolve_model_name_or_path(name_or_path))
    if positions is not None and length > positions:
        raise UserInputError(f"{length_flags} = {length} is longer than the {positions} positions of {flag} "
                             f"{name_or_path}; use at most {positions}")


def check_reward_model_path(flag: str, name_or_path: str) -> str:
    """A step-2 output folder (marker, or reward weights with a value head)."""
    from utils.model.critic import check_reward_model_folder
    from utils.model.model_utils import resolve_model_name_or_path

    try:
        folder = check_reward_model_folder(resolve_model_name_or_path(name_or_path))
    except UserInputError as e:
        raise UserInputError(f"{flag}: {e}") from None
    check_model_folder(flag, folder)
    check_weights_readable(flag, folder)
    return folder


def check_shared_vocabulary(actor: str, critic: str, trust_remote_code: bool = False) -> None:
    """Step 3: the reward model must read the actor's token ids as the same tokens.

    Every token of the actor's tokenizer must have the same id in the step-2 folder's
    tokenizer (a reward model trained on another vocabulary would score nonsense, or
    index past its embeddings). ``--allow_vocab_mismatch`` skips this check.
    """
    from utils.model.model_utils import load_hf_tokenizer

    actor_vocab = load_hf_tokenizer(actor, trust_remote_code=trust_remote_code).get_vocab()
    critic_vocab = load_hf_tokenizer(critic, trust_remote_code=trust_remote_code).get_vocab()
    differ = sorted(t for t, i in actor_vocab.items() if critic_vocab.get(t) != i)
    if differ:
        raise UserInputError(f"tokenizer/model vocabulary mismatch: --actor_model_name_or_path {actor} "
                             f"({len(actor_vocab)} tokens) and --critic_model_name_or_path {critic} "
                             f"({len(critic_vocab)} tokens) disagree on {len(differ)} tokens (e.g. "
                             f"{', '.join(map(repr, differ[:3]))}), so the reward model would score the wrong "
                             "tokens; train the reward model from the actor's tokenizer (or pass "
                             "--allow_vocab_mismatch to run anyway)")


def check_phase_share(data_split: str, phase: int, has_sft_only_data: bool = False) -> None:
    """``--data_split`` must give this step's phase (1, 2 or 3) a non-zero share."""
    from utils.data.split import parse_data_split

    if parse_data_split(data_split)[phase - 1] == 0 and not (phase == 1 and has_sft_only_data):
        raise UserInputError(f"--data_split {data_split}: the share of phase {phase} (this step's data) is 0, "
                             "so there is nothing to train on")


def changed_flags(args, out_dir: str) -> list:
    """``--flag old -> new`` for the result flags that differ from the newest checkpoint in ``out_dir``
    (none when there is no readable checkpoint; flags not resolved yet, such as a default dtype, are skipped)."""
    import glob

    from utils.checkpoint import RUN_ONLY_FLAGS, STATE

    states = sorted(glob.glob(os.path.join(out_dir, "checkpoints", "step-*", STATE)))
    if not states:
        return []
    try:
        import torch

        saved = torch.load(states[-1], weights_only=True).get("config", {})
    except Exception:  # noqa: BLE001 - a damaged checkpoint only loses this detail of the message
        return []
    return [f"--{key} {saved[key]!r} -> {value!r}" for key, value in sorted(vars(args).items())
            if key in saved and key not in RUN_ONLY_FLAGS and value is not None and saved[key] != value]


def check_output_is_not_an_input(out_dir: Optional[str], models: dict) -> None:
    """Refuse an ``--output_dir`` that is, or holds, one of the run's input model folders (``{flag: path}``):
    ``--overwrite`` would delete the input before the run could read it, and saving would replace it."""
    if not out_dir:
        return
    out = os.path.realpath(out_dir)
    for flag, path in models.items():
        if path and os.path.isdir(path):
            model = os.path.realpath(path)
            if model == out or model.startswith(out + os.sep):
                raise UserInputError(f"--output_dir {out_dir} {'is' if model == out else 'holds'} the input model of "
                                     f"{flag} ({path}): training would replace it; give another --output_dir")


def prepare_output_dir(args, log=print) -> RunFolder:
    """The rerun rule for ``--output_dir`` (README, "Reruns and output folders"), one for every step: the
    :class:`~utils.run_folder.RunFolder` of ``--output_dir``, taken for this run (rank 0: locked, what kills left
    cleaned up, a finished run refused unless ``--overwrite``, which sets the earlier run's entries aside until
    the new run's first step). Checkpoints of an unfinished run are resumed from later (:mod:`utils.checkpoint`).

    Call last among the checks: nothing is moved when another check fails.
    """
    folder = RunFolder(getattr(args, "output_dir", None), log)
    if folder.path:
        folder.claim(getattr(args, "overwrite", False), changes=lambda: changed_flags(args, folder.path))
        folder.will_write(getattr(args, "data_output_path", None),
                          args.tensorboard_path if getattr(args, "enable_tensorboard", False) else None)
    return folder


def preflight(args, causal_lms: Mapping[str, str] = (), reward_models: Mapping[str, str] = (),
              phase: Optional[int] = None, data: bool = True, length: Optional[tuple] = None) -> RunFolder:
    """The cheap checks of an entry point (module docstring); raises :class:`UserInputError`. Returns the run's
    output folder, taken for it (:func:`prepare_output_dir`): run the rest inside ``with folder:``.

    ``phase``: the data phase the step trains on (checked to have a non-zero ``--data_split`` share).
    ``length``: ``(tokens, "the flags that make it")`` every model must have positions for; default
    ``--max_seq_len``. Given both a causal LM and a reward model (step 3), they must share one
    vocabulary unless ``--allow_vocab_mismatch``.
    """
    from utils.data.data_utils import check_data_sources

    if phase is not None:
        check_phase_share(args.data_split, phase, bool(getattr(args, "sft_only_data_path", None)))
    check_output_dir_writable(getattr(args, "output_dir", None))
    if data and getattr(args, "data_output_path", None):
        check_output_dir_writable(args.data_output_path, "--data_output_path")
    if getattr(args, "enable_tensorboard", False):
        check_output_dir_writable(args.tensorboard_path, "--tensorboard_path")
    check_output_is_not_an_input(getattr(args, "output_dir", None), {**dict(causal_lms), **dict(reward_models)})
    if length is None and getattr(args, "max_seq_len", None):
        length = (args.max_seq_len, "--max_seq_len")
    for flag, name in dict(causal_lms).items():
        check_causal_lm_path(flag, name)
        if length:
            check_sequence_fits(flag, name, *length)
        if getattr(args, "apply_chat_template", False):
            check_chat_template(flag, name, getattr(args, "trust_remote_code", False))
    for flag, name in dict(reward_models).items():
        check_reward_model_path(flag, name)
        if length:
            check_sequence_fits(flag, name, *length)
    if causal_lms and reward_models and not getattr(args, "allow_vocab_mismatch", False):
        (actor, *_), (critic, *_) = dict(causal_lms).values(), dict(reward_models).values()
        check_shared_vocabulary(actor, critic, getattr(args, "trust_remote_code", False))
    local_rank = int(os.environ.get("LOCAL_RANK", max(getattr(args, "local_rank", -1), 0)))
    if data and local_rank == 0:
        names = list(args.data_path) + list(getattr(args, "sft_only_data_path", None) or [])
        check_data_sources(names, args.data_output_path, args.seed)
    return prepare_output_dir(args)


def run_step(run, args, phase: int):
    """The ``main`` of steps 1, 2 and DPO: fail fast, before any model or DeepSpeed set-up (the shared flag checks,
    the ZeRO combination, then :func:`preflight`: the model, the data and the output folder, which the run then
    holds), then ``run(args, folder)`` inside the folder (a failure before the first step leaves it as it was)."""
    from utils.arguments import validate_common
    from utils.compat import check_zero_combination

    validate_common(args)
    check_zero_combination(args)
    with preflight(args, causal_lms={"--model_name_or_path": args.model_name_or_path}, phase=phase) as folder:
        return run(args, folder)
