"""Split, tokenise and cache prompt datasets for the three training phases.

``create_prompt_dataset(...)`` returns ``(train, eval)`` torch datasets of
UNPADDED token ids; the phase's collator pads each batch:

=======  ===================================  =====================================================
phase    one sample                           collated batch
=======  ===================================  =====================================================
1 (SFT)  prompt+chosen+eot                    input_ids/attention_mask/labels [B, L], right-padded,
                                              labels = ids with padding → -100
         (chat template: {"input_ids",        (and the prompt's tokens → -100)
         "prompt_length"})
2 (RM)   (prompt+chosen+eot, prompt+rej+eot)  input_ids/attention_mask [2B, L] = [chosen…; rejected…]
         (``--kwise``: a prompt's pairs,      (``--kwise``: [U, L], each distinct text once, and the
         :func:`group_by_prompt`)             pairs' rows and prompts, :class:`DataCollatorKwise`)
3 (PPO)  {"input_ids": prompt, "prompt": its   prompt/prompt_att_mask [B, max_prompt_len], LEFT-padded;
         text, "row": the dataset row}        prompt_text and rows: lists of the texts and rows
=======  ===================================  =====================================================

A phase-3 ``row`` is the dataset row's fields (those holding JSON values: text, numbers, booleans,
None, and lists and objects of them, such as IFEval's ``instruction_id_list`` and ``kwargs``) plus
``"reference_answer"``: the answer the adapter reads from the row (a ``chosen`` answer, gsm8k's worked
solution), or None. Reward functions read it (:mod:`utils.reward_functions`).

With ``--apply_chat_template`` (``apply_chat_template=True``) the texts are the tokenizer's chat template's
(:mod:`utils.data.chat_template`): the prompt is the row's messages with the generation prompt, the answer the
assistant turn up to its end-of-turn token (which replaces ``end_of_conversation_token``), both tokenised as
written; the SFT loss (and perplexity) then covers the answer only, as TRL and OpenRLHF do.

Phases 1 and 2 pad to the longest sequence of the batch (rounded up to a
multiple of 8) instead of to ``max_seq_len``: the losses are the same, the
compute is not. Phase 3 pads to exactly ``max_prompt_seq_len`` like the reference.

Tokenised data are cached under ``--data_output_path`` keyed by a sha256 of
everything that changes the result: the datasets' content fingerprints (local
files: path and sha256 of the content), split, phase, seed, the tokenizer's vocabulary and
special tokens, ``max_seq_len``, the end-of-text token, the sft-only sets and, when applied, the chat
template.
Local rank 0 builds the cache (written atomically); other ranks wait at a
barrier and then read it.
"""
from __future__ import annotations

import json
import os
from typing import List, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from utils.data.chat_template import chat_format
from utils.data.local_datasets import PROMPT_MESSAGES
from utils.data.raw_datasets import get_raw_dataset
from utils.data.split import get_split_index
from utils.errors import UserInputError
from utils.files import content_hash

REFERENCE = "reference_answer"  # the key under which a phase-3 row carries the adapter's answer (module docstring)
CACHE_VERSION = 3  # 2: phase-3 samples carry their prompt text and dataset row; 3: stats count texts cut
# Phase 3's rows (portable_row), in phase 3's cache key only (steps 1 and 2 keep theirs, and their resumes):
# 2: list and object fields kept (IFEval's instruction_id_list and kwargs)
ROW_FIELDS_VERSION = 2


class PromptDataset(Dataset):
    """Tokenised samples of one phase (see module docstring for the sample layout)."""

    def __init__(self, samples: list, train_phase: int, stats: dict | None = None):
        self.samples = samples
        self.train_phase = train_phase
        self.stats = stats or {}
        self.cache_key = None  # set by create_prompt_dataset: the data, split, tokenizer ... it was built from

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        return self.samples[idx]


def _ids(tokenizer, text: str, max_len: int | None) -> torch.Tensor:
    kw = dict(truncation=True, max_length=max_len) if max_len else {}
    return torch.tensor(tokenizer(text, **kw)["input_ids"], dtype=torch.int32)


def _blank(text) -> bool:
    return text is None or not str(text).strip()


