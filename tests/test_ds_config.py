"""DeepSpeed configs and optimizer groups (utils/ds_utils.py), against the reference's fields."""
import os

import pytest
import torch

from utils import ds_utils


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_train_config_fields(stage):
    cfg = ds_utils.get_train_ds_config(offload=False, dtype="bf16", stage=stage)
    zero = cfg["zero_optimization"]
    assert zero["stage"] == stage
    assert zero["offload_param"] == {"device": "none"} and zero["offload_optimizer"] == {"device": "none"}
    assert zero["stage3_param_persistence_threshold"] == 1e4
    assert zero["stage3_max_live_parameters"] == 3e7
    assert zero["stage3_prefetch_bucket_size"] == 3e7
    assert zero["overlap_comm"] is True and zero["memory_efficient_linear"] is False
    assert cfg["gradient_clipping"] == 1.0
    assert cfg["prescale_gradients"] is False and cfg["wall_clock_breakdown"] is False
    assert cfg["steps_per_print"] == 10
    assert cfg["bf16"] == {"enabled": True} and "fp16" not in cfg
    assert cfg["hybrid_engine"] == {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1,
                                    "release_inference_cache": False, "pin_parameters": True,
                                    "tp_gather_partition_size": 8}
    assert cfg["tensorboard"]["enabled"] is False


def test_train_config_offload_fp16_hybrid_tensorboard():
    cfg = ds_utils.get_train_ds_config(offload=True, dtype="fp16", stage=3, enable_hybrid_engine=True,
                                       inference_tp_size=2, max_out_tokens=256, enable_tensorboard=True,
                                       tb_path="/tmp/tb", tb_name="step3_actor")
    zero = cfg["zero_optimization"]
    assert zero["offload_param"] == {"device": "cpu"} and zero["offload_optimizer"] == {"device": "cpu"}
    assert cfg["fp16"] == {"enabled": True, "loss_scale_window": 100} and "bf16" not in cfg
    assert cfg["hybrid_engine"]["enabled"] is True
    assert cfg["hybrid_engine"]["inference_tp_size"] == 2 and cfg["hybrid_engine"]["max_out_tokens"] == 256
    assert cfg["tensorboard"] == {"enabled": True, "output_path": "/tmp/tb/ds_tensorboard_logs/",
                                  "job_name": "step3_actor_tensorboard"}


def test_fp32_has_no_precision_block():
    cfg = ds_utils.get_train_ds_config(offload=False, dtype="fp32", stage=2)
    assert "fp16" not in cfg and "bf16" not in cfg


def test_eval_config_fields():
    cfg = ds_utils.get_eval_ds_config(offload=True, dtype="fp16", stage=3)
    assert cfg["zero_optimization"] == {"stage": 3, "stage3_param_persistence_threshold": 1e4,
                                        "offload_param": {"device": "cpu"}, "memory_efficient_linear": False}
    assert cfg["fp16"] == {"enabled": True, "loss_scale_window": 100}
    assert cfg["gradient_clipping"] == 1.0
    assert "hybrid_engine" not in cfg and "offload_optimizer" not in cfg["zero_optimization"]
    cfg = ds_utils.get_eval_ds_config(offload=False, dtype="bf16")
    assert cfg["zero_optimization"]["stage"] == 0 and cfg["zero_optimization"]["offload_param"] == {"device": "none"}
    assert cfg["bf16"] == {"enabled": True}


@pytest.mark.parametrize("micro, world, accum, total", [(4, 1, 1, 4), (8, 2, 4, 64), (16, 8, 1, 128), (1, 3, 5, 15)])
def test_set_batch_sizes(micro, world, accum, total):
    cfg = ds_utils.set_batch_sizes(ds_utils.get_train_ds_config(False, "bf16"), micro, world, accum)
    assert cfg["train_micro_batch_size_per_gpu"] == micro
    assert cfg["gradient_accumulation_steps"] == accum
    assert cfg["train_batch_size"] == total


