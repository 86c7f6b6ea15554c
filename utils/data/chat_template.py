"""Formatting with the tokenizer's own chat template (``--apply_chat_template``).

Without the flag every step trains on DeepSpeed-Chat's text (``" Human: … Assistant:"`` prompts, answers
ending with ``--eot_token``). With it, as OpenRLHF's ``--apply_chat_template`` and TRL's conversational
data, the text is what ``tokenizer.apply_chat_template`` writes:

* a prompt is its messages (:func:`dschat_messages` reads them back from DeepSpeed-Chat's text; the local
  loaders build them from the rows' own fields) formatted with ``add_generation_prompt=True``;
* an answer is the assistant turn the template writes after that prompt, up to and including the
  template's **end-of-turn token** (``<|im_end|>`` for SmolLM2 and Qwen, ``<|eot_id|>`` for Llama 3; the
  EOS when the template writes no special token after an answer). The text stops there: what a template
  writes after it (a newline) is never trained on, and generation stops at that token;
* both are tokenised as written (``add_special_tokens=False``: a template writes its own BOS), the prompt
  alone and then the answer after it, so the prompt tokens are the ones generation starts from.

The reward score sits on the end-of-turn token: the steps' existing rule reads a score at the last token
before the first pad (``utils.model.reward_model.end_score_index``, ``utils.rl_math.pairwise_reward_loss``),
which is the end-of-turn token as long as the pad token is not one the template writes.
:func:`use_distinct_pad` makes sure of that (SmolLM2's pad is its ``<|im_end|>``): it pads with the
tokenizer's unknown token, or a new ``[PAD]`` (as :func:`utils.model.model_utils.load_hf_tokenizer` does for
Llama models without a pad), when the template writes the pad token.

Pure: takes a tokenizer, returns strings and token ids; no torch.
"""
from __future__ import annotations

import re

from utils.errors import UserInputError

# Probe texts: plain words no template rewrites
_PROBE_QUESTION = "dschat probe question"
_PROBE_ANSWER = "dschat probe answer"
_PROBE_CONVERSATION = [{"role": "user", "content": _PROBE_QUESTION}, {"role": "assistant", "content": _PROBE_ANSWER},
                       {"role": "user", "content": _PROBE_QUESTION}, {"role": "assistant", "content": _PROBE_ANSWER}]
NEW_PAD = "[PAD]"  # added when no existing token can pad (as load_hf_tokenizer's Llama rule)

# DeepSpeed-Chat's turn markers: "Human:"/"Assistant:" at the start or after whitespace
_TURN = re.compile(r"(?:^|(?<=\s))(Human|Assistant):")
_ROLES = {"Human": "user", "Assistant": "assistant"}


def dschat_messages(prompt: str | None) -> list | None:
    """The messages of a prompt in DeepSpeed-Chat's text convention.

    ``" Human: Hi Assistant: Hello Human: Bye Assistant:"`` → user "Hi", assistant "Hello", user "Bye"
    (the trailing empty ``Assistant:`` is the generation prompt); text before the first marker is a system
    message; a prompt without markers is one user message. None and blank prompts give None.
    """
    if prompt is None or not prompt.strip():
        return None
    parts = _TURN.split(prompt)
    if len(parts) == 1:
        return [{"role": "user", "content": prompt.strip()}]
    messages = [{"role": "system", "content": parts[0].strip()}] if parts[0].strip() else []
    for marker, content in zip(parts[1::2], parts[2::2]):
        messages.append({"role": _ROLES[marker], "content": content.strip()})
    if messages[-1]["role"] == "assistant" and not messages[-1]["content"]:
        messages.pop()  # the generation prompt
    if not any(m["role"] == "user" for m in messages):
        return [{"role": "user", "content": prompt.strip()}]
    return messages


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


# A causal LM saved by step 1, DPO or step 3 records the format it was trained in, so chat.py answers in it
TRAINING_FORMAT_FILE = "training_format.json"


def training_format_file(apply_chat_template: bool) -> dict:
    """``extra_files`` for :func:`utils.model.model_utils.save_hf_format`: the training format of the model."""
    import json

    return {TRAINING_FORMAT_FILE: json.dumps({"apply_chat_template": bool(apply_chat_template)}) + "\n"}


