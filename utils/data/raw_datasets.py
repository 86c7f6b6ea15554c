"""Raw datasets: one adapter per supported source, all with DeepSpeed-Chat's interface.

An adapter turns rows of one source into the text convention every training step
uses::

    prompt   " Human: <question> Assistant:"     (hh-style sets keep "\\n\\nHuman: ... \\n\\nAssistant:")
    chosen   " <answer>"                          (answers start with a space)
    rejected " <answer>"  or None when the source has no rejected answer (SFT-only)
    prompt_and_chosen / prompt_and_rejected = prompt + answer (None when either is None)

Sources (:func:`get_raw_dataset` dispatches on the name, by substring as the reference):

* hub names (``Dahoas/rm-static`` ... ``lmqg/qag_jaquad``, see ``HUB_DATASETS``): loaded
  with ``datasets.load_dataset`` on first use; a name that is also an existing local
  path (a ``save_to_disk`` folder or data files in the upstream column layout) is read
  from disk instead, as the reference does;
* ``local/jsonfile``: ``data/train.json`` and ``data/eval.json`` relative to the
  current directory, rows ``{"prompt", "chosen", "rejected"}`` (the reference's
  ``" " + field`` rendering);
* any existing local path: a ``.json`` (JSON list or JSON lines), ``.jsonl``,
  ``.jsonl.gz``, ``.json.gz`` or ``.parquet`` file, a ``datasets.save_to_disk`` folder
  (Dataset or DatasetDict), or a folder holding ``train*`` and ``eval|validation|
  valid|dev|test*`` files of those formats (also under ``data/``, shards allowed, e.g.
  ``train-00000-of-00002.parquet``). Row layouts, detected from the first row's keys:
  ``prompt``+``chosen`` (+``rejected``); ``chosen``+``rejected`` full hh-rlhf
  conversations; LLaMA-Factory ``conversations`` (+``chosen``/``rejected``
  preference, or SFT when absent); alpaca ``instruction``/``input``/``output`` (or
  ``chosen``/``rejected``); ``question``/``answer`` (gsm8k);
* ``builtin/...`` (:mod:`utils.data.builtin`), generated locally.

Sets without an eval split are split 9:1 into train/eval with
:func:`utils.data.split.get_split_index` (split name ``train_eval``, ``9,1``).

Loading is lazy: constructing an adapter only resolves the name (and, for local
data, which files will be read), so :meth:`PromptRawDataset.fingerprint` and
``dataset_name_clean`` are available without reading data or reaching the hub.
Data are read (and validated) on the first ``get_train_data``/``get_eval_data``/
``load`` call; every user-fixable problem raises :class:`UserInputError` naming the
dataset and the file/field (and row or line).

Empty strings: a field that is ``""`` comes back as ``""`` from ``get_prompt``/
``get_chosen``/``get_rejected`` (not wrapped, no leading space, not None), and
``get_prompt_and_*`` is simply prompt + answer. The tokenising layer decides what to
do with empty fields (it counts and skips them).
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import re

import numpy as np

from utils.data.split import get_split_index
from utils.errors import UserInputError

# Bump when the way rows are read or rendered changes: part of every fingerprint,
# so tokenised-data caches built by older code are not reused.
RAW_FORMAT_VERSION = 1

HH_ASSISTANT = "\n\nAssistant:"
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


def normalize_prompt(prompt):
    """A prompt already ending in "Assistant:" is kept; any other is wrapped in
    ``" Human: ... Assistant:"``. None and "" pass through."""
    if prompt is None or prompt == "":
        return prompt
    if prompt.rstrip().endswith("Assistant:"):
        return prompt
    return _wrap_prompt(prompt)


def normalize_answer(answer):
    """An answer gets a leading space unless it starts with whitespace; None/"" pass."""
    if answer is None or answer == "" or answer[0].isspace():
        return answer
    return " " + answer


def _safe_name(text, limit=60):
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")[:limit] or "dataset"


def _files_fingerprint(files):
    parts = []
    for path in files:
        st = os.stat(path)
        parts.append(f"{path}:{st.st_size}:{st.st_mtime_ns}")
    return f"local:v{RAW_FORMAT_VERSION}:" + ";".join(parts)


def _short_hash(text):
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


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


# --------------------------------------------------------------------------- base class
class PromptRawDataset:
    """DeepSpeed-Chat's raw-dataset interface (see the module docstring).

    ``dataset_name`` is the name the user gave; ``dataset_name_clean`` is safe for
    file names (it includes a hash of the files' fingerprint for local data, so that
    split-index and cache files follow edits). Build from already-loaded rows with
    :meth:`from_rows` (no download).
    """

    canonical_name = None   # e.g. "Dahoas/rm-static"
    clean_name = None       # the reference's dataset_name_clean
    eval_split = None       # upstream eval split; None -> 9:1 split of train
    has_rejected = True     # False: the source never has rejected answers (SFT-only hub sets);
                            # local data may still lack them per row (get_rejected -> None)
    required_columns = ()   # checked when the data are read

    def __init__(self, output_path, seed, local_rank, dataset_name):
        self._setup(output_path, seed, local_rank, dataset_name)
        self._resolve()

    # ---- construction
    def _setup(self, output_path, seed, local_rank, dataset_name):
        self.output_path = output_path
        self.seed = seed
        self.local_rank = local_rank
        self.dataset_name = dataset_name if dataset_name is not None else self.canonical_name
        self.dataset_name_clean = self.clean_name or _safe_name(str(self.dataset_name))
        self._files = None
        self._loaded = False
        self._train = self._eval = None
        self._train_view = self._eval_view = None

    def _resolve(self):
        """Work out where the data come from (no reading); set ``_files`` for local data."""

    @classmethod
    def from_rows(cls, train, eval=None, *, output_path, seed=1234, local_rank=-1,
                  dataset_name=None, source="in-memory rows"):
        """An adapter over already-loaded rows (list of dicts or ``datasets.Dataset``) in
        the source's column layout; ``eval=None`` means "no eval split" (9:1 split of
        ``train``), a given ``eval`` is used as the eval split."""
        self = cls.__new__(cls)
        self._setup(output_path, seed, local_rank, dataset_name)
        self._given_eval = eval is not None  # an explicit eval split is used as given
        self._set_data({"train": [(source + " (train)", train)]}
                       if eval is None else
                       {"train": [(source + " (train)", train)], "eval": [(source + " (eval)", eval)]})
        return self

    # ---- loading
    def _read(self):
        """{split: [(source, data)]} (hub or disk)."""
        raise NotImplementedError

    def _pick_eval(self, splits):
        if getattr(self, "_given_eval", False):
            return "eval"
        if self.eval_split is None:
            return None
        for split in (self.eval_split, "eval") + EVAL_SPLIT_NAMES:
            if split in splits:
                return split
        return None

    def _set_data(self, splits):
        if "train" not in splits:
            raise UserInputError(
                f"dataset {self.dataset_name!r}: no 'train' split (found: {', '.join(sorted(splits)) or 'none'})")
        eval_name = self._pick_eval(splits)
        self._train = _combine([self._prepare(d, src) for src, d in splits["train"]])
        self._eval = None if eval_name is None else _combine(
            [self._prepare(d, src) for src, d in splits[eval_name]])
        self._loaded = True

    def load(self):
        """Read and validate the data now (the getters call this on first use)."""
        if not self._loaded:
            self._set_data(self._read())
        return self

    def _prepare(self, data, source):
        """Validate (and possibly convert) one part of a split; returns the rows."""
        if len(data) == 0:
            raise UserInputError(f"dataset {self.dataset_name!r}: {source} is empty (no rows)")
        names = _column_names(data)
        if names is not None:
            for col in self.required_columns:
                if col not in names:
                    raise UserInputError(
                        f"dataset {self.dataset_name!r}: {source} lacks the column {col!r} "
                        f"(has: {', '.join(names)})")
        else:
            for i, row in enumerate(data):
                if not isinstance(row, dict):
                    raise UserInputError(
                        f"dataset {self.dataset_name!r}: {source} row {i + 1} is a "
                        f"{_type_name(row)}, expected a dict of fields")
                for col in self.required_columns:
                    if col not in row:
                        raise UserInputError(
                            f"dataset {self.dataset_name!r}: {source} row {i + 1} lacks the "
                            f"field {col!r} (has: {', '.join(row)})")
        return data

    # ---- splits
    def _train_eval_split(self, part):
        index = get_split_index(self.output_path, self.dataset_name_clean, self.seed, "train_eval",
                                "9,1", part, len(self._train), expected=2)
        return _select(self._train, index)

    def get_train_data(self):
        self.load()
        if self._train_view is None:
            self._train_view = self._train if self._eval is not None else self._train_eval_split(0)
        return self._train_view

    def get_eval_data(self):
        self.load()
        if self._eval_view is None:
            self._eval_view = self._eval if self._eval is not None else self._train_eval_split(1)
        return self._eval_view

    # ---- rows
    def get_prompt(self, sample):
        raise NotImplementedError

    def get_chosen(self, sample):
        raise NotImplementedError

    def get_rejected(self, sample):
        return None

    def get_prompt_and_chosen(self, sample):
        return _concat(self.get_prompt(sample), self.get_chosen(sample))

    def get_prompt_and_rejected(self, sample):
        return _concat(self.get_prompt(sample), self.get_rejected(sample))

    # ---- cache key
    def fingerprint(self):
        """What identifies the content (for the tokenised-data cache key)."""
        if self._files is not None:
            return self._files_fp
        return f"name:{self.dataset_name}:v{RAW_FORMAT_VERSION}"

    def _use_files(self, files, clean_prefix):
        self._files = list(files)
        self._files_fp = _files_fingerprint(self._files)
        self.dataset_name_clean = f"{clean_prefix}_{_short_hash(self._files_fp)}"

    def __repr__(self):
        return f"{type(self).__name__}({self.dataset_name!r})"


# --------------------------------------------------------------------------- hub adapters
class _HubDataset(PromptRawDataset):
    hub_id = None
    hub_config = None

    def _resolve(self):
        path = os.path.expanduser(self.dataset_name)
        self._local = None
        if os.path.exists(path):  # the reference: an existing path is read from disk
            self._local = _LocalSource(path, self.dataset_name)
            self._use_files(self._local.files, self.clean_name)

    def _read(self):
        if self._local is not None:
            return self._local.read()
        return _load_hub(self.hub_id, self.hub_config, self.dataset_name)

    def fingerprint(self):
        if self._files is not None:
            return self._files_fp
        config = f":{self.hub_config}" if self.hub_config else ""
        return f"hub:{self.dataset_name}:{self.hub_id}{config}:v{RAW_FORMAT_VERSION}"


class DahoasRmstaticDataset(_HubDataset):
    """Prompts already ``"\\n\\nHuman: ... \\n\\nAssistant:"``; answers already spaced."""
    canonical_name = hub_id = "Dahoas/rm-static"
    clean_name = "Dahoas_rm_static"
    eval_split = "test"
    required_columns = ("prompt", "chosen", "rejected")

    def get_prompt(self, sample):
        return sample["prompt"]

    def get_chosen(self, sample):
        return sample["chosen"]

    def get_rejected(self, sample):
        return sample["rejected"]


class DahoasFullhhrlhfDataset(DahoasRmstaticDataset):
    canonical_name = hub_id = "Dahoas/full-hh-rlhf"
    clean_name = "Dahoas_full_hh_rlhf"


class DahoasSyntheticinstructgptjpairwiseDataset(_HubDataset):
    canonical_name = hub_id = "Dahoas/synthetic-instruct-gptj-pairwise"
    clean_name = "Dahoas_synthetic_instruct_gptj_pairwise"
    eval_split = None
    required_columns = ("prompt", "chosen", "rejected")

    def get_prompt(self, sample):
        return _wrap_prompt(sample["prompt"])

    def get_chosen(self, sample):
        return _answer(sample["chosen"])

    def get_rejected(self, sample):
        return _answer(sample["rejected"])


class YitingxieRlhfrewarddatasetsDataset(_HubDataset):
    """Rows: prompt ``"\\n\\nHuman: ...\\n\\n"``, answers ``"Assistant: ..."`` (the
    reference: prompt + "Assistant:", answer = text after the last "Assistant:")."""
    canonical_name = hub_id = "yitingxie/rlhf-reward-datasets"
    clean_name = "yitingxie_rlhf_reward_datasets"
    eval_split = "test"
    required_columns = ("prompt", "chosen", "rejected")

    def get_prompt(self, sample):
        p = sample["prompt"]
        return p if p is None or p == "" else p + "Assistant:"

    @staticmethod
    def _tail(text):
        return text if text is None or text == "" else text.split("Assistant:")[-1]

    def get_chosen(self, sample):
        return self._tail(sample["chosen"])

    def get_rejected(self, sample):
        return self._tail(sample["rejected"])

    def get_prompt_and_chosen(self, sample):
        return _concat(sample["prompt"], sample["chosen"])

    def get_prompt_and_rejected(self, sample):
        return _concat(sample["prompt"], sample["rejected"])


_CITATION_SPACED = re.compile(r" [\(\[].*?[\)\]]")
_CITATION = re.compile(r"[\(\[].*?[\)\]]")


class OpenaiWebgptcomparisonsDataset(_HubDataset):
    """chosen = the higher-scored answer (answer_0 on ties, as the reference), with
    citation brackets such as "[1]" (and any bracketed/parenthesised text) removed."""
    canonical_name = hub_id = "openai/webgpt_comparisons"
    clean_name = "openai_webgpt_comparisons"
    eval_split = None
    required_columns = ("question", "answer_0", "answer_1", "score_0", "score_1")

    @staticmethod
    def _clean(response):
        response = _CITATION_SPACED.sub("", response)
        return _CITATION.sub("", response)

    def get_prompt(self, sample):
        return _wrap_prompt(sample["question"]["full_text"])

    def get_chosen(self, sample):
        first = float(sample["score_0"]) >= float(sample["score_1"])
        return _answer(self._clean(sample["answer_0"] if first else sample["answer_1"]))

    def get_rejected(self, sample):
        first = float(sample["score_0"]) < float(sample["score_1"])
        return _answer(self._clean(sample["answer_0"] if first else sample["answer_1"]))


class StanfordnlpSHPDataset(_HubDataset):
    """labels == 1 means human_ref_A is preferred."""
    canonical_name = hub_id = "stanfordnlp/SHP"
    clean_name = "stanfordnlp_SHP"
    eval_split = "validation"
    required_columns = ("history", "human_ref_A", "human_ref_B", "labels")

    def get_prompt(self, sample):
        return _wrap_prompt(sample["history"])

    def get_chosen(self, sample):
        return _answer(sample["human_ref_A"] if int(sample["labels"]) == 1 else sample["human_ref_B"])

    def get_rejected(self, sample):
        return _answer(sample["human_ref_B"] if int(sample["labels"]) == 1 else sample["human_ref_A"])


class PvduySharegptalpacaoavicunaformatDataset(_HubDataset):
    """Vicuna-format prompts ("USER: ... ASSISTANT:") become " Human: ... Assistant:";
    chosen = label; no rejected."""
    canonical_name = hub_id = "pvduy/sharegpt_alpaca_oa_vicuna_format"
    clean_name = "pvduy_sharegpt_alpaca_oa_vicuna_format"
    eval_split = "test"
    has_rejected = False
    required_columns = ("prompt", "label")

    def get_prompt(self, sample):
        p = sample["prompt"]
        if p is None or p == "":
            return p
        p = p.replace("USER:", "Human:").replace("ASSISTANT:", "Assistant:")
        return p if p[0].isspace() else " " + p

    def get_chosen(self, sample):
        return _answer(sample["label"])


class Wangrui6ZhihuKOLDataset(_HubDataset):
    canonical_name = hub_id = "wangrui6/Zhihu-KOL"
    clean_name = "wangrui6_Zhihu_KOL"
    eval_split = None
    has_rejected = False
    required_columns = ("INSTRUCTION", "RESPONSE")

    def get_prompt(self, sample):
        return _wrap_prompt(sample["INSTRUCTION"])

    def get_chosen(self, sample):
        return _answer(sample["RESPONSE"])


class CohereMiraclzhqueries2212Dataset(_HubDataset):
    """chosen/rejected = the first positive/negative passage (None when there is none)."""
    canonical_name = hub_id = "Cohere/miracl-zh-queries-22-12"
    clean_name = "Cohere_miracl_zh_queries_22_12"
    eval_split = "dev"
    required_columns = ("query", "positive_passages", "negative_passages")

    def get_prompt(self, sample):
        return _wrap_prompt(sample["query"])

    @staticmethod
    def _first_text(passages):
        return _answer(passages[0]["text"]) if passages else None

    def get_chosen(self, sample):
        return self._first_text(sample["positive_passages"])

    def get_rejected(self, sample):
        return self._first_text(sample["negative_passages"])


class CohereMiracljaqueries2212Dataset(CohereMiraclzhqueries2212Dataset):
    canonical_name = hub_id = "Cohere/miracl-ja-queries-22-12"
    clean_name = "Cohere_miracl_ja_queries_22_12"


class HelloSimpleAIHC3ChineseDataset(_HubDataset):
    canonical_name = hub_id = "Hello-SimpleAI/HC3-Chinese"
    hub_config = "all"
    clean_name = "Hello_SimpleAI_HC3_Chinese"
    eval_split = None
    has_rejected = False
    required_columns = ("question", "human_answers")

    def get_prompt(self, sample):
        return _wrap_prompt(sample["question"])

    def get_chosen(self, sample):
        answers = sample["human_answers"]
        return _answer(answers[0]) if answers else None


class MkqaChineseDataset(_HubDataset):
    """The "mkqa" set, one language: queries[lang], answers[lang][0]["text"]."""
    canonical_name = "mkqa-Chinese"
    hub_id = "mkqa"
    clean_name = "mkqa_Chinese"
    lang = "zh_cn"
    eval_split = None
    has_rejected = False
    required_columns = ("queries", "answers")

    def get_prompt(self, sample):
        return _wrap_prompt(sample["queries"][self.lang])

    def get_chosen(self, sample):
        answers = sample["answers"][self.lang]
        return _answer(answers[0]["text"]) if answers else None


class MkqaJapaneseDataset(MkqaChineseDataset):
    canonical_name = "mkqa-Japanese"
    clean_name = "mkqa_Japanese"
    lang = "ja"


class LmqgQgjaquadDataset(_HubDataset):
    canonical_name = hub_id = "lmqg/qg_jaquad"
    clean_name = "lmqg_qg_jaquad"
    eval_split = "validation"
    has_rejected = False
    required_columns = ("question", "sentence")

    def get_prompt(self, sample):
        return _wrap_prompt(sample["question"])

    def get_chosen(self, sample):
        return _answer(sample["sentence"])


class LmqgQagjaquadDataset(_HubDataset):
    """As the reference: prompt = the first of ``questions``, chosen = ``paragraph``."""
    canonical_name = hub_id = "lmqg/qag_jaquad"
    clean_name = "lmqg_qag_jaquad"
    eval_split = "validation"
    has_rejected = False
    required_columns = ("questions", "paragraph")

    def get_prompt(self, sample):
        questions = sample["questions"]
        return _wrap_prompt(questions[0]) if questions else None

    def get_chosen(self, sample):
        return _answer(sample["paragraph"])


# Dispatch order (substring match), as the reference's get_raw_dataset.
HUB_DATASETS = (
    ("Dahoas/rm-static", DahoasRmstaticDataset),
    ("Dahoas/full-hh-rlhf", DahoasFullhhrlhfDataset),
    ("Dahoas/synthetic-instruct-gptj-pairwise", DahoasSyntheticinstructgptjpairwiseDataset),
    ("yitingxie/rlhf-reward-datasets", YitingxieRlhfrewarddatasetsDataset),
    ("openai/webgpt_comparisons", OpenaiWebgptcomparisonsDataset),
    ("stanfordnlp/SHP", StanfordnlpSHPDataset),
    ("pvduy/sharegpt_alpaca_oa_vicuna_format", PvduySharegptalpacaoavicunaformatDataset),
    ("wangrui6/Zhihu-KOL", Wangrui6ZhihuKOLDataset),
    ("Cohere/miracl-zh-queries-22-12", CohereMiraclzhqueries2212Dataset),
    ("Hello-SimpleAI/HC3-Chinese", HelloSimpleAIHC3ChineseDataset),
    ("mkqa-Chinese", MkqaChineseDataset),
    ("mkqa-Japanese", MkqaJapaneseDataset),
    ("Cohere/miracl-ja-queries-22-12", CohereMiracljaqueries2212Dataset),
    ("lmqg/qg_jaquad", LmqgQgjaquadDataset),
    ("lmqg/qag_jaquad", LmqgQagjaquadDataset),
)


# --------------------------------------------------------------------------- local/jsonfile
def _check_str(name, source, row_no, row, field, required):
    value = row.get(field)
    if value is None:
        if required:
            raise UserInputError(
                f"dataset {name!r}: {source} row {row_no}: missing field {field!r}")
        return
    if not isinstance(value, str):
        raise UserInputError(
            f"dataset {name!r}: {source} row {row_no}: field {field!r} must be a string, "
            f"got {_type_name(value)}")


class LocalJsonFileDataset(PromptRawDataset):
    """The reference's ``local/jsonfile``: ``data/train.json`` + ``data/eval.json``
    (relative to the current directory), rows ``{"prompt", "chosen", "rejected"}``;
    every field is rendered as ``" " + text`` (the prompt is expected to hold its own
    "Human: ... Assistant:" markers)."""
    canonical_name = "local/jsonfile"
    clean_name = "jsonfile"
    eval_split = "eval"

    def _resolve(self):
        self._paths = {split: os.path.abspath(os.path.join("data", f"{split}.json"))
                       for split in ("train", "eval")}
        missing = [p for p in self._paths.values() if not os.path.isfile(p)]
        if missing:
            raise UserInputError(
                f"dataset {self.dataset_name!r}: missing file(s) {', '.join(missing)}; local/jsonfile "
                f"reads data/train.json and data/eval.json relative to the current directory "
                f"({os.getcwd()}), each a JSON list of {{\"prompt\", \"chosen\", \"rejected\"}} rows")
        self._use_files(self._paths.values(), self.clean_name)

    def _read(self):
        return {split: [(f"file {p}", _read_json_rows(p, self.dataset_name))]
                for split, p in self._paths.items()}

    def _prepare(self, data, source):
        data = super()._prepare(data, source)
        rows = data if isinstance(data, list) else data.to_list()
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise UserInputError(
                    f"dataset {self.dataset_name!r}: {source} row {i + 1} is a "
                    f"{_type_name(row)}, expected a JSON object")
            _check_str(self.dataset_name, source, i + 1, row, "prompt", True)
            _check_str(self.dataset_name, source, i + 1, row, "chosen", True)
            _check_str(self.dataset_name, source, i + 1, row, "rejected", False)
        return rows

    def get_prompt(self, sample):
        return _answer(sample.get("prompt"))

    def get_chosen(self, sample):
        return _answer(sample.get("chosen"))

    def get_rejected(self, sample):
        return _answer(sample.get("rejected"))


# --------------------------------------------------------------------------- local paths
_ROLE_PREFIX = {"human": " Human: ", "user": " Human: ",
                "gpt": " Assistant: ", "assistant": " Assistant: ", "system": " "}

LOCAL_LAYOUTS = (
    '{"prompt", "chosen"[, "rejected"]}',
    '{"chosen", "rejected"} full "\\n\\nHuman: ... \\n\\nAssistant: ..." conversations',
    'LLaMA-Factory {"conversations": [{"from", "value"}], "chosen", "rejected"} (or SFT without chosen)',
    'alpaca {"instruction", "input", "output"} (or "chosen"/"rejected" instead of "output")',
    '{"question", "answer"}',
)


def detect_layout(keys):
    """The row layout of a local file from its first row's keys (None if unknown)."""
    keys = set(keys)
    if "conversations" in keys:
        return "conversations_pairwise" if "chosen" in keys else "conversations_sft"
    if "instruction" in keys:
        return "alpaca_pairwise" if "chosen" in keys and "output" not in keys else "alpaca"
    if "prompt" in keys:
        return "prompt_chosen"
    if "chosen" in keys and "rejected" in keys:
        return "hh"
    if "question" in keys and "answer" in keys:
        return "qa"
    return None


