"""A ZeRO-3 actor on the fast generation path (issue 55): its weights gathered once per rollout into a whole-weight
:class:`utils.generation.GenerationCopy`, generated from on each rank alone, freed after; ``model.generate`` on the
partitioned actor (synced across ranks) only when the copy would not fit (:func:`utils.generation.copy_fits`).

The decision and the estimates are pure and checked by hand. The copy and the trainer's path run on real one-rank
ZeRO-3 engines in this process (a gloo group of one, torn down after the module), on a Llama-style tiny model with
tied embeddings (OPT + fp32 + ZeRO-3 is the combination DeepSpeed fails on the CPU); two ranks and step 3 end to end
start fresh Pythons and are marked slow.
"""
import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import REPO, run_entry
from utils.generation import GenerationCopy, available_memory, copy_fits, is_partitioned, kv_cache_bytes

GIB = 1 << 30


# --------------------------------------------------------------------------- the decision, by hand

def test_the_copy_fits_when_weights_plus_the_larger_of_cache_and_gathered_bucket_fit_in_90_percent_of_free():
    # 2 GiB copy + max(1 GiB cache, 0.5 GiB bucket) = 3 GiB ≤ 0.9 · 4 GiB = 3.6 GiB
    assert copy_fits(2 * GIB, 1 * GIB, GIB // 2, 4 * GIB) == (True, None)
    # the bucket is the larger: 2 + 1.5 = 3.5 GiB ≤ 3.6 GiB fits; with 3.8 GiB free 3.42 GiB is usable: it does not
    assert copy_fits(2 * GIB, 0, 3 * GIB // 2, 4 * GIB) == (True, None)
    fits, why = copy_fits(2 * GIB, 0, 3 * GIB // 2, 3.8 * GIB)
    assert not fits and why.startswith("a whole-weight copy would not fit: 2.00 GiB of weights + 1.50 GiB")
    assert "> 90% of 3.80 GiB free" in why and why.endswith("model.generate on the partitioned actor (synced across "
                                                             "ranks)")
    # the limit itself fits; one byte more does not
    assert copy_fits(9, 0, 0, 10) == (True, None)
    assert copy_fits(9, 1, 0, 10)[0] is False
    # the cache counts as much as the bucket: 2 + 2 > 3.6
    assert copy_fits(2 * GIB, 2 * GIB, 0, 4 * GIB)[0] is False
    # another usable share
    assert copy_fits(5, 0, 0, 10, usable=0.5) == (True, None) and copy_fits(6, 0, 0, 10, usable=0.5)[0] is False


def test_kv_cache_bytes_by_hand():
    # Llama, grouped KV heads: 2 (K, V) · 4 layers · 3 rows · 2 KV heads · 32 (128 / 4 heads) · 10 tokens · 2 bytes
    llama = SimpleNamespace(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, hidden_size=128)
    assert kv_cache_bytes(llama, 3, 10, torch.bfloat16) == 2 * 4 * 3 * 2 * 32 * 10 * 2 == 30720
    # an explicit head size wins over hidden / heads
    assert kv_cache_bytes(SimpleNamespace(**vars(llama), head_dim=64), 3, 10, torch.bfloat16) == 61440
    # OPT: as many KV heads as query heads; fp32
    opt = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, hidden_size=64)
    assert kv_cache_bytes(opt, 1, 5, torch.float32) == 2 * 2 * 1 * 4 * 16 * 5 * 4 == 5120


def test_available_memory_counts_the_caching_allocators_unused_blocks_on_cuda_and_available_ram_on_the_cpu(
        monkeypatch):
    import psutil

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 5 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 4 * GIB)
    assert available_memory("cuda:0") == 4 * GIB  # 3 GiB free + 1 GiB held unused by PyTorch
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=7 * GIB, total=16 * GIB))
    assert available_memory("cpu") == 7 * GIB


# --------------------------------------------------------------------------- one-rank ZeRO-3 engines

