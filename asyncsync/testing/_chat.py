"""A tiny model that chats: a ChatML-style template with hermes tool calls, and a few
steps of supervised fine-tuning that teach it one tool call.

`make_tiny_model(..., chat_template=True)` calls `add_chat` after building the
model: the tokenizer gets ``<|im_start|>``/``<|im_end|>`` (the end of a turn, and the
model's EOS), ``tokenizer_config.json`` gets `CHAT_TEMPLATE`, and the weights are
fine-tuned (seeded and deterministic on one machine, but landing elsewhere on another
instruction set, so trained until a margin is reached) so that greedy decoding

- answers a user turn with a call of `WEATHER_TOOL`: `TOOL_CALL_TEXT` (its arguments
  compact JSON: the template re-renders them with spaces, so the sampled text and its
  re-rendering differ, as they do for real models), and
- answers the tool's result with `ANSWER_TEXT`,
- answers `LONG_QUESTION` asked without tools with `LONG_TEXT`, a sentence repeated (a
  turn of hundreds of tokens, for streaming: cut it with ``max_tokens``),

whatever the system prompt and the tool descriptions say. A vLLM server started with
``--enable-auto-tool-choice --tool-call-parser hermes`` parses the call
(``LocalVLLMServer(tool_call_parser="hermes")``).
"""

from __future__ import annotations

import json
import logging
import random
from typing import Any

from asyncsync._core.errors import AsyncSyncError

__all__ = [
    "ANSWER_TEXT",
    "CHAT_MARKUP_TOKENS",
    "CHAT_SPECIAL_TOKENS",
    "CHAT_TEMPLATE",
    "LONG_QUESTION",
    "LONG_TEXT",
    "THINKING_CHAT_TEMPLATE",
    "TOOL_CALL_TEXT",
    "WEATHER_TOOL",
    "ChatModelError",
    "add_chat",
    "chat_corpus",
]

logger = logging.getLogger("asyncsync.testing")

#: The chat model's extra special tokens: a turn opens with the first and ends with the
#: second (the model's EOS).
CHAT_SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>")

#: Markup the chat model's tokenizer holds as one token each (plain text, not special:
#: they decode into the text the tool parser reads), as real hermes models do.
CHAT_MARKUP_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

#: The one tool the chat model calls (OpenAI's ``tools`` shape).
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}

#: The same tool as openai-agents' ``function_tool`` describes it (strict JSON schema).
_STRICT_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "properties": {"city": {"title": "City", "type": "string"}},
            "required": ["city"],
            "title": "get_weather_args",
            "type": "object",
            "additionalProperties": False,
        },
        "strict": True,
    },
}

#: What the model samples for a user turn: the hermes envelope exactly as vLLM's hermes
#: structural tag enforces it for ``strict`` tools (openai-agents' default), the
#: arguments as compact JSON, which the template re-renders with spaces: the sampled text
#: and its re-rendering differ, as they do for real models.
TOOL_CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>'
#: What the model samples after the tool's result.
ANSWER_TEXT = "It is sunny in Paris."
#: A question the model answers at length when it comes without tools.
LONG_QUESTION = "Describe the weather in Paris at length."
#: Its answer: one sentence over and over (a periodic text the tiny model learns to go on
#: with; a turn of it is as long as its ``max_tokens``).
LONG_TEXT = "The sun is out over Paris and the sky is clear. " * 40
#: How many tokens of `LONG_TEXT` the fine-tuning teaches (the model goes on with the
#: period after them).
_LONG_TOKENS = 280