_MISSING = object()


class _RowReader:
    """Reads the fields of one local row, raising UserInputError naming row and field."""

    def __init__(self, name, source, row_no, row):
        self.name, self.source, self.row_no, self.row = name, source, row_no, row

    def fail(self, field, problem):
        raise UserInputError(
            f"dataset {self.name!r}: {self.source} row {self.row_no}: field {field!r} {problem}")

    def text(self, field, required=True, value=_MISSING, label=None):
        """The string in ``field`` (or ``value``, reported as ``label``); None if absent
        and not required."""
        if value is _MISSING:
            value = self.row.get(field)
        label = label or field
        if value is None:
            if required:
                raise UserInputError(
                    f"dataset {self.name!r}: {self.source} row {self.row_no}: missing field {label!r}")
            return None
        if not isinstance(value, str):
            self.fail(label, f"must be a string, got {_type_name(value)}")
        return value


def _render_turns(reader, turns, field):
    if not isinstance(turns, list):
        reader.fail(field, f"must be a list of {{\"from\", \"value\"}} turns, got {_type_name(turns)}")
    parts = []
    for j, turn in enumerate(turns):
        label = f"{field}[{j}]"
        if not isinstance(turn, dict):
            reader.fail(label, f"must be an object {{\"from\", \"value\"}}, got {_type_name(turn)}")
        role = reader.text("from", value=turn.get("from"), label=label + ".from")
        value = reader.text("value", value=turn.get("value"), label=label + ".value")
        prefix = _ROLE_PREFIX.get(role.lower())
        if prefix is None:
            reader.fail(label + ".from", f"has unsupported role {role!r} (expected human/user, gpt/assistant or system)")
        parts.append((role.lower(), prefix + value))
    return parts


