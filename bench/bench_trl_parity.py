#!/usr/bin/env python
"""One GRPO update, the same batch, step 3's trainer and TRL's ``GRPOTrainer``: do they compute the same gradient?

    .venv/bin/python bench/bench_trl_parity.py --model /path/to/smollm2    # ~2 min on 2 CPU cores (+ the peer env)

The real-model bench (``bench_real_rl.py``) compares step 3 with TRL over whole runs, where every difference of
sampling, seeds and rounding adds up and one run spreads over 10 to 20 points. This bench takes those away: step 3's
:class:`~step3_rlhf_finetuning.ppo_trainer.DeepSpeedPPOTrainer` samples one batch (a few chat prompts, 4 answers
each) from the model, the answers get fixed scores, the reference log-probs a fixed perturbation (so the β·KL
term has a gradient); then step 3's ``train_step`` and TRL's ``compute_loss`` (``loss_type="dapo"``,
``scale_rewards="group"``, β, ε 0.2: the settings the real-model bench gives TRL) each take that batch and the
same fp32 weights, and the bench compares what they computed: the answers' log-probs, the loss, and the gradient
of every weight (relative L2 difference and cosine). Both must agree to float32 rounding; anything more is a
difference of method, and the table says where. It also lists the optimizer settings either side would step with
(TRL's from its ``GRPOConfig`` as ``trl_run.py`` builds it).

Step 3 runs here on an engine stand-in (what the trainer uses of a DeepSpeed engine: backward, step), which keeps
the gradient instead of stepping: fp32, ZeRO 0, one micro-batch, so DeepSpeed's engine would pass the same
gradient to its optimizer. TRL runs in the peer bench's environment (``--peer-venv``, built on first use).
"""
from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C from the first second on: one line, exit 130 (utils/interrupt.py)
    from utils.interrupt import exit_quietly_on_ctrl_c

    exit_quietly_on_ctrl_c()

import argparse
import json
import os
import subprocess
import tempfile
from types import SimpleNamespace

import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))

PROMPTS = ("Give three tips for staying healthy. Do not use any commas in your response.",
           "Describe the water cycle. Finish your response with the exact phrase \"Is there anything else?\"",
           "Name a famous painter and one of their works. Your answer must contain a title wrapped in double "
           "angular brackets such as <<poem of joy>>.",
           "Explain why the sky is blue. Answer with less than 40 words.")
GROUP = 4  # answers per prompt
BETA = 0.04  # the real-model bench's β
KL_NOISE = 0.05  # the reference log-probs: the policy's own, moved by this much (a seeded normal per token)


class GradientKeeper(torch.nn.Module):
    """What step 3's trainer uses of a DeepSpeed engine (``module``, call, train/eval, backward, step), keeping the
    gradient where the engine would step."""

    def __init__(self, module):
        super().__init__()
        self.module, self.grads = module, None

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def torch_autocast_enabled(self):
        return False

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.grads = {n: p.grad.detach().clone() for n, p in self.module.named_parameters() if p.grad is not None}

    def zero_optimization_stage(self):
        return 0


