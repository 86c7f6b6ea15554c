"""Fast answer generation: a pre-allocated static KV cache and a CUDA-graph decode step.

Step 3 spends most of its time generating. ``model.generate`` re-launches every
kernel of every layer from Python for each new token, so on a GPU a 1.3 B model
decodes ~30× slower than its weights can be read. :class:`StaticGenerator` keeps

* one :class:`transformers.StaticCache` of ``max_prompt_len + max_new_tokens``
  positions for the batch, allocated once and reused by every call;
* the prompt forward ("prefill") eager, with the prompt's 2-D attention mask;
* the one-token decode forward captured once as a CUDA graph (``backend="cuda-graph"``)
  and replayed for every token of every later call, or run eagerly (``"static"``,
  the CPU path);
* for a Llama, that decode forward is the fused step of :mod:`utils.model.fused_decode` (12 kernels a layer on
  CUDA against transformers' ~46: the captured graph was bound by its kernel count), optionally
  ``torch.compile``'d; the model's own forward where the fused step cannot run (one log line says which and why).

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
falls back. A ZeRO-3 actor generates from a :class:`GenerationCopy` holding its whole weights, gathered once per
rollout, when :func:`copy_fits` says the copy fits in memory.
"""
from __future__ import annotations

import contextlib
import math
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
    ``cuda-graph`` / ``static`` fall back to ``hf`` (with the reason) for a ZeRO-3 ``model`` whose weights are
    still partitions (gathered layer by layer during the forward, which a graph cannot capture; a
    :class:`GenerationCopy` of it holds whole weights and takes the fast path), an architecture outside
    :data:`SUPPORTED_MODEL_TYPES`, attention other than SDPA, or ``cuda-graph`` without a CUDA device.
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
    if zero_stage == 3 and is_partitioned(model):
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


def is_partitioned(model: torch.nn.Module) -> bool:
    """Are ``model``'s parameters ZeRO-3 partitions (DeepSpeed marks each with a ``ds_id``)?"""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def _hook_dicts(module: torch.nn.Module) -> list:
    """The hook dictionaries of ``module`` itself (forward, backward, state-dict ones)."""
    return [value for name, value in vars(module).items() if name.endswith("hooks") and isinstance(value, dict)]


def _from_deepspeed(hook) -> bool:
    return (getattr(hook, "__module__", None) or "").split(".")[0] == "deepspeed"


# bytes of the actor's dtype gathered at once when a ZeRO-3 copy is refreshed (one all-gather a bucket)
GATHER_BUCKET_BYTES = 1 << 28
_ALIGN_BYTES = 512  # each parameter of a copy starts at this alignment in its flat buffer (as the CUDA allocator's)