def _answer_value(reader, field):
    """LLaMA-Factory answers are {"from": "gpt", "value": ...} (a plain string is accepted)."""
    value = reader.row.get(field)
    if isinstance(value, dict):
        return reader.text(field, value=value.get("value"), label=field + ".value")
    return reader.text(field)


def _canonical_row(layout, reader):
    """{"prompt", "chosen", "rejected"} already in the text convention."""
    row = reader.row
    if layout == "prompt_chosen":
        return {"prompt": normalize_prompt(reader.text("prompt")),
                "chosen": normalize_answer(reader.text("chosen")),
                "rejected": normalize_answer(reader.text("rejected", required=False))}
    if layout == "hh":
        chosen, rejected = reader.text("chosen"), reader.text("rejected")
        cut = chosen.rfind(HH_ASSISTANT)
        if cut < 0:
            reader.fail("chosen", f"has no {HH_ASSISTANT!r} turn (expected a full hh-rlhf conversation)")
        prompt = chosen[:cut + len(HH_ASSISTANT)]
        if rejected.startswith(prompt):
            rejected_answer = rejected[len(prompt):]
        else:  # the two sides diverge earlier: each side's own last answer
            cut_r = rejected.rfind(HH_ASSISTANT)
            if cut_r < 0:
                reader.fail("rejected", f"has no {HH_ASSISTANT!r} turn (expected a full hh-rlhf conversation)")
            rejected_answer = rejected[cut_r + len(HH_ASSISTANT):]
        return {"prompt": prompt, "chosen": normalize_answer(chosen[len(prompt):]),
                "rejected": normalize_answer(rejected_answer)}
    if layout in ("conversations_pairwise", "conversations_sft"):
        turns = _render_turns(reader, row.get("conversations"), "conversations")
        system = reader.text("system", required=False)
        prefix = " " + system if system else ""
        if layout == "conversations_pairwise":
            chosen = _answer_value(reader, "chosen")
            rejected = _answer_value(reader, "rejected")
        else:
            if not turns or turns[-1][0] not in ("gpt", "assistant"):
                reader.fail("conversations", "must end with a gpt/assistant turn (the answer) "
                            "when the row has no \"chosen\"")
            chosen = turns[-1][1][len(" Assistant: "):]
            turns = turns[:-1]
            rejected = None
        prompt = prefix + "".join(text for _, text in turns) + " Assistant:"
        return {"prompt": prompt, "chosen": _answer(chosen), "rejected": _answer(rejected)}
    if layout in ("alpaca", "alpaca_pairwise"):
        instruction = reader.text("instruction")
        extra = reader.text("input", required=False)
        query = instruction + "\n" + extra if extra else instruction
        system = reader.text("system", required=False)
        prompt = " " + system if system else ""
        history = row.get("history")
        if history:
            if not isinstance(history, list):
                reader.fail("history", f"must be a list of [question, answer] pairs, got {_type_name(history)}")
            for j, pair in enumerate(history):
                if not (isinstance(pair, (list, tuple)) and len(pair) == 2
                        and all(isinstance(x, str) for x in pair)):
                    reader.fail(f"history[{j}]", "must be a [question, answer] pair of strings")
                prompt += " Human: " + pair[0] + " Assistant: " + pair[1]
        prompt += " Human: " + query + " Assistant:"
        if layout == "alpaca":
            return {"prompt": prompt, "chosen": _answer(reader.text("output")), "rejected": None}
        return {"prompt": prompt, "chosen": _answer(_answer_value(reader, "chosen")),
                "rejected": _answer(_answer_value(reader, "rejected"))}
    # qa
    return {"prompt": _wrap_prompt(reader.text("question")),
            "chosen": _answer(reader.text("answer")), "rejected": None}


