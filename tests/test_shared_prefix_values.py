"""The reward model's and critic's values with a shared prefix run once: step 2's ``--kwise`` batch (a prompt's K
answers after one pass of the prompt) and step 3's critic and reward model (a group's G answers after one pass of its
prompt). By hand: the split and the prefix lengths; then each shared pass against the plain one, values, scores,
loss and gradients, on the tiny Llama (RoPE, column positions) and the tiny OPT (learned positions, its own rule),
and the tokens each pass feeds the backbone."""
import pytest
import torch
from torch.testing import assert_close

from utils.data.data_utils import DataCollatorKwise
from utils.model.lean_forward import group_heads, group_prefix_lengths, pair_groups, split_groups


# --------------------------------------------------------------------------- by hand

def test_split_groups_by_hand():
    # rows 0 and 2 share [5, 6, 7]; row 1 is alone in its group with [8, 9]; right padded with 0
    ids = torch.tensor([[5, 6, 7, 1, 2],
                        [8, 9, 3, 0, 0],
                        [5, 6, 7, 4, 0]])
    att = (ids != 0).long()
    split = split_groups(ids, att, source=torch.tensor([0, 2, 1]), group=torch.tensor([0, 0, 1]),
                         shared=torch.tensor([3, 2]), stop=torch.tensor([5, 4, 3]))
    assert split.head.tolist() == [0, 1]  # each prefix read from its group's first row
    assert split.prefix.tolist() == [[5, 6, 7], [0, 8, 9]]  # left padded to the longest prefix
    assert split.prefix_mask.tolist() == [[1, 1, 1], [0, 1, 1]]
    assert split.prefix_columns.tolist() == [[0, 1, 2], [0, 0, 1]]
    assert split.conts.tolist() == [[1, 2], [4, 0], [3, 0]]  # columns shared … stop − 1, right padded
    assert split.present.tolist() == [[True, True], [True, False], [True, False]]
    assert split.cont_mask.tolist() == [[1, 1], [1, 0], [1, 0]]  # row 2's column 4 is in but is padding
    assert split.columns[:, 0].tolist() == [3, 3, 2]


def test_group_heads_and_pair_groups_by_hand():
    # groups 2, 0, 2, 1, 0: group 0 first at index 1, group 1 at 3, group 2 at 0
    assert group_heads(torch.tensor([2, 0, 2, 1, 0]), 3).tolist() == [1, 3, 0]
    source, group = pair_groups(3, "cpu")  # rows [c0, c1, c2, r0, r1, r2]
    assert source.tolist() == [0, 3, 1, 4, 2, 5]
    assert group.tolist() == [0, 0, 1, 1, 2, 2]


def test_group_prefix_lengths_by_hand():
    ids = torch.tensor([[5, 6, 7, 1, 2],
                        [5, 6, 3, 0, 0],
                        [8, 9, 4, 4, 0],
                        [8, 9, 0, 0, 0],
                        [5, 6, 7, 1, 0]])
    att = (ids != 0).long()
    # group 0: rows 0, 1, 4 agree on 2 columns; group 1: rows 2 and 3 on 2 (row 3's length)
    assert group_prefix_lengths(ids, att, torch.tensor([0, 0, 1, 1, 0])).tolist() == [2, 2]
    # without row 1, rows 0 and 4 agree on 4 columns, at most row 4's length (4)
    assert group_prefix_lengths(ids, att, torch.tensor([0, 1, 2, 2, 0])).tolist() == [4, 3, 2]


# --------------------------------------------------------------------------- against the plain pass

def critic(name):
    from utils.model.critic import create_critic_model
    from utils.model.model_utils import load_hf_tokenizer
    from utils.model.tiny import resolve_model_path

    path = resolve_model_path(name)
    tokenizer = load_hf_tokenizer(path)
    torch.manual_seed(0)
    model = create_critic_model(path, tokenizer, None, num_padding_at_beginning=0)
    torch.nn.init.normal_(model.v_head.weight, std=1.0)  # scores clearly apart
    return model, tokenizer