class Toy(torch.nn.Module):
    """Parameter names of the kinds the groups distinguish."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)                  # fc.weight: decay, fc.bias: no decay
        self.self_attn_layer_norm = torch.nn.LayerNorm(2)  # OPT: "layer_norm.weight"
        self.input_layernorm = torch.nn.LayerNorm(2)     # Llama-style: "layernorm.weight"
        self.norm = torch.nn.LayerNorm(2)                # "norm.weight"
        self.ln_f = torch.nn.LayerNorm(2)                # GPT-2 style: "ln_f.weight"
        self.lora_right_weight = torch.nn.Parameter(torch.zeros(2, 1))
        self.lora_left_weight = torch.nn.Parameter(torch.zeros(1, 2))
        self.frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)


def names(model, group):
    by_id = {id(p): n for n, p in model.named_parameters()}
    return sorted(by_id[id(p)] for p in group["params"])


def test_optimizer_groups():
    model = Toy()
    decay, lora, no_decay = ds_utils.get_optimizer_grouped_parameters(model, weight_decay=0.1, lora_lr=5e-4)
    assert names(model, decay) == ["fc.weight"] and decay["weight_decay"] == 0.1 and "lr" not in decay
    assert names(model, lora) == ["lora_left_weight", "lora_right_weight"]
    assert lora["lr"] == 5e-4 and lora["weight_decay"] == 0.1
    assert names(model, no_decay) == sorted(
        ["fc.bias", "self_attn_layer_norm.weight", "self_attn_layer_norm.bias", "input_layernorm.weight",
         "input_layernorm.bias", "norm.weight", "norm.bias", "ln_f.weight", "ln_f.bias"])
    assert no_decay["weight_decay"] == 0.0


def test_empty_groups_dropped_and_cpu_optimizer():
    model = Toy()
    for n, p in model.named_parameters():
        p.requires_grad = "lora" in n
    groups = ds_utils.get_optimizer_grouped_parameters(model, 0.0, lora_lr=1e-4)
    assert len(groups) == 1 and groups[0]["lr"] == 1e-4
    for p in model.parameters():
        p.requires_grad = True
    opt = ds_utils.create_optimizer(model, weight_decay=0.01, learning_rate=1e-3, lora_learning_rate=2e-4,
                                    offload=False)
    assert isinstance(opt, torch.optim.AdamW)  # CPU, no offload
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 2e-4, 1e-3]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.01, 0.0]
    assert all(g["betas"] == (0.9, 0.95) for g in opt.param_groups)


def test_tiny_opt_groups_with_lora():
    from transformers import AutoModelForCausalLM

    from utils.model.model_utils import create_hf_model, load_hf_tokenizer
    from utils.lora import convert_linear_layer_to_lora

    tok = load_hf_tokenizer("tiny-opt")
    model = create_hf_model(AutoModelForCausalLM, "tiny-opt", tok)
    # 4 layers x (q, k, v, out, fc1, fc2): 24 weights + 2 embeddings decay; 24 biases + 4 x 2 layer norms x 2
    # + final layer norm x 2 = 42 no-decay (lm_head is tied to embed_tokens)
    decay, no_decay = ds_utils.get_optimizer_grouped_parameters(model, 0.1)
    assert (len(decay["params"]), len(no_decay["params"])) == (26, 42)
    convert_linear_layer_to_lora(model, "decoder.layers.", 8)  # base weights frozen, biases stay trainable
    decay, lora, no_decay = ds_utils.get_optimizer_grouped_parameters(model, 0.1, lora_lr=3e-4)
    assert (len(decay["params"]), len(lora["params"]), len(no_decay["params"])) == (2, 48, 42)


def test_mixed_precision_lora_spans_hpz_over_one_node_only_on_several_nodes():
    """As DeepSpeed-Chat: ZeRO++'s secondary partition (hpZ) is one node wide when the job spans several nodes."""
    one_node = ds_utils.get_train_ds_config(False, "bf16", 3, enable_mixed_precision_lora=True, world_size=8,
                                            devices_per_node=8)["zero_optimization"]
    assert one_node["zero_quantized_nontrainable_weights"] and "zero_hpz_partition_size" not in one_node
    two_nodes = ds_utils.get_train_ds_config(False, "bf16", 3, enable_mixed_precision_lora=True, world_size=16,
                                             devices_per_node=8)["zero_optimization"]
    assert two_nodes["zero_hpz_partition_size"] == 8
    plain = ds_utils.get_train_ds_config(False, "bf16", 3, world_size=16, devices_per_node=8)["zero_optimization"]
    assert "zero_hpz_partition_size" not in plain and "zero_quantized_nontrainable_weights" not in plain


