"""The raw-dataset interface every adapter has (DeepSpeed-Chat's): :class:`PromptRawDataset`.

An adapter turns rows of one source into the text convention every training step
uses::

    prompt   " Human: <question> Assistant:"     (hh-style sets keep "\\n\\nHuman: ... \\n\\nAssistant:")
    chosen   " <answer>"                          (answers start with a space)
    rejected " <answer>"  or None when the source has no rejected answer (SFT-only)
    prompt_and_chosen / prompt_and_rejected = prompt + answer (None when either is None)
    prompt_messages  the prompt as chat messages [{"role", "content"}] (``--apply_chat_template``,
                     :mod:`utils.data.chat_template`): read back from the prompt text, or built from
                     the row's own turns by the local layouts that have them

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

The adapters: :mod:`utils.data.hub_datasets`, :mod:`utils.data.local_datasets`;
:func:`utils.data.raw_datasets.get_raw_dataset` picks one by name.
"""
from __future__ import annotations

from utils.data.sources import (EVAL_SPLIT_NAMES, _column_names, _combine, _concat, _safe_name,
                                _select, _type_name)
from utils.data.chat_template import dschat_messages
from utils.data.split import get_split_index
from utils.errors import UserInputError
from utils.files import content_hash

# Bump when the way rows are read or rendered changes: part of every fingerprint,
# so tokenised-data caches built by older code are not reused.
RAW_FORMAT_VERSION = 2  # 2: local rows keep their other fields beside prompt/chosen/rejected


def _files_fingerprint(files):
    """The files' paths and content (sha256): an edit that keeps the size and the modification time is noticed."""
    return f"local:v{RAW_FORMAT_VERSION}:" + ";".join(f"{path}:{content_hash(path)}" for path in files)


def _short_hash(text):
    return content_hash(text.encode("utf-8"), digits=12)


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

    def get_prompt_messages(self, sample):
        """The prompt as chat messages (None for a blank prompt): read from the text convention
        (:func:`utils.data.chat_template.dschat_messages`)."""
        return dschat_messages(self.get_prompt(sample))

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
