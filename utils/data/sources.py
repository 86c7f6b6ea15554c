"""Where raw data come from, and the small helpers the adapters share.

* reading data files: ``.json`` (JSON list or JSON lines), ``.jsonl``, ``.jsonl.gz``,
  ``.json.gz`` and ``.parquet`` (pyarrow, imported on use), every user-fixable problem a
  :class:`UserInputError` naming the dataset and the file (and row or line);
* :class:`_LocalSource`: a local file, a ``datasets.save_to_disk`` folder (Dataset or
  DatasetDict), or a folder holding ``train*`` and ``eval|validation|valid|dev|test*``
  files (also under ``data/``, shards allowed), resolved on construction, read on demand;
* :func:`_load_hub`: ``datasets.load_dataset`` (imported on use) with a user-facing error;
* combining/selecting rows held as lists of dicts or ``datasets.Dataset``;
* text helpers for the text convention (:mod:`utils.data.prompt_dataset`).
"""
from __future__ import annotations

import gzip
import json
import os
import re

import numpy as np

from utils.errors import UserInputError

DATA_EXTENSIONS = (".jsonl.gz", ".json.gz", ".jsonl", ".json", ".parquet")
TRAIN_SPLIT_NAMES = ("train",)
EVAL_SPLIT_NAMES = ("eval", "validation", "valid", "dev", "test")
_SPLIT_FILE_RE = re.compile(r"^(train|eval|validation|valid|dev|test)(?:[-_.].*)?$", re.IGNORECASE)


# --------------------------------------------------------------------------- text helpers
def _wrap_prompt(question):
    """``" Human: " + q + " Assistant:"``; None and "" pass through."""
    if question is None or question == "":
        return question
    return " Human: " + question + " Assistant:"


def _answer(text):
    """``" " + text``; None and "" pass through."""
    if text is None or text == "":
        return text
    return " " + text


def _concat(prompt, answer):
    if prompt is None or answer is None:
        return None
    return prompt + answer


def _safe_name(text, limit=60):
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")[:limit] or "dataset"


def _type_name(value):
    return "null" if value is None else type(value).__name__


# --------------------------------------------------------------------------- reading files
def _data_extension(path):
    lower = path.lower()
    for ext in DATA_EXTENSIONS:
        if lower.endswith(ext):
            return ext
    return None


