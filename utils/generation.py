"""Fast answer generation: a pre-allocated static KV cache and a CUDA-graph decode step.

Step 3 spends most of its time generating. ``model.generate`` re-launches every
kernel of every layer from Python for each new token, so on a GPU a 1.3 B model
decodes ~30× slower than its weights can be read. :class:`StaticGenerator` keeps

* one :class:`transformers.StaticCache` of ``max_prompt_len + max_new_tokens``
  positions for the batch, allocated once and reused by every call;
* the prompt forward ("prefill") eager, with the prompt's 2-D attention mask;
* the one-token decode forward captured once as a CUDA graph (``backend="cuda-graph"``)
  and replayed for every token of every later call, or run eagerly (``"static"``,
  the CPU path).

It reproduces ``model.generate``'s greedy output token for token (same position ids:
``cumsum(mask) − 1`` with pads at 0; rows that emitted EOS continue with the pad id;
the same EOS rule), and samples with Hugging Face's temperature / top-k / top-p
warpers, drawing with :func:`sample_categorical` from a caller-seeded ``torch.Generator``, when ``do_sample``
(``model.generate`` draws the same way through :class:`CategoricalSampling`, see
:func:`generate_kwargs`). It stops once every
row has ended (checked every ``check_every`` tokens); the returned sequence may then
carry up to ``check_every − 1`` extra all-pad columns, which callers pad anyway.

LoRA layers (:class:`utils.lora.LinearLayer_LoRA`) are fused into their base
weights for the call and restored bit-exactly afterwards (a copy of the base weights
is kept; fuse → unfuse in bf16 would drift). Parameters are updated in place by the
optimizers, so the captured graph stays valid across PPO steps; if a parameter's
storage moves anyway, the graph is captured again (and the log says so).

Shapes: prompts ``[B, P]`` left padded, ``P ≤ max_prompt_len``; output ``[B, P + n]``,
``n ≤ max_new_tokens``. Batches smaller than the captured one are padded with copies of
their last row (and cut off again); a larger batch rebuilds the cache and graph.

:func:`choose_backend` picks the backend for a model and device and says why it
falls back.
"""
from __future__ import annotations

import contextlib
import time

import torch

from utils.model.model_utils import cache_kwarg

BACKENDS = ("auto", "cuda-graph", "static", "hf")
# architectures whose StaticCache decoding is checked token for token against model.generate (tests)
SUPPORTED_MODEL_TYPES = ("opt", "llama")


def choose_backend(requested: str, model, zero_stage: int = 0) -> tuple[str, str | None]:
    """``(backend, why_not_faster)`` for ``--generation_backend requested`` on ``model``.

    ``auto`` → ``cuda-graph`` on a CUDA device, else ``hf`` (on a CPU the plain
    ``generate`` is as fast as the static path, see ``bench/bench_generation.py``).
    ``cuda-graph`` / ``static`` fall back to ``hf`` (with the reason) for ZeRO-3
    (partitioned weights are gathered layer by layer during the forward, which a graph
    cannot capture), an architecture outside :data:`SUPPORTED_MODEL_TYPES`, attention
    other than SDPA, or ``cuda-graph`` without a CUDA device.
    """
    if requested not in BACKENDS:
        raise ValueError(f"generation backend {requested!r} is not one of {BACKENDS}")
    if requested == "hf":
        return "hf", None
    device = next(model.parameters()).device
    wanted = requested if requested != "auto" else ("cuda-graph" if device.type == "cuda" else "hf")
    if wanted == "hf":
        return "hf", f"no CUDA device ({device.type}): model.generate is the fastest path there"
    model_type = getattr(model.config, "model_type", "?")
    if zero_stage == 3:
        return "hf", "ZeRO-3 partitions the actor's weights; generating with model.generate (synced across ranks)"
    if model_type not in SUPPORTED_MODEL_TYPES:
        return "hf", (f"model type {model_type!r} is not one of the checked architectures "
                      f"{', '.join(SUPPORTED_MODEL_TYPES)}; generating with model.generate")
    attention = getattr(model.config, "_attn_implementation", "sdpa") or "sdpa"
    if attention != "sdpa":
        return "hf", f"attention implementation {attention!r} is not supported by the static path (needs sdpa)"
    if wanted == "cuda-graph" and device.type != "cuda":
        return "static", f"CUDA graphs need a CUDA device (model is on {device.type}); decoding eagerly"
    return wanted, None