def _arrow_is_string(feature):
    return getattr(feature, "dtype", None) in ("string", "large_string")


class LocalPathDataset(PromptRawDataset):
    """Any existing local file or folder (formats and layouts: module docstring).

    Rows come back as ``{"prompt", "chosen", "rejected"}`` already in the text
    convention (a ``save_to_disk`` folder in the prompt/chosen layout stays a
    memory-mapped ``datasets.Dataset`` and is normalised by the getters). Prompts
    that do not end in "Assistant:" are wrapped in " Human: ... Assistant:"; answers
    get a leading space unless they start with whitespace.
    """
    eval_split = "eval"

    def _resolve(self):
        self._local = _LocalSource(self.dataset_name, self.dataset_name)
        base = os.path.basename(self._local.path.rstrip(os.sep)) or "dataset"
        self._use_files(self._local.files, "local_" + _safe_name(base, 40))

    def _read(self):
        return self._local.read()

    def _prepare(self, data, source):
        if len(data) == 0:
            raise UserInputError(f"dataset {self.dataset_name!r}: {source} is empty (no rows)")
        if not isinstance(data, list):
            names = list(data.column_names)
            layout = detect_layout(names)
            if layout == "prompt_chosen":
                return self._check_arrow(data, source)
            if layout is None:
                self._unknown_layout(source, names)
            data = data.to_list()
        first = data[0]
        layout = detect_layout(first.keys())
        if layout is None:
            self._unknown_layout(source, list(first.keys()))
        rows = []
        for i, row in enumerate(data):
            if not isinstance(row, dict):
                raise UserInputError(
                    f"dataset {self.dataset_name!r}: {source} row {i + 1} is a {_type_name(row)}, "
                    "expected an object of fields")
            rows.append(_canonical_row(layout, _RowReader(self.dataset_name, source, i + 1, row)))
        return rows

    def _unknown_layout(self, source, keys):
        raise UserInputError(
            f"dataset {self.dataset_name!r}: {source}: cannot tell the row layout from the fields "
            f"{sorted(keys)}; supported layouts: " + "; ".join(LOCAL_LAYOUTS))

    def _check_arrow(self, ds, source):
        for col, required in (("prompt", True), ("chosen", True), ("rejected", False)):
            if col not in ds.column_names:
                if required:
                    raise UserInputError(
                        f"dataset {self.dataset_name!r}: {source} lacks the column {col!r}")
                continue
            feature = ds.features[col]
            if not (_arrow_is_string(feature) or (not required and getattr(feature, "dtype", None) == "null")):
                raise UserInputError(
                    f"dataset {self.dataset_name!r}: {source}: column {col!r} must hold strings, "
                    f"found {ds.features[col]}")
            if required:
                column = ds.data.column(col)
                if column.null_count:
                    row = column.to_pylist().index(None)
                    raise UserInputError(
                        f"dataset {self.dataset_name!r}: {source} row {row + 1}: missing field {col!r}")
        return ds

    def get_prompt(self, sample):
        return normalize_prompt(sample["prompt"])

    def get_chosen(self, sample):
        return normalize_answer(sample["chosen"])

    def get_rejected(self, sample):
        return normalize_answer(sample.get("rejected"))