def _template(think: bool) -> str:
    """ChatML with hermes tool calls (Qwen2.5's layout). Every newline is written out
    (``'\\n'`` in a string), none comes from the template's own layout: Jinja's
    whitespace control is easy to get wrong. With ``think``, assistant turns after the
    last user turn open with an empty ``<think>`` block and earlier ones do not (as
    Qwen3's template strips earlier reasoning): the render of a conversation is then
    not an extension of the render of its beginning once a new user turn arrives."""
    head = (
        "{% set ns = namespace(last_user=-1) %}"
        "{% for m in messages %}{% if m.role == 'user' %}"
        "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
        "{% if tools %}{{ '<|im_start|>system\\n' }}"
        "{% if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{% endif %}"
        "{{ '# Tools\\n<tools>' }}"
        "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
        '{{ \'\\n</tools>\\nCall one with <tool_call>\\n{"name": ..., "arguments": ...}'
        "\\n</tool_call><|im_end|>\\n' }}"
        "{% elif messages[0].role == 'system' %}"
        "{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
        "{% endif %}"
    )
    thinking = (
        "{% if loop.index0 > ns.last_user %}{{ '\\n<think>\\n\\n</think>\\n' }}{% endif %}"
        if think
        else ""
    )
    body = (
        "{% for message in messages %}"
        "{% if message.role == 'system' and loop.first %}"
        "{% elif message.role == 'user' or message.role == 'system' %}"
        "{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
        "{% elif message.role == 'assistant' %}{{ '<|im_start|>assistant' }}" + thinking + ""
        "{% if message.content %}{{ '\\n' + message.content }}{% endif %}"
        "{% for call in message.tool_calls or [] %}"
        "{% set f = call.function if call.function is defined else call %}"
        '{{ \'\\n<tool_call>\\n{"name": "\' + f.name + \'", "arguments": \' }}'
        "{{ (f.arguments if f.arguments is string else (f.arguments | tojson)) + '}' }}"
        "{{ '\\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\\n' }}"
        "{% elif message.role == 'tool' %}"
        "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
        "{{ '<|im_start|>user' }}{% endif %}"
        "{{ '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
        "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
        "{{ '<|im_end|>\\n' }}{% endif %}"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    return head + body


#: The chat model's template: ChatML with hermes ``<tool_call>`` JSON, tool results as
#: ``<tool_response>`` in a user turn.
CHAT_TEMPLATE = _template(think=False)
#: The same with an empty ``<think>`` block on assistant turns after the last user turn
#: only: not prefix-stable across a new user turn (pass it per request with
#: ``chat_template=`` to a server started with ``--trust-request-chat-template``).
THINKING_CHAT_TEMPLATE = _template(think=True)


def chat_corpus() -> list[str]:
    """Lines added to the tokenizer's training corpus of a chat model, so that the
    template's markup and JSON take few tokens."""
    return [
        json.dumps(WEATHER_TOOL),
        json.dumps(_STRICT_TOOL),
        TOOL_CALL_TEXT,
        ANSWER_TEXT,
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        "<tool_response>\n</tool_response> # Tools\n<tools>\n</tools>",
        '{"type": "function", "function": {"name": "description": "parameters": '
        '"properties": "required": "string" "object" "strict": true false null}}',
        "What is the weather in Paris? You are a helpful assistant.",
        LONG_QUESTION,
        LONG_TEXT[:200],
    ]


#: Words the training conversations' varying parts are drawn from.
_WORDS = (  # noqa: SIM905 - a sentence reads better than a list of words
    "the agent calls tools and answers questions about the weather in a city you are a "
    "helpful assistant reply briefly use the tool when asked be precise policy trainer "
    "python asyncio weights server fleet"
).split()

#: Fine-tuning: Adam at `_SFT_LR`, decayed linearly to zero over `_SFT_MAX_STEPS`
#: steps of `_SFT_BATCH` examples drawn from the training ones and `_check_examples`
#: (the conversations the tests use: checked without being trained on, one of them
#: stayed at 0.05 on an Intel AVX-512-FP16 CPU), the gradient's norm clipped to
#: `_SFT_CLIP` (without it the loss spiked and some seeds missed the margin), stopped as
#: soon as every target token of every one of them has probability at least
#: `_SFT_MIN_PROB` (checked every `_SFT_CHECK_EVERY` steps). A fixed number of steps at
#: a fixed rate is not enough: the float kernels differ between CPUs (AVX2 / AVX-512),
#: so the same seeded run lands elsewhere on each, and at a rate of 1e-2 it was seen to
#: land where greedy decoding no longer called the tool. A margin this wide also keeps
#: vLLM's kernels, which sum in another order than transformers', on the same tokens.
_SFT_MAX_STEPS = 800
_SFT_CHECK_EVERY = 50
_SFT_BATCH = 8
_SFT_LR = 3e-3
_SFT_MIN_PROB = 0.9
_SFT_CLIP = 1.0


class ChatModelError(AsyncSyncError, RuntimeError):
    """The chat model's fine-tuning ended without teaching it its turns (the lowest
    probability of a target token is in the message)."""


def _conversations(
    rng: random.Random,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """One training conversation in two prefixes, and its tool: up to the user turn (the
    model calls the tool next) and up to the tool's result (the model answers next).
    System prompt, tool description and question vary, so that only the shape decides;
    the assistant's call comes back with its arguments as an object (the template
    re-renders them with spaces) or as the compact string that was sampled (an agent
    echoing the message as it came), as it does in a session."""

    def words(lo: int, hi: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(lo, hi)))

    tool = json.loads(json.dumps(rng.choice((WEATHER_TOOL, _STRICT_TOOL))))
    tool["function"]["description"] = rng.choice((words(2, 8), "The weather in a city."))
    first: list[dict[str, Any]] = []
    if rng.random() < 0.7:
        first.append({"role": "system", "content": words(3, 12)})
    question = "What is the weather in Paris?"
    if rng.random() < 0.5:
        question = f"{words(1, 5)} {question}"
    first.append({"role": "user", "content": question})
    tool_result = rng.choice(["sunny", "sunny, 21 C", words(1, 4)])
    return first, _second(first, tool_result, compact=rng.random() < 0.5), tool


def _second(
    first: list[dict[str, Any]], tool_result: str, *, compact: bool
) -> list[dict[str, Any]]:
    """``first`` followed by the model's tool call and the tool's result."""
    arguments: Any = '{"city":"Paris"}' if compact else {"city": "Paris"}
    call = {"name": "get_weather", "arguments": arguments}
    calls = [{"type": "function", "function": call}]
    return [
        *first,
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "content": tool_result},
    ]


