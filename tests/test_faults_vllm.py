"""Faults produced for real on the session's vLLM-CPU servers (issue 12): a server
frozen with SIGSTOP during a round, a trainer killed with SIGKILL mid-publish."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import asyncsync as az
from asyncsync.backends._segments import leaked_segments, open_segments
from asyncsync.testing import LocalVLLMServer, check_greedy
from tests.calls import CallLog, recording
from tests.conftest import VLLMFleet
from tests.test_shm_lifecycle import mapped_anywhere
from tests.waiting import HANG

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio]

PROMPT = [1, 17, 42, 99, 123, 7]
MAX_TOKENS = 8
#: The servers that are not frozen: deadlines that only catch a hang, so that their
#: answers never race one on a loaded machine.
GENEROUS = az.Timeouts.uniform(HANG)
#: The server to be frozen (its own client): its start, update and finish run under a
#: 10 s update deadline, which ends the frozen call; its answered calls took well under
#: a second under load (printed with each run), far inside it.
FREEZE_TIMEOUTS = az.Timeouts(connect=HANG, control=HANG, update=10, generate=HANG)
#: A server frozen before a round: the round's health probe runs under the control
#: deadline (10 s), which ends the frozen call.
PROBE_FREEZE_TIMEOUTS = az.Timeouts(connect=HANG, control=10, update=10, generate=HANG)
UPDATE_OPS = {"start_weight_update", "update_weights", "finish_weight_update"}


def _original(model_dir: Path) -> dict[str, object]:
    from safetensors.torch import load_file

    return dict(load_file(model_dir / "model.safetensors"))


@contextmanager
def frozen(server: LocalVLLMServer) -> Iterator[None]:
    """SIGSTOP the server's whole process group; SIGCONT on exit, whatever happens."""
    assert server.process is not None
    pgid = os.getpgid(server.process.pid)
    os.killpg(pgid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(pgid, signal.SIGCONT)


async def _greedy(fleet: az.Fleet, url: str) -> list[int]:
    completion = await fleet.client(url).generate(
        PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
    )
    return list(completion.token_ids)


def _print_margin(log: CallLog, url: str) -> None:
    """How long ``url``'s slowest answered update-phase call took, beside its deadline
    (what a slower machine eats into; printed, never asserted)."""
    slowest = log.slowest_answer(url, "update")
    print(f"\nslowest answered update call to {url}: {slowest:.2f} s (deadline 10 s)")


async def _healthy_again(fleet: az.Fleet, url: str) -> None:
    deadline = time.monotonic() + 120
    while True:
        try:
            await fleet.client(url).health()
            return
        except az.AsyncSyncError:
            assert time.monotonic() < deadline, f"{url} never answered /health again"
            await asyncio.sleep(0.2)


@pytest.mark.timeout(300)
async def test_a_frozen_server_is_lost_and_the_fleet_keeps_serving(
    vllm_fleet: VLLMFleet, tiny_model_dir: Path
) -> None:
    """Issue 18's scenario: publish, freeze one of two servers (SIGSTOP), publish again.
    The round runs to the end on the healthy server, waiting one control deadline (the
    frozen server's health probe, before anything is started) and sending the frozen
    server nothing more, and is published there; the frozen one, lost at the round's
    probe, is dirty and out of routing. The fleet keeps serving: every generation goes
    to the healthy server, at once. Thawed, the lost server is caught up by the
    publisher from the round it kept, without a publish (ending first the update its
    queued calls may have opened), and serves again; the next round includes it by
    default; both are exact.

    Only the server to be frozen has short deadlines (its own client): the healthy
    one's calls never race a deadline on a loaded machine. "One deadline" is read from
    the calls that timed out (tests/calls.py), not from the clock."""
    weights = _original(tiny_model_dir)
    healthy, stopped = vllm_fleet.tokenizer_server, vllm_fleet.token_only_server
    async with (
        az.AsyncVLLMClient(stopped.url, timeouts=PROBE_FREEZE_TIMEOUTS) as to_freeze,
        az.Fleet([healthy.url, to_freeze], timeouts=GENEROUS, admission_timeout=1) as fleet,
    ):
        publisher = az.AsyncWeightPublisher(fleet)
        with recording(fleet.client(url) for url in fleet.urls) as log:
            await publisher.publish(weights, version="before")  # engines initialized
            mark = log.mark()
            with frozen(stopped):
                report = await publisher.publish(weights, version="during")
                # One deadline: the frozen server's health probe; no start was sent to
                # it (the fleet's own background probes of the suspect server may
                # time out too, each a probe, none held the round).
                sent = log.to(stopped.url, mark)
                assert sent, "nothing was sent to the frozen server"
                assert (sent[0].op, sent[0].timed_out) == ("health", True), sent
                assert not {s.op for s in sent} & UPDATE_OPS, sent
                assert {s.url for s in log.timed_out(mark)} == {stopped.url}
                assert report.version == publisher.version == fleet.current_version == "during"
                assert (report.servers, report.lost) == ([healthy.url], [stopped.url])
                outcome = report.outcomes[stopped.url]
                assert (outcome.phase, type(outcome.error)) == ("probe", az.ServerTimeout)
                assert fleet.state(stopped.url).dirty
                assert fleet.state(stopped.url).weight_version == "before"
                # Still frozen: every generation goes to the healthy server, none waits.
                for _ in range(4):
                    completion = await fleet.generate(
                        PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
                    )
                    assert completion.server == healthy.url
                    assert {s.version for s in completion.weight_versions} == {"during"}
                    check_greedy(
                        tiny_model_dir, PROMPT, completion.token_ids, max_new_tokens=MAX_TOKENS
                    )
            await _healthy_again(fleet, stopped.url)
            # Thawed and answering: caught up to "during" without a publish, exact.
            state = await fleet.ready(stopped.url, timeout=120)
            assert (state.weight_version, state.dirty) == ("during", False)
            check_greedy(
                tiny_model_dir, PROMPT, await _greedy(fleet, stopped.url), max_new_tokens=MAX_TOKENS
            )
            # The next round includes it by default and repairs it; both are exact.
            report = await publisher.publish(weights, version="original")  # what others expect
            assert report.version == publisher.version == "original"
            assert report.lost == []
            assert [s.dirty for s in fleet.servers] == [False, False]
            for url in fleet.urls:
                check_greedy(
                    tiny_model_dir, PROMPT, await _greedy(fleet, url), max_new_tokens=MAX_TOKENS
                )
            await publisher.aclose()
        _print_margin(log, stopped.url)


_TRAINER = textwrap.dedent(
    """
    import asyncio, sys
    from safetensors.torch import load_file
    import asyncsync as az

    async def main(model_dir, urls):
        weights = load_file(model_dir + "/model.safetensors")
        async with az.Fleet(urls) as fleet:
            shm = az.backends.Shm(buffer_bytes=1 << 20)
            publisher = az.AsyncWeightPublisher(fleet, backend=shm)
            n = 0
            while True:
                n += 1
                await publisher.publish(weights, version=f"doomed-{n}")
                print(n, flush=True)

    asyncio.run(main(sys.argv[1], sys.argv[2:]))
    """
)


@pytest.mark.timeout(300)
async def test_a_killed_trainer_leaves_nothing_once_the_servers_moved_on(
    vllm_fleet: VLLMFleet, tiny_model_dir: Path
) -> None:
    """SIGKILL a trainer while it publishes in a loop to both real servers: nothing is
    ever named in /dev/shm; the servers' next round ends whatever it left open and
    frees the dead trainer's memory (no process maps its segments any more)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _TRAINER,
        str(tiny_model_dir),
        *vllm_fleet.urls,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=180)
        assert line.strip() == b"1", await proc.stderr.read() if proc.stderr else b""
        await asyncio.wait_for(proc.stdout.readline(), timeout=60)  # rounds keep going
        assert open_segments(proc.pid)
        assert mapped_anywhere(f"asyncsync-{proc.pid}-")  # the servers map them
        assert leaked_segments(pid=proc.pid) == []
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    assert leaked_segments(pid=proc.pid) == []
    async with az.Fleet(vllm_fleet.urls) as fleet, az.AsyncWeightPublisher(fleet) as publisher:
        report = await publisher.publish(_original(tiny_model_dir), version="original")
        assert report.version == "original"
        assert not any(s.dirty for s in fleet.servers)
    assert mapped_anywhere(f"asyncsync-{proc.pid}-") == []
    assert open_segments() == []


async def test_a_prompt_longer_than_the_context_is_a_typed_error_and_harmless(
    vllm_fleet: VLLMFleet,
) -> None:
    """A prompt longer than ``--max-model-len`` (256 here): by default asyncsync learned
    the context length from the server and refuses it before sending; told a larger one
    (the caller's word wins, the server is not asked), vLLM's own 400 comes back as a
    ServerError naming the status. Either way the server keeps serving (unlike an id
    outside the vocabulary, which the learned ``vocab_size`` guards)."""
    server = vllm_fleet.token_only_server
    too_long = [7] * (server.max_model_len + 10)
    async with az.Fleet([server.url]) as fleet:
        with pytest.raises(ValueError, match=f"max_model_len={server.max_model_len}, as the"):
            await fleet.generate(too_long, max_tokens=2)
        completion = await fleet.generate(PROMPT, max_tokens=2, temperature=0.0)
        assert len(completion.token_ids) == 2
    async with az.Fleet([server.url], max_model_len=10 * server.max_model_len) as fleet:
        client = fleet.client(server.url)
        with pytest.raises(az.ServerError) as info:
            await client.generate(too_long, max_tokens=2)
        assert info.value.status == 400
        assert server.url in str(info.value)
        completion = await client.generate(PROMPT, max_tokens=2, temperature=0.0)
        assert len(completion.token_ids) == 2
        assert fleet.state(server.url).healthy
