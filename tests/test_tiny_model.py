"""make_tiny_model: deterministic, transformers-compatible, no downloads."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from asyncsync.testing import (
    TINY_MODEL_CONFIG,
    TINY_MOE_CONFIG,
    check_greedy,
    describe_cpu,
    make_tiny_model,
    reference_greedy,
    reference_logprobs,
)
from asyncsync.testing._cpu import ISA_FLAGS


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.server_deps
def test_same_seed_gives_byte_identical_weights(tmp_path: Path) -> None:
    a = make_tiny_model(tmp_path / "a", seed=3, tokenizer=False)
    b = make_tiny_model(tmp_path / "b", seed=3, tokenizer=False)
    c = make_tiny_model(tmp_path / "c", seed=4, tokenizer=False)
    assert _digest(a / "model.safetensors") == _digest(b / "model.safetensors")
    assert _digest(a / "model.safetensors") != _digest(c / "model.safetensors")


@pytest.mark.server_deps
def test_architecture_and_size(tiny_model_dir: Path) -> None:
    from safetensors.torch import load_file

    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    assert config["head_dim"] == 64
    assert config["hidden_size"] // config["num_attention_heads"] == 64
    assert config["tie_word_embeddings"] is False
    tensors = load_file(tiny_model_dir / "model.safetensors")
    assert all(str(t.dtype) == "torch.float32" for t in tensors.values())
    n_params = sum(t.numel() for t in tensors.values())
    assert 350_000 <= n_params <= 500_000, n_params
    assert "lm_head.weight" in tensors


@pytest.mark.server_deps
def test_tokenizer_covers_the_whole_vocabulary(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(tok) == TINY_MODEL_CONFIG["vocab_size"]
    ids = tok.encode("the trainer publishes weights", add_special_tokens=False)
    assert tok.decode(ids) == "the trainer publishes weights"
    # Every id the model can emit decodes to something.
    assert all(tok.convert_ids_to_tokens(i) is not None for i in range(len(tok)))
    assert tok.eos_token_id == TINY_MODEL_CONFIG["eos_token_id"]


@pytest.mark.server_deps
def test_token_only_model_has_no_tokenizer(tmp_path: Path) -> None:
    d = make_tiny_model(tmp_path / "m", tokenizer=False)
    assert not (d / "tokenizer.json").exists()
    assert (d / "config.json").is_file()


def test_unknown_override_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="hidden_sise"):
        make_tiny_model(tmp_path / "m", hidden_sise=3)


@pytest.mark.server_deps
def test_reference_greedy_is_deterministic(tiny_model_dir: Path) -> None:
    first = reference_greedy(tiny_model_dir, [1, 5, 9], 6)
    assert first == reference_greedy(tiny_model_dir, [1, 5, 9], 6)
    assert len(first) == 6
    assert all(0 <= t < TINY_MODEL_CONFIG["vocab_size"] for t in first)


@pytest.mark.server_deps
def test_moe_model_has_per_expert_checkpoint_tensors(tmp_path: Path) -> None:
    """``arch="qwen3_moe"``: every expert's projections are their own checkpoint tensors
    (the form vLLM fuses as it loads), deterministic like the dense model."""
    from safetensors.torch import load_file

    a = make_tiny_model(tmp_path / "a", seed=1, tokenizer=False, arch="qwen3_moe")
    b = make_tiny_model(tmp_path / "b", seed=1, tokenizer=False, arch="qwen3_moe")
    assert _digest(a / "model.safetensors") == _digest(b / "model.safetensors")
    config = json.loads((a / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe"
    experts, layers = TINY_MOE_CONFIG["num_experts"], TINY_MODEL_CONFIG["num_hidden_layers"]
    tensors = load_file(a / "model.safetensors")
    expert_names = {n for n in tensors if ".mlp.experts." in n}
    assert len(expert_names) == layers * experts * 3  # gate, up, down
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in expert_names
    assert tuple(tensors["model.layers.0.mlp.experts.0.gate_proj.weight"].shape) == (
        TINY_MOE_CONFIG["moe_intermediate_size"],
        TINY_MODEL_CONFIG["hidden_size"],
    )
    assert len(reference_greedy(a, [1, 5, 9], 4)) == 4


@pytest.mark.server_deps
def test_bfloat16_model_is_the_float32_model_rounded(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    full = load_file(make_tiny_model(tmp_path / "f", tokenizer=False) / "model.safetensors")
    half_dir = make_tiny_model(tmp_path / "h", tokenizer=False, dtype="bfloat16")
    half = load_file(half_dir / "model.safetensors")
    assert json.loads((half_dir / "config.json").read_text())["dtype"] == "bfloat16"
    assert set(half) == set(full)
    for name, tensor in half.items():
        assert tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor, full[name].to(torch.bfloat16)), name


def test_unknown_arch_or_dtype_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="arch must be 'qwen2' or 'qwen3_moe', got 'llama'"):
        make_tiny_model(tmp_path / "m", arch="llama")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dtype must be 'float32' or 'bfloat16', got 'float16'"):
        make_tiny_model(tmp_path / "m", dtype="float16")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unknown qwen2 config overrides \\['num_experts'\\]"):
        make_tiny_model(tmp_path / "m", num_experts=4)


@pytest.mark.server_deps
def test_check_greedy_accepts_the_greedy_tokens_and_names_the_first_wrong_one(
    tiny_model_dir: Path,
) -> None:
    prompt = [1, 17, 42, 99]
    tokens = reference_greedy(tiny_model_dir, prompt, 6)
    logprobs = reference_logprobs(tiny_model_dir, prompt + tokens)[len(prompt) :]
    check_greedy(tiny_model_dir, prompt, tokens, logprobs=logprobs, max_new_tokens=6)  # type: ignore[arg-type]
    wrong = [*tokens[:3], (tokens[3] + 1) % 512, *tokens[4:]]
    with pytest.raises(AssertionError, match=rf"token 3 \({wrong[3]}\) .* not a greedy choice"):
        check_greedy(tiny_model_dir, prompt, wrong)
    with pytest.raises(AssertionError, match="5 tokens, expected 6"):
        check_greedy(tiny_model_dir, prompt, tokens[:5], max_new_tokens=6)
    off = [*logprobs[:2], logprobs[2] - 0.01, *logprobs[3:]]  # type: ignore[operator]
    with pytest.raises(AssertionError, match=r"token 2 .* logprob .*tolerance 0\.001"):
        check_greedy(tiny_model_dir, prompt, tokens, logprobs=off)  # type: ignore[arg-type]
    # A tie is a tie: within the tolerance, either token is a greedy choice.
    check_greedy(tiny_model_dir, prompt, wrong, tolerance=1e6)


@pytest.mark.server_deps
def test_check_greedy_computes_bfloat16_weights_in_float32_with_its_tolerance(
    tmp_path: Path,
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    half_dir = make_tiny_model(tmp_path / "h", tokenizer=False, dtype="bfloat16")
    half = AutoModelForCausalLM.from_pretrained(half_dir, dtype=torch.bfloat16)
    prompt = [3, 250, 11, 480]
    tokens = reference_greedy(half.float(), prompt, 6)
    half = half.to(torch.bfloat16)
    check_greedy(half, prompt, tokens, max_new_tokens=6)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}  # not converted in place
    with pytest.raises(AssertionError, match=r"tolerance 1\.5"):
        check_greedy(half_dir, prompt, [tokens[0], *[(t + 7) % 512 for t in tokens[1:]]])


def test_describe_cpu_names_the_cpu_and_every_flag_that_matters() -> None:
    info = describe_cpu()
    assert info["cpu"]
    assert [word[:-1] for word in info["isa"].split()] == list(ISA_FLAGS)
    assert all(word[-1] in "+-" for word in info["isa"].split())


@pytest.mark.server_deps
def test_a_chat_model_is_fine_tuned_once_per_cache_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncsync.testing import TINY_MODEL_CACHE_ENV, _chat

    tuned: list[int] = []

    def fine_tune(model: object, examples: list[object], checks: list[object], seed: int) -> int:
        tuned.append(seed)  # the real one takes a minute; what is cached is tested here
        return 0

    monkeypatch.setattr(_chat, "_fine_tune", fine_tune)
    monkeypatch.setenv(TINY_MODEL_CACHE_ENV, str(tmp_path / "cache"))
    a = make_tiny_model(tmp_path / "a", seed=5, chat_template=True)
    b = make_tiny_model(tmp_path / "b", seed=5, chat_template=True)
    assert tuned == [5]  # the second is a copy
    assert _digest(a / "model.safetensors") == _digest(b / "model.safetensors")
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    make_tiny_model(tmp_path / "c", seed=6, chat_template=True)
    make_tiny_model(tmp_path / "d", seed=5, chat_template=True, num_hidden_layers=1)
    assert tuned == [5, 6, 5]  # another seed, another config: built
    assert len(list((tmp_path / "cache").iterdir())) == 3  # no staging directory left
    monkeypatch.delenv(TINY_MODEL_CACHE_ENV)
    make_tiny_model(tmp_path / "e", seed=5, chat_template=True)
    assert tuned == [5, 6, 5, 5]  # no cache without the variable


@pytest.mark.server_deps
def test_a_chat_model_that_has_not_learned_is_an_error_not_a_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncsync.testing import TINY_MODEL_CACHE_ENV, ChatModelError, _chat

    monkeypatch.setattr(_chat, "_SFT_MAX_STEPS", 2)
    monkeypatch.setattr(_chat, "_SFT_CHECK_EVERY", 1)
    monkeypatch.setenv(TINY_MODEL_CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(
        ChatModelError, match=r"after 2 steps .* probability 0\.\d+ \(needed 0\.9\)"
    ):
        make_tiny_model(tmp_path / "m", seed=0, chat_template=True)
    assert not (tmp_path / "m" / "model.safetensors").exists()
    assert not list((tmp_path / "cache").glob("tiny-chat-*"))  # nothing cached either
