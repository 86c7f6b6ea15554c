"""LoRA (utils/lora.py) on the tiny-opt model: a fresh LoRA model computes the
base model, fusing gives a plain Linear with the LoRA layer's output (also through
save_hf_format + from_pretrained), parameter freezing, and bad module names."""
import copy

import pytest
import torch
from torch import nn

from utils.errors import UserInputError
from utils.model.model_utils import enable_activation_checkpointing
from utils.lora import (LinearLayer_LoRA, convert_linear_layer_to_lora, convert_lora_to_linear_layer,
                               make_model_gradient_checkpointing_compatible, only_optimize_lora_parameters,
                               unfuse_lora_weight)

LORA_KEYS = ("lora_right_weight", "lora_left_weight")


@pytest.fixture(scope="module")
def base():
    from transformers import AutoModelForCausalLM

    from utils.model.model_utils import create_hf_model, load_hf_tokenizer

    tok = load_hf_tokenizer("tiny-opt")
    model = create_hf_model(AutoModelForCausalLM, "tiny-opt", tok, dropout=0.0).eval()
    x = torch.tensor([tok(" Human: Describe the lamp. Assistant: The lamp is bright.")["input_ids"]])
    return model, tok, x


@pytest.fixture
def model(base):
    return copy.deepcopy(base[0])


def logits(model, x):
    with torch.no_grad():
        return model(input_ids=x).logits


def lora_layers(model):
    return [m for m in model.modules() if isinstance(m, LinearLayer_LoRA)]


