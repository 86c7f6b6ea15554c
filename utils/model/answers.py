"""A causal LM's answers to text prompts, batched and seeded: the held-out check (:mod:`utils.heldout`) and the
comparison collector (:mod:`step2_reward_model_finetuning.collect_comparisons`) both sample with this.

Prompts of the same token length are generated together in chunks of ``batch_size`` (no padding, so a
prompt's answers do not depend on which other prompts share its batch); a prompt's ``per_prompt``
answers come back next to each other, in prompt order.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch

SEED = 1234


def generate_answers(model, tokenizer, prompts: List[str], max_new_tokens: int, sampling: Optional[dict] = None,
                     per_prompt: int = 1, seed: int = SEED, batch_size: int = 64,
                     progress: Optional[Callable[[int], None]] = None) -> List[str]:
    """``len(prompts) · per_prompt`` answers (decoded, special tokens dropped, cut at a new "Human:" turn).

    Greedy when ``sampling`` is None (then ``per_prompt`` copies of the one greedy answer are pointless: use 1);
    else ``sampling = {"temperature", "top_k", "top_p"}`` (step 3's flags). Drawn after seeding torch with
    ``seed``; the caller's random state is restored afterwards. ``progress(n)`` is called with the number of
    prompts done after each batch.
    """
    device = next(model.parameters()).device
    encoded = [tokenizer(p, return_tensors="pt").input_ids[0] for p in prompts]
    by_length: Dict[int, List[int]] = {}
    for i, ids in enumerate(encoded):
        by_length.setdefault(len(ids), []).append(i)
    decoding = dict(do_sample=False) if sampling is None else dict(
        do_sample=True, temperature=sampling["temperature"], top_k=sampling["top_k"], top_p=sampling["top_p"],
        num_return_sequences=per_prompt)
    n = 1 if sampling is None else per_prompt
    answers = [""] * (len(prompts) * n)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        for length, indices in sorted(by_length.items()):
            for start in range(0, len(indices), batch_size):
                chunk = indices[start:start + batch_size]
                ids = torch.stack([encoded[i] for i in chunk]).to(device)
                with torch.no_grad():
                    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **decoding,
                                         max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                                         pad_token_id=tokenizer.pad_token_id)
                for row in range(out.shape[0]):  # generate returns a prompt's n answers next to each other
                    text = tokenizer.decode(out[row, length:], skip_special_tokens=True)
                    answers[chunk[row // n] * n + row % n] = text.split("Human:")[0].strip()
                if progress is not None:
                    progress(len(chunk))
    return answers


def load_for_answers(model_dir: str, device: str = "cpu"):
    """``(model, tokenizer)`` of a saved causal LM, in eval mode, fp32 on a CPU (the checks' numbers)."""
    from transformers import AutoModelForCausalLM

    from utils.model.model_utils import load_hf_tokenizer

    tokenizer = load_hf_tokenizer(model_dir)
    dtype = torch.float32 if device == "cpu" else None
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype or "auto").to(device).eval()
    return model, tokenizer