def _json_value(value) -> bool:
    """Is ``value`` plain data: None, text, a number, a boolean, or a list or string-keyed object of them?"""
    if value is None or isinstance(value, (str, int, float, bool)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_json_value(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_value(v) for k, v in value.items())
    return False


def portable_row(raw_dataset, row) -> dict:
    """The phase-3 ``row`` of a sample (module docstring): JSON values only (lists kept as lists), so the cache
    and the step-3 checkpoints load with ``torch.load(weights_only=True)``; not the loader's own
    ``prompt_messages``; ``"reference_answer"`` from the adapter."""
    fields = {k: list(v) if isinstance(v, tuple) else v for k, v in dict(row).items()
              if k != PROMPT_MESSAGES and _json_value(v)}
    try:
        reference = raw_dataset.get_chosen(row)
    except Exception:  # noqa: BLE001 - an adapter without answers (prompt-only data)
        reference = None
    fields[REFERENCE] = reference if isinstance(reference, str) else None
    return fields


def _chat_sample(raw_dataset, row, train_phase: int, chat, max_seq_len: int, cut: list | None = None) -> tuple:
    """``(sample, None)`` or ``(None, why it is skipped)`` of one row in the chat template's format ``chat``
    (a :class:`~utils.data.chat_template.ChatFormat`); ``cut`` gets a 1 for each text cut at ``max_seq_len``."""
    messages = raw_dataset.get_prompt_messages(row)
    if messages is None:
        return None, "empty prompt"
    if train_phase == 3:
        prompt = chat.prompt(messages)
        ids = chat.encode(prompt)
        if len(ids) > max_seq_len:
            return None, f"prompt longer than {max_seq_len} tokens"
        return {"input_ids": torch.tensor(ids, dtype=torch.int32), "prompt": prompt,
                "row": portable_row(raw_dataset, row)}, None

    def ids(answer):
        prompt_ids, answer_ids = chat.conversation_ids(messages, answer)
        if cut is not None and len(prompt_ids) + len(answer_ids) > max_seq_len:
            cut.append(1)
        return torch.tensor((prompt_ids + answer_ids)[:max_seq_len], dtype=torch.int32), len(prompt_ids)

    chosen = raw_dataset.get_chosen(row)
    if train_phase == 1:
        if _blank(chosen):
            return None, "empty chosen answer"
        sample, prompt_length = ids(chosen)
        if prompt_length >= max_seq_len:
            return None, f"prompt of {max_seq_len}+ tokens leaves no answer token"
        return {"input_ids": sample, "prompt_length": prompt_length}, None
    rejected = raw_dataset.get_rejected(row)
    if rejected is None:
        return None, "no rejected answer"
    if _blank(chosen) or _blank(rejected):
        return None, "empty chosen or rejected answer"
    (c, _), (r, _) = ids(chosen), ids(rejected)
    if torch.equal(c, r):
        return None, "chosen and rejected tokenise identically"
    return (c, r), None


def tokenize_phase(raw_dataset, rows, train_phase: int, tokenizer, end_of_conversation_token: str,
                   max_seq_len: int, chat=None) -> PromptDataset:
    """Tokenise ``rows`` of ``raw_dataset`` for one phase, skipping (and counting) unusable rows; in the chat
    template's format ``chat`` when given (module docstring)."""
    samples, skipped, cut = [], {}, []  # cut: a 1 for each text longer than max_seq_len (phases 1 and 2)

    def skip(reason):
        skipped[reason] = skipped.get(reason, 0) + 1

    def capped(text):
        ids = _ids(tokenizer, text, max_seq_len)
        if ids.numel() >= max_seq_len and len(tokenizer(text)["input_ids"]) > max_seq_len:
            cut.append(1)
        return ids

    eot = end_of_conversation_token or ""
    for row in rows:
        cut_before = len(cut)  # a skipped row's cut texts do not count
        if chat is not None:
            sample, reason = _chat_sample(raw_dataset, row, train_phase, chat, max_seq_len, cut)
            if sample is None:
                del cut[cut_before:]
                skip(reason)
            else:
                samples.append(sample)
        elif train_phase == 1:
            text = raw_dataset.get_prompt_and_chosen(row)
            if _blank(text) or _blank(raw_dataset.get_chosen(row)):
                skip("empty chosen answer")
                continue
            samples.append(capped(text + eot))
        elif train_phase == 2:
            chosen, rejected = raw_dataset.get_prompt_and_chosen(row), raw_dataset.get_prompt_and_rejected(row)
            if chosen is None or rejected is None:
                skip("no rejected answer")
                continue
            if _blank(raw_dataset.get_chosen(row)) or _blank(raw_dataset.get_rejected(row)):
                skip("empty chosen or rejected answer")
                continue
            c, r = capped(chosen + eot), capped(rejected + eot)
            if torch.equal(c, r):
                del cut[cut_before:]
                skip("chosen and rejected tokenise identically")
                continue
            samples.append((c, r))
        else:
            prompt = raw_dataset.get_prompt(row)
            if _blank(prompt):
                skip("empty prompt")
                continue
            ids = _ids(tokenizer, prompt, None)
            if ids.numel() > max_seq_len:
                skip(f"prompt longer than {max_seq_len} tokens")
                continue
            samples.append({"input_ids": ids, "prompt": prompt, "row": portable_row(raw_dataset, row)})
    return PromptDataset(samples, train_phase, stats={"kept": len(samples), "skipped": skipped, "cut": len(cut)})


def _phase_rows(raw_dataset, split_name: str, data, output_path, seed, data_split, train_phase):
    """The rows of ``data`` that belong to ``train_phase`` under the seeded split."""
    index = get_split_index(output_path, raw_dataset.dataset_name_clean, seed, split_name, data_split,
                            train_phase - 1, len(data)).tolist()
    return data.select(index) if hasattr(data, "select") else [data[i] for i in index]


def create_dataset(local_rank, dataset_name, data_split, output_path, train_phase, seed, tokenizer,
                   end_of_conversation_token, max_seq_len, chat=None):
    """One dataset's (train, eval) phase datasets (``chat``: :func:`tokenize_phase`)."""
    raw = get_raw_dataset(dataset_name, output_path, seed, local_rank)
    out = []
    for split_name, data in (("train", raw.get_train_data()), ("eval", raw.get_eval_data())):
        rows = _phase_rows(raw, split_name, data, output_path, seed, data_split, train_phase)
        out.append(tokenize_phase(raw, rows, train_phase, tokenizer, end_of_conversation_token,
                                  max_seq_len, chat))
    return out[0], out[1], raw


def phase_prompts(data_path, data_split, output_path, phase, seed, local_rank=-1) -> dict:
    """``{"train": [(prompt, row)], "eval": [...]}``: the text prompts of ``phase``'s rows of every dataset (rows as
    :func:`portable_row`), untokenised — what the comparison collector answers. Blank prompts are left out."""
    out = {"train": [], "eval": []}
    for name in data_path:
        raw = get_raw_dataset(name, output_path, seed, local_rank)
        for split_name, data in (("train", raw.get_train_data()), ("eval", raw.get_eval_data())):
            for row in _phase_rows(raw, split_name, data, output_path, seed, data_split, phase):
                prompt = raw.get_prompt(row)
                if not _blank(prompt):
                    out[split_name].append((prompt, portable_row(raw, row)))
    return out


def _tokenizer_fingerprint(tokenizer) -> str:
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()))
    special = json.dumps([tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.padding_side,
                          getattr(tokenizer, "add_bos_token", None)])
    return content_hash((vocab + special + type(tokenizer).__name__).encode(), digits=None)