def sample_categorical(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """``[B]``: one token drawn from each row of ``probs [B, V]`` (non-negative; rows need not sum to 1).

    By the inverse of the cumulative distribution: one uniform number a row and a binary search in the row's
    running sum. ``torch.multinomial`` draws an exponential number for every entry instead: 1.57 M of them for
    32 rows of a 49 152-token vocabulary, 55 ms a token on a 2-core CPU against 1.4 ms here (a quarter of step 3's
    generation time on SmolLM2). The running sum is float32: a token's chance is off by at most half a float32
    step of the sum before it (≤ 3e-8), far below the bf16 logits' own rounding. Zero-probability tokens (cut by
    top-k / top-p) are never drawn.
    """
    cdf = probs.float().cumsum(dim=-1)
    total = cdf[:, -1:].contiguous()
    u = torch.rand(total.shape, generator=generator, device=probs.device, dtype=cdf.dtype) * total
    token = torch.searchsorted(cdf, u, right=True)
    # u rounded up to the total (or past the last positive entry): the last token with a positive chance
    last = torch.searchsorted(cdf, total, right=False)
    return torch.minimum(token, last).squeeze(1)


def uncached_autocast(device_type: str):
    """The autocast now active on ``device_type`` (on or off, its dtype) without its cache of cast weights.

    Autocast casts a weight once per context and reuses the copy until the context exits; a CUDA graph captured
    over that copy would replay freed memory, and even within one context an in-place update of the weight (an
    optimizer step) is not seen. Under this context every forward casts the weights as they are now."""
    return torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type),
                          enabled=torch.is_autocast_enabled(device_type), cache_enabled=False)


class GenerationCopy:
    """A copy of ``model`` for generation whose parameters are ``dtype`` (``--generation_dtype bf16``).

    Under ``--torch_autocast`` the actor keeps fp32 weights and autocast casts each matmul's weight to bf16; in
    generation that also keeps the norms, the residual stream and (through the fp32 rotary tables) the keys of the
    KV cache in fp32, cast again for attention at every token. Generating from a bf16 copy removes those costs;
    the training pass still runs on the fp32 weights, and its log-probs are the ones the loss uses.

    Buffers (a rotary ``inv_freq``) stay as they are; parameters shared in ``model`` (tied embeddings) stay shared
    in the copy; the forward hooks on ``model`` itself (a training engine's) are not copied. :meth:`refresh` copies
    the model's current weights in place (no new storage: a CUDA graph captured on the copy stays valid); the
    trainer calls it before every generation. ``model``'s parameters must be whole (not ZeRO-3 partitions)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype):
        import copy

        # deepcopy's memo: each parameter is "already copied" as a frozen cast of itself (tied ones once)
        memo = {id(p): torch.nn.Parameter(p.detach().to(dtype), requires_grad=False) for p in model.parameters()}
        self.module = copy.deepcopy(model, memo).eval()
        # a training engine's forward hooks on the model it wraps (DeepSpeed's timers, its input casts) are the
        # engine's business, not the copy's
        for hooks in (self.module._forward_pre_hooks, self.module._forward_pre_hooks_with_kwargs,
                      self.module._forward_hooks, self.module._forward_hooks_with_kwargs,
                      self.module._forward_hooks_always_called):
            hooks.clear()
        self._pairs = list(zip(self.module.parameters(), model.parameters(), strict=True))

    @torch.no_grad()
    def refresh(self) -> None:
        """The copy's weights ← the model's current weights, cast to ``dtype``."""
        for copied, param in self._pairs:
            copied.copy_(param)


def sampling_warpers(temperature: float | None, top_k: int | None, top_p: float | None):
    """Hugging Face's temperature / top-k / top-p warpers for the settings that change anything."""
    from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    warpers = LogitsProcessorList()
    if temperature is not None and temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return warpers


class CategoricalSampling:
    """A logits processor for ``model.generate(do_sample=False)`` that samples: it warps the scores
    (temperature, top-k, top-p), draws a token with :func:`sample_categorical` and leaves every other token at
    −inf, so that greedy decoding picks the drawn one. The same distribution as ``do_sample=True``, without
    ``torch.multinomial``'s cost (:func:`sample_categorical`)."""

    def __init__(self, temperature: float | None = 1.0, top_k: int | None = None, top_p: float | None = None):
        self.warpers = sampling_warpers(temperature, top_k, top_p)
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.warpers(input_ids, scores.float()), dim=-1)
        token = sample_categorical(probs)
        return torch.full_like(scores, -float("inf")).scatter_(1, token[:, None], 0.0)


