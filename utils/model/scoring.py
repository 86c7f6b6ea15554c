"""Scoring texts with a step-2 reward model, shared by ``rw_eval.py`` and the held-out check (:mod:`utils.heldout`).

* :func:`score_texts`: the end score (``forward_value``'s, :mod:`utils.model.reward_model`) of each
  ``prompt + answer + eot``;
* :func:`accuracy_by_kind`: the share of pairs whose chosen answer scores higher, overall and per kind.
"""


def _template_batch(tokenizer, chat, chunk, max_seq_len: int):
    """``(ids, mask, prompt lengths)`` of ``(prompt, answer)`` pairs in the chat template's format, right-padded."""
    import torch

    from utils.data.chat_template import dschat_messages
    from utils.data.data_utils import _right_pad

    seqs, prompt_lengths = [], []
    for prompt, answer in chunk:
        prompt_ids, answer_ids = chat.conversation_ids(dschat_messages(prompt), answer)
        seqs.append(torch.tensor((prompt_ids + answer_ids)[:max_seq_len]))
        prompt_lengths.append(min(len(prompt_ids), max_seq_len))
    ids, mask = _right_pad(seqs, max(len(s) for s in seqs), tokenizer.pad_token_id)
    return ids, mask, torch.tensor(prompt_lengths)


def score_texts(model, tokenizer, pairs, max_seq_len: int, eot: str, batch_size: int = 16, device="cpu",
                chat=None) -> list:
    """End scores of ``prompt + answer + eot`` for ``pairs`` of (prompt, answer), or, with ``chat`` (a
    :class:`~utils.data.chat_template.ChatFormat`), of the pair in its chat template's format; list of floats."""
    import torch

    scores = []
    for i in range(0, len(pairs), batch_size):
        chunk = pairs[i:i + batch_size]
        if chat is not None:
            ids, mask, prompt_lengths = _template_batch(tokenizer, chat, chunk, max_seq_len)
        else:
            batch = tokenizer([p + a + eot for p, a in chunk], truncation=True, max_length=max_seq_len,
                              padding=True, return_tensors="pt")  # right padding (load_hf_tokenizer)
            prompt_lengths = torch.tensor([len(tokenizer(p, truncation=True, max_length=max_seq_len)["input_ids"])
                                           for p, _ in chunk])
            ids, mask = batch["input_ids"], batch["attention_mask"]
        with torch.no_grad():
            out = model.forward_value(input_ids=ids.to(device), attention_mask=mask.to(device),
                                      prompt_length=prompt_lengths.to(device))
        scores.extend(out["chosen_end_scores"].float().tolist())
    return scores


def accuracy_by_kind(kinds: list, chosen_scores: list, rejected_scores: list) -> dict:
    """``{"overall": acc, kind: acc, ...}``: share of pairs with chosen > rejected, overall and per kind."""
    groups = {"overall": []}
    for kind, c, r in zip(kinds, chosen_scores, rejected_scores):
        correct = c > r
        groups["overall"].append(correct)
        if kind is not None:
            groups.setdefault(kind, []).append(correct)
    return {kind: sum(v) / len(v) for kind, v in groups.items() if v}