@pytest.fixture(scope="module")
def one_rank_group():
    """A gloo group of one rank in this process (as a plain ``python main.py`` gets), torn down after the module."""
    import deepspeed.comm as dist

    from utils.distributed import init_distributed

    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    saved = {name: os.environ.get(name) for name in names}
    for name in names:
        os.environ.pop(name, None)
    init_distributed(SimpleNamespace(local_rank=-1))
    yield
    if torch.distributed.is_initialized():
        dist.destroy_process_group()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory):
    """tiny-llama with tied input and output embeddings, as a model folder."""
    from transformers import AutoModelForCausalLM

    from utils.model.model_utils import load_hf_tokenizer, resolve_model_name_or_path

    folder = tmp_path_factory.mktemp("tied") / "tiny-llama-tied"
    path = resolve_model_name_or_path("tiny-llama")
    model = AutoModelForCausalLM.from_pretrained(path, tie_word_embeddings=True)
    model.tie_weights()
    model.save_pretrained(folder)
    load_hf_tokenizer(path).save_pretrained(folder)
    return str(folder)


def build_engine(folder: str, stage: int, train: bool = True):
    """A DeepSpeed engine of ``folder`` at ZeRO ``stage`` (fp32, micro batch 4), trained (AdamW, lr 1e-2) or
    frozen."""
    from transformers import AutoModelForCausalLM

    from utils.model.model_utils import create_hf_model, load_hf_tokenizer
    from utils.training import OptimConfig, frozen_ds_config, make_engine, train_ds_config

    tokenizer = load_hf_tokenizer(folder)
    config = train_ds_config("fp32", stage, False, 4, 1) if train else frozen_ds_config("fp32", stage, False, 4, 1)
    model = create_hf_model(AutoModelForCausalLM, folder, tokenizer, config, dropout=0.0)
    optim = OptimConfig(1e-2, 0.0, 1e-2, False, "constant", 0) if train else None
    return make_engine(model, config, optim, total_steps=4), tokenizer


def full_weights(engine) -> dict:
    """name → the whole weight (ZeRO-3 partitions gathered), tied names included."""
    from utils.model.model_utils import gather_full_state_dict

    return gather_full_state_dict(engine, engine.zero_optimization_stage())


def one_step(engine) -> None:
    """One AdamW step of the LM loss on fixed token ids (moves every weight)."""
    ids = torch.arange(4 * 12).reshape(4, 12) % 600 + 5
    engine.train()
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()


@pytest.fixture(scope="module")
def zero3_actor(one_rank_group, tied_llama):
    return build_engine(tied_llama, 3)


def test_the_copy_of_a_partitioned_actor_is_its_whole_weights_bit_for_bit_and_follows_an_optimizer_step(zero3_actor):
    """fp32: the gathered copy equals the full weights exactly, before and after an optimizer step (refresh picks up
    the new weights in the same storage); bf16: their bf16 rounding. The tied embedding stays one tensor, the copy
    carries none of ZeRO-3's hooks, and release() gives its storage back."""
    from utils.model.model_utils import release_zero3_params

    engine, _ = zero3_actor
    assert is_partitioned(engine.module) and all(p.numel() == 0 for p in engine.module.parameters())
    copies = {dtype: GenerationCopy(engine.module, dtype) for dtype in (None, torch.bfloat16)}
    for step in range(2):
        release_zero3_params(engine, 3)
        full = full_weights(engine)
        for dtype, copy in copies.items():
            assert copy.partitioned and copy.flat is None  # nothing held until the first refresh
            copy.refresh()
            state = copy.module.state_dict()
            assert state.keys() == full.keys()
            for name, weight in full.items():
                expected = weight if dtype is None else weight.to(torch.bfloat16)
                assert state[name].dtype == expected.dtype and torch.equal(state[name], expected), (step, name)
            module = copy.module
            assert module.lm_head.weight is module.model.embed_tokens.weight
            assert not is_partitioned(module)
            assert not any(hook.__module__.startswith("deepspeed") for m in module.modules()
                           for hook in [*m._forward_pre_hooks.values(), *m._forward_hooks.values()])
            pointers = [p.data_ptr() for p in module.parameters()]
            copy.refresh()  # allocated: in place
            assert [p.data_ptr() for p in module.parameters()] == pointers
            copy.release()
            assert copy.flat is None and all(p.numel() == 0 for p in module.parameters())
        one_step(engine)
    # the copy's bytes: every parameter once (tied: once), each padded to a multiple of 512 bytes
    params = list(engine.module.parameters())
    for dtype, size in ((None, 4), (torch.bfloat16, 2)):
        assert 0 <= copies[dtype].nbytes - size * sum(p.ds_numel for p in params) < 512 * len(params)