def generate_kwargs(do_sample: bool, temperature: float | None = 1.0, top_k: int | None = None,
                    top_p: float | None = None) -> dict:
    """``model.generate``'s decoding arguments: greedy, or sampling through :class:`CategoricalSampling`."""
    from transformers.generation.logits_process import LogitsProcessorList

    kwargs = dict(do_sample=False, temperature=None, top_k=None, top_p=None)
    if do_sample:
        kwargs["logits_processor"] = LogitsProcessorList([CategoricalSampling(temperature, top_k, top_p)])
    return kwargs


@contextlib.contextmanager
def lora_fused(model):
    """Fuse every LoRA layer into its base weight for the block; restore the exact base weights after."""
    from utils.lora import LinearLayer_LoRA

    layers = [m for m in model.modules() if isinstance(m, LinearLayer_LoRA) and not m.fuse_lora]
    backups = [m.weight.detach().clone() for m in layers]
    with torch.no_grad():
        for m in layers:
            m.fuse_lora_weight()
    try:
        yield
    finally:
        with torch.no_grad():
            for m, backup in zip(layers, backups):
                m.weight.data.copy_(backup)
                m.fuse_lora = False


class StaticGenerator:
    """Greedy / sampled decoding on a static KV cache, the decode step as a CUDA graph (module docstring).

    Args:
        model: a Hugging Face causal LM (OPT, Llama), in eval mode while generating.
        max_prompt_len: the longest prompt ``P`` (step 3: ``--max_prompt_seq_len``).
        max_new_tokens: answer tokens ``A`` (step 3: ``--max_answer_seq_len``).
        eos_token_id, pad_token_id: a row ends at ``eos_token_id`` (an id, or several: any of them);
            later tokens are ``pad_token_id``.
        use_cuda_graph: capture the decode step (CUDA only); else run it eagerly.
        check_every: tokens between "has every row ended?" checks (each is a host sync).
        log: callable for the one-off capture message (default: silent).
    """

    def __init__(self, model, max_prompt_len: int, max_new_tokens: int, eos_token_id, pad_token_id: int,
                 use_cuda_graph: bool = True, check_every: int = 8, log=None):
        self.model = model
        self.cache_kwarg = cache_kwarg(model)
        self.max_prompt_len, self.max_new_tokens = max_prompt_len, max_new_tokens
        self.total = max_prompt_len + max_new_tokens
        ends = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        self.end_ids = torch.tensor([int(e) for e in ends])
        self.pad_token_id = int(pad_token_id)
        self.use_cuda_graph = use_cuda_graph
        self.check_every = max(1, check_every)
        self.log = log or (lambda msg: None)
        self.batch_size = 0
        self.cache = None
        self.graph = None
        self.capture_seconds = 0.0  # one-off cost of the last capture
        self.last_prefill_seconds = 0.0
        self._param_ptrs = None

    # ------------------------------------------------------------------ buffers and graph

    def _allocate(self, batch_size: int, device) -> None:
        from transformers import StaticCache

        self.batch_size = batch_size
        self.cache = StaticCache(config=self.model.config, max_cache_len=self.total)
        self.tok = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        # the decode step's SDPA mask [B, 1, 1, total] (True = attend): the prompt's real tokens, then one
        # answer column opened per step
        self.mask = torch.zeros(batch_size, 1, 1, self.total, dtype=torch.bool, device=device)
        self.graph, self.graph_logits, self._param_ptrs = None, None, None

    def _reset_cache(self) -> None:
        for layer in self.cache.layers:
            if getattr(layer, "is_initialized", False):
                layer.cumulative_length.zero_()

    def _cache_lengths(self) -> list:
        return [layer.cumulative_length.clone() for layer in self.cache.layers]

    def _set_cache_lengths(self, lengths: list) -> None:
        for layer, value in zip(self.cache.layers, lengths):
            layer.cumulative_length.copy_(value)

    def _decode_forward(self) -> torch.Tensor:
        out = self.model(input_ids=self.tok, attention_mask=self.mask, position_ids=self.pos,
                         **{self.cache_kwarg: self.cache}, use_cache=True)
        return out.logits[:, -1, :]

    def _params_moved(self) -> bool:
        ptrs = [p.data_ptr() for p in self.model.parameters()]
        moved = self._param_ptrs is not None and ptrs != self._param_ptrs
        self._param_ptrs = ptrs
        return moved

    def _capture(self) -> None:
        """Record the decode step as a CUDA graph (after the prefill filled the cache)."""
        start = time.time()
        lengths = self._cache_lengths()
        no_cast_cache = uncached_autocast("cuda")  # --torch_autocast: the graph records the weights' casts
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), no_cast_cache:
            for _ in range(2):  # warm-up: cuBLAS handles, lazy buffers
                self._decode_forward()
        torch.cuda.current_stream().wait_stream(stream)
        self._set_cache_lengths(lengths)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), no_cast_cache:
            self.graph_logits = self._decode_forward()
        self._set_cache_lengths(lengths)  # capture records without running; keep the prefill's length
        torch.cuda.synchronize()
        self.graph = graph
        self.capture_seconds = time.time() - start
        self.log(f"generation: captured the decode step as a CUDA graph in {self.capture_seconds:.2f}s "
                 f"(batch {self.batch_size}, cache {self.total} tokens; paid once per run)")

    def _decode_logits(self) -> torch.Tensor:
        if not self.use_cuda_graph:
            return self._decode_forward()
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.graph_logits

    # ------------------------------------------------------------------ generate

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, do_sample: bool = False,
                 temperature: float | None = 1.0, top_k: int | None = None, top_p: float | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """``[B, P + n]``: the prompts followed by the answers (module docstring)."""
        B, P = input_ids.shape
        if P > self.max_prompt_len:
            raise ValueError(f"prompt length {P} exceeds the generator's max_prompt_len {self.max_prompt_len}")
        rows = B
        if B < self.batch_size:  # pad the batch to the captured size with copies of its last row
            extra = self.batch_size - B
            input_ids = torch.cat([input_ids, input_ids[-1:].expand(extra, P)])
            attention_mask = torch.cat([attention_mask, attention_mask[-1:].expand(extra, P)])
            B = self.batch_size
        if self.cache is None or B != self.batch_size:
            self._allocate(B, input_ids.device)
        with lora_fused(self.model):
            if self.use_cuda_graph and self._params_moved() and self.graph is not None:
                self.log("generation: the actor's parameters moved in memory; capturing the decode graph again")
                self.graph = None
            seq = self._generate(input_ids, attention_mask.long(), do_sample, temperature, top_k, top_p, generator)
        return seq[:rows]

    def _generate(self, input_ids, mask, do_sample, temperature, top_k, top_p, generator):
        B, P = input_ids.shape
        A = self.max_new_tokens
        warpers = sampling_warpers(temperature, top_k, top_p) if do_sample else None

        def pick(logits: torch.Tensor) -> torch.Tensor:
            logits = logits.float()
            if not do_sample:
                return logits.argmax(dim=-1)
            probs = torch.softmax(warpers(None, logits), dim=-1)
            return sample_categorical(probs, generator)

        # prefill: the prompt (positions as model.generate: cumsum(mask) − 1, pads at 0)
        start = time.time()
        self._reset_cache()
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                         **{self.cache_kwarg: self.cache}, use_cache=True, logits_to_keep=1)
        answers = torch.full((B, A), self.pad_token_id, dtype=torch.long, device=input_ids.device)
        unfinished = torch.ones(B, dtype=torch.bool, device=input_ids.device)
        end_ids = self.end_ids.to(input_ids.device)
        token = pick(out.logits[:, -1, :])
        del out
        if token.is_cuda:
            torch.cuda.synchronize()
        self.last_prefill_seconds = time.time() - start
        self.mask.zero_()
        self.mask[:, 0, 0, :P] = mask.bool()
        self.pos.copy_(positions[:, -1:])
        steps = A
        for t in range(A):
            token = torch.where(unfinished, token, self.pad_token_id)
            answers[:, t] = token
            unfinished &= ~torch.isin(token, end_ids)
            if t == A - 1:
                break
            if (t + 1) % self.check_every == 0 and not bool(unfinished.any()):
                steps = t + 1
                break
            # feed the token at cache slot P + t
            self.tok.copy_(token[:, None])
            self.pos.add_(1)
            self.mask[:, 0, 0, P + t] = True
            token = pick(self._decode_logits())
        return torch.cat([input_ids, answers[:, :steps]], dim=1)
