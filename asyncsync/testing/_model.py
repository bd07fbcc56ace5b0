"""A tiny, deterministic Qwen2 causal LM built locally (no downloads).

The model is small enough that a real vLLM-CPU server loads it in seconds, and it is
initialised with a spread large enough that greedy decoding has clear winners, so that
vLLM and transformers agree token for token in float32.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["TINY_MODEL_CONFIG", "make_tiny_model", "reference_greedy", "reference_logprobs"]

#: Architecture of the tiny model (Qwen2 family, fp32, untied embeddings, head_dim 64).
TINY_MODEL_CONFIG: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    # A wide init gives large logit gaps, so greedy argmax is robust to the tiny
    # numeric differences between vLLM's CPU kernels and transformers.
    "initializer_range": 0.25,
}

_SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|endoftext|>"]

# A fixed corpus for training the byte-level BPE: deterministic, and large enough to
# yield the merges needed for a 512-entry vocabulary.
_CORPUS = (
    "the policy gradient trainer publishes weights to every server of the fleet and "
    "generates tokens with logprobs while the reward model scores each rollout "
    "asynchronous reinforcement learning keeps samples tagged with the weight version "
    "shared memory buffers carry tensors from the trainer process to the inference "
    "engine a tool call returns an observation that the agent appends to its "
    "trajectory numbers 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 42 100 "
    "256 512 1024 hello world python asyncio await event loop thread executor "
    "coroutine future task alpha beta gamma delta epsilon zeta eta theta iota kappa "
    "lambda mu nu xi omicron pi rho sigma tau upsilon phi chi psi omega red green "
    "blue yellow black white orange monday tuesday wednesday thursday friday saturday "
    "sunday january february march"
)
_CORPUS_WORDS = _CORPUS.split()


def _build_tokenizer(vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Permutations of the corpus give enough distinct pairs for all merges.
    lines = [" ".join(_CORPUS_WORDS[i:] + _CORPUS_WORDS[:i]) for i in range(len(_CORPUS_WORDS))]
    tok.train_from_iterator(lines, trainer=trainer)
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        # Every id the model can emit must decode: pad the vocabulary with named tokens.
        tok.add_tokens([f"<|extra_{i}|>" for i in range(missing)])
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"tiny tokenizer has {tok.get_vocab_size()} entries, expected {vocab_size}"
        )
    return tok


def make_tiny_model(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    tokenizer: bool = True,
    **overrides: Any,
) -> Path:
    """Write a tiny, deterministic, transformers-compatible Qwen2 causal LM to ``path``.

    The same ``seed`` (and overrides) always gives byte-identical weight files. With
    ``tokenizer=True`` a small byte-level BPE tokenizer (built locally with the
    ``tokenizers`` library) is saved beside it, so ``/v1/completions`` works; without it,
    serve the model token-only (``--skip-tokenizer-init``).

    ``overrides`` replace entries of :data:`TINY_MODEL_CONFIG` (e.g. ``hidden_size=512``
    for a larger model in benchmarks). Requires ``torch`` and ``transformers``
    (the ``asyncsync[server]`` extra).

    Returns the model directory as a :class:`~pathlib.Path`.
    """
    unknown = set(overrides) - set(TINY_MODEL_CONFIG)
    if unknown:
        raise TypeError(f"make_tiny_model: unknown config overrides {sorted(unknown)}")
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = {**TINY_MODEL_CONFIG, **overrides}
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)

    config = Qwen2Config(**cfg)
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        with torch.device("cpu"):
            model = Qwen2ForCausalLM(config).to(torch.float32)
    finally:
        torch.random.set_rng_state(generator_state)
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)

    if tokenizer:
        from transformers import PreTrainedTokenizerFast

        tok = _build_tokenizer(int(cfg["vocab_size"]))
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token="<|bos|>",
            eos_token="<|endoftext|>",
            pad_token="<|pad|>",
            model_max_length=int(cfg["max_position_embeddings"]),
        )
        fast.save_pretrained(out)
    return out


def _load(model_dir: str | os.PathLike[str] | Any) -> Any:
    if isinstance(model_dir, str | os.PathLike):
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    else:
        model = model_dir
    model.eval()
    return model


def reference_greedy(
    model_or_dir: str | os.PathLike[str] | Any,
    prompt_token_ids: Sequence[int],
    max_new_tokens: int,
) -> list[int]:
    """Greedy decoding with transformers (argmax, EOS ignored): the ground truth that a
    vLLM server serving the same weights must reproduce token for token."""
    import torch

    model = _load(model_or_dir)
    ids = torch.tensor([list(prompt_token_ids)], dtype=torch.long)
    out: list[int] = []
    # transformers renamed the KV cache argument and output field (``past_key_values`` ->
    # ``cache``, warning from 5.2x); use the name this version's forward takes.
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        past = None
        step_input = ids
        for _ in range(max_new_tokens):
            result = model(input_ids=step_input, use_cache=True, **{key: past})
            past = getattr(result, key)
            next_id = int(result.logits[0, -1].argmax())
            out.append(next_id)
            step_input = torch.tensor([[next_id]], dtype=torch.long)
    return out


def reference_logprobs(
    model_or_dir: str | os.PathLike[str] | Any,
    token_ids: Sequence[int],
) -> list[float | None]:
    """Per-position log-probability of each token given its prefix (position 0: None)."""
    import torch

    model = _load(model_or_dir)
    ids = torch.tensor([list(token_ids)], dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].to(torch.float64)
    logp = torch.log_softmax(logits, dim=-1)
    return [None] + [float(logp[pos - 1, token_ids[pos]]) for pos in range(1, len(token_ids))]
