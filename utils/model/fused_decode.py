"""A lean one-token decode step for Llama-style causal LMs on a static KV cache (used by utils.generation).

On a GPU the captured decode step of ``model.forward`` replays transformers' eager Llama ops: ~8 kernels an
RMSNorm, ~10 a layer for the rotary embedding, separate q, k, v and gate, up matmuls, the 4-D mask rebuilt, ...
(~1,400 kernels a token for SmolLM2-135M's 30 layers): at a few µs a kernel the step is bound by the kernel count,
not by reading the weights. :class:`LlamaDecodeStep` computes the same function with few ops a layer:

* **one q/k/v matmul and one gate/up matmul**: the weights are concatenated once into buffers of the step's own
  and copied again, in place, by :meth:`LlamaDecodeStep.refresh` before every generation (a CUDA graph captured on
  them stays valid; LoRA fused into the base weights is seen). The q/k/v buffer also holds ``rotate_half`` of the
  q and k rows (``rotate_half(W·h) = (R·W)·h``, R a signed permutation: rows swapped and negated, exact) and zero
  rows for v, so the one matmul gives ``[q k v | rot(q) rot(k) 0]``;
* **RMSNorm as one** ``torch.nn.functional.rms_norm`` (one ``_fused_rms_norm`` kernel on CUDA; 6 aten ops on the
  CPU);
* **rotary in 2 ops over q, k and v at once**: ``heads·cos + rot(heads)·sin`` with a table of every cache
  position's cos and sin per head (1 and 0 on the v heads, which pass through unchanged), computed once by the
  model's own rotary module (every static RoPE variant, llama3 scaling included) and gathered once a step;
* **one cache write**: a layer's keys and values are the two halves of one ``[2, B, Hk, T, D]`` tensor (installed
  into the :class:`transformers.StaticCache` layer, so the prefill writes there too), and the step's k and v,
  adjacent in the rotated heads, go in with one ``index_copy_`` at the step's slot (a device tensor the step
  advances itself: no host number changes between steps);
* **grouped-query attention without repeating the cache**: the ``G = H / Hk`` query heads of one KV head go to SDPA
  as ``G`` query rows against that head's keys (``[B, Hk, G, D] × [B, Hk, T, D]``); the mask is an additive bias
  ``[B, 1, 1, T]``, closed by :meth:`LlamaDecodeStep.start` and opened where the boolean mask is, once a step (in
  storage padded to 16 columns, which CUDA's memory-efficient kernel needs to take it without a copy). Where SDPA
  returns its output laid out ``[B, G, Hk, D]`` (CUDA's kernels), ``o_proj``'s columns are permuted to match, once
  a refresh, instead of copying the output every layer;
* **residual adds inside the output matmuls** (``addmm``).

Ops a layer: 2 norms, 3 matmuls + 2 ``addmm``, 2 rotary, 1 cache write, 1 SDPA, silu and the product: 12 kernels on
CUDA (transformers' eager layer: ~46), 22 aten ops on the CPU (tests/test_decode_ops.py keeps the bound).
The result equals ``model(...)``'s logits up to float rounding (fp32: token for token on the tests' tiny models).
:func:`unsupported` says why a model cannot take this path (the caller then runs the model's own forward).
Shapes: ``B`` rows, ``T`` cache positions, ``H`` query heads, ``Hk`` KV heads, ``D`` head dim, ``V`` vocabulary.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# RoPE types whose tables depend on the position alone (the "dynamic" family rescales with the sequence length)
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
PROJECTIONS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
               ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))


def _plain_linear(module) -> bool:
    """An ``nn.Linear`` or the project's LoRA layer (whose fused ``weight`` is the whole map): their ``weight``
    is what the module computes with. Anything else (a PEFT layer, a quantised one) may compute more."""
    from utils.lora import LinearLayer_LoRA

    return type(module) in (nn.Linear, LinearLayer_LoRA)


def unsupported(model) -> str | None:
    """Why ``model`` cannot decode through :class:`LlamaDecodeStep` now, or None when it can.

    Checked at every generation (cheap): a Llama layout of plain linear layers without biases, SiLU, a RoPE whose
    table depends on the position alone, whole (not ZeRO-3 partitioned) weights of one dtype on a CPU or CUDA
    device, and no autocast (its casts would have to be matched op for op; generate from a ``--generation_dtype bf16`` copy)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type != "llama":
        return f"model type {model_type!r} is not llama"
    backbone = getattr(model, "model", None)
    layers = getattr(backbone, "layers", None)
    if layers is None or not hasattr(model, "lm_head") or not hasattr(backbone, "rotary_emb"):
        return "not the LlamaForCausalLM layout (model.layers, lm_head, rotary_emb)"
    if getattr(config, "hidden_act", None) != "silu":
        return f"activation {getattr(config, 'hidden_act', None)!r} is not silu"
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        return "attention or MLP biases"
    rope_type = getattr(backbone.rotary_emb, "rope_type", None)
    if rope_type not in STATIC_ROPE_TYPES:
        return f"RoPE type {rope_type!r} is not one of {', '.join(STATIC_ROPE_TYPES)}"
    if len(layers) != config.num_hidden_layers:
        return "the layer list does not match num_hidden_layers"
    device = model.lm_head.weight.device
    if device.type not in ("cpu", "cuda"):
        return f"device {device.type!r}"
    if torch.is_autocast_enabled(device.type):
        return "autocast is on (generate from a --generation_dtype bf16 copy for the fused step)"
    if model.training and getattr(config, "attention_dropout", 0.0):
        return "attention dropout in training mode"
    dtypes = {p.dtype for p in model.parameters()}
    if len(dtypes) != 1:
        return f"parameters of several dtypes ({', '.join(sorted(str(d).replace('torch.', '') for d in dtypes))})"
    for layer in layers:
        for parent, name in PROJECTIONS:
            module = getattr(getattr(layer, parent, None), name, None)
            if not _plain_linear(module) or module.bias is not None:
                return f"{parent}.{name} is a {type(module).__name__}, not a plain linear layer without bias"
            if module.weight.dim() != 2 or module.weight.numel() == 0:
                return f"{parent}.{name}'s weight is partitioned (shape {tuple(module.weight.shape)})"
    return None


