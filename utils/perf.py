"""DeepSpeed-Chat-style throughput lines (latency, TFLOPs, samples/s).

The FLOP count is the reference's estimate for a decoder-only transformer:
24·f·B·S·L·h²·(1 + S/(6h) + V/(16·L·h)), with f = 3 for forward+backward
(4 with activation checkpointing) and f = 1 for a forward pass alone.
"""
from __future__ import annotations


def throughput_due(step: int, total_steps: int) -> bool:
    """Log throughput about five times a run (and at its last step), never more often than every 10 steps:
    a log read without a terminal is then the run's progress, not pages of timing lines."""
    return step == total_steps or step % max(10, -(-total_steps // 5)) == 0


def model_shape(config):
    """(num_layers, hidden_size, vocab_size) of a Hugging Face config."""
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer")
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd")
    return layers, hidden, config.vocab_size


def transformer_flops(config, batch_size: int, seq_length: int, factor: float) -> float:
    layers, hidden, vocab = model_shape(config)
    return (24 * factor * batch_size * seq_length * layers * hidden ** 2
            * (1.0 + seq_length / (6.0 * hidden) + vocab / (16.0 * layers * hidden)))


def count_parameters(model) -> int:
    """Parameter count, ZeRO-3 aware (partitioned parameters carry ``ds_numel``)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def throughput_line(model, config, e2e_time: float, batch_size: int, seq_length: int,
                    world_size: int = 1, gradient_checkpointing: bool = False) -> str:
    """The reference's step-1/2 line for one optimizer step of ``batch_size`` samples per rank."""
    factor = 4 if gradient_checkpointing else 3
    tflops = transformer_flops(config, batch_size, seq_length, factor) / (e2e_time * 1e12)
    params_b = count_parameters(model) / 1e9
    return (f"Model Parameters: {params_b:.3f} B, Latency: {e2e_time:.2f}s, TFLOPs: {tflops:.4f}, "
            f"Samples/sec: {batch_size * world_size / e2e_time:.2f}, Time/seq {e2e_time / batch_size:.3f}s, "
            f"Batch Size: {batch_size}, Sequence Length: {seq_length}")
