"""Step 3's unsupervised (pre-training) data: text packed into fixed-length LM blocks.

``--unsupervised_dataset_name`` may be

* a local text file (``.txt``, one row per non-blank line), e.g. tinyshakespeare's ``input.txt``;
* a local folder of ``.txt`` files (read in sorted order, recursively);
* a local ``.json`` / ``.jsonl`` / ``.parquet`` / ``.csv`` file (column ``text``, else the first);
* a Hugging Face hub dataset name with ``--unsupervised_dataset_config_name`` (e.g.
  ``wikitext`` + ``wikitext-2-raw-v1``), loaded lazily with ``datasets`` (its ``train`` split).

Every row is tokenised (the tokenizer adds its BOS per row, as the reference's
``datasets.map`` does), the token streams are concatenated and cut into blocks of
``block_size = max_prompt_seq_len + max_answer_seq_len`` tokens; the tail shorter than a
block is dropped. Each sample is ``{"input_ids", "attention_mask", "labels"}`` of
``[block_size]`` with ``labels = input_ids`` (the LM loss shifts them).
"""
from __future__ import annotations

import os
from typing import Iterable, Iterator, List

import torch
from torch.utils.data import Dataset

from utils.errors import UserInputError

TABLE_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
TOKENIZE_BATCH = 1000


class PackedTextDataset(Dataset):
    """``[N, block_size]`` token blocks; item ``i`` is an LM sample with ``labels = input_ids``."""

    def __init__(self, blocks: torch.Tensor):
        self.blocks = blocks

    def __len__(self):
        return self.blocks.shape[0]

    def __getitem__(self, idx):
        ids = self.blocks[idx]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _text_files(folder: str) -> List[str]:
    files = sorted(os.path.join(root, name) for root, _, names in os.walk(folder)
                   for name in names if name.endswith(".txt"))
    if not files:
        raise UserInputError(f"--unsupervised_dataset_name {folder}: the folder has no .txt files")
    return files


def _lines(paths: Iterable[str]) -> Iterator[str]:
    """The non-empty lines of text files; a file that is not UTF-8 text (a binary file named .txt) is refused,
    naming where, instead of being read as replacement characters."""
    for path in paths:
        line_no = 0
        try:
            with open(path, encoding="utf-8") as f:
                for line_no, line in enumerate(f, 1):
                    if line.strip():
                        yield line.rstrip("\n")
        except OSError as e:
            raise UserInputError(f"--unsupervised_dataset_name: cannot read {path}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise UserInputError(f"--unsupervised_dataset_name: {path} is not UTF-8 text (line {line_no + 1}: "
                                 f"{e.reason}); give text files") from None


def _text_column(dataset, source: str) -> Iterator[str]:
    columns = dataset.column_names
    if not columns:
        raise UserInputError(f"--unsupervised_dataset_name {source}: the dataset has no columns")
    column = "text" if "text" in columns else columns[0]
    for text in dataset[column]:
        if text is not None and str(text).strip():
            yield str(text)


def _hub_rows(name: str, config_name: str | None) -> Iterator[str]:
    try:
        import datasets

        raw = datasets.load_dataset(name, config_name)
    except Exception as e:  # offline, unknown name, bad config: all user-fixable
        raise UserInputError(f"--unsupervised_dataset_name {name} (config {config_name}): cannot load it "
                             f"from the Hugging Face hub ({type(e).__name__}: {e}); offline, give a local "
                             ".txt file or folder instead") from None
    if "train" not in raw:
        raise UserInputError(f"--unsupervised_dataset_name {name}: no 'train' split (has {list(raw)})")
    return _text_column(raw["train"], name)


def unsupervised_rows(name: str, config_name: str | None = None) -> Iterator[str]:
    """The text rows of ``name`` (see the module docstring for what ``name`` may be)."""
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        return _lines(_text_files(path))
    if os.path.isfile(path):
        ext = os.path.splitext(path)[1].lower()
        if ext in TABLE_FORMATS:
            import datasets

            table = datasets.load_dataset(TABLE_FORMATS[ext], data_files=path, split="train")
            return _text_column(table, path)
        return _lines([path])
    if path.startswith((".", "/", "~")) or path.count("/") > 1:
        raise UserInputError(f"--unsupervised_dataset_name {name}: no such file or folder")
    return _hub_rows(name, config_name)


def pack_tokens(rows: Iterable[str], tokenizer, block_size: int, max_blocks: int | None = None) -> torch.Tensor:
    """Tokenise ``rows``, concatenate, cut into ``[N, block_size]`` blocks (tail dropped).

    ``max_blocks`` stops reading once that many blocks are full (None = all).
    """
    if block_size < 2:
        raise ValueError(f"block_size must be ≥ 2, got {block_size}")
    stream: List[int] = []
    batch: List[str] = []
    limit = None if max_blocks is None else max_blocks * block_size

    def flush():
        for ids in tokenizer(batch)["input_ids"]:
            stream.extend(ids)
        batch.clear()

    for row in rows:
        batch.append(row)
        if len(batch) == TOKENIZE_BATCH:
            flush()
            if limit is not None and len(stream) >= limit:
                break
    if batch:
        flush()
    n = len(stream) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    return torch.tensor(stream[:n * block_size], dtype=torch.long).view(n, block_size)


def get_unsupervised_data(name: str, config_name: str | None, tokenizer, block_size: int,
                          max_blocks: int | None = None, log=print) -> PackedTextDataset:
    """Packed LM blocks of ``name`` (file / folder / hub dataset); a clear error when there is too little text."""
    blocks = pack_tokens(unsupervised_rows(name, config_name), tokenizer, block_size, max_blocks)
    if blocks.shape[0] == 0:
        raise UserInputError(f"--unsupervised_dataset_name {name}: not enough text for one block of "
                             f"{block_size} tokens (--max_prompt_seq_len + --max_answer_seq_len)")
    log(f"unsupervised data: {blocks.shape[0]} blocks of {block_size} tokens from {name}")
    return PackedTextDataset(blocks)