def cache_key(data_path, data_split, train_phase, seed, tokenizer, max_seq_len, end_of_conversation_token,
              sft_only_data_path, fingerprints, chat_template: str | None = None) -> str:
    """sha256 over everything that changes the tokenised result (see module docstring); ``chat_template``: the
    template's text when it is applied (without one the key is what it always was); phase 3's also holds the
    version of its rows' fields."""
    parts = dict(version=CACHE_VERSION, data_path=list(data_path), fingerprints=fingerprints,
                 data_split=data_split, phase=train_phase, seed=seed, tokenizer=_tokenizer_fingerprint(tokenizer),
                 max_seq_len=max_seq_len, eot=end_of_conversation_token, sft_only=list(sft_only_data_path))
    if chat_template is not None:
        parts["chat_template"] = chat_template
    if train_phase == 3:
        parts["row_fields"] = ROW_FIELDS_VERSION
    return content_hash(json.dumps(parts, sort_keys=True).encode(), digits=24)


def _save(obj, path):
    from utils.files import atomic_write

    atomic_write(path, lambda tmp: torch.save(obj, tmp), "the data cache")


def _concat_shuffled(datasets: Sequence[PromptDataset], seed: int, train_phase: int) -> PromptDataset:
    samples = [s for d in datasets for s in d.samples]
    order = np.arange(len(samples))
    np.random.RandomState(seed=seed).shuffle(order)
    stats = {"kept": len(samples), "skipped": {}}
    cut = sum(d.stats.get("cut", 0) for d in datasets)
    if cut:
        stats["cut"] = cut
    for d in datasets:
        for reason, n in d.stats.get("skipped", {}).items():
            stats["skipped"][reason] = stats["skipped"].get(reason, 0) + n
    return PromptDataset([samples[i] for i in order], train_phase, stats)


