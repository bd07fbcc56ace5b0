"""Weight integrity: after a round, check what the servers hold against the trainer.

Two methods, each opt-in (``publish(..., verify=...)``, ``publisher.verify(...)``):

- **checksum**: vLLM's ``/weight_checker`` (``{"action": "checksum"}``, vLLM >= 0.32)
  answers a SHA-256 of every parameter of the served model as it sits in memory
  (``dp0:pp0:pcp0:tp0:<name>``). The trainer hashes the same bytes as it publishes
  them (in the worker thread, as they are packed): each tensor in the served dtype, and
  vLLM's fused ``qkv_proj`` (q, k, v) and ``gate_up_proj`` (gate, up) as the
  concatenation of their parts. A parameter whose two digests differ is a mismatch. A
  parameter the server reports under no name the trainer can build, or whose bytes the
  server does not keep (vLLM-CPU replaces a prepacked linear layer's weight by an empty
  tensor: its digest is that of no bytes), is *unseen*: the checksum says nothing of it.
- **probe**: a few fixed prompts are generated greedily on every server (with the
  sampled tokens' logprobs) and scored by the trainer's own forward pass over the
  prompt and the server's tokens: every server token must be the trainer's greedy
  choice (within ``atol`` of its best logprob, so near-ties do not fail) and its
  logprob must equal the trainer's within ``atol``. It sees every parameter that
  influences those prompts, whatever the server's memory layout.

docs/publishing.md says which parameters each method sees on vLLM-CPU.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from asyncsync._core.errors import (
    AsyncSyncError,
    FleetError,
    UnsupportedVLLMError,
    WeightMismatchError,
)
from asyncsync._core.types import CallOutcome
from asyncsync._publish.weights import WeightsLike
from asyncsync.backends.contract import WeightSource

if TYPE_CHECKING:
    from concurrent.futures import Executor

    import torch

    from asyncsync._core.completion import Completion
    from asyncsync.fleet import Fleet

__all__ = [
    "DEFAULT_PROBE_PROMPTS",
    "EMPTY_DIGEST",
    "FUSED_PARAMETERS",
    "DigestTap",
    "Probe",
    "TrainerDigests",
    "Verify",
    "VerifyLike",
    "VerifyResult",
    "as_verify",
    "compare_checksums",
    "score_probe",
    "verify_servers",
]

#: Logits of every position for a list of token ids: ``fn(ids) -> Tensor[len(ids), vocab]``
#: (or a causal-LM module, called as ``module(input_ids=...)``).
Probe = Any
#: The prompts a probe generates from: short id sequences, valid in any vocabulary of
#: 256 ids or more (pass your own through ``Verify(prompts=...)``).
DEFAULT_PROBE_PROMPTS: tuple[tuple[int, ...], ...] = (
    (1, 17, 42, 99, 123, 7),
    (1, 200, 3, 64),
    (5, 250, 31, 8, 100, 12, 77),
)

#: The digest vLLM reports for a parameter that holds no bytes.
EMPTY_DIGEST = hashlib.sha256(b"").hexdigest()

#: vLLM's fused parameters: the fused module's name -> its parts, in the order they are
#: concatenated along dim 0 (``packed_modules_mapping`` of vLLM's decoder models).
FUSED_PARAMETERS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


@dataclass(frozen=True)
class Verify:
    """What to check after a round (``publish(..., verify=Verify(...))``); each
    server's answer is a `VerifyResult`.

    Args:
        checksum: compare vLLM's ``/weight_checker`` checksums with the trainer's
            digests of what it published (vLLM >= 0.32).
        probe: the trainer's model, to score greedy generations of ``prompts``: a
            causal-LM ``torch.nn.Module`` (called as ``module(input_ids=ids)``, its
            ``.logits`` or its output used; put in eval mode while it runs) or a
            function ``fn(token_ids) -> logits`` of shape ``[len(token_ids), vocab]``.
            ``verify="probe"`` uses the published module itself.
        prompts: the probe's prompts (token ids).
        max_tokens: tokens generated per prompt.
        atol: tolerance on logprobs: a server token within ``atol`` of the trainer's
            best is accepted as its greedy choice, and the server's logprob of it must
            be within ``atol`` of the trainer's. Raise it for bf16 servers.
        dtype: the dtype the servers hold the weights in, for checksums (default: each
            tensor's own dtype; vLLM casts what it loads to its ``--dtype``).
    """

    checksum: bool = False
    probe: Probe | None = None
    prompts: Sequence[Sequence[int]] = DEFAULT_PROBE_PROMPTS
    max_tokens: int = 4
    atol: float = 1e-2
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if not self.checksum and self.probe is None:
            raise ValueError("Verify needs checksum=True, a probe, or both")
        if self.probe is not None and not callable(self.probe):
            raise TypeError(f"Verify(probe=...) must be callable, got {type(self.probe).__name__}")
        if self.max_tokens < 1:
            raise ValueError(f"Verify(max_tokens=...) must be >= 1, got {self.max_tokens}")
        if not self.prompts or not all(self.prompts):
            raise ValueError("Verify(prompts=...) needs at least one non-empty prompt")
        if not self.atol >= 0:
            raise ValueError(f"Verify(atol=...) must be >= 0, got {self.atol}")


#: What ``publish(verify=...)`` takes.
VerifyLike = Literal["checksum", "probe"] | Verify


def as_verify(verify: VerifyLike | None, weights: WeightsLike) -> Verify | None:
    """``publish(verify=...)`` as a `Verify`: ``"checksum"``, ``"probe"`` (the
    published module scores the probe) or a ``Verify``; ValueError/TypeError before
    anything is sent."""
    if verify is None or isinstance(verify, Verify):
        return verify
    if verify == "checksum":
        return Verify(checksum=True)
    if verify == "probe":
        if not callable(getattr(weights, "named_parameters", None)) or not callable(weights):
            raise ValueError(
                "verify='probe' needs the weights to be the model itself (a torch module); "
                "pass verify=Verify(probe=model_or_function) otherwise"
            )
        return Verify(probe=weights)
    raise ValueError(f"verify must be None, 'checksum', 'probe' or a Verify, got {verify!r}")


# --------------------------------------------------------------------------- checksum
def _digest(tensor: torch.Tensor, dtype: torch.dtype | None) -> hashlib._Hash:
    """SHA-256 of the tensor's bytes as vLLM hashes a parameter (contiguous, row-major),
    in ``dtype`` when given."""
    import torch

    t = tensor.detach()
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    flat = t.cpu().contiguous().view(-1).view(torch.uint8)
    return hashlib.sha256(flat.numpy())


def _fused_name(name: str) -> tuple[str, int, int] | None:
    """``(fused name, index of this part, number of parts)`` when ``name`` is a part of a
    fused vLLM parameter (``...self_attn.k_proj.weight`` -> ``...qkv_proj.weight``)."""
    parts = name.split(".")
    if len(parts) < 2:
        return None
    for fused, members in FUSED_PARAMETERS.items():
        if parts[-2] in members:
            fused_name = ".".join([*parts[:-2], fused, parts[-1]])
            return fused_name, members.index(parts[-2]), len(members)
    return None


@dataclass
class _FusedDigest:
    """The digest of a fused parameter, fed with its parts in their order (a part that
    comes early is kept until the ones before it came)."""

    count: int
    hasher: Any = field(default_factory=hashlib.sha256)
    next_part: int = 0
    early: dict[int, bytes] = field(default_factory=dict)

    def add(self, index: int, data: bytes) -> None:
        self.early[index] = data
        while self.next_part in self.early:
            self.hasher.update(self.early.pop(self.next_part))
            self.next_part += 1

    @property
    def complete(self) -> bool:
        return self.next_part == self.count


class TrainerDigests:
    """The trainer's digests of the tensors it published, by the server's names."""

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        self.dtype = dtype
        self.digests: dict[str, str] = {}
        self._fused: dict[str, _FusedDigest] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        import torch

        digest = _digest(tensor, self.dtype)
        self.digests[name] = digest.hexdigest()
        fused = _fused_name(name)
        if fused is not None:
            fused_name, index, count = fused
            t = tensor.detach()
            if self.dtype is not None and t.dtype != self.dtype:
                t = t.to(self.dtype)
            data = t.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            self._fused.setdefault(fused_name, _FusedDigest(count)).add(index, data)

    def expected(self) -> dict[str, str]:
        """Every digest the trainer can vouch for: each tensor, each complete fusion."""
        out = dict(self.digests)
        for name, fused in self._fused.items():
            if fused.complete:
                out[name] = fused.hasher.hexdigest()
        return out


class DigestTap(WeightSource):
    """A source whose tensors are hashed as they are produced (in the worker thread),
    so that one-shot streams and factories can be verified too."""

    def __init__(self, source: WeightSource, digests: TrainerDigests) -> None:
        super().__init__(source.weights)
        self._source = source
        self.digests = digests

    @property
    def reiterable(self) -> bool:
        return self._source.reiterable

    def metadata(self) -> Any:
        return self._source.metadata()

    def __iter__(self) -> Iterator[Any]:
        for name, tensor in self._source:
            full = getattr(tensor, "full_tensor", None)
            materialized = full() if callable(full) else tensor
            self.digests.add(name, materialized)
            yield name, materialized


def _parameter_name(key: str) -> str:
    """``dp0:pp0:pcp0:tp0:model.norm.weight`` -> ``model.norm.weight``."""
    return key.rsplit(":", 1)[-1]


@dataclass
class VerifyResult:
    """What verification found on one server: the result of a `Verify` request
    (``PublishReport.verified``, `AsyncWeightPublisher.verify`). Was ``Verification``
    before 0.2.0.

    Attributes:
        url: the server.
        checked: parameters whose checksum equals the trainer's digest.
        unseen: parameters the checksum cannot vouch for (the server keeps no bytes of
            them, or under a name the trainer cannot build).
        mismatched: parameters whose checksum differs from the trainer's digest.
        prompts: probe prompts whose generation the trainer's forward pass confirmed.
        problems: what did not match, one line each (empty: verified).
    """

    url: str
    checked: list[str] = field(default_factory=list)
    unseen: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    prompts: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def error(self) -> WeightMismatchError:
        return WeightMismatchError(
            "weights differ from the trainer's: " + "; ".join(self.problems),
            server=self.url,
            mismatched=tuple(self.mismatched),
        )


def compare_checksums(
    result: VerifyResult, checksums: Mapping[str, str], expected: Mapping[str, str]
) -> None:
    """Compare one server's ``/weight_checker`` checksums with the trainer's digests.

    Every worker reports its own parameters (``dp<i>:pp<j>:pcp<k>:tp<l>:<name>``).
    Across tensor-parallel ranks a parameter is either replicated (the same bytes
    everywhere: compared) or sharded (a digest per shard, which the trainer, hashing
    whole tensors, cannot vouch for: unseen unless every digest equals the trainer's).
    Data-parallel replicas of a parameter must all match.
    """
    by_name: dict[str, set[tuple[str, str]]] = {}
    for key, digest in checksums.items():
        prefix = key.rsplit(":", 1)[0] if ":" in key else ""
        tp = next((p for p in prefix.split(":") if p.startswith("tp")), "")
        by_name.setdefault(_parameter_name(key), set()).add((tp, digest))
    for name, found in sorted(by_name.items()):
        want = expected.get(name)
        digests = {digest for _tp, digest in found}
        sharded = len({tp for tp, _digest in found}) > 1 and digests != {want}
        if want is None or EMPTY_DIGEST in digests or sharded:
            result.unseen.append(name)
        elif digests == {want}:
            result.checked.append(name)
        else:
            result.mismatched.append(name)
    result.unseen.extend(n for n in expected if n not in by_name and _fused_name(n) is None)
    if result.mismatched:
        shown = ", ".join(result.mismatched[:5])
        more = len(result.mismatched) - 5
        result.problems.append(
            f"checksum differs for {len(result.mismatched)} parameter(s): {shown}"
            + (f" and {more} more" if more > 0 else "")
        )
    elif not result.checked:
        result.problems.append(
            "no parameter's checksum could be compared (every one is unseen): "
            "use verify='probe' for this server"
        )


# --------------------------------------------------------------------------- probe
def _logits(probe: Probe, ids: list[int]) -> torch.Tensor:
    """The probe's logits for ``ids``: ``[len(ids), vocab]``."""
    import torch

    with torch.no_grad():
        if isinstance(probe, torch.nn.Module):
            was_training = probe.training
            probe.eval()
            try:
                device = next(probe.parameters()).device
                out = probe(input_ids=torch.tensor([ids], device=device))
            finally:
                probe.train(was_training)
            logits = getattr(out, "logits", out)
            return logits[0].detach().to("cpu", torch.float64)
        return torch.as_tensor(probe(list(ids))).detach().to("cpu", torch.float64)


def score_probe(
    result: VerifyResult,
    probe: Probe | Callable[[list[int]], Any],
    prompt_index: int,
    prompt: Sequence[int],
    completion: Completion,
    atol: float,
) -> None:
    """Score one server generation of ``prompt`` with the trainer's forward pass (in
    the worker thread: the forward pass is the trainer's compute)."""
    import torch

    tokens = list(completion.token_ids)
    ids = [*prompt, *tokens]
    logp = torch.log_softmax(_logits(probe, ids), dim=-1)
    if logp.shape[0] != len(ids):
        raise ValueError(
            f"the probe returned logits for {logp.shape[0]} positions; {len(ids)} were given"
        )
    for i, token in enumerate(tokens):
        row = logp[len(prompt) - 1 + i]
        best = int(row.argmax())
        if float(row[token]) < float(row[best]) - atol:
            result.problems.append(
                f"probe prompt {prompt_index}, token {i}: the server chose {token} "
                f"(trainer logprob {float(row[token]):.4f}) where the trainer's greedy "
                f"choice is {best} ({float(row[best]):.4f})"
            )
            return
        got = completion.logprobs[i] if completion.logprobs is not None else None
        if got is not None and abs(got - float(row[token])) > atol:
            result.problems.append(
                f"probe prompt {prompt_index}, token {i}: the server's logprob of "
                f"{token} is {got:.4f}, the trainer's {float(row[token]):.4f}"
            )
            return
    result.prompts += 1


# --------------------------------------------------------------------------- servers
async def verify_servers(
    fleet: Fleet,
    targets: Sequence[str],
    verify: Verify,
    expected: Mapping[str, str],
    executor: Executor,
) -> dict[str, VerifyResult | Exception]:
    """Check every target at once: a `VerifyResult` per server, or the error
    that kept it from being checked (no ``/weight_checker``, no answer...)."""

    async def one(url: str) -> VerifyResult | Exception:
        result = VerifyResult(url)
        if url not in fleet:
            return AsyncSyncError("removed from the fleet", server=url)
        try:
            if verify.checksum:
                checksums = await fleet.client(url).weight_checksums()
                compare_checksums(result, checksums, expected)
            if verify.probe is not None:
                await _probe(fleet, url, verify, result, executor)
        except AsyncSyncError as exc:
            return exc
        return result

    async with asyncio.TaskGroup() as group:
        tasks = {
            url: group.create_task(one(url), name=f"asyncsync:verify:{url}") for url in targets
        }
    return {url: task.result() for url, task in tasks.items()}


async def _probe(
    fleet: Fleet, url: str, verify: Verify, result: VerifyResult, executor: Executor
) -> None:
    """Greedy generations of every prompt on ``url``, scored in the worker thread."""
    loop = asyncio.get_running_loop()
    client = fleet.client(url)
    for index, prompt in enumerate(verify.prompts):
        completion = await client.generate(
            list(prompt),
            max_tokens=verify.max_tokens,
            temperature=0.0,
            ignore_eos=True,
            logprobs=0,
        )
        await loop.run_in_executor(
            executor, score_probe, result, verify.probe, index, prompt, completion, verify.atol
        )
        if not result.ok:
            return


async def check_checksum_route(fleet: Fleet, targets: Sequence[str]) -> None:
    """``/weight_checker`` exists on every target (vLLM >= 0.32), before anything is
    sent: `UnsupportedVLLMError` otherwise."""
    for url in targets:
        client = fleet.client(url)
        protocol = await client.protocol()
        if protocol != "0.32":
            raise UnsupportedVLLMError(
                client.server_state.vllm_version or protocol,
                "/weight_checker (verify='checksum')",
                server=url,
            )


async def verify_now(
    fleet: Fleet, urls: list[str], source: WeightSource, checks: Verify, executor: Executor
) -> dict[str, VerifyResult]:
    """`AsyncWeightPublisher.verify`: the trainer's digests of ``source`` (taken in the
    worker thread), then every server checked; mismatched servers are marked dirty
    before anything is raised, and servers that could not be checked raise one
    `FleetError` carrying every server's result."""
    expected: dict[str, str] = {}
    if checks.checksum:
        await check_checksum_route(fleet, urls)
        digests = TrainerDigests(checks.dtype)
        tap = DigestTap(source, digests)
        await asyncio.get_running_loop().run_in_executor(executor, lambda: [None for _ in tap])
        expected = digests.expected()
    found = await verify_servers(fleet, urls, checks, expected, executor)
    # Every server that does not match is marked first, whatever else failed.
    fleet.mark_dirty([url for url, r in found.items() if isinstance(r, VerifyResult) and not r.ok])
    errors = {url: r for url, r in found.items() if isinstance(r, Exception)}
    if errors:
        raise FleetError(
            f"verify could not check {len(errors)} of {len(found)} server(s): "
            + "; ".join(f"{url}: {err}" for url, err in errors.items()),
            list(errors.values()),
            operation="verify",
            outcomes={
                url: CallOutcome(url, error=r) if isinstance(r, Exception) else CallOutcome(url, r)
                for url, r in found.items()
            },
        )
    return {url: r for url, r in found.items() if isinstance(r, VerifyResult)}