SKIPPED_ALLREDUCE = r"""
import os, sys, torch
from types import SimpleNamespace
from transformers import AutoModelForCausalLM
from utils.distributed import init_distributed
from utils.ds_utils import get_train_ds_config
from utils.training import OptimConfig, make_engine
from utils.model.model_utils import create_hf_model, load_hf_tokenizer

init_distributed(SimpleNamespace(local_rank=-1))
tokenizer = load_hf_tokenizer("tiny-opt")
weights = []
for skip in (True, False):
    torch.manual_seed(0)
    model = create_hf_model(AutoModelForCausalLM, "tiny-opt", tokenizer, dropout=0.0)
    config = get_train_ds_config(offload=False, dtype="fp32", stage=int(sys.argv[1]))
    config.update(train_micro_batch_size_per_gpu=4, train_batch_size=4, gradient_clipping=1.0)
    engine = make_engine(model, config, OptimConfig(1e-2, 0.0, 1e-2, False, "constant", 0), total_steps=3)
    print("skipped" if not engine.enable_backward_allreduce else "allreduce")
    if sys.argv[1] == "0":
        engine.enable_backward_allreduce = not skip  # the second run: DeepSpeed's own all-reduce
    torch.manual_seed(1)
    for _ in range(3):
        ids = torch.randint(4, 200, (4, 12))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    weights.append([p.detach().clone() for p in engine.module.parameters()])
print("equal" if all(torch.equal(a, b) for a, b in zip(*weights)) else "DIFFERENT")
"""


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1])
def test_one_rank_stage_0_skips_the_identity_gradient_allreduce_bit_identically(stage):
    """One rank, ZeRO 0: DeepSpeed's gradient all-reduce copies every gradient into one flat buffer and back to
    average over a single rank; make_engine turns it off (a transient copy of all gradients less) and the trained
    weights are bit-identical to a run with it on. ZeRO 1 keeps DeepSpeed's own path."""
    import subprocess
    import sys

    from tests.conftest import REPO

    proc = subprocess.run([sys.executable, "-c", SKIPPED_ALLREDUCE, str(stage)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line in ("skipped", "allreduce", "equal", "DIFFERENT")]
    assert lines == (["skipped", "skipped", "equal"] if stage == 0 else ["allreduce", "allreduce", "equal"])


BF16_STEP = r"""
import torch
from types import SimpleNamespace
from transformers import AutoModelForCausalLM
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from utils.distributed import init_distributed
from utils.ds_utils import get_train_ds_config
from utils.training import OptimConfig, make_engine
from utils.model.model_utils import create_hf_model, load_hf_tokenizer

init_distributed(SimpleNamespace(local_rank=-1))
tokenizer = load_hf_tokenizer("tiny-llama")
weights = []
for ours in (True, False):
    torch.manual_seed(0)
    model = create_hf_model(AutoModelForCausalLM, "tiny-llama", tokenizer, dropout=0.0)
    config = get_train_ds_config(offload=False, dtype="bf16", stage=0)
    config.update(train_micro_batch_size_per_gpu=4, train_batch_size=4, gradient_clipping=1.0)
    engine = make_engine(model, config, OptimConfig(1e-3, 0.1, 1e-3, False, "constant", 0), total_steps=3)
    print(type(engine.optimizer).__name__, "skipped" if not engine.enable_backward_allreduce else "allreduce")
    if not ours:  # the second run: DeepSpeed's own step and all-reduce
        engine.optimizer.__class__, engine.enable_backward_allreduce = FP16_UnfusedOptimizer, True
    torch.manual_seed(1)
    ids = torch.randint(4, 200, (4, 12))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    print("skipped steps", engine.skipped_steps, "norm", engine.get_global_grad_norm())
    weights.append([p.detach().clone() for group in engine.optimizer.fp32_groups for p in group])
moved = sum(not torch.equal(a, b) for a, b in zip(*weights))
close = all(torch.allclose(a, b, rtol=1e-6, atol=1e-9) for a, b in zip(*weights))
print("close" if close else "DIFFERENT", "differing tensors", moved)
"""


@pytest.mark.slow
def test_bf16_at_zero_0_trains_with_the_fused_step_as_deepspeeds_own():
    """``--dtype bf16`` at ZeRO 0 through make_engine: DeepSpeed's wrapper gets the multi-tensor step and the identity
    all-reduce is skipped; a step of tiny-llama gives DeepSpeed's own path's norm and fp32 master weights to float
    rounding (the norm's sum runs in another order: over more steps Adam turns such rounding into flips of ±lr
    where a gradient is near 0, as any reordering of the sums would)."""
    import subprocess
    import sys

    from tests.conftest import REPO

    proc = subprocess.run([sys.executable, "-c", BF16_STEP], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.count("FusedBf16Optimizer skipped") == 2 and out.count("skipped steps 0 norm") == 2, out
    norms = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("skipped steps")]
    assert norms[0] == pytest.approx(norms[1], rel=1e-6) and "close" in out, out


@pytest.mark.slow
def test_one_cpu_process_neither_builds_nor_loads_deepspeeds_shm_op():
    """A one-rank CPU group has nobody to all-reduce with: DeepSpeed's shared-memory op (a 1-2 min JIT compile
    on a fresh machine, and a shared buffer in /dev/shm) is skipped there; the 2-rank tests still use it."""
    import subprocess
    import sys

    from tests.conftest import REPO

    code = ("import os, glob; from types import SimpleNamespace; from utils.distributed import init_distributed\n"
            "init_distributed(SimpleNamespace(local_rank=-1))\n"
            "import torch; from deepspeed.comm import comm as dist\n"
            "t = torch.ones(3); dist.inference_all_reduce(t); dist.all_reduce(t)\n"
            "port = os.environ['MASTER_PORT']\n"
            "print('op', dist.cdb.shm_comm_op, 'sum', t.tolist(), 'buffers', "
            "glob.glob(f'/dev/shm/deepspeed_allreduce_buffer_*_{port}_0'))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "op None sum [1.0, 1.0, 1.0] buffers []" in proc.stdout
    assert "shm_comm_op built successfully" not in proc.stdout + proc.stderr


def test_adam_betas_reach_every_steps_optimizer_and_out_of_range_ones_are_refused(capsys):
    """``--adam_betas`` (DeepSpeed-Chat's 0.9 0.95 by default; TRL's 0.999 for the second) is what AdamW steps with,
    for step 1 and for step 3's actor and critic; a beta outside [0, 1) is one argparse line."""
    from step1_supervised_finetuning.main import parse_args as step1_args
    from step3_rlhf_finetuning.main import parse_args as step3_args
    from utils.training import OptimConfig

    model = torch.nn.Linear(3, 2)

    def betas_of(optim):
        return ds_utils.create_optimizer(model, optim.weight_decay, optim.learning_rate, optim.lora_learning_rate,
                                         False, optim.betas).param_groups[0]["betas"]

    assert betas_of(OptimConfig.from_args(step1_args([]))) == (0.9, 0.95)
    assert betas_of(OptimConfig.from_args(step1_args(["--adam_betas", "0.8", "0.999"]))) == (0.8, 0.999)
    step3 = step3_args(["--actor_model_name_or_path", "tiny-llama", "--adam_betas", "0.85", "0.99"])
    assert betas_of(OptimConfig.from_args(step3, "actor")) == betas_of(OptimConfig.from_args(step3, "critic")) \
        == (0.85, 0.99)
    with pytest.raises(SystemExit):
        step1_args(["--adam_betas", "0.9", "1.0"])
    assert "--adam_betas: must be in [0, 1), got 1.0" in capsys.readouterr().err


# --------------------------------------------------------------------------- bf16 at ZeRO 0: the fused step

def _unfused_pair(monkeypatch, layers: int = 6, clip: float = 1.0):
    """Two identical bf16 models, each under DeepSpeed's ``FP16_UnfusedOptimizer`` around a torch AdamW; the second
    with :func:`ds_utils.fuse_bf16_step`'s class (no process group: DeepSpeed's rank lookup is stubbed)."""
    import deepspeed.comm
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda *a, **k: 0)
    pairs = []
    for _ in range(2):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(layers)]).to(torch.bfloat16)
        groups = ds_utils.get_optimizer_grouped_parameters(model, 0.1)
        inner = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), fused=True)
        pairs.append((model, FP16_UnfusedOptimizer(inner, low_precision_dtype=torch.bfloat16, clip_grad=clip)))
    pairs[1][1].__class__ = ds_utils._fused_unfused_optimizer()
    return pairs