class GenerationCopy:
    """A copy of ``model`` with whole weights, for generation: in ``dtype`` (``--generation_dtype bf16``; None: the
    model's own), or gathered from ZeRO-3 partitions.

    Under ``--torch_autocast`` the actor keeps fp32 weights and autocast casts each matmul's weight to bf16; in
    generation that also keeps the norms, the residual stream and (through the fp32 rotary tables) the keys of the
    KV cache in fp32, cast again for attention at every token. Generating from a bf16 copy removes those costs;
    the training pass still runs on the fp32 weights, and its log-probs are the ones the loss uses.

    Under ZeRO-3 (``model``'s parameters are partitions, :func:`is_partitioned`) each rank holds a slice of every
    weight, and ``model.generate`` gathers every layer again for every token, all ranks in step (``synced_gpus``).
    The copy holds whole weights instead: :meth:`refresh` gathers them once (``deepspeed.zero.GatheredParameters``,
    :data:`GATHER_BUCKET_BYTES` of the actor's dtype at a time, so the transient whole weights stay one bucket), and
    each rank then generates on its own, through the static path. :meth:`release` gives the memory back after the
    rollout (training then has it, which is what ZeRO-3 is for); the next :meth:`refresh` allocates it again as one
    flat buffer of the same size, which the CUDA caching allocator normally returns at the same address, so a CUDA
    graph captured on the copy stays valid (if it moved, :class:`StaticGenerator` sees it and captures again).

    Buffers (a rotary ``inv_freq``) are copied as they are; parameters shared in ``model`` (tied embeddings) stay
    shared in the copy; the hooks on ``model`` itself (a training engine's) and DeepSpeed's hooks on its
    submodules (ZeRO-3's gathering) are not copied. :meth:`refresh` copies the model's current weights in place
    (no new storage while the copy is allocated: a CUDA graph captured on the copy stays valid); the trainer calls it
    before every generation. ``device``: where the copy lives (default: the parameters' device; a ZeRO-3 actor whose
    partitions are offloaded to the CPU needs its engine's device here)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype | None = None, device=None,
                 gather_bucket_bytes: int = GATHER_BUCKET_BYTES):
        import copy

        params = list(model.parameters())  # tied parameters once
        self.partitioned = is_partitioned(model)
        self.dtype = dtype or params[0].dtype
        self.device = torch.device(device) if device is not None else params[0].device
        shapes = [tuple(p.ds_shape) if hasattr(p, "ds_id") else tuple(p.shape) for p in params]
        align = max(1, _ALIGN_BYTES // torch.empty(0, dtype=self.dtype).element_size())
        self._offsets, total = [], 0
        for shape in shapes:
            self._offsets.append(total)
            total += -(-math.prod(shape) // align) * align
        self.numel = total  # of the flat buffer, padding included
        self.nbytes = total * torch.empty(0, dtype=self.dtype).element_size()
        self._shapes = shapes
        # deepcopy's memo: each parameter is "already copied" as a frozen empty one (tied ones once), each
        # submodule's hook dictionaries as themselves less DeepSpeed's hooks, the top module's as empty
        memo = {id(p): torch.nn.Parameter(torch.empty(0, dtype=self.dtype, device=self.device), requires_grad=False)
                for p in params}
        for module in model.modules():
            for hooks in _hook_dicts(module):
                memo[id(hooks)] = type(hooks)() if module is model else type(hooks)(
                    (key, hook) for key, hook in hooks.items() if not _from_deepspeed(hook))
        self.module = copy.deepcopy(model, memo).eval()
        for module in self.module.modules():  # ZeRO-3's parameter dictionary (it gathers on access) → a plain one
            module.__dict__["_parameters"] = dict(module._parameters)
        self._copies = [memo[id(p)] for p in params]
        self._pairs = list(zip(self._copies, params, strict=True))
        self._buckets = self._gather_buckets(params, gather_bucket_bytes)
        self.flat = None
        if not self.partitioned:  # whole weights: ready now; partitions are gathered by the first refresh
            self.refresh()

    @staticmethod
    def _gather_buckets(params, limit: int) -> list:
        """Index lists of ``params`` gathered together: consecutive, at most ``limit`` bytes each (≥ 1 parameter)."""
        buckets, size = [[]], 0
        for i, p in enumerate(params):
            nbytes = (p.ds_numel if hasattr(p, "ds_id") else p.numel()) * p.element_size()
            if buckets[-1] and size + nbytes > limit:
                buckets.append([])
                size = 0
            buckets[-1].append(i)
            size += nbytes
        return buckets

    @property
    def gather_bytes(self) -> int:
        """The largest bucket :meth:`refresh` gathers at once, in bytes of the model's dtype (0 if not partitioned)."""
        if not self.partitioned:
            return 0
        return max(sum(math.prod(self._shapes[i]) * self._pairs[i][1].element_size() for i in bucket)
                   for bucket in self._buckets)

    def allocate(self) -> None:
        """The copy's storage: one flat buffer, each parameter a view into it (a no-op while allocated)."""
        if self.flat is not None:
            return
        self.flat = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        for copied, offset, shape in zip(self._copies, self._offsets, self._shapes):
            copied.data = self.flat[offset:offset + math.prod(shape)].view(shape)

    def release(self) -> None:
        """Give the copy's storage back (its parameters become empty) until the next :meth:`refresh`."""
        for copied in self._copies:
            copied.data = torch.empty(0, dtype=self.dtype, device=self.device)
        self.flat = None

    @torch.no_grad()
    def refresh(self) -> None:
        """The copy's weights ← the model's current weights, cast to ``dtype`` (allocated again after a
        :meth:`release`). Partitioned weights are gathered bucket by bucket: collective, call on every rank."""
        self.allocate()
        if not self.partitioned:
            for copied, param in self._pairs:
                copied.copy_(param)
            return
        import deepspeed

        for bucket in self._buckets:
            with deepspeed.zero.GatheredParameters([self._pairs[i][1] for i in bucket]):
                for i in bucket:
                    copied, param = self._pairs[i]
                    copied.copy_(param)


def kv_cache_bytes(config, batch_size: int, length: int, dtype: torch.dtype) -> int:
    """Bytes of the keys and values of ``batch_size`` sequences of ``length`` tokens for a model of ``config``:
    2 (K, V) · layers · batch · KV heads · head size · length · the dtype's size (Llama's grouped KV heads
    included; OPT has as many as query heads)."""
    heads = getattr(config, "num_attention_heads")
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * batch_size * kv_heads * head_dim * length * itemsize