def step3_side(model_path: str, answer_len: int, seed: int, work: str) -> dict:
    """Sample the batch with step 3's trainer, take its update's gradient, write the batch for TRL."""
    from transformers import AutoModelForCausalLM

    from step3_rlhf_finetuning.config import GenerationConfig, PPOConfig, RewardConfig
    from step3_rlhf_finetuning.ppo_trainer import DeepSpeedPPOTrainer
    from utils.data.chat_template import chat_format
    from utils.data.data_utils import DataCollatorRLHF
    from utils.model.model_utils import load_hf_tokenizer

    tokenizer = load_hf_tokenizer(model_path, apply_chat_template=True)
    load = lambda: AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)  # noqa: E731
    actor, ref = GradientKeeper(load().train()), GradientKeeper(load().eval())
    engine = SimpleNamespace(actor=actor, ref=ref, critic=None, reward=None, actor_ema=None, tokenizer=tokenizer)
    ppo = PPOConfig(advantage_estimator="grpo", n_samples_per_prompt=GROUP, kl_ctl=BETA, loss_agg="token_mean")
    eot = chat_format(tokenizer, model_path).eot  # the template's end of turn, as step 3 takes it
    generation = GenerationConfig(max_prompt_seq_len=192, max_answer_seq_len=answer_len, do_sample=True,
                                  temperature=1.0, backend="hf", eot_token=eot)
    trainer = DeepSpeedPPOTrainer(engine, ppo, generation, log=lambda *_: None, reward=RewardConfig(), on_policy=True)

    ids = [torch.tensor(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                      tokenize=True, return_dict=True)["input_ids"])
           for p in PROMPTS]
    batch = DataCollatorRLHF(192, tokenizer.pad_token_id)(ids)
    torch.manual_seed(seed)
    rollout = trainer.generate(batch["prompt"], batch["prompt_att_mask"], step=1)
    if len(rollout) != GROUP * len(PROMPTS):
        raise SystemExit(f"step 3 kept {len(rollout)} of {GROUP * len(PROMPTS)} answers (too short); try another --seed")
    generator = torch.Generator().manual_seed(seed)
    rollout.scores = torch.rand(len(rollout), generator=generator)  # fixed scores, distinct within every group
    with torch.no_grad():
        own = trainer._action_log_probs(actor.module, rollout)
    noise = KL_NOISE * torch.randn(own.shape, generator=generator)
    rollout.ref_logprobs = (own + noise) * rollout.action_mask
    rollout.logprobs = torch.zeros_like(own)  # on-policy: the training pass writes its own detached log-probs
    trainer.compute_advantages(rollout)
    normalizer = trainer.loss_normalizers([rollout], 1)[0]
    losses = trainer.train_step(rollout, normalizer)

    P = rollout.prompt_length
    batch_file = os.path.join(work, "batch.pt")
    torch.save({"prompt_ids": rollout.prompts, "prompt_mask": rollout.attention_mask[:, :P],
                "completion_ids": rollout.answer_ids, "completion_mask": rollout.attention_mask[:, P:],
                "scores": rollout.scores, "ref_per_token_logps": rollout.ref_logprobs, "group": GROUP,
                "beta": BETA}, batch_file)
    loss = losses["actor_loss"] + BETA * losses["kl_loss"]
    return {"batch": batch_file, "grads": actor.grads, "logprobs": rollout.logprobs.clone(),
            "advantages": rollout.advantages[:, 0].clone(), "loss": float(loss), "mask": rollout.action_mask,
            "tokens": int(rollout.action_mask.sum()), "answers": len(rollout)}


def trl_side(python: str, model_path: str, batch_file: str, work: str) -> dict:
    """TRL's ``compute_loss`` and gradient on the batch (``trl_run.py grpo_loss`` in the peer environment)."""
    from train import child_env

    out = os.path.join(work, "trl")
    cmd = [python, os.path.join(REPO, "bench", "peers", "trl_run.py"), "grpo_loss", "--model", model_path,
           "--data", batch_file, "--out", out, "--beta", str(BETA)]
    subprocess.run(cmd, check=True, cwd=REPO, env=child_env())  # the repository before the user's PYTHONPATH
    return torch.load(os.path.join(out, "grads.pt"), weights_only=True)


def compare(ours: dict, trl: dict) -> list:
    """``[(quantity, value)]``: how far TRL's numbers are from step 3's on the same batch."""
    def rel(a, b):
        return float((a - b).norm() / b.norm().clamp(min=1e-30))

    mask = ours["mask"].bool()
    rows = [("answers / answer tokens", f"{ours['answers']} / {ours['tokens']}"),
            ("log-probs: max abs difference (answer tokens)",
             f"{float((ours['logprobs'] - trl['logprobs'])[mask].abs().max()):.2e}"),
            ("advantages: max abs difference", f"{float((ours['advantages'] - trl['advantages']).abs().max()):.2e}"),
            ("loss: step 3 / TRL", f"{ours['loss']:.6f} / {trl['loss']:.6f}")]
    names = sorted(set(ours["grads"]) & set(trl["grads"]))
    missing = sorted(set(ours["grads"]) ^ set(trl["grads"]))
    a = torch.cat([ours["grads"][n].flatten() for n in names]).double()  # float64: 135 M terms in one sum
    b = torch.cat([trl["grads"][n].flatten() for n in names]).double()
    worst = max(names, key=lambda n: rel(ours["grads"][n], trl["grads"][n]))
    rows += [("gradient: tensors compared (only one side has)", f"{len(names)} ({len(missing)})"),
             ("gradient norm: step 3 / TRL", f"{float(a.norm()):.6f} / {float(b.norm()):.6f}"),
             ("gradient: relative L2 difference, all weights", f"{rel(a, b):.2e}"),
             ("gradient: cosine, all weights", f"{float(torch.nn.functional.cosine_similarity(a, b, dim=0)):.8f}"),
             (f"gradient: worst tensor ({worst})", f"{rel(ours['grads'][worst], trl['grads'][worst]):.2e}")]
    return rows