def _train(model, optimizer, steps: int, scale: float = 1.0):
    torch.manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 8, dtype=torch.bfloat16)
        (model(x).float().pow(2).sum() * scale).backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("scale", [1e-3, 1e3])  # gradient norm below / above the clip
def test_fused_bf16_step_trains_as_deepspeeds_unfused_step(monkeypatch, scale):
    """bf16 weights at ZeRO 0: the multi-tensor step (utils.ds_utils.bf16_master_step) gives the weights, the fp32
    masters, the norm and the Adam moments of DeepSpeed's per-parameter step, clipped or not, to float rounding."""
    (ref_model, ref), (model, fused) = _unfused_pair(monkeypatch)
    _train(ref_model, ref, 3, scale)
    _train(model, fused, 3, scale)
    assert fused._global_grad_norm == pytest.approx(ref._global_grad_norm, rel=1e-4)
    for a, b in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(a, b)  # bf16 copies of masters within float rounding: the same bf16 values
    for a, b in zip((p for g in ref.fp32_groups for p in g), (p for g in fused.fp32_groups for p in g)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ref.optimizer.state[a][key], fused.optimizer.state[b][key], rtol=1e-4,
                                       atol=1e-10)
    assert fused.state_dict().keys() == ref.state_dict().keys()  # checkpoints keep DeepSpeed's format


