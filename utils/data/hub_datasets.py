"""Hub adapters: one :class:`PromptRawDataset` per supported Hugging Face hub set.

Hub names (``Dahoas/rm-static`` ... ``lmqg/qag_jaquad``, see ``HUB_DATASETS``, in the
dispatch order of :func:`utils.data.raw_datasets.get_raw_dataset`) are loaded with
``datasets.load_dataset`` on first use; a name that is also an existing local path (a
``save_to_disk`` folder or data files in the upstream column layout) is read from disk
instead, as the reference does.
"""
from __future__ import annotations

import os
import re

from utils.data.prompt_dataset import RAW_FORMAT_VERSION, PromptRawDataset
from utils.data.sources import _LocalSource, _answer, _concat, _load_hub, _wrap_prompt


# --------------------------------------------------------------------------- hub adapters
class _HubDataset(PromptRawDataset):
    """A hub dataset of DeepSpeed-Chat's list (or a local copy of one); its ``clean_name`` is the reference's
    ``dataset_name_clean``, its canonical name with "/" and "-" as "_"."""
    hub_id = None
    hub_config = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.canonical_name:
            cls.clean_name = cls.canonical_name.replace("/", "_").replace("-", "_")

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


class _ColumnsDataset(_HubDataset):
    """A dataset whose prompt, chosen (and rejected) answers are plain text columns, named in that order by
    ``required_columns``: the prompt wrapped in the Human/Assistant turns, the answers spaced."""

    def get_prompt(self, sample):
        return _wrap_prompt(sample[self.required_columns[0]])

    def get_chosen(self, sample):
        return _answer(sample[self.required_columns[1]])

    def get_rejected(self, sample):
        return _answer(sample[self.required_columns[2]]) if self.has_rejected else None


class DahoasRmstaticDataset(_HubDataset):
    """Prompts already ``"\\n\\nHuman: ... \\n\\nAssistant:"``; answers already spaced."""
    canonical_name = hub_id = "Dahoas/rm-static"
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


class DahoasSyntheticinstructgptjpairwiseDataset(_ColumnsDataset):
    canonical_name = hub_id = "Dahoas/synthetic-instruct-gptj-pairwise"
    eval_split = None
    required_columns = ("prompt", "chosen", "rejected")


class YitingxieRlhfrewarddatasetsDataset(_HubDataset):
    """Rows: prompt ``"\\n\\nHuman: ...\\n\\n"``, answers ``"Assistant: ..."`` (the
    reference: prompt + "Assistant:", answer = text after the last "Assistant:")."""
    canonical_name = hub_id = "yitingxie/rlhf-reward-datasets"
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


class Wangrui6ZhihuKOLDataset(_ColumnsDataset):
    canonical_name = hub_id = "wangrui6/Zhihu-KOL"
    eval_split = None
    has_rejected = False
    required_columns = ("INSTRUCTION", "RESPONSE")


class CohereMiraclzhqueries2212Dataset(_HubDataset):
    """chosen/rejected = the first positive/negative passage (None when there is none)."""
    canonical_name = hub_id = "Cohere/miracl-zh-queries-22-12"
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


class HelloSimpleAIHC3ChineseDataset(_HubDataset):
    canonical_name = hub_id = "Hello-SimpleAI/HC3-Chinese"
    hub_config = "all"
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
    lang = "ja"


class LmqgQgjaquadDataset(_ColumnsDataset):
    canonical_name = hub_id = "lmqg/qg_jaquad"
    eval_split = "validation"
    has_rejected = False
    required_columns = ("question", "sentence")


class LmqgQagjaquadDataset(_HubDataset):
    """As the reference: prompt = the first of ``questions``, chosen = ``paragraph``."""
    canonical_name = hub_id = "lmqg/qag_jaquad"
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