def blend(datasets: Sequence[PromptDataset], sft_only: Sequence[PromptDataset], seed: int,
          train_phase: int) -> PromptDataset:
    """The phase's datasets concatenated and shuffled with the seed; then, as DeepSpeed-Chat mixes them, the
    ``--sft_only_data_path`` sets (phase 1) appended to that and the whole shuffled again with the seed."""
    mixed = _concat_shuffled(datasets, seed, train_phase)
    return _concat_shuffled([mixed, *sft_only], seed, train_phase) if sft_only else mixed


def _fingerprints(names, output_path, seed, local_rank) -> List[str]:
    return [get_raw_dataset(n, output_path, seed, local_rank).fingerprint() for n in names]


def check_data_sources(names: Sequence[str], output_path: str, seed: int) -> None:
    """Fail fast, before any model or DeepSpeed set-up, on bad ``--data_path`` entries.

    Every name is resolved (unknown names, missing paths); data that are already on
    this machine (local files/folders, ``builtin/...``) are also read and validated
    (malformed JSON, missing fields). Hub sets are only resolved: reading them would
    mean downloading. Raises :class:`UserInputError` naming the dataset and the problem.
    """
    for name in names:
        raw = get_raw_dataset(name, output_path, seed, -1)
        if not raw.fingerprint().startswith("hub:"):  # hub adapters not backed by a local path
            raw.load()


def _load_cache(path: str) -> dict:
    """A cache file, loaded without running code (``weights_only``); raises on anything else."""
    blob = torch.load(path, weights_only=True)
    if not isinstance(blob, dict) or "samples" not in blob or "stats" not in blob:
        raise ValueError("not a data cache")
    return blob