def make_trainer(engine, tokenizer, backend: str, log: list, dtype=None):
    from step3_rlhf_finetuning.config import GenerationConfig, PPOConfig
    from step3_rlhf_finetuning.ppo_trainer import DeepSpeedPPOTrainer

    rlhf = SimpleNamespace(actor=engine, critic=None, ref=None, reward=None, actor_ema=None, tokenizer=tokenizer)
    generation = GenerationConfig(max_prompt_seq_len=16, max_answer_seq_len=10, backend=backend, dtype=dtype)
    return DeepSpeedPPOTrainer(rlhf, PPOConfig(advantage_estimator="grpo", kl_ctl=0.0), generation, log=log.append)


def prompts_of(tokenizer):
    texts = ["Human: What is the colour of the sky? Assistant:", "Human: Name a fruit. Assistant:",
             "Human: Say hello. Assistant:"]
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="pt", padding="max_length", max_length=16, truncation=True)
    return batch["input_ids"], batch["attention_mask"]


@pytest.mark.parametrize("backend", ["static", "hf"])
def test_zero3_fast_path_answers_equal_the_zero0_paths_and_the_fallback_when_the_copy_does_not_fit(
        zero3_actor, tied_llama, backend, monkeypatch):
    """Greedy answers of the ZeRO-3 trainer (the gathered copy through the static path, or model.generate on the copy)
    equal those of a ZeRO-0 trainer on the same weights (gathered from the ZeRO-3 engine after its steps); the copy is
    freed after each rollout. When the copy would not fit, the reason is said once and model.generate runs on the
    partitioned actor (synced), with the same answers."""
    import utils.generation as generation

    engine, tokenizer = zero3_actor
    one_step(engine)
    log = []
    trainer = make_trainer(engine, tokenizer, backend, log)
    assert trainer.generation_backend == backend and trainer.generation_copy.partitioned
    assert any("ZeRO-3 actor: its weights are gathered once per rollout into a whole float32 copy" in line
               for line in log)
    assert f"generation: {backend} backend" in log

    plain, _ = build_engine(tied_llama, 0, train=False)
    plain.module.load_state_dict(full_weights(engine))
    reference = make_trainer(plain, tokenizer, backend, [])
    assert reference.generation_copy is None
    prompts, mask = prompts_of(tokenizer)
    expected, _ = reference._generate_sequence(prompts, mask)
    fast, _ = trainer._generate_sequence(prompts, mask)
    assert expected.shape[1] > prompts.shape[1] and torch.equal(fast, expected)
    assert trainer.generation_copy.flat is None  # freed after the rollout

    monkeypatch.setattr(generation, "available_memory", lambda device: 1024)
    seen = []
    synced = engine.module.generate

    def generate(*args, **kwargs):
        seen.append(kwargs["synced_gpus"])
        return synced(*args, **kwargs)

    monkeypatch.setattr(engine.module, "generate", generate)
    for _ in range(2):
        slow, _ = trainer._generate_sequence(prompts, mask)
        assert torch.equal(slow, expected)
    assert seen == [True, True]
    said = [line for line in log if "would not fit" in line]
    assert len(said) == 1 and "generating with model.generate on the partitioned actor" in said[0]


# --------------------------------------------------------------------------- fresh Pythons: two ranks, step 3