class TokenCounter:
    """Counts the tokens (rows × columns) a module is called on."""

    def __init__(self, module):
        self.tokens = 0
        self.handle = module.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        ids = args[0] if args else kwargs["input_ids"]
        self.tokens += ids.numel()


def both_passes(model, run):
    """``run(model)`` → a dict of tensors and a scalar to differentiate, on the plain pass (``share_prefix`` False)
    and the shared one: their results, parameter gradients and backbone tokens."""
    results = []
    for share in (False, True):
        model.share_prefix = share
        model.zero_grad()
        counter = TokenCounter(model.rwtransformer)
        try:
            out, objective = run(model, share)
            objective.backward()
        finally:
            counter.handle.remove()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append(({k: v.detach() for k, v in out.items()}, grads, counter.tokens))
    model.share_prefix = True
    model.zero_grad()
    return results


def assert_same(plain, shared):
    (out_p, grads_p, _), (out_s, grads_s, _) = plain, shared
    for key in out_p:
        assert_close(out_s[key], out_p[key], atol=1e-5, rtol=1e-5)
    assert grads_p.keys() == grads_s.keys() and grads_p
    for name, grad in grads_p.items():
        # up to rounding, on the gradient's own scale (a key bias's is 0 up to rounding in both: softmax ignores a
        # shift common to all keys; a prompt token's embedding sums G rows' gradients in another order)
        assert_close(grads_s[name], grad, atol=1e-5 * max(float(grad.abs().max()), 1e-1), rtol=1e-4)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-opt"])
@pytest.mark.parametrize("loss", ["span", "end"])
def test_kwise_batch_runs_each_prompt_once_with_the_plain_loss_and_gradients(name, loss):
    model, tok = critic(name)
    model.loss = loss

    def texts(prompt, answers):
        return [torch.tensor(tok(prompt + a + tok.eos_token, add_special_tokens=False)["input_ids"])
                for a in answers]

    lamp = texts(" Human: Describe the lamp in the hall. Assistant:",
                 [" The lamp is bright and kind and calm.", " The lamp is dull.", " A lamp.", " It glows."])
    door = texts(" Human: Describe the door. Assistant:", [" The door is open.", " The door is closed and cold."])
    prompts = [[(lamp[0], lamp[1]), (lamp[0], lamp[2]), (lamp[2], lamp[1]), (lamp[3], lamp[1])],
               [(door[1], door[0])]]
    batch = DataCollatorKwise(tok.pad_token_id, 128)(prompts)
    assert batch["input_ids"].shape[0] == 6

    def run(model, share):
        out = model(**batch)
        return out, out["loss"]

    plain, shared = both_passes(model, run)
    assert_same(plain, shared)
    assert shared[2] < 0.75 * plain[2]  # the prompts ran once: fewer tokens through the backbone


def step3_rows(tok, G, P, A, seed=1):
    """Two prompts, left padded to ``P`` columns (7 and 4 real tokens), each with ``G`` answers of 6, 3, 1, …
    tokens right padded to ``A``: ``[2G, P + A]`` ids and mask, as step 3's rollout holds them."""
    g = torch.Generator().manual_seed(seed)
    pad, V = tok.pad_token_id, len(tok)
    ids, att = torch.full((2 * G, P + A), pad), torch.zeros(2 * G, P + A, dtype=torch.long)
    for i, length in enumerate((7, 4)):
        prompt = torch.randint(5, V, (length,), generator=g)
        for j in range(G):
            row, n = i * G + j, (6, 3, 1, 5)[j % 4]
            ids[row, P - length:P], att[row, P - length:P] = prompt, 1
            ids[row, P:P + n], att[row, P:P + n] = torch.randint(5, V, (n,), generator=g), 1
    return ids, att


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-opt"])
def test_step3_critic_and_reward_values_run_each_prompt_once(name):
    """What step 3 reads (the critic's values from ``P − 1``, the reward model's end scores) and the critic's gradients
    are the plain pass's, each group's prompt run once."""
    model, tok = critic(name)
    G, P, A = 3, 8, 6
    ids, att = step3_rows(tok, G, P, A)
    weights = torch.randn(2 * G, A + 1, generator=torch.Generator().manual_seed(2))

    def run(model, share):
        out = model.forward_value(ids, att, prompt_length=P, group_size=G)
        values = out["values"][:, P - 1:]
        return {"values": values, "end": out["chosen_end_scores"]}, (values * weights).sum()

    plain, shared = both_passes(model, run)
    assert_same(plain, shared)
    assert shared[2] == 2 * P + 2 * G * A < plain[2] == 2 * G * (P + A)