def optimizer_settings(trl: dict) -> list:
    """``[(setting, step 3, TRL)]``: what each side's optimizer step would use. Step 3's side is the AdamW its actor
    gets at step 3's default flags (:func:`utils.ds_utils.create_optimizer`, on a stand-in linear layer)."""
    from step3_rlhf_finetuning.main import parse_args
    from utils.ds_utils import create_optimizer, get_train_ds_config
    from utils.training import OptimConfig

    args = parse_args(["--actor_model_name_or_path", "actor"])
    optim = OptimConfig.from_args(args, "actor")
    adam = create_optimizer(torch.nn.Linear(2, 2), optim.weight_decay, optim.learning_rate, optim.lora_learning_rate,
                            offload=False, betas=optim.betas)
    weights = adam.param_groups[0]  # the group with weight decay (biases and norms have none)
    clip = get_train_ds_config(offload=False, dtype="fp32", stage=0)["gradient_clipping"]
    ours = {"optimizer": f"torch {type(adam).__name__}", "betas": str(weights["betas"]), "eps": f"{weights['eps']:g}",
            "weight decay": str(weights["weight_decay"]), "gradient clipping (max norm)": str(clip)}
    return [(k, v, str(trl["optimizer"].get(k, "?"))) for k, v in ours.items()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=os.environ.get("SMOLLM2_DIR") or os.path.join(os.path.dirname(REPO),
                                                                                             "smollm2"))
    parser.add_argument("--answer_len", type=int, default=48, help="new tokens per answer")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--peer-venv", dest="peer_venv", default=os.path.join(REPO, ".venv-peers"))
    parser.add_argument("--trl", default="1.16.0", help="the TRL version of the peer environment")
    parser.add_argument("--work", default=None, help="folder for the batch and TRL's gradient (default: a temp dir)")
    opts = parser.parse_args(argv)
    if not os.path.isfile(os.path.join(opts.model, "config.json")):
        from utils.errors import UserInputError

        raise UserInputError(f"--model {opts.model}: no config.json there (build it: "
                             "make smollm2)")
    from bench_peers import ensure_peer_env

    python = ensure_peer_env(opts.peer_venv, opts.trl)
    work = opts.work or tempfile.mkdtemp(prefix="trl-parity-")
    os.makedirs(work, exist_ok=True)
    ours = step3_side(opts.model, opts.answer_len, opts.seed, work)
    trl = trl_side(python, opts.model, ours["batch"], work)

    print(f"\n### One GRPO update on the same batch: step 3's trainer and TRL {opts.trl}'s GRPOTrainer "
          f"({os.path.basename(opts.model.rstrip('/'))}, fp32, β {BETA}, {len(PROMPTS)} prompts × {GROUP})\n")
    rows, optimizer = compare(ours, trl), optimizer_settings(trl)  # once: compare concatenates every gradient
    print("| quantity | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    print("\n| optimizer setting | step 3 | TRL (trl_run.py) |\n|---|---|---|")
    for name, a, b in optimizer:
        print(f"| {name} | {a} | {b} |")
    with open(os.path.join(work, "parity.json"), "w") as f:
        json.dump({"rows": rows, "optimizer": optimizer}, f, indent=1)
    return 0


if __name__ == "__main__":
    from utils.entrypoint import run_script

    run_script(main)