TWO_RANKS = r"""
import json, sys
from types import SimpleNamespace

import deepspeed
import torch
from transformers import AutoModelForCausalLM

from utils.distributed import end_distributed, init_distributed
from utils.generation import GenerationCopy, StaticGenerator
from utils.model.model_utils import create_hf_model, load_hf_tokenizer, release_zero3_params
from utils.training import OptimConfig, make_engine, train_ds_config

init_distributed(SimpleNamespace(local_rank=-1))
rank, folder = torch.distributed.get_rank(), sys.argv[1]
tokenizer = load_hf_tokenizer(folder)
config = train_ds_config("fp32", 3, False, 2, 1)
model = create_hf_model(AutoModelForCausalLM, folder, tokenizer, config, dropout=0.0)
engine = make_engine(model, config, OptimConfig(1e-2, 0.0, 1e-2, False, "constant", 0), total_steps=4)
ids = (torch.arange(2 * 12).reshape(2, 12) + 7 * rank) % 600 + 5  # each rank its own rows
engine.backward(engine(input_ids=ids, labels=ids).loss)
engine.step()
release_zero3_params(engine, 3)
params = list(engine.module.parameters())
sliced = all(p.ds_tensor.numel() < p.ds_numel for p in params if not p.ds_persist)
copy = GenerationCopy(engine.module, None)
copy.refresh()
with deepspeed.zero.GatheredParameters(params):
    equal = all(torch.equal(c, p) for c, p in zip(copy.module.parameters(), params, strict=True))
# each rank alone: rank 1 decodes 5 more tokens than rank 0 (a collective in the forward would hang)
generator = StaticGenerator(copy.module, 12, 3 + 5 * rank, -1, tokenizer.pad_token_id, use_cuda_graph=False)
answers = generator.generate(ids, torch.ones_like(ids))[:, 12:]
checksum = copy.flat.double().sum().reshape(1)
both = [torch.zeros(1, dtype=torch.float64) for _ in range(2)]
torch.distributed.all_gather(both, checksum)
# one write a line (print writes the text and its newline apart, so two ranks' lines could run together)
sys.stdout.write("RESULT " + json.dumps({"rank": rank, "sliced": sliced, "equal": equal,
                                         "answer_tokens": answers.shape[1],
                                         "tied": copy.module.lm_head.weight is copy.module.model.embed_tokens.weight,
                                         "same_copy_on_both": bool(torch.equal(both[0], both[1]))}) + "\n")
sys.stdout.flush()
end_distributed()  # as run_main does: gloo's threads let go of the all_gather before Python exits
"""


@pytest.mark.multiproc
@pytest.mark.slow
def test_two_ranks_each_hold_the_whole_model_in_their_copy_and_generate_alone(tied_llama, tmp_path):
    """ZeRO-3 over 2 gloo ranks (torchrun), after an optimizer step on different rows: each rank holds a slice of every
    large weight, yet its gathered copy equals the whole model (tied embedding kept), both ranks' copies are the same,
    and each decodes a different number of tokens from it without the other (no synced_gpus)."""
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", str(script), tied_llama], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    # each rank's flat JSON object after "RESULT ", wherever the two ranks' output met
    results = sorted((json.loads(found) for found in re.findall(r"RESULT (\{[^{}]*\})", proc.stdout)),
                     key=lambda r: r["rank"])
    assert results == [{"rank": rank, "sliced": True, "equal": True, "answer_tokens": 3 + 5 * rank, "tied": True,
                        "same_copy_on_both": True} for rank in (0, 1)]


@pytest.mark.slow
def test_step3_with_a_zero3_actor_generates_from_the_gathered_copy(tmp_path):
    """Step 3 end to end with --actor_zero_stage 3 (GRPO on tiny-llama, scored by the built-in rule) and
    --generation_dtype bf16, which ZeRO-3 no longer refuses: the log says the path taken (the gathered bf16 copy
    through the static backend), and two RL steps run."""
    out = tmp_path / "out"
    proc = run_entry(
        "step3_rlhf_finetuning/main.py", "--data_path", "builtin/preference-small", "--data_output_path",
        tmp_path / "data", "--actor_model_name_or_path", "tiny-llama", "--output_dir", out,
        "--advantage_estimator", "grpo", "--n_samples_per_prompt", 2, "--do_sample", "--reward_fn", "builtin_rule",
        "--max_prompt_seq_len", 32, "--max_answer_seq_len", 8, "--per_device_generation_batch_size", 2,
        "--per_device_training_batch_size", 4, "--max_steps", 2, "--actor_learning_rate", 1e-3,
        "--num_warmup_steps", 0, "--actor_zero_stage", 3, "--generation_backend", "static",
        "--generation_dtype", "bf16", env={"OMP_NUM_THREADS": "1"})
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    assert "generation: ZeRO-3 actor: its weights are gathered once per rollout into a whole bf16 copy" in log
    assert "generation: static backend" in log and "would not fit" not in log
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["phase"] == "train"] == [1, 2]