def test_rows_that_do_not_repeat_their_prompt_take_the_plain_pass():
    model, tok = critic("tiny-llama")
    G, P, A = 3, 8, 6
    ids, att = step3_rows(tok, G, P, A)
    ids[1, P - 1] = ids[0, P - 1] + 1  # the first group's second row has another prompt
    counter = TokenCounter(model.rwtransformer)
    with torch.no_grad():
        shared = model.forward_value(ids, att, prompt_length=P, group_size=G)["values"][:, P - 1:]
        plain = model.forward_value(ids, att, prompt_length=P)["values"][:, P - 1:]
    counter.handle.remove()
    assert counter.tokens == 2 * 2 * G * (P + A)  # both passes plain
    assert_close(shared, plain)


# --------------------------------------------------------------------------- end to end

@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 3])
def test_step3_ppo_with_a_critic_runs_each_groups_prompt_once_at_zero_0_and_3(tmp_path, stage):
    """Step 3 PPO (gae) on tiny-llama with 2 answers a prompt: the critic's and the reward model's shared prompt pass
    inside DeepSpeed engines, ZeRO-3 included (partitioned weights gathered for each of its two backbone calls), two
    RL steps with finite losses and a critic that moved."""
    import json
    import math

    from tests.conftest import run_entry
    from utils.model.critic import create_critic_model, load_reward_model, save_reward_model
    from utils.model.model_utils import load_hf_tokenizer

    tokenizer = load_hf_tokenizer("tiny-llama")
    critic_folder = tmp_path / "reward"
    save_reward_model(create_critic_model("tiny-llama", tokenizer, None, 0), tokenizer, str(critic_folder))
    out = tmp_path / "out"
    proc = run_entry(
        "step3_rlhf_finetuning/main.py", "--data_path", "builtin/preference-small", "--data_output_path",
        tmp_path / "data", "--actor_model_name_or_path", "tiny-llama", "--critic_model_name_or_path", critic_folder,
        "--output_dir", out, "--n_samples_per_prompt", 2, "--do_sample", "--max_prompt_seq_len", 32,
        "--max_answer_seq_len", 8, "--per_device_generation_batch_size", 2, "--per_device_training_batch_size", 4,
        "--max_steps", 2, "--actor_learning_rate", 1e-3, "--critic_learning_rate", 1e-3, "--num_warmup_steps", 0,
        "--actor_zero_stage", stage, "--critic_zero_stage", stage, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["phase"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    assert all(math.isfinite(r[k]) for r in train for k in ("actor_loss", "critic_loss", "reward", "kl"))
    before, after = (load_reward_model(str(folder))[0] for folder in (critic_folder, out / "critic"))
    assert any(not torch.equal(a, b) for a, b in zip(before.state_dict().values(), after.state_dict().values()))


def test_the_bench_prints_each_case_with_fewer_tokens_and_the_same_results(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "bench_shared_prefix.py"
    spec = importlib.util.spec_from_file_location("bench_shared_prefix", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--prompts", "2", "--answers", "4", "--micro", "4", "--answer_len", "16", "--repeats", "1"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| step")]
    assert len(rows) == 3
    for name, _, _, _, tokens, difference in rows:
        plain, shared = map(int, tokens.split("/"))
        assert shared < plain, name
        assert float(difference) < 1e-4, name
