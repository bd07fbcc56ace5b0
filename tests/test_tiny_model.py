"""make_tiny_model: deterministic, transformers-compatible, no downloads."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from asyncsync.testing import TINY_MODEL_CONFIG, make_tiny_model, reference_greedy


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