def _render(tokenizer: Any, messages: list[dict[str, Any]], tool: dict[str, Any]) -> list[int]:
    prompt = tokenizer.apply_chat_template(
        messages, tools=[tool], add_generation_prompt=True, tokenize=True
    )
    prompt = list(getattr(prompt, "input_ids", prompt))
    if isinstance(prompt[0], list):  # a batch of one
        prompt = prompt[0]
    return [int(i) for i in prompt]


def _targets(tokenizer: Any) -> tuple[list[int], list[int]]:
    call_ids = tokenizer.encode(TOOL_CALL_TEXT + "<|im_end|>", add_special_tokens=False)
    answer_ids = tokenizer.encode(ANSWER_TEXT + "<|im_end|>", add_special_tokens=False)
    return list(call_ids), list(answer_ids)


def _long_target(tokenizer: Any) -> list[int]:
    return list(tokenizer.encode(LONG_TEXT, add_special_tokens=False))[:_LONG_TOKENS]


def _long_prompt(tokenizer: Any, system: str | None) -> list[int]:
    messages = [{"role": "user", "content": LONG_QUESTION}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(getattr(prompt, "input_ids", prompt))
    return [int(i) for i in (prompt[0] if isinstance(prompt[0], list) else prompt)]


def _examples(tokenizer: Any, count: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, target ids) pairs rendered with `CHAT_TEMPLATE`; one in eight is the
    long answer to `LONG_QUESTION` without tools."""
    rng = random.Random(seed)
    call_ids, answer_ids = _targets(tokenizer)
    long_ids = _long_target(tokenizer)
    out: list[tuple[list[int], list[int]]] = []
    conversations = 0
    while len(out) < count:
        first, second, tool = _conversations(rng)
        out.append((_render(tokenizer, first, tool), call_ids))
        out.append((_render(tokenizer, second, tool), answer_ids))
        conversations += 1
        if conversations % 4 == 0:
            system = rng.choice([None, " ".join(rng.choice(_WORDS) for _ in range(6))])
            out.append((_long_prompt(tokenizer, system), long_ids))
    return out


def _check_examples(tokenizer: Any) -> list[tuple[list[int], list[int]]]:
    """The conversations the tests and examples hold the model to: the plain question
    with `WEATHER_TOOL`, and openai-agents' shape (its instructions as the system prompt,
    the strict tool), each turn with the call echoed both ways."""
    call_ids, answer_ids = _targets(tokenizer)
    question = {"role": "user", "content": "What is the weather in Paris?"}
    system = {"role": "system", "content": "You are a helpful assistant."}
    out: list[tuple[list[int], list[int]]] = []
    for first, tool in (([question], WEATHER_TOOL), ([system, question], _STRICT_TOOL)):
        out.append((_render(tokenizer, first, tool), call_ids))
        out.extend(
            (_render(tokenizer, _second(first, "sunny", compact=compact), tool), answer_ids)
            for compact in (False, True)
        )
    out.append((_long_prompt(tokenizer, None), _long_target(tokenizer)))
    return out


def _lowest_target_probability(model: Any, examples: list[tuple[list[int], list[int]]]) -> float:
    """The lowest probability the model gives a target token of any example (teacher
    forcing, in batches padded at the end, which a causal model does not see): above
    one half, greedy decoding samples every target."""
    import torch

    lowest = 1.0
    with torch.no_grad():
        for start in range(0, len(examples), 32):
            batch = examples[start : start + 32]
            width = max(len(p) + len(t) for p, t in batch)
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            for row, (prompt, target) in enumerate(batch):
                ids[row, : len(prompt) + len(target)] = torch.tensor(prompt + target)
            probs = model(input_ids=ids).logits.float().softmax(-1)
            for row, (prompt, target) in enumerate(batch):
                at = torch.arange(len(prompt) - 1, len(prompt) + len(target) - 1)
                lowest = min(lowest, float(probs[row, at, torch.tensor(target)].min()))
    return lowest


def _fine_tune(
    model: Any, examples: list[tuple[list[int], list[int]]],
    checks: list[tuple[list[int], list[int]]], seed: int,
) -> int:  # fmt: skip
    """Supervised fine-tuning on the targets only (loss masked on the prompts), until
    every target token of ``examples`` and ``checks`` is sampled with a wide margin;
    returns the number of steps. Raises `ChatModelError` when the margin is not reached."""
    import torch

    rng = random.Random(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=_SFT_LR)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / _SFT_MAX_STEPS)
    lowest = 0.0
    pool = examples + checks
    for step in range(1, _SFT_MAX_STEPS + 1):
        model.train()
        batch = rng.sample(pool, min(_SFT_BATCH, len(pool)))
        width = max(len(p) + len(t) for p, t in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        for row, (prompt, target) in enumerate(batch):
            seq = prompt + target
            ids[row, : len(seq)] = torch.tensor(seq)
            labels[row, len(prompt) : len(seq)] = torch.tensor(target)
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), _SFT_CLIP)
        optimizer.step()
        schedule.step()
        if step % _SFT_CHECK_EVERY == 0 or step == _SFT_MAX_STEPS:
            model.eval()
            lowest = _lowest_target_probability(model, pool)
            if lowest >= _SFT_MIN_PROB:
                return step
    raise ChatModelError(
        f"fine-tuning the tiny chat model did not converge: after {_SFT_MAX_STEPS} steps the "
        f"least likely target token has probability {lowest:.3f} (needed {_SFT_MIN_PROB}); "
        "greedy decoding would not reliably call the tool"
    )


def add_chat(model: Any, tokenizer: Any, seed: int) -> Any:
    """Give ``tokenizer`` the chat template and teach ``model`` the tool call; returns
    the fine-tuned model (the caller saves both)."""
    tokenizer.chat_template = CHAT_TEMPLATE
    examples = _examples(tokenizer, 96, seed)
    checks = _check_examples(tokenizer)
    import torch

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # the same result on every machine of a kind, and no
        steps = _fine_tune(model, examples, checks, seed)  # fight with servers for the cores
    finally:
        torch.set_num_threads(threads)
    logger.info("the tiny chat model learned its turns in %d fine-tuning steps", steps)
    return model