def available_memory(device) -> int:
    """Bytes a new allocation on ``device`` can take now: on CUDA the driver's free memory plus what PyTorch's
    caching allocator holds unused (``mem_get_info`` does not count that as free); on the CPU the available RAM."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    import psutil

    return int(psutil.virtual_memory().available)


def copy_fits(copy_bytes: int, kv_bytes: int, gather_bytes: int, available_bytes: int,
              usable: float = 0.9) -> tuple[bool, str | None]:
    """``(fits, why_not)``: may a ZeRO-3 actor generate from a whole-weight copy (:class:`GenerationCopy`)?

    It needs the copy (``copy_bytes``) and, on top, the larger of the KV cache (``kv_bytes``, 0 when the
    generator's cache is already allocated) and the bucket of gathered weights while the copy is refreshed
    (``gather_bytes``; it is released before the cache fills). That must fit in ``usable`` (90 %: the prompt's
    forward and the allocator's rounding take the rest) of ``available_bytes`` (:func:`available_memory`).
    """
    needed = copy_bytes + max(kv_bytes, gather_bytes)
    limit = usable * available_bytes
    if needed <= limit:
        return True, None
    gib = 1 << 30
    return False, (f"a whole-weight copy would not fit: {copy_bytes / gib:.2f} GiB of weights + "
                   f"{max(kv_bytes, gather_bytes) / gib:.2f} GiB of KV cache or gathered weights > {usable:.0%} of "
                   f"{available_bytes / gib:.2f} GiB free; generating with model.generate on the partitioned actor "
                   "(synced across ranks)")


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
        log: callable for the one-off messages: the decode path, the capture (default: silent).
        decode: ``"auto"``: the fused step of :mod:`utils.model.fused_decode` where the model allows it (checked
            at every call; else, said once, the model's own forward); ``"forward"``: always the model's forward.
        compile_decode: ``torch.compile`` the fused step (inside the captured graph); on a failure, said once, the
            eager fused step. Off by default: its gain is measured on a GPU (docs/benchmarks.md).
    """

    DECODE_PATHS = ("auto", "forward")

    def __init__(self, model, max_prompt_len: int, max_new_tokens: int, eos_token_id, pad_token_id: int,
                 use_cuda_graph: bool = True, check_every: int = 8, log=None, decode: str = "auto",
                 compile_decode: bool = False, compile_backend: str = "inductor"):
        if decode not in self.DECODE_PATHS:
            raise ValueError(f"decode path {decode!r} is not one of {self.DECODE_PATHS}")
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
        self.decode = decode
        self.decode_path = None  # "fused" or "forward": the path of the last call (module docstring)
        self.fused = None  # the LlamaDecodeStep for the allocated batch
        self.compile_decode, self.compile_backend = compile_decode, compile_backend
        self._compiled = None

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
        self.fused, self._compiled = None, None

    def _reset_cache(self) -> None:
        for layer in self.cache.layers:
            if getattr(layer, "is_initialized", False):
                layer.cumulative_length.zero_()

    def _cache_lengths(self) -> list:
        """Where the next key goes: each cache layer's length (the model's forward) and the fused step's slot."""
        slot = [self.fused.slot.clone()] if self.fused is not None else []
        return [layer.cumulative_length.clone() for layer in self.cache.layers] + slot

    def _set_cache_lengths(self, lengths: list) -> None:
        counters = [layer.cumulative_length for layer in self.cache.layers]
        for counter, value in zip(counters + ([self.fused.slot] if self.fused is not None else []), lengths):
            counter.copy_(value)

    def _choose_decode_path(self) -> None:
        """The fused step where :func:`utils.model.fused_decode.unsupported` finds nothing against it, else the
        model's forward; one log line whenever the path changes (the first call included)."""
        from utils.model import fused_decode

        why = fused_decode.unsupported(self.model) if self.decode == "auto" else "decode='forward' was asked for"
        path = "fused" if why is None else "forward"
        if path != self.decode_path:
            if path == "fused":
                self.log("generation: decode step: the fused Llama step (one q/k/v and one gate/up matmul a layer, "
                         "fused RMSNorm, rotary from a table, utils/model/fused_decode.py)"
                         + (", torch.compile'd" if self.compile_decode else ""))
            else:
                self.log(f"generation: decode step: the model's own forward (not the fused step: {why})")
            self.graph = None  # a graph records one path
        self.decode_path = path
        if path == "fused":
            if self.fused is None:
                self.fused = fused_decode.LlamaDecodeStep(self.model, self.cache, self.batch_size, self.total)
                if self.compile_decode:
                    self._compiled = self._try_compile(lambda: torch.compile(
                        self.fused.__call__, fullgraph=True, dynamic=False, backend=self.compile_backend))
            else:
                self.fused.refresh()  # the weights as they are now (optimizer step, fused LoRA), in place

    def _try_compile(self, call):
        """``call()`` (building or first running the compiled step), or None after one line saying why not."""
        try:
            return call()
        except Exception as e:  # noqa: BLE001 - any compiler failure: the eager step computes the same
            first = (str(e).strip().splitlines() or [""])[0][:200]
            self.log(f"generation: torch.compile of the fused decode step failed ({type(e).__name__}: {first}); "
                     "decoding with the eager fused step")
            self._compiled, self.compile_decode = None, False
            return None

    def _fused_forward(self) -> torch.Tensor:
        if self._compiled is not None:
            # compiled at its first call (the capture's warm-up on a GPU, before any state is recorded)
            logits = self._try_compile(lambda: self._compiled(self.tok, self.pos, self.mask))
            if logits is not None:
                return logits
        return self.fused(self.tok, self.pos, self.mask)

    def _decode_forward(self) -> torch.Tensor:
        if self.decode_path == "fused":
            return self._fused_forward()
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
            self._choose_decode_path()
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
        if self.decode_path == "fused":
            self.fused.start(P)  # the first answer token's key goes to cache slot P
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
