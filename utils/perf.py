"""DeepSpeed-Chat-style throughput lines (latency, TFLOPs, samples/s): steps 1 and 2 (:func:`throughput_line`)
and step 3 (:func:`step3_throughput`, :func:`throughput_lines`).

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


def step3_throughput(actor_config, critic_config, *, experience_time: float, generate_time: float,
                     train_time: float, sequences: int, seq_length: int, answer_length: int, generated_tokens: int,
                     actor_train_samples: int, critic_train_samples: int, world_size: int = 1,
                     actor_factor: float = 3.0, critic_factor: float = 3.0, actor_params: int = 0,
                     critic_params: int = 0, bytes_per_param: int = 4) -> dict:
    """DeepSpeed-Chat's step-3 numbers for one PPO step (per rank counts, ``world_size`` ranks).

    ``sequences``: experiences generated (all generation batches); ``actor_train_samples``
    / ``critic_train_samples``: rows each model was trained on (× PPO epochs; the actor's
    count includes unsupervised rows — the reference used a batch of 2 there).
    End-to-end time = experience time (generation + scoring) + training time. ``critic_config`` None:
    no critic (the critic-free estimators).
    """
    e2e_time = experience_time + train_time
    train_flops = transformer_flops(actor_config, actor_train_samples, seq_length, actor_factor)
    if critic_config is not None:
        train_flops += transformer_flops(critic_config, critic_train_samples, seq_length, critic_factor)
    gen_flops = transformer_flops(actor_config, sequences, seq_length, 1)
    per_token = generate_time / max(generated_tokens, 1)
    tera = 1e12 * world_size
    return {
        "e2e_latency": e2e_time, "gen_latency": generate_time, "train_latency": train_time,
        "e2e_tflops": (train_flops + gen_flops) * world_size / (max(e2e_time, 1e-9) * tera),
        "gen_tflops": gen_flops * world_size / (max(generate_time, 1e-9) * tera),
        "train_tflops": train_flops * world_size / (max(train_time, 1e-9) * tera),
        "samples_per_sec": sequences * world_size / max(e2e_time, 1e-9),
        "gen_tokens_per_sec": sequences * world_size * generated_tokens / max(generate_time, 1e-9),
        "per_token_latency_ms": per_token * 1000,
        "gen_bandwidth_gbs": actor_params * bytes_per_param / max(per_token, 1e-9) / 1e9,
        "sequences": sequences * world_size, "seq_length": seq_length, "answer_length": answer_length,
        "actor_params_b": actor_params / 1e9, "critic_params_b": critic_params / 1e9,
    }


def throughput_lines(t: dict) -> list:
    """The reference's four step-3 throughput lines from :func:`step3_throughput`'s dict."""
    return [
        f"End-to-End => Latency: {t['e2e_latency']:.2f}s, TFLOPs: {t['e2e_tflops']:.4f}, "
        f"Samples/sec: {t['samples_per_sec']:.2f}, Time/seq {t['e2e_latency'] / max(t['sequences'], 1):.3f}s, "
        f"Batch Size: {t['sequences']}, Total Seq. Length: {t['seq_length']}",
        f"Generation => Latency: {t['gen_latency']:.2f}s, Per-token Latency {t['per_token_latency_ms']:.2f} ms, "
        f"TFLOPs: {t['gen_tflops']:.4f}, BW: {t['gen_bandwidth_gbs']:.2f} GB/sec, "
        f"Tokens/sec: {t['gen_tokens_per_sec']:.1f}, Answer Seq. Length: {t['answer_length']}",
        f"Training   => Latency: {t['train_latency']:.2f}s, TFLOPs: {t['train_tflops']:.4f}",
        f"Actor Model Parameters => {t['actor_params_b']:.3f} B, "
        f"Critic Model Parameters => {t['critic_params_b']:.3f} B",
    ]