def randomise_lora(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for layer in lora_layers(model):
        with torch.no_grad():
            layer.lora_left_weight.copy_(torch.randn(layer.lora_left_weight.shape, generator=gen) * 0.5)


def test_hand_computed_layer_and_its_fusion():
    linear = nn.Linear(3, 2)
    with torch.no_grad():
        linear.weight.copy_(torch.tensor([[1.0, 0, 0], [0, 1, 0]]))
        linear.bias.zero_()
    layer = LinearLayer_LoRA(linear.weight, lora_dim=1, bias=linear.bias)
    assert layer.lora_right_weight.shape == (3, 1) and layer.lora_left_weight.shape == (1, 2)
    assert layer.lora_scaling == 1.0 and not layer.weight.requires_grad
    assert (layer.lora_left_weight == 0).all() and (layer.lora_right_weight != 0).any()
    with torch.no_grad():
        layer.lora_right_weight.copy_(torch.tensor([[1.0], [2.0], [3.0]]))
        layer.lora_left_weight.copy_(torch.tensor([[1.0, -1.0]]))
    x = torch.tensor([[1.0, 1.0, 1.0]])
    # x W^T = [1, 1]; x R = 6; x R L = [6, -6] -> [7, -5]
    assert layer(x).tolist() == [[7.0, -5.0]]
    layer.fuse_lora_weight()
    # W + (R L)^T = [[1,0,0],[0,1,0]] + [[1,2,3],[-1,-2,-3]]
    assert layer.weight.tolist() == [[2.0, 2.0, 3.0], [-1.0, -1.0, -3.0]]
    assert layer(x).tolist() == [[7.0, -5.0]]
    layer.unfuse_lora_weight()
    assert layer.weight.tolist() == [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]


def test_fresh_lora_model_equals_base(model, base):
    _, _, x = base
    before = logits(model, x)
    keys_before = set(model.state_dict())
    convert_linear_layer_to_lora(model, "decoder.layers.", lora_dim=8)
    layers = lora_layers(model)
    assert len(layers) == 4 * 6  # q, k, v, out_proj, fc1, fc2 in each of the 4 layers
    fc1 = model.model.decoder.layers[0].fc1
    assert fc1.lora_right_weight.shape == (128, 8) and fc1.lora_left_weight.shape == (8, 512)
    assert fc1.lora_scaling == pytest.approx(1 / 8)
    # base parameters keep their names: only the LoRA factors are new keys
    assert {k for k in model.state_dict() if not k.endswith(LORA_KEYS)} == keys_before
    assert torch.equal(logits(model, x), before)  # L = 0: exactly the base model


def test_fused_plain_linear_matches_lora_layer(model, base):
    _, _, x = base
    before = logits(model, x)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    convert_linear_layer_to_lora(model, "decoder.layers.", lora_dim=8)
    randomise_lora(model)
    with_lora = logits(model, x)
    assert (with_lora - before).abs().max() > 1e-2  # the LoRA update matters

    layer = model.model.decoder.layers[1].self_attn.q_proj
    h = torch.randn(5, 128)
    lora_out = layer(h)
    convert_lora_to_linear_layer(model)
    plain = nn.Linear(128, 128)
    plain.load_state_dict({"weight": layer.weight.detach(), "bias": layer.bias.detach()})
    torch.testing.assert_close(plain(h), lora_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits(model, x), with_lora, atol=1e-4, rtol=1e-4)

    unfuse_lora_weight(model)
    for name, p in model.named_parameters():
        if not name.endswith(LORA_KEYS):
            torch.testing.assert_close(p.detach(), original[name], atol=1e-6, rtol=0)
    torch.testing.assert_close(logits(model, x), with_lora, atol=1e-5, rtol=1e-5)


def test_saved_lora_model_loads_as_plain_model(model, base, tmp_path):
    from transformers import AutoModelForCausalLM

    from utils.model.model_utils import save_hf_format

    _, tok, x = base
    convert_linear_layer_to_lora(model, "decoder.layers.", lora_dim=8)
    randomise_lora(model, seed=1)
    expected = logits(model, x)
    save_hf_format(model, tok, str(tmp_path / "out"))
    assert not model.model.decoder.layers[0].fc1.fuse_lora  # unfused again after saving
    torch.testing.assert_close(logits(model, x), expected, atol=1e-5, rtol=1e-5)
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert not any("lora" in n for n, _ in loaded.named_parameters())
    torch.testing.assert_close(logits(loaded, x), expected, atol=1e-4, rtol=1e-4)


def test_only_optimize_lora(model):
    convert_linear_layer_to_lora(model, "decoder.layers.", lora_dim=4)
    only_optimize_lora_parameters(model)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * 24 and all(n.endswith(LORA_KEYS) for n in trainable)
    only_optimize_lora_parameters(model, force_optimize_params=("embed_tokens",))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable - {n for n in trainable if n.endswith(LORA_KEYS)} == {"model.decoder.embed_tokens.weight"}


def test_lora_only_training_with_gradient_checkpointing_reaches_the_factors(model, base):
    _, _, x = base
    convert_linear_layer_to_lora(model, "decoder.layers.", lora_dim=4)
    only_optimize_lora_parameters(model)
    make_model_gradient_checkpointing_compatible(model)
    enable_activation_checkpointing(model)
    model.train()
    model(input_ids=x, labels=x).loss.backward()
    grads = [layer.lora_left_weight.grad for layer in lora_layers(model)]
    assert all(g is not None for g in grads) and all(g.abs().sum() > 0 for g in grads)
    assert model.model.decoder.layers[0].fc1.weight.grad is None  # frozen base weight


def test_activation_checkpointing_uses_the_non_deprecated_entry_point(model):
    # transformers 5.24 deprecates gradient_checkpointing_enable (removed in v6); steps 1-3 call the helper
    import warnings

    from utils.model.reward_model import RewardModel

    reward = RewardModel(copy.deepcopy(model).model, type("Tok", (), {"pad_token_id": 1, "eos_token_id": 2})(), 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        enable_activation_checkpointing(model)
        reward.gradient_checkpointing_enable()

    def on(m):  # transformers 5.24 renamed the flag too
        return m.is_activation_checkpointing if hasattr(type(m), "is_activation_checkpointing") else m.is_gradient_checkpointing

    assert on(model) and on(reward.rwtransformer)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        reward.gradient_checkpointing_disable()
    assert not on(reward.rwtransformer)


def test_unmatched_module_name_is_a_user_error(model):
    with pytest.raises(UserInputError, match="--lora_module_name 'transformer.h.' matches no nn.Linear") as err:
        convert_linear_layer_to_lora(model, "transformer.h.", lora_dim=8)
    assert "its first one is 'model.decoder.layers.0." in str(err.value)  # the error shows what would match
    assert "try --lora_module_name layers." in str(err.value)
    assert not lora_layers(model)


def test_reward_model_lora_only_training_reaches_the_factors_through_checkpointing():
    """A fix: DeepSpeed-Chat's step 2 calls make_model_gradient_checkpointing_compatible on the RewardModel wrapper,
    which has neither enable_input_require_grads nor get_input_embeddings, so it does nothing: under reentrant
    checkpointing (without transformers' own input hook, which recent versions add) LoRA-only training updates the
    value head alone. apply_lora hooks the backbone."""
    import functools

    from torch.utils.checkpoint import checkpoint

    from utils.lora import apply_lora
    from utils.model.critic import create_critic_model
    from utils.model.model_utils import load_hf_tokenizer

    tok = load_hf_tokenizer("tiny-opt")
    batch = tok([" Human: Describe the lamp. Assistant: The lamp is bright." + tok.eos_token,
                 " Human: Describe the lamp. Assistant: No." + tok.eos_token], padding=True, return_tensors="pt")
    torch.manual_seed(0)
    ours = create_critic_model("tiny-opt", tok, None, num_padding_at_beginning=1)
    reference = copy.deepcopy(ours)
    apply_lora(ours, "decoder.layers.", 4, only_optimize=True, force_optimize=("v_head",))
    convert_linear_layer_to_lora(reference, "decoder.layers.", lora_dim=4)  # DeepSpeed-Chat's three calls
    only_optimize_lora_parameters(reference, ("v_head",))
    make_model_gradient_checkpointing_compatible(reference)

    def lora_grads(model):
        model.rwtransformer._set_gradient_checkpointing(  # reentrant, without transformers' input hook
            enable=True, gradient_checkpointing_func=functools.partial(checkpoint, use_reentrant=True))
        model.train()
        model(**batch)["loss"].backward()
        assert model.v_head.weight.grad is not None
        return [layer.lora_left_weight.grad for layer in lora_layers(model)]

    assert all(g is not None and g.abs().sum() > 0 for g in lora_grads(ours))
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        assert all(g is None for g in lora_grads(reference))
