"""Input checks every entry point runs first: bad input fails in about a second, with one
:class:`~utils.errors.UserInputError`, before distributed set-up, DeepSpeed, any model
is built, and before anything is written (no output folder, no log file).

    preflight(args, causal_lms={"--model_name_or_path": args.model_name_or_path})

checks the output folder can be written, that each causal-LM path exists and is not a
step-2 reward-model folder, that each reward-model path is a step-2 folder, and reads
and validates local data files (hub data sets are only resolved: reading them would
mean downloading).
"""
from __future__ import annotations

import os
import tempfile
from typing import Mapping, Optional

from utils.errors import UserInputError


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
    return path


def check_reward_model_path(flag: str, name_or_path: str) -> str:
    """A step-2 output folder (marker or reward weights)."""
    from utils.model.critic import check_reward_model_folder
    from utils.model.model_utils import resolve_model_name_or_path

    try:
        return check_reward_model_folder(resolve_model_name_or_path(name_or_path))
    except UserInputError as e:
        raise UserInputError(f"{flag}: {e}") from None


def check_shared_vocabulary(actor: str, critic: str, trust_remote_code: bool = False) -> None:
    """Step 3: the reward model must read the actor's token ids as the same tokens.

    Every token of the actor's tokenizer must have the same id in the step-2 folder's
    tokenizer (a reward model trained on another vocabulary would score nonsense, or
    index past its embeddings).
    """
    from utils.model.model_utils import load_hf_tokenizer

    actor_vocab = load_hf_tokenizer(actor, trust_remote_code=trust_remote_code).get_vocab()
    critic_vocab = load_hf_tokenizer(critic, trust_remote_code=trust_remote_code).get_vocab()
    differ = sorted(t for t, i in actor_vocab.items() if critic_vocab.get(t) != i)
    if differ:
        raise UserInputError(f"tokenizer/model vocabulary mismatch: --actor_model_name_or_path {actor} "
                             f"({len(actor_vocab)} tokens) and --critic_model_name_or_path {critic} "
                             f"({len(critic_vocab)} tokens) disagree on {len(differ)} tokens (e.g. "
                             f"{', '.join(map(repr, differ[:3]))}); train the reward model from the actor's tokenizer")


def check_phase_share(data_split: str, phase: int, has_sft_only_data: bool = False) -> None:
    """``--data_split`` must give this step's phase (1, 2 or 3) a non-zero share."""
    from utils.data.split import parse_data_split

    if parse_data_split(data_split)[phase - 1] == 0 and not (phase == 1 and has_sft_only_data):
        raise UserInputError(f"--data_split {data_split}: the share of phase {phase} (this step's data) is 0, "
                             "so there is nothing to train on")


def preflight(args, causal_lms: Mapping[str, str] = (), reward_models: Mapping[str, str] = (),
              phase: Optional[int] = None, data: bool = True) -> None:
    """The cheap checks of an entry point (module docstring); raises :class:`UserInputError`.

    ``phase``: the data phase the step trains on (checked to have a non-zero ``--data_split`` share).
    """
    from utils.data.data_utils import check_data_sources

    if phase is not None:
        check_phase_share(args.data_split, phase, bool(getattr(args, "sft_only_data_path", None)))
    check_output_dir_writable(getattr(args, "output_dir", None))
    for flag, name in dict(causal_lms).items():
        check_causal_lm_path(flag, name)
    for flag, name in dict(reward_models).items():
        check_reward_model_path(flag, name)
    local_rank = int(os.environ.get("LOCAL_RANK", max(getattr(args, "local_rank", -1), 0)))
    if data and local_rank == 0:
        names = list(args.data_path) + list(getattr(args, "sft_only_data_path", None) or [])
        check_data_sources(names, args.data_output_path, args.seed)
