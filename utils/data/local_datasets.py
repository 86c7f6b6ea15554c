"""Local adapters: ``local/jsonfile``, any existing local path, and ``builtin/...``.

* ``local/jsonfile``: ``data/train.json`` and ``data/eval.json`` relative to the
  current directory, rows ``{"prompt", "chosen", "rejected"}`` (the reference's
  ``" " + field`` rendering);
* any existing local path: a ``.json`` (JSON list or JSON lines), ``.jsonl``,
  ``.jsonl.gz``, ``.json.gz`` or ``.parquet`` file, a ``datasets.save_to_disk`` folder
  (Dataset or DatasetDict), or a folder holding ``train*`` and ``eval|validation|
  valid|dev|test*`` files of those formats (also under ``data/``, shards allowed, e.g.
  ``train-00000-of-00002.parquet``). Row layouts, detected from the first row's keys:
  ``prompt``+``chosen`` (+``rejected``); ``prompt`` alone (prompts for step 3 and the comparison
  collector, e.g. IFEval's rows; steps 1 and 2 find no answers in them); ``chosen``+``rejected`` full hh-rlhf
  conversations; LLaMA-Factory ``conversations`` (+``chosen``/``rejected``
  preference, or SFT when absent); alpaca ``instruction``/``input``/``output`` (or
  ``chosen``/``rejected``); ``question``/``answer`` (gsm8k);
* ``builtin/...`` (:mod:`utils.data.builtin`), generated locally.
"""
from __future__ import annotations

import os

from utils.data.prompt_dataset import RAW_FORMAT_VERSION, PromptRawDataset
from utils.data.sources import _LocalSource, _answer, _read_json_rows, _safe_name, _type_name, _wrap_prompt
from utils.errors import UserInputError

HH_ASSISTANT = "\n\nAssistant:"