class LlamaDecodeStep:
    """The one-token forward ``(tok [B, 1], pos [B, 1], mask [B, 1, 1, T]) → logits [B, V]`` of a Llama on
    ``cache`` (a :class:`transformers.StaticCache` of ``T`` positions whose layers' keys and values this step
    provides, installed before the prefill fills them), writing the token's key and value at :attr:`slot` and
    advancing it (module docstring).

    :meth:`refresh` before every generation (in place: the concatenated weights, the references to the model's
    other weights); :meth:`start` after the prefill. ``grouped_output``: lay ``o_proj``'s columns out as SDPA's
    output ``[B, G, Hk, D]`` (default: as a probe SDPA call on the device returns it)."""

    def __init__(self, model, cache, batch_size: int, total: int, grouped_output: bool | None = None):
        config = model.config
        self.model, self.total = model, total
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.hidden, self.eps = config.hidden_size, config.rms_norm_eps
        self.ffn = config.intermediate_size
        weight = model.lm_head.weight
        device, dtype = weight.device, weight.dtype
        H, Hk, D = self.heads, self.kv_heads, self.head_dim
        N, G = H + 2 * Hk, H // Hk  # heads out of the q/k/v matmul; query heads per KV head
        layers = model.model.layers
        self.qkv = [torch.zeros(2, N, D, self.hidden, device=device, dtype=dtype) for _ in layers]  # [W | R·W]
        self.gate_up = [torch.empty(2 * self.ffn, self.hidden, device=device, dtype=dtype) for _ in layers]
        # per layer: keys and values as one tensor; the cache layer's are views of it
        self.kv = [torch.zeros(2, batch_size, Hk, total, D, device=device, dtype=dtype) for _ in layers]
        for layer, kv in zip(cache.layers, self.kv):
            if not getattr(layer, "is_initialized", False):  # its device, shapes and length counter
                layer.lazy_initialization(kv[0, :, :, :1], kv[1, :, :, :1])
            layer.keys, layer.values = kv[0], kv[1]
        padded = -(-total // 16) * 16
        self.bias = torch.zeros(batch_size, 1, 1, padded, device=device, dtype=dtype)[..., :total]
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        if grouped_output is None:
            probe = F.scaled_dot_product_attention(torch.zeros(batch_size, Hk, G, D, device=device, dtype=dtype),
                                                   self.kv[0][0], self.kv[0][1], attn_mask=self.bias)
            grouped_output = G > 1 and not probe.is_contiguous() and probe.transpose(1, 2).is_contiguous()
        self.grouped_output = grouped_output
        self.o_grouped = ([torch.empty(self.hidden, H * D, device=device, dtype=dtype) for _ in layers]
                          if grouped_output else None)
        # [T, 2, N, D]: cos and sin of every position for the q and k heads; 1 and 0 for the v heads
        self.rope = torch.zeros(total, 2, N, D, device=device, dtype=dtype)
        cos, sin = model.model.rotary_emb(self.rope, torch.arange(total, device=device)[None])  # [1, T, D]
        self.rope[:, 0, :H + Hk] = cos[0, :, None]
        self.rope[:, 1, :H + Hk] = sin[0, :, None]
        self.rope[:, 0, H + Hk:] = 1
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """The step's weights ← the model's current ones, in place; the references to the rest re-read."""
        backbone = self.model.model
        H, Hk, D, half = self.heads, self.kv_heads, self.head_dim, self.head_dim // 2
        self.refs = []
        for i, (layer, qkv, gate_up) in enumerate(zip(backbone.layers, self.qkv, self.gate_up)):
            attn, mlp = layer.self_attn, layer.mlp
            torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight], out=qkv[0].view(-1, self.hidden))
            qk = qkv[0, :H + Hk]  # [H + Hk, D, hidden]
            qkv[1, :H + Hk, :half] = -qk[:, half:]  # R·W: rotate_half's rows (−second half, first half)
            qkv[1, :H + Hk, half:] = qk[:, :half]
            torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], out=gate_up)
            o_proj = attn.o_proj.weight  # [hidden, H·D], columns by query head h = k·G + g
            if self.o_grouped is not None:  # columns by (g, k): SDPA's [B, G, Hk, D] output read as it lies
                self.o_grouped[i].view(self.hidden, H // Hk, Hk, D).copy_(
                    o_proj.view(self.hidden, Hk, H // Hk, D).transpose(1, 2))
                o_proj = self.o_grouped[i]
            self.refs.append((layer.input_layernorm.weight, o_proj, layer.post_attention_layernorm.weight,
                              mlp.down_proj.weight))
        self.embed, self.norm = backbone.embed_tokens.weight, backbone.norm.weight
        self.lm_head = self.model.lm_head.weight

    def start(self, prompt_width: int) -> None:
        """After the prefill of ``[B, prompt_width]`` prompts: the next key goes to that slot, every column of the
        bias is closed (the steps open the mask's columns; a column once opened stays open within a call)."""
        self.slot.fill_(prompt_width)
        self.bias.fill_(-float("inf"))

    def __call__(self, tok: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``[B, V]`` logits of the tokens ``tok [B, 1]`` at positions ``pos [B, 1]``, attending where
        ``mask [B, 1, 1, T]`` is True (the token's own slot included)."""
        B = tok.shape[0]
        H, Hk, D, F_ = self.heads, self.kv_heads, self.head_dim, self.ffn
        N, G = H + 2 * Hk, H // Hk
        self.bias.masked_fill_(mask, 0.0)  # additive: 0 attend, −inf not
        rope = self.rope[pos[:, 0]]  # [B, 2, N, D]
        cos, sin = rope[:, 0], rope[:, 1]
        x = F.embedding(tok[:, 0], self.embed)  # [B, hidden]: the residual stream
        for qkv_w, gate_up_w, kv, (ln1, o_w, ln2, down_w) in zip(self.qkv, self.gate_up, self.kv, self.refs):
            both = torch.mm(F.rms_norm(x, (self.hidden,), ln1, self.eps), qkv_w.view(-1, self.hidden).t())
            both = both.view(B, 2, N, D)  # [q k v | rot(q) rot(k) 0]
            heads = torch.addcmul(both[:, 0] * cos, both[:, 1], sin)  # q, k rotated; v as it is
            # k and v, adjacent: [B, 2·Hk, D] → [2, B, Hk, 1, D] into slot `slot` of [2, B, Hk, T, D]
            kv.index_copy_(3, self.slot, heads[:, H:].view(B, 2, Hk, 1, D).transpose(0, 1))
            # the G query heads of a KV head as G query rows against its keys: no repeated cache
            attn = F.scaled_dot_product_attention(heads[:, :H].view(B, Hk, G, D), kv[0], kv[1],
                                                  attn_mask=self.bias, scale=D ** -0.5)  # [B, Hk, G, D]
            attn = attn.transpose(1, 2) if self.grouped_output else attn  # as it lies in memory
            x = torch.addmm(x, attn.reshape(B, H * D), o_w.t())  # x + o_proj(attention)
            gate_up = torch.mm(F.rms_norm(x, (self.hidden,), ln2, self.eps), gate_up_w.t())  # [B, 2F]
            x = torch.addmm(x, F.silu(gate_up[:, :F_]) * gate_up[:, F_:], down_w.t())  # x + down(silu(gate)·up)
        self.slot.add_(1)
        return torch.mm(F.rms_norm(x, (self.hidden,), self.norm, self.eps), self.lm_head.t())