def create_prompt_dataset(local_rank, data_path, data_split, output_path, train_phase, seed, tokenizer,
                          max_seq_len, end_of_conversation_token="<|endoftext|>", sft_only_data_path=(),
                          reload=False, log=print, apply_chat_template=False):
    """(train, eval) :class:`PromptDataset` for ``train_phase``, built once and cached.

    ``--sft_only_data_path`` datasets go whole (split 10,0,0) into phase 1 only. ``apply_chat_template``:
    the tokenizer's chat template formats the texts (module docstring; a tokenizer without one is a
    :class:`UserInputError`).
    Raises :class:`UserInputError` when nothing usable is left.
    """
    if train_phase not in (1, 2, 3):
        raise ValueError(f"train_phase must be 1, 2 or 3, got {train_phase}")
    data_path = list(data_path)
    sft_only = list(sft_only_data_path or [])
    if not data_path:
        raise UserInputError("--data_path: give at least one dataset")
    chat = chat_format(tokenizer, getattr(tokenizer, "name_or_path", None) or "the model") \
        if apply_chat_template else None
    if chat is not None:
        log(chat.describe())
    os.makedirs(output_path, exist_ok=True)
    fingerprints = _fingerprints(data_path + sft_only, output_path, seed, local_rank)
    key = cache_key(data_path, data_split, train_phase, seed, tokenizer, max_seq_len, end_of_conversation_token,
                    sft_only, fingerprints, chat_template=tokenizer.chat_template if chat else None)
    train_file = os.path.join(output_path, f"traindata_phase{train_phase}_{key}.pt")
    eval_file = os.path.join(output_path, f"evaldata_phase{train_phase}_{key}.pt")
    cached = os.path.isfile(train_file) and os.path.isfile(eval_file)

    blobs = {}  # rank 0 reads the cache once: a damaged or foreign one (truncated, a pickle payload) is rebuilt
    if local_rank <= 0 and cached and not reload:
        try:
            blobs = {path: _load_cache(path) for path in (train_file, eval_file)}
        except Exception as e:  # noqa: BLE001 - whatever is wrong with it, the data are still there to re-read
            log(f"data cache {train_file} is damaged or holds more than data ({type(e).__name__}); rebuilding it")
            reload = True
    if local_rank <= 0 and (reload or not cached):
        parts = {"data": [], "sft": []}  # (train, eval) of each dataset
        for name in data_path:
            parts["data"].append(create_dataset(local_rank, name, data_split, output_path, train_phase, seed,
                                                tokenizer, end_of_conversation_token, max_seq_len, chat)[:2])
        for name in sft_only if train_phase == 1 else ():
            parts["sft"].append(create_dataset(local_rank, name, "10,0,0", output_path, 1, seed, tokenizer,
                                               end_of_conversation_token, max_seq_len, chat)[:2])
        train_dataset, eval_dataset = (blend([d[i] for d in parts["data"]], [d[i] for d in parts["sft"]], seed,
                                             train_phase) for i in (0, 1))
        _save({"samples": train_dataset.samples, "stats": train_dataset.stats}, train_file)
        _save({"samples": eval_dataset.samples, "stats": eval_dataset.stats}, eval_file)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()

    datasets = []
    for path in (train_file, eval_file):
        blob = blobs.get(path)
        if blob is None:
            try:
                blob = _load_cache(path)
            except Exception as e:  # noqa: BLE001 - rank 0 has just checked or rebuilt it
                raise UserInputError(f"cannot read the data cache {path} ({type(e).__name__}: {e}); delete "
                                     f"{output_path} to rebuild it") from None
        datasets.append(PromptDataset(blob["samples"], train_phase, blob["stats"]))
    train_dataset, eval_dataset = datasets
    train_dataset.cache_key = eval_dataset.cache_key = key  # what a resumed run must find unchanged
    for split, d in (("train", train_dataset), ("eval", eval_dataset)):
        if d.stats.get("skipped"):
            detail = ", ".join(f"{n} × {reason}" for reason, n in sorted(d.stats["skipped"].items()))
            log(f"data: phase {train_phase} {split}: kept {d.stats['kept']} rows, skipped {detail}")
        if d.stats.get("cut"):  # the answers of these texts are shortened (the reward model scores them at the cut)
            texts = d.stats["kept"] * (2 if train_phase == 2 else 1)
            log(f"data: phase {train_phase} {split}: {d.stats['cut']} of {texts} texts are longer than "
                f"--max_seq_len {max_seq_len} and were cut there (their answers shortened"
                f"{'; the reward is read at the cut' if train_phase == 2 else ''})")
    if len(train_dataset) == 0:
        raise UserInputError(f"--data_path {' '.join(data_path)}: no usable rows for phase {train_phase} "
                             f"(skipped: {train_dataset.stats.get('skipped') or 'none'})")
    if len(eval_dataset) == 0 and train_phase in (1, 2):  # steps 1 and 2 would report made-up eval numbers
        measure = "perplexity" if train_phase == 1 else "reward accuracy"
        raise UserInputError(f"--data_path {' '.join(data_path)}: the phase-{train_phase} eval split is empty "
                             f"({len(train_dataset)} train rows, 0 eval rows with --data_split {data_split}), so "
                             f"the {measure} cannot be measured; give more rows, a dataset with its own eval/test "
                             f"split, or a larger phase-{train_phase} share in --data_split")
    return train_dataset, eval_dataset


# --------------------------------------------------------------------------- collators

def _round_up(n: int, multiple: int = 8) -> int:
    return ((n + multiple - 1) // multiple) * multiple


def _right_pad(seqs, length: int, pad_id: int):
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), length), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = s
        mask[i, :len(s)] = 1
    return ids, mask


def pad_multiple(device) -> int:
    """Batch lengths are rounded up to a multiple of this: 128 on a GPU, 8 on a CPU.

    Dynamic padding makes every batch a new tensor shape. On a GPU each first-seen
    shape costs ~0.2 s (GEMM heuristics, allocator, attention kernel selection; measured
    with OPT-1.3B on an H100, where a 8×512 step is CPU-bound at ~0.21 s whatever its
    length), so 50 batches of ~30 distinct lengths lost ~5 s: rounding to 128 leaves
    at most ``max_seq_len / 128`` shapes and the extra padding is free. On a CPU padding
    costs compute, so only 8.
    """
    return 128 if getattr(device, "type", str(device)) == "cuda" else 8