# --------------------------------------------------------------------------- text helpers
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
    (relative to the current directory; DeepSpeed-Chat reads its own checkout's ``data/`` folder), rows
    ``{"prompt", "chosen", "rejected"}``;
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
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
_DSCHAT_PREFIX = {"user": " Human: ", "assistant": " Assistant: ", "system": " "}
# The prompt's turns as chat messages, kept in the rows of the layouts that have them as fields
# (read by LocalPathDataset.get_prompt_messages for --apply_chat_template; never a phase-3 row field)
PROMPT_MESSAGES = "prompt_messages"

LOCAL_LAYOUTS = (
    '{"prompt", "chosen"[, "rejected"]}',
    '{"prompt"} alone (step 3\'s prompts)',
    '{"chosen", "rejected"} full "\\n\\nHuman: ... \\n\\nAssistant: ..." conversations',
    'LLaMA-Factory {"conversations": [{"from", "value"}], "chosen", "rejected"} (or SFT without chosen)',
    'alpaca {"instruction", "input", "output"} (or "chosen"/"rejected" instead of "output")',
    '{"question", "answer"}',
)


def detect_layout(keys):
    """The row layout of a local file from its first row's keys (None if unknown). A row with ``instruction`` and
    ``prompt`` but no answer (``output``/``chosen``/``rejected``) is a prompt row, not alpaca: the IFEval data
    builder's (``bench/ifeval_data.py``) keep the bare instruction beside the prompt."""
    keys = set(keys)
    answers = keys & {"output", "chosen", "rejected"}
    if "conversations" in keys:
        return "conversations_pairwise" if "chosen" in keys else "conversations_sft"
    if "instruction" in keys and (answers or "prompt" not in keys):
        return "alpaca_pairwise" if "chosen" in keys and "output" not in keys else "alpaca"
    if "prompt" in keys:
        return "prompt_chosen" if answers else "prompt_only"
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


def _turn_messages(reader, turns, field):
    """LLaMA-Factory ``[{"from", "value"}]`` turns as ``[{"role", "content"}]`` (roles user/assistant/system)."""
    if not isinstance(turns, list):
        reader.fail(field, f"must be a list of {{\"from\", \"value\"}} turns, got {_type_name(turns)}")
    messages = []
    for j, turn in enumerate(turns):
        label = f"{field}[{j}]"
        if not isinstance(turn, dict):
            reader.fail(label, f"must be an object {{\"from\", \"value\"}}, got {_type_name(turn)}")
        role = reader.text("from", value=turn.get("from"), label=label + ".from")
        value = reader.text("value", value=turn.get("value"), label=label + ".value")
        if role.lower() not in _ROLES:
            reader.fail(label + ".from", f"has unsupported role {role!r} (expected human/user, gpt/assistant or system)")
        messages.append({"role": _ROLES[role.lower()], "content": value})
    return messages


def dschat_prompt(messages):
    """A prompt's messages in the text convention: " Human: q Assistant: a ... Human: q Assistant:"
    (a system message is written as " " + its text)."""
    return "".join(_DSCHAT_PREFIX[m["role"]] + m["content"] for m in messages) + " Assistant:"


def _answer_value(reader, field):
    """LLaMA-Factory answers are {"from": "gpt", "value": ...} (a plain string is accepted)."""
    value = reader.row.get(field)
    if isinstance(value, dict):
        return reader.text(field, value=value.get("value"), label=field + ".value")
    return reader.text(field)


def _system(reader):
    system = reader.text("system", required=False)
    return [{"role": "system", "content": system}] if system else []


def _canonical_row(layout, reader):
    """{"prompt", "chosen", "rejected"} already in the text convention (and, for the layouts whose turns are
    fields, the prompt's messages under PROMPT_MESSAGES)."""
    row = reader.row
    if layout in ("prompt_chosen", "prompt_only"):  # prompt-only rows: chosen (and rejected) may be absent
        return {"prompt": normalize_prompt(reader.text("prompt")),
                "chosen": normalize_answer(reader.text("chosen", required=layout == "prompt_chosen")),
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
        turns = _turn_messages(reader, row.get("conversations"), "conversations")
        if layout == "conversations_pairwise":
            chosen = _answer_value(reader, "chosen")
            rejected = _answer_value(reader, "rejected")
        else:
            if not turns or turns[-1]["role"] != "assistant":
                reader.fail("conversations", "must end with a gpt/assistant turn (the answer) "
                            "when the row has no \"chosen\"")
            chosen = turns.pop()["content"]
            rejected = None
        messages = _system(reader) + turns
        return {"prompt": dschat_prompt(messages), "chosen": _answer(chosen), "rejected": _answer(rejected),
                PROMPT_MESSAGES: messages}
    if layout in ("alpaca", "alpaca_pairwise"):
        instruction = reader.text("instruction")
        extra = reader.text("input", required=False)
        query = instruction + "\n" + extra if extra else instruction
        messages = _system(reader)
        history = row.get("history")
        if history:
            if not isinstance(history, list):
                reader.fail("history", f"must be a list of [question, answer] pairs, got {_type_name(history)}")
            for j, pair in enumerate(history):
                if not (isinstance(pair, (list, tuple)) and len(pair) == 2
                        and all(isinstance(x, str) for x in pair)):
                    reader.fail(f"history[{j}]", "must be a [question, answer] pair of strings")
                messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
        messages.append({"role": "user", "content": query})
        if layout == "alpaca":
            chosen, rejected = _answer(reader.text("output")), None
        else:
            chosen, rejected = _answer(_answer_value(reader, "chosen")), _answer(_answer_value(reader, "rejected"))
        return {"prompt": dschat_prompt(messages), "chosen": chosen, "rejected": rejected, PROMPT_MESSAGES: messages}
    # qa
    question = reader.text("question")
    return {"prompt": _wrap_prompt(question), "chosen": _answer(reader.text("answer")), "rejected": None,
            PROMPT_MESSAGES: [{"role": "user", "content": question}]}


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
            canonical = _canonical_row(layout, _RowReader(self.dataset_name, source, i + 1, row))
            # the row's other fields stay (a step-3 reward function may read them: utils.reward_functions)
            rows.append({**{k: v for k, v in row.items() if k not in canonical}, **canonical})
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

    def get_prompt_messages(self, sample):
        messages = sample.get(PROMPT_MESSAGES)
        if messages:  # the layouts whose turns are fields (conversations, alpaca, question/answer)
            return [dict(m) for m in messages]
        return super().get_prompt_messages(sample)


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
        self._version = builtin.dataset_version(self.dataset_name)
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
