"""A causal LM's answers to text prompts, batched and seeded: the held-out check (:mod:`utils.heldout`) and the
comparison collector (:mod:`step2_reward_model_finetuning.collect_comparisons`) both sample with this.

Prompts of the same token length are generated together in chunks of ``batch_size`` (no padding, so a
prompt's answers do not depend on which other prompts share its batch); a prompt's ``per_prompt``
answers come back next to each other, in prompt order.
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch

SEED = 1234


def generate_answers(model, tokenizer, prompts: List[str], max_new_tokens: int, sampling: Optional[dict] = None,
                     per_prompt: int = 1, seed: int = SEED, batch_size: int = 64,
                     progress: Optional[Callable[[int], None]] = None, chat=None) -> List[str]:
    """``len(prompts) · per_prompt`` answers (decoded, special tokens dropped, cut at a new "Human:" turn).

    Greedy when ``sampling`` is None (then ``per_prompt`` copies of the one greedy answer are pointless: use 1);
    else ``sampling = {"temperature", "top_k", "top_p"}`` (step 3's flags). Drawn after seeding torch with
    ``seed``; the caller's random state is restored afterwards. ``progress(n)`` is called after each batch with
    the number of prompts it held (an increment, as tqdm's ``update`` takes).

    ``chat`` (a :class:`utils.data.chat_template.ChatFormat`): the prompts (DeepSpeed-Chat text) are written in the
    model's chat template and an answer ends at its end of turn. Prompts of a chat template rarely share a length,
    so these are generated ``batch_size`` at a time in order of length, left padded (a prompt's answers then
    depend on its batch only through float rounding).
    """
    from utils.data.chat_template import dschat_messages
    from utils.generation import generate_kwargs

    device = next(model.parameters()).device
    if chat is not None:
        encoded = [torch.tensor(chat.encode(chat.prompt(dschat_messages(p)))) for p in prompts]
        stop = list(chat.stop_ids)
    else:
        encoded = [tokenizer(p, return_tensors="pt").input_ids[0] for p in prompts]
        stop = tokenizer.eos_token_id
    if chat is not None:  # one group, in length order: cut into left-padded batches below
        groups = {0: sorted(range(len(prompts)), key=lambda i: len(encoded[i]))}
    else:
        groups = {}
        for i, ids in enumerate(encoded):
            groups.setdefault(len(ids), []).append(i)
    # sampled by the inverse CDF, as step 3 samples (utils.generation): greedy generate over a drawing processor,
    # which takes no num_return_sequences, so a prompt's row is repeated for its answers
    decoding = generate_kwargs(False) if sampling is None else generate_kwargs(
        True, sampling["temperature"], sampling["top_k"], sampling["top_p"])
    n = 1 if sampling is None else per_prompt
    answers = [""] * (len(prompts) * n)
    pad = tokenizer.pad_token_id
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        for _, indices in sorted(groups.items()):
            for start in range(0, len(indices), batch_size):
                chunk = indices[start:start + batch_size]
                length = max(len(encoded[i]) for i in chunk)
                ids = torch.full((len(chunk), length), pad, dtype=torch.long)
                mask = torch.zeros_like(ids)
                for row, i in enumerate(chunk):
                    ids[row, length - len(encoded[i]):], mask[row, length - len(encoded[i]):] = encoded[i], 1
                ids, mask = ids.repeat_interleave(n, dim=0), mask.repeat_interleave(n, dim=0)
                with torch.no_grad():
                    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **decoding,
                                         max_new_tokens=max_new_tokens, eos_token_id=stop, pad_token_id=pad)
                for row in range(out.shape[0]):  # generate returns a prompt's n answers next to each other
                    text = tokenizer.decode(out[row, length:], skip_special_tokens=True)
                    answers[chunk[row // n] * n + row % n] = text.split("Human:")[0].strip()
                if progress is not None:
                    progress(len(chunk))
    return answers


def prompt_ids(tokenizer, prompt: str, chat=None) -> list:
    """The token ids a model is prompted with: in its chat template's format with ``chat``, else the text's."""
    from utils.data.chat_template import dschat_messages

    return chat.prompt_ids(dschat_messages(prompt)) if chat is not None else tokenizer(prompt).input_ids


def check_room(flag: str, positions: Optional[int], tokenizer, chat, prompts: list, max_new_tokens: int) -> None:
    """Every prompt and ``max_new_tokens`` fit the model's ``positions`` (None: unknown, not checked; a learned
    position table fails with an IndexError past its end): refused with the numbers before anything is generated."""
    from utils.errors import UserInputError

    if not positions or not prompts:
        return
    longest = max(len(prompt_ids(tokenizer, p, chat)) for p in prompts)
    if longest + max_new_tokens > positions:
        raise UserInputError(f"--max_new_tokens {max_new_tokens}: the longest prompt has {longest} tokens and {flag} "
                             f"has {positions} positions, so at most {max(positions - longest, 0)} new tokens fit")


def load_for_answers(model_dir: str, device: str = "cpu", apply_chat_template: bool = False,
                     trust_remote_code: bool = False, dtype: Optional[torch.dtype] = None):
    """``(model, tokenizer)`` of a saved causal LM, in eval mode, fp32 on a CPU (the checks' numbers) unless
    ``dtype`` says otherwise (``torch.bfloat16``: sampling about twice as fast on a CPU with bf16 instructions);
    the tokenizer as the steps load it with ``--apply_chat_template`` when asked; the folder's own code only with
    ``trust_remote_code``."""
    from transformers import AutoModelForCausalLM

    from utils.model.model_utils import load_hf_tokenizer

    tokenizer = load_hf_tokenizer(model_dir, apply_chat_template=apply_chat_template,
                                  trust_remote_code=trust_remote_code)
    dtype = dtype or (torch.float32 if device == "cpu" else None)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype or "auto",
                                                 trust_remote_code=trust_remote_code).to(device).eval()
    return model, tokenizer