def trained_with_template(folder: str) -> bool | None:
    """Whether the model in ``folder`` was trained with ``--apply_chat_template`` (None: not recorded)."""
    import json
    import os

    try:
        with open(os.path.join(folder, TRAINING_FORMAT_FILE)) as f:
            return bool(json.load(f)["apply_chat_template"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


class ChatFormat:
    """How one tokenizer's chat template writes prompts and answers (module docstring).

    ``eot``/``eot_id``: the end-of-turn token; ``stop_ids``: the tokens that end an answer (end of turn
    and EOS). Build with :func:`chat_format`.
    """

    def __init__(self, tokenizer, model: str = "the model"):
        if not has_chat_template(tokenizer):
            raise UserInputError(f"{model} has no chat template; drop --apply_chat_template")
        self.tokenizer = tokenizer
        self.model = model
        self.eot = self._end_of_turn()
        self.eot_id = int(tokenizer.convert_tokens_to_ids(self.eot))
        eos = tokenizer.eos_token_id
        self.stop_ids = tuple(dict.fromkeys([self.eot_id] + ([int(eos)] if eos is not None else [])))

    # ---- the template
    def render(self, messages: list, add_generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - a jinja TemplateError, or a template's own raise_exception
            roles = "/".join(m["role"] for m in messages)
            raise UserInputError(f"the chat template of {self.model} cannot format a {roles} conversation: "
                                 f"{type(e).__name__}: {e}") from None

    def _end_of_turn(self) -> str:
        """The special token the template writes right after an answer, else the EOS."""
        tok = self.tokenizer
        text = self.render(_PROBE_CONVERSATION[:2])
        after = text[text.rfind(_PROBE_ANSWER) + len(_PROBE_ANSWER):] if _PROBE_ANSWER in text else ""
        ids = self.encode(after) if after.strip() else []
        special = set(tok.all_special_ids) | {i for i, t in getattr(tok, "added_tokens_decoder", {}).items()
                                              if getattr(t, "special", False)}
        if ids and ids[0] in special:
            return tok.convert_ids_to_tokens(ids[0])
        if tok.eos_token is None:
            raise UserInputError(f"the chat template of {self.model} writes no special token after an answer "
                                 "and the tokenizer has no EOS token: nothing can end an answer")
        return tok.eos_token

    # ---- texts
    def prompt(self, messages: list) -> str:
        """The prompt text: ``messages`` and the generation prompt (the assistant turn's opening)."""
        return self.render(messages, add_generation_prompt=True)

    def answer(self, messages: list, answer: str) -> str:
        """The text the template writes after :meth:`prompt` for the assistant turn ``answer``, up to and
        including the end-of-turn token (``answer`` + that token when the template's text does not extend the
        prompt)."""
        content = answer.strip()
        prompt = self.prompt(messages)
        full = self.render(list(messages) + [{"role": "assistant", "content": content}])
        if full.startswith(prompt):
            tail = full[len(prompt):]
            cut = tail.rfind(self.eot)
            if cut >= 0 and content in tail[:cut]:
                return tail[:cut + len(self.eot)]
        return content + self.eot

    # ---- token ids
    def encode(self, text: str) -> list:
        """Token ids of a text the template wrote (no special tokens added: the template writes its own)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, messages: list) -> list:
        return self.encode(self.prompt(messages))

    def conversation_ids(self, messages: list, answer: str) -> tuple:
        """``(prompt ids, answer ids)``: the prompt as generation sees it, then the answer turn after it."""
        prompt = self.prompt(messages)
        completion = self.answer(messages, answer)
        prompt_ids, full = self.encode(prompt), self.encode(prompt + completion)
        if full[:len(prompt_ids)] == prompt_ids:
            return prompt_ids, full[len(prompt_ids):]
        return prompt_ids, self.encode(completion)  # the two merge at the boundary: keep the prompt's tokens

    def describe(self) -> str:
        pad = self.tokenizer.pad_token
        return (f"chat template of {self.model}: prompts end with its generation prompt, answers with "
                f"{self.eot!r}, padding with {pad!r}")


def chat_format(tokenizer, model: str = "the model") -> ChatFormat:
    """The :class:`ChatFormat` of ``tokenizer``; a :class:`UserInputError` naming ``model`` when it has no
    chat template."""
    return ChatFormat(tokenizer, model)


def use_distinct_pad(tokenizer, model: str = "the model") -> str | None:
    """Pad with a token the chat template never writes (module docstring); returns the old pad token when
    it changed, else None. The template's end-of-turn token, or any token of a two-turn conversation, must
    not be the pad token: a reward score is read before the first pad, and would then be read inside the
    prompt (or before the end of turn)."""
    fmt = chat_format(tokenizer, model)
    written = set(fmt.encode(fmt.render(_PROBE_CONVERSATION))) | {fmt.eot_id}
    old = tokenizer.pad_token
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id not in written:
        return None
    unk = tokenizer.unk_token_id
    if unk is not None and unk not in written and unk not in fmt.stop_ids:
        tokenizer.pad_token = tokenizer.unk_token
    else:
        tokenizer.add_special_tokens({"pad_token": NEW_PAD})
    return old