# --------------------------------------------------------------------------- builtin
class BuiltinDataset(PromptRawDataset):
    """``builtin/...`` sets from :mod:`utils.data.builtin` (rows already in the convention)."""
    eval_split = "eval"

    def _resolve(self):
        from utils.data import builtin
        if self.dataset_name not in builtin.BUILTIN_DATASETS:
            raise UserInputError(
                f"dataset {self.dataset_name!r}: unknown built-in dataset; known: "
                + ", ".join(builtin.BUILTIN_DATASETS))
        self._version = getattr(builtin, "VERSION", 0)
        self.dataset_name_clean = _safe_name(self.dataset_name)

    def _read(self):
        from utils.data import builtin
        data = builtin.load_builtin(self.dataset_name)
        return {split: [(f"built-in {self.dataset_name} ({split})", rows)] for split, rows in data.items()}

    def fingerprint(self):
        return f"builtin:{self.dataset_name}:v{getattr(self, '_version', 0)}:raw{RAW_FORMAT_VERSION}"

    def get_prompt(self, sample):
        return sample["prompt"]

    def get_chosen(self, sample):
        return sample["chosen"]

    def get_rejected(self, sample):
        return sample.get("rejected")


# --------------------------------------------------------------------------- dispatch
def supported_names():
    """The names :func:`get_raw_dataset` understands (besides local paths)."""
    names = [name for name, _ in HUB_DATASETS] + ["local/jsonfile"]
    try:
        from utils.data import builtin
        names += list(builtin.BUILTIN_DATASETS)
    except ImportError:  # pragma: no cover
        names.append("builtin/...")
    return names


def get_raw_dataset(dataset_name, output_path, seed, local_rank):
    """The adapter for ``dataset_name`` (no data are read yet; see the module docstring)."""
    if not isinstance(dataset_name, str) or not dataset_name.strip():
        raise UserInputError(f"dataset {dataset_name!r}: empty dataset name")
    if dataset_name.startswith("builtin/"):
        return BuiltinDataset(output_path, seed, local_rank, dataset_name)
    if "local/jsonfile" in dataset_name:
        return LocalJsonFileDataset(output_path, seed, local_rank, dataset_name)
    for key, cls in HUB_DATASETS:
        if key in dataset_name:
            return cls(output_path, seed, local_rank, dataset_name)
    if os.path.exists(os.path.expanduser(dataset_name)):
        return LocalPathDataset(output_path, seed, local_rank, dataset_name)
    raise UserInputError(
        f"dataset {dataset_name!r}: not a supported dataset name, and no local path "
        f"{os.path.abspath(os.path.expanduser(dataset_name))} exists. Supported names: "
        + ", ".join(supported_names())
        + "; or a local path, which must exist (a .json/.jsonl/.jsonl.gz/.json.gz/.parquet file, "
        "a datasets.save_to_disk folder, or a folder with train/eval files)")