def test_fused_bf16_step_skips_an_inf_gradient_as_deepspeed_does(monkeypatch):
    """An inf gradient: no weight changes, the step is reported as an overflow (the engine counts it skipped)."""
    _, (model, fused) = _unfused_pair(monkeypatch)
    before = [p.detach().clone() for p in model.parameters()]
    (model(torch.randn(2, 8, dtype=torch.bfloat16)).float().sum() * float("inf")).backward()
    assert fused.step() is True and fused.overflow
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_fused_bf16_step_runs_a_few_ops_and_one_host_sync_whatever_the_parameter_count(monkeypatch):
    """DeepSpeed's unfused step runs ops and host syncs per parameter (a GPU launches a kernel per op); the fused
    step runs the same few multi-tensor ops and reads one number back, for 12 parameters or 120."""
    from utils.op_count import OpCounter

    def count_ops(fn):
        with OpCounter() as ops:
            fn()
        return ops.kernel_count, ops.sync_count

    counts = {}
    for layers in (6, 60):
        (ref_model, ref), (model, fused) = _unfused_pair(monkeypatch, layers)
        for net, optimizer, name in ((ref_model, ref, "deepspeed"), (model, fused, "fused")):
            net(torch.randn(2, 8, dtype=torch.bfloat16)).float().sum().backward()
            counts[name, 2 * layers] = count_ops(optimizer.step)
    print(counts)
    assert counts["deepspeed", 120][1] >= 120 and counts["deepspeed", 120][0] >= 10 * 120
    assert counts["fused", 12][1] == counts["fused", 120][1] == 1
    assert counts["fused", 120][0] == counts["fused", 12][0] <= 20