class DataCollatorSFT:
    """Phase 1: right-pad to the batch's longest (rounded up to ``pad_to_multiple``, ≤ max_seq_len);
    labels ignore padding, and a chat-template sample's prompt (its first ``prompt_length`` tokens).

    ``pack=True`` (:func:`packs_sequences`): no padding at all. The batch's sequences go end to end in one row
    (``input_ids``, ``labels``, ``position_ids`` restarting at 0 for each) with a block-diagonal causal
    ``attention_mask [1, 1, L, L]`` (True = attend), so no sequence sees another and the loss is the padded
    batch's (tests/test_data_utils.py); each sequence's first label is ignored, as it is when padded (nothing
    before it predicts it). Every batch carries ``tokens``: its real tokens."""

    def __init__(self, pad_token_id: int, max_seq_len: int, pad_to_multiple: int = 8, pack: bool = False):
        self.pad_token_id, self.max_seq_len, self.multiple = pad_token_id, max_seq_len, pad_to_multiple
        self.pack = pack

    def __call__(self, samples):
        seqs = [s["input_ids"] if isinstance(s, dict) else s for s in samples]
        seqs = [s[:self.max_seq_len] for s in seqs]
        prompt_lengths = [s["prompt_length"] if isinstance(s, dict) else 0 for s in samples]
        tokens = torch.tensor(sum(len(s) for s in seqs))
        if self.pack:
            return self._packed(seqs, prompt_lengths, tokens)
        length = min(_round_up(max(len(s) for s in seqs), self.multiple), self.max_seq_len)
        ids, mask = _right_pad(seqs, length, self.pad_token_id)
        labels = ids.masked_fill(mask == 0, -100)
        for i, n in enumerate(prompt_lengths):
            labels[i, :n] = -100
        return {"input_ids": ids, "attention_mask": mask, "labels": labels, "tokens": tokens}

    @staticmethod
    def _packed(seqs, prompt_lengths, tokens):
        ids = torch.cat([torch.as_tensor(s, dtype=torch.long) for s in seqs])[None]
        labels = ids.clone()
        segments, positions, start = [], [], 0
        for i, (s, n) in enumerate(zip(seqs, prompt_lengths)):
            labels[0, start:start + max(n, 1)] = -100  # the prompt, and the first token at least
            segments.append(torch.full((len(s),), i))
            positions.append(torch.arange(len(s)))
            start += len(s)
        segment = torch.cat(segments)
        L = len(segment)
        mask = torch.tril(torch.ones(L, L, dtype=torch.bool)) & (segment[:, None] == segment[None, :])
        return {"input_ids": ids, "attention_mask": mask[None, None], "position_ids": torch.cat(positions)[None],
                "labels": labels, "tokens": tokens}


# model types whose transformers 5 forward takes a 4-D attention mask with explicit position ids as given (checked
# for llama and opt in tests/test_data_utils.py): step 1 packs its batches for these on a CPU
PACKABLE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "opt", "gemma", "gemma2", "phi3")


def packs_sequences(device, model) -> bool:
    """Step 1 packs each batch without padding (:class:`DataCollatorSFT`) on a CPU, where padding costs compute,
    for the model types of :data:`PACKABLE_MODEL_TYPES`; on a GPU it pads to few shapes (:func:`pad_multiple`)."""
    on_cpu = getattr(device, "type", str(device)) == "cpu"
    return on_cpu and getattr(getattr(model, "config", None), "model_type", None) in PACKABLE_MODEL_TYPES


class DataCollatorReward:
    """Phase 2: ``input_ids``/``attention_mask`` [2B, L] = chosen rows then rejected rows
    (L: the longest, rounded up to ``pad_to_multiple``, ≤ max_seq_len)."""

    def __init__(self, pad_token_id: int, max_seq_len: int, pad_to_multiple: int = 8):
        self.pad_token_id, self.max_seq_len, self.multiple = pad_token_id, max_seq_len, pad_to_multiple

    def __call__(self, samples):
        seqs = [c for c, _ in samples] + [r for _, r in samples]
        length = min(_round_up(max(len(s) for s in seqs), self.multiple), self.max_seq_len)
        ids, mask = _right_pad(seqs, length, self.pad_token_id)
        return {"input_ids": ids, "attention_mask": mask}