def _read_json_rows(path, name):
    """Rows of a JSON list or JSON-lines file (optionally gzip'ed)."""
    opener = gzip.open if path.lower().endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            text = f.read()
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise UserInputError(f"dataset {name!r}: cannot read file {path}: {e}") from None
    if text.startswith("\ufeff"):
        text = text[1:]
    stripped = text.lstrip()
    if not stripped:
        raise UserInputError(f"dataset {name!r}: file {path} is empty (no rows)")
    if stripped[0] == "[":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserInputError(
                f"dataset {name!r}: file {path}: malformed JSON at line {e.lineno} "
                f"column {e.colno}: {e.msg}") from None
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise UserInputError(
                    f"dataset {name!r}: file {path}: row {i + 1} is a {_type_name(row)}, "
                    "expected a JSON object with the row's fields")
    else:
        rows = []
        for lineno, line in enumerate(text.split("\n"), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                if not rows:  # maybe one JSON document spread over lines
                    try:
                        whole = json.loads(text)
                    except json.JSONDecodeError:
                        whole = None
                    if whole is not None:
                        raise UserInputError(
                            f"dataset {name!r}: file {path} holds a single JSON "
                            f"{_type_name(whole)}; expected a JSON list of rows or one JSON "
                            "object per line (JSON lines)") from None
                raise UserInputError(
                    f"dataset {name!r}: file {path}: malformed JSON on line {lineno} "
                    f"(column {e.colno}): {e.msg}") from None
            if not isinstance(row, dict):
                raise UserInputError(
                    f"dataset {name!r}: file {path}: line {lineno} is a JSON "
                    f"{_type_name(row)}, expected a JSON object with the row's fields")
            rows.append(row)
    if not rows:
        raise UserInputError(f"dataset {name!r}: file {path} is empty (no rows)")
    return rows


def _read_parquet_rows(path, name):
    try:
        import pyarrow.parquet as pq
        table = pq.read_table(path)
    except ImportError:  # pragma: no cover - pyarrow comes with datasets
        raise UserInputError(f"dataset {name!r}: reading {path} needs pyarrow (pip install pyarrow)") from None
    except Exception as e:  # noqa: BLE001 - any unreadable parquet file is the user's to fix
        raise UserInputError(f"dataset {name!r}: cannot read parquet file {path}: {e}") from None
    if table.num_rows == 0:
        raise UserInputError(f"dataset {name!r}: file {path} is empty (no rows)")
    return table.to_pylist()


def _read_data_file(path, name):
    ext = _data_extension(path)
    if ext is None:
        raise UserInputError(
            f"dataset {name!r}: file {path} has an unsupported extension; supported: "
            + ", ".join(DATA_EXTENSIONS) + " (or a datasets.save_to_disk folder)")
    if ext == ".parquet":
        return _read_parquet_rows(path, name)
    return _read_json_rows(path, name)


def _is_save_to_disk_folder(path):
    return os.path.isfile(os.path.join(path, "dataset_dict.json")) or (
        os.path.isfile(os.path.join(path, "state.json"))
        and os.path.isfile(os.path.join(path, "dataset_info.json")))


def _split_files(folder):
    """{"train": [files], "eval": [files]} found in ``folder`` (or ``folder/data``)."""
    for directory in (folder, os.path.join(folder, "data")):
        if not os.path.isdir(directory):
            continue
        by_split = {}
        for entry in sorted(os.listdir(directory)):
            path = os.path.join(directory, entry)
            ext = _data_extension(entry)
            if ext is None or not os.path.isfile(path):
                continue
            m = _SPLIT_FILE_RE.match(entry[:-len(ext)])
            if m:
                by_split.setdefault(m.group(1).lower(), []).append(path)
        if "train" in by_split:
            found = {"train": by_split["train"]}
            for split in EVAL_SPLIT_NAMES:
                if split in by_split:
                    found["eval"] = by_split[split]
                    break
            return found
    return None


class _LocalSource:
    """Where a local dataset's data live: resolved on construction, read on demand."""

    def __init__(self, path, name):
        self.name = name
        self.path = os.path.abspath(os.path.expanduser(path))
        if os.path.isdir(self.path):
            if _is_save_to_disk_folder(self.path):
                self.kind = "save_to_disk"
                self.files = sorted(
                    os.path.join(root, f) for root, _, names in os.walk(self.path) for f in names)
                self.split_files = None
            else:
                found = _split_files(self.path)
                if found is None:
                    raise UserInputError(
                        f"dataset {name!r}: folder {self.path} is not a datasets.save_to_disk "
                        "folder and holds no train file (looked for train{"
                        + ",".join(DATA_EXTENSIONS) + "} and train-*/train_* shards, also under data/)")
                self.kind = "files"
                self.split_files = found
                self.files = [f for split in ("train", "eval") for f in found.get(split, [])]
        elif os.path.isfile(self.path):
            if _data_extension(self.path) is None:
                raise UserInputError(
                    f"dataset {name!r}: file {self.path} has an unsupported extension; "
                    "supported: " + ", ".join(DATA_EXTENSIONS) + " (or a datasets.save_to_disk folder)")
            self.kind = "file"
            self.split_files = {"train": [self.path]}
            self.files = [self.path]
        else:
            raise UserInputError(f"dataset {name!r}: local path {self.path} does not exist")

    def read(self):
        """{"train": [(source, data)], "eval": [(source, data)]?} with data a list of
        dicts or a ``datasets.Dataset``."""
        if self.kind != "save_to_disk":
            return {split: [(f"file {f}", _read_data_file(f, self.name)) for f in files]
                    for split, files in self.split_files.items()}
        import datasets
        try:
            loaded = datasets.load_from_disk(self.path)
        except Exception as e:  # noqa: BLE001
            raise UserInputError(
                f"dataset {self.name!r}: cannot load the datasets.save_to_disk folder {self.path}: {e}") from None
        if isinstance(loaded, datasets.Dataset):
            return {"train": [(f"folder {self.path}", loaded)]}
        splits = {}
        for split in loaded:
            splits[split] = [(f"folder {self.path} (split {split!r})", loaded[split])]
        return splits


def _load_hub(hub_id, config, name):
    try:
        import datasets
    except ImportError:  # pragma: no cover
        raise UserInputError(f"dataset {name!r}: loading from the hub needs the datasets package") from None
    try:
        if config is None:
            loaded = datasets.load_dataset(hub_id)
        else:
            loaded = datasets.load_dataset(hub_id, config)
    except Exception as e:  # noqa: BLE001 - offline, hub down, renamed set: all user-fixable
        raise UserInputError(
            f"dataset {name!r}: could not load {hub_id!r} from the Hugging Face hub "
            f"({type(e).__name__}: {str(e)[:300]}); the hub could not be reached or refused the "
            "request. Without network, download it elsewhere and pass a local path instead "
            "(a datasets.save_to_disk folder or .json/.jsonl/.parquet files).") from None
    return {split: [(f"hub {hub_id} (split {split!r})", loaded[split])] for split in loaded}


def _combine(parts):
    """Concatenate prepared parts (lists of dicts and/or datasets.Dataset)."""
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(p, list) for p in parts):
        return [row for p in parts for row in p]
    import datasets
    if all(isinstance(p, datasets.Dataset) for p in parts):
        return datasets.concatenate_datasets(parts)
    return [row for p in parts for row in (p if isinstance(p, list) else p.to_list())]


def _select(data, indices):
    indices = [int(i) for i in np.asarray(indices).tolist()]
    if isinstance(data, list):
        return [data[i] for i in indices]
    return data.select(indices)


def _column_names(data):
    if isinstance(data, list):
        return None
    return list(data.column_names)