def group_by_prompt(dataset: PromptDataset) -> PromptDataset:
    """Step 2's ``--kwise``: the phase-2 pairs of ``dataset`` grouped by prompt
    (:func:`utils.data.comparisons.group_pairs`), one sample per prompt: the list of its ``(chosen, rejected)``
    pairs. A loader's batch size then counts prompts, and an epoch's shuffle moves whole prompts."""
    from utils.data.comparisons import group_pairs

    keys = [(tuple(c.tolist()), tuple(r.tolist())) for c, r in dataset.samples]
    grouped = PromptDataset([[dataset.samples[i] for i in group] for group in group_pairs(keys)], 2, dataset.stats)
    grouped.cache_key = dataset.cache_key
    return grouped


class DataCollatorKwise:
    """Phase 2 with ``--kwise`` (InstructGPT's K-wise batching): samples are prompts (:func:`group_by_prompt`),
    each a list of ``(chosen, rejected)`` pairs; each distinct text of the batch is one row
    (:func:`utils.data.comparisons.dedup_answers`), however many pairs it is in.

    Returns ``input_ids``/``attention_mask`` ``[U, L]`` (U distinct texts, L: the longest rounded up to
    ``pad_to_multiple``, ≤ max_seq_len), ``chosen_index``/``rejected_index`` ``[N]`` long (pair i's rows) and
    ``pair_group`` ``[N]`` long (pair i's prompt: 0 … prompts − 1), for
    :meth:`utils.model.reward_model.RewardModel.forward`."""

    def __init__(self, pad_token_id: int, max_seq_len: int, pad_to_multiple: int = 8):
        self.pad_token_id, self.max_seq_len, self.multiple = pad_token_id, max_seq_len, pad_to_multiple

    def __call__(self, prompts):
        from utils.data.comparisons import dedup_answers

        pairs = [pair for group in prompts for pair in group]
        tensors = {}
        keys = []
        for chosen, rejected in pairs:
            key = (tuple(chosen.tolist()), tuple(rejected.tolist()))
            tensors.setdefault(key[0], chosen)
            tensors.setdefault(key[1], rejected)
            keys.append(key)
        texts, chosen_index, rejected_index = dedup_answers(keys)
        seqs = [tensors[t][:self.max_seq_len] for t in texts]
        length = min(_round_up(max(len(s) for s in seqs), self.multiple), self.max_seq_len)
        ids, mask = _right_pad(seqs, length, self.pad_token_id)
        group = [g for g, pairs_of_prompt in enumerate(prompts) for _ in pairs_of_prompt]
        return {"input_ids": ids, "attention_mask": mask, "chosen_index": torch.tensor(chosen_index),
                "rejected_index": torch.tensor(rejected_index), "pair_group": torch.tensor(group)}


class DataCollatorRLHF:
    """Phase 3: prompts LEFT-padded to the batch's longest prompt, rounded up to ``pad_to_multiple`` and at most
    ``max_token_len`` (DeepSpeed-Chat pads every batch to ``max_token_len``: the same answers, with up to 3× the
    tokens in every pass when prompts are short): ``prompt``/``prompt_att_mask`` [B, P], and the samples'
    ``prompt_text`` and ``rows`` (lists; a bare tensor sample has text "" and row {})."""

    def __init__(self, max_token_len: int, pad_token_id: int, pad_to_multiple: int = 8):
        self.max_token_len, self.pad_token_id, self.multiple = max_token_len, pad_token_id, pad_to_multiple

    def __call__(self, samples):
        samples = [s if isinstance(s, dict) else {"input_ids": s, "prompt": "", "row": {}} for s in samples]
        longest = max(min(len(s["input_ids"]), self.max_token_len) for s in samples)
        length = min(_round_up(longest, self.multiple), self.max_token_len)
        ids = torch.full((len(samples), length), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, sample in enumerate(samples):
            s = sample["input_ids"][-length:]
            ids[i, length - len(s):] = s
            mask[i, length - len(s):] = 1
        return {"prompt": ids, "prompt_att_mask": mask, "prompt_text": [s["prompt"] for s in samples],
                "rows": [s["row"] for s in samples]}
