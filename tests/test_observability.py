"""Logging and metrics hooks, against FakeVLLMServers: what each module logs (retries,
failovers, dirty marks, round phases), that the API key never appears, the hook
protocol, and the prometheus_client and OpenTelemetry adapters with the real libraries."""

from __future__ import annotations

import logging
import re
import sys
import types
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch

import asyncsync as az
from asyncsync import metrics
from asyncsync._publish.progress import in_notebook, progress_enabled
from asyncsync._publish.report import SECONDS_ORDER, Phase
from asyncsync.testing import FakeVLLMServer, Fault
from tests.publish_fakes import shm_fakes

SECRET = "sk-do-not-log-me-4242"
PROMPT = [3, 4, 5]
FAST_RETRY = az.RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.02)


@pytest_asyncio.fixture
async def fakes() -> AsyncIterator[list[FakeVLLMServer]]:
    async with shm_fakes(2) as servers:
        yield servers


class Recorder(metrics.MetricsHook):
    """Keeps every event (overrides all three callbacks)."""

    def __init__(self) -> None:
        self.published: list[az.PublishReport] = []
        self.failed: list[tuple[str, az.PublishError]] = []
        self.completions: list[az.Completion] = []

    def on_publish(self, report: az.PublishReport) -> None:
        self.published.append(report)

    def on_publish_failed(self, version: str, error: az.PublishError) -> None:
        self.failed.append((version, error))

    def on_generation(self, completion: az.Completion) -> None:
        self.completions.append(completion)


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    hook = metrics.add_hook(Recorder())
    yield hook
    metrics.remove_hook(hook)


async def _publish(fleet: az.Fleet, version: str) -> az.PublishReport:
    """A round that needs every server (a failure fails it)."""
    async with az.AsyncWeightPublisher(fleet) as publisher:
        return await publisher.publish(
            {"w": torch.ones(8)}, version=version, progress=False, min_servers="all"
        )


# ---------------------------------------------------------------------- logging
#: The logger names docs/observability.md promises (public API, not module paths).
LOGGERS = {
    "asyncsync.http", "asyncsync.fleet", "asyncsync.generate", "asyncsync.publish",
    "asyncsync.gloo", "asyncsync.blocking", "asyncsync.metrics", "asyncsync.vllm_plugin",
    "asyncsync.ray", "asyncsync.testing",
}  # fmt: skip


def test_the_package_logs_only_to_the_documented_logger_names() -> None:
    root = Path(az.__file__).parent
    found: dict[str, str] = {}
    for path in root.rglob("*.py"):
        for name in re.findall(r"logging\.getLogger\(([^)]*)\)", path.read_text()):
            found[name] = str(path.relative_to(root))
    # the root (its NullHandler) and vLLM's own (the plugin routes its records there)
    names = {n.strip("\"'") for n in found} - {"asyncsync", "vllm"}
    assert names == LOGGERS, found
    text = (root.parent / "docs" / "observability.md").read_text()
    assert all(f"`{name}`" in text for name in LOGGERS)


@pytest.mark.asyncio
async def test_each_module_logs_what_happened_and_never_the_api_key(
    fakes: list[FakeVLLMServer], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="asyncsync")
    fakes[0].inject("/version", Fault.error(503, "busy", shape="openai"))
    fakes[1].inject("/update_weights", Fault.error(500, "worker failed"))
    dead = FakeVLLMServer()
    dead_url = (await dead.start()).url
    await dead.stop()
    urls = [f.url for f in fakes]
    async with az.Fleet(urls, api_key=SECRET, retry=FAST_RETRY) as fleet:
        await fleet.vllm_version()  # 503 once, then retried
        with pytest.raises(az.PublishError):
            await _publish(fleet, "v1")  # update fails on one server: dirty, rollback
        fleet.mark_clean()
        await _publish(fleet, "v2")
    async with az.Fleet([dead_url, urls[0]], api_key=SECRET, retry=None) as fleet:
        await fleet.generate(PROMPT, max_tokens=2)  # refused by the first, sent on
    by_logger: dict[str, list[str]] = {}
    for record in caplog.records:
        by_logger.setdefault(record.name, []).append(record.getMessage())
        assert SECRET not in record.getMessage()
        assert SECRET not in repr(record.args)
    assert SECRET not in caplog.text

    def logged(name: str, text: str) -> bool:
        return any(text in message for message in by_logger.get(name, []))

    assert logged("asyncsync.http", f"{urls[0]} /version failed (attempt 1 of 3)")
    assert logged("asyncsync.fleet", f"server {urls[1]} marked dirty (needs a resync)")
    assert logged("asyncsync.publish", "publishing 'v1' failed")
    assert logged("asyncsync.publish", f"round 'v1' left {urls[0]}, {urls[1]} dirty")
    assert logged("asyncsync.publish", "round 'v2': start took")
    assert logged("asyncsync.publish", f"published 'v2' to {urls[0]}, {urls[1]}")
    assert logged("asyncsync.fleet", f"server {dead_url} unhealthy after generate")
    assert logged("asyncsync.generate", f"generation never reached {dead_url}")
    timings = [r for r in caplog.records if r.name == "asyncsync.publish" and " took " in r.msg]
    assert {r.levelno for r in timings} == {logging.DEBUG}


OBSERVABILITY_DOCS = Path(__file__).resolve().parents[1] / "docs" / "observability.md"


def _documented_row(first_cell: str, level: str) -> str:
    """The last cell of the row of docs/observability.md's tables that starts so."""
    for line in OBSERVABILITY_DOCS.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[:2] == [first_cell, level] or (cells[:1] == [first_cell] and not level):
            return cells[-1]
    raise AssertionError(f"docs/observability.md has no row {first_cell} {level}")


@pytest.mark.asyncio
async def test_the_phase_timing_lines_read_as_documented(
    fakes: list[FakeVLLMServer], caplog: pytest.LogCaptureFixture
) -> None:
    """docs/observability.md quotes one DEBUG line of a round; every timing line a round
    logs has that form (the version, a phase of ServerOutcome.phase, seconds to four
    places), and a round logs one for each phase it ran."""
    row = _documented_row("`asyncsync.publish`", "DEBUG")
    quoted = re.search(r"`(round [^`]+)`", row)
    assert quoted is not None, row
    example = re.fullmatch(r"round '(?P<v>[^']+)': (?P<phase>\w+) took (?P<s>[\d.]+) s", quoted[1])
    assert example is not None, f"the documented line {quoted[1]!r} has another form"
    assert example["phase"] in {p.value for p in Phase}
    places = len(example["s"].split(".")[1])
    form = re.compile(rf"round '(?P<v>[^']*)': (?P<phase>\w+) took \d+\.\d{{{places}}} s")

    caplog.set_level(logging.DEBUG, logger="asyncsync.publish")
    weights = {f"w{i}": torch.ones(512) for i in range(4)}  # 8 KiB: several chunks
    async with (
        az.Fleet([f.url for f in fakes]) as fleet,
        az.AsyncWeightPublisher(fleet, backend=az.backends.Shm(buffer_bytes=4096)) as publisher,
    ):
        report = await publisher.publish(weights, version="v1", progress=False, pause="keep")
    lines = [r.getMessage() for r in caplog.records if r.name == "asyncsync.publish"]
    timings = [line for line in lines if " took " in line]
    assert timings
    assert [line for line in timings if not form.fullmatch(line)] == []
    matches = [m for m in map(form.fullmatch, timings) if m]
    assert {m["v"] for m in matches} == {"v1"}
    phases = [Phase(m["phase"]) for m in matches]
    assert {ph.seconds_key for ph in phases} == set(report.seconds) - {"pack", "total"}
    assert phases.count(Phase.UPDATE) == report.chunks  # one line per chunk's fan-out


def test_the_documented_phase_labels_are_the_reports_seconds() -> None:
    """The ``phase`` label takes each key of ``PublishReport.seconds``: the docs list
    them all, in the report's order."""
    row = _documented_row("`asyncsync_publish_phase_seconds`", "")
    label, *values = re.findall(r"`(\w+)`", row)  # `PublishReport.seconds` is no label
    assert (label, values) == ("phase", [*SECONDS_ORDER, "total"]), row


@pytest.mark.asyncio
async def test_the_api_key_is_not_in_reprs_or_errors(fakes: list[FakeVLLMServer]) -> None:
    fakes[0].inject("/health", Fault.error(500, "boom"))
    async with az.AsyncVLLMClient(fakes[0].url, api_key=SECRET, retry=None) as client:
        with pytest.raises(az.ServerError) as info:
            await client.health()
        assert SECRET not in repr(client)
        assert SECRET not in repr(client._endpoint.record)
        assert SECRET not in str(info.value)
        assert SECRET not in repr(info.value)
    assert fakes[0].requests[0].headers["Authorization"] == f"Bearer {SECRET}"


# ---------------------------------------------------------------------- hooks
@pytest.mark.asyncio
async def test_hooks_receive_rounds_and_generations(
    fakes: list[FakeVLLMServer], recorder: Recorder
) -> None:
    urls = [f.url for f in fakes]
    async with az.Fleet(urls) as fleet:
        report = await _publish(fleet, "v1")
        fakes[0].inject("/update_weights", Fault.error(500, "worker failed"))
        with pytest.raises(az.PublishError) as info:
            await _publish(fleet, "v2")
        fleet.mark_clean()
        routed = await fleet.generate_n(PROMPT, n=2, max_tokens=3)
        async with fleet.stream(PROMPT, max_tokens=2) as stream:
            _ = [delta async for delta in stream]
        direct = await fleet.client(urls[0]).generate(PROMPT, max_tokens=1)
        batch = await fleet.client(urls[1]).generate_batch([PROMPT, PROMPT], max_tokens=1)
    assert recorder.published == [report]
    assert recorder.failed == [("v2", info.value)]
    assert recorder.completions == [*routed, stream.completion, direct, *batch[0], *batch[1]]
    assert [c.staleness for c in recorder.completions[:3]] == [0, 0, 0]  # via the fleet
    assert direct.staleness is None  # a client alone knows no fleet history


@pytest.mark.asyncio
async def test_a_broken_hook_is_logged_and_changes_nothing(
    fakes: list[FakeVLLMServer], recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken(metrics.MetricsHook):
        def on_generation(self, completion: az.Completion) -> None:
            raise RuntimeError("hook bug")

    broken = metrics.add_hook(Broken())
    try:
        async with az.AsyncVLLMClient(fakes[0].url) as client:
            completion = await client.generate(PROMPT, max_tokens=2)
    finally:
        metrics.remove_hook(broken)
    assert recorder.completions == [completion]  # the next hook still ran
    assert "metrics hook" in caplog.text
    assert "hook bug" in caplog.text
    assert metrics.hooks() == (recorder,)


# ---------------------------------------------------------------------- adapters
async def _round_and_generation(
    fakes: list[FakeVLLMServer], hook: metrics.MetricsHook
) -> tuple[az.PublishReport, az.Completion]:
    """One publish round and one 4-token generation, seen by ``hook``."""
    metrics.add_hook(hook)
    try:
        async with az.Fleet([f.url for f in fakes]) as fleet:
            return await _publish(fleet, "v1"), await fleet.generate(PROMPT, max_tokens=4)
    finally:
        metrics.remove_hook(hook)


@pytest.mark.asyncio
async def test_prometheus_adapter(fakes: list[FakeVLLMServer]) -> None:
    prom = pytest.importorskip("prometheus_client", reason="prometheus_client not installed")
    registry = prom.CollectorRegistry()
    report, completion = await _round_and_generation(
        fakes, metrics.PrometheusMetrics(registry=registry)
    )

    def value(name: str, **labels: str) -> float | None:
        got: float | None = registry.get_sample_value(name, labels)
        return got

    assert value("asyncsync_publish_bytes_total") == report.bytes
    assert value("asyncsync_publish_rounds_total", outcome="ok") == 1
    assert value("asyncsync_published_version_info", version="v1") == 1
    assert value("asyncsync_publish_phase_seconds_sum", phase="transfer") == pytest.approx(
        report.seconds["transfer"]
    )
    # how close the round came to the transport's ceiling (shm: this host's memcpy)
    assert report.efficiency is not None
    assert value("asyncsync_publish_efficiency") == pytest.approx(report.efficiency)
    ceiling = value("asyncsync_publish_ceiling_gigabytes_per_second")
    assert ceiling == pytest.approx(report.ceiling_gb_per_s)
    server = completion.server
    assert value("asyncsync_generation_seconds_count", server=server) == 1
    assert value("asyncsync_generated_tokens_total", server=server) == 4
    assert value("asyncsync_generation_staleness_count") == 1
    assert value("asyncsync_generation_staleness_bucket", le="0.0") == 1


@pytest.mark.asyncio
async def test_opentelemetry_adapter(fakes: list[FakeVLLMServer]) -> None:
    pytest.importorskip("opentelemetry.sdk.metrics", reason="opentelemetry-sdk not installed")
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    hook = metrics.OpenTelemetryMetrics(provider.get_meter("test"))
    try:
        report, completion = await _round_and_generation(fakes, hook)
    finally:
        provider.shutdown()
    points = _otel_points(reader)
    assert points["asyncsync.publish.bytes"] == [({}, report.bytes)]
    assert points["asyncsync.publish.rounds"] == [({"outcome": "ok"}, 1)]
    phases = {attrs["phase"]: total for attrs, total in points["asyncsync.publish.duration"]}
    assert phases == pytest.approx(report.seconds)
    assert report.efficiency is not None
    assert points["asyncsync.publish.efficiency"] == [({}, pytest.approx(report.efficiency))]
    assert points["asyncsync.publish.ceiling"] == [({}, pytest.approx(report.ceiling_gb_per_s))]
    assert points["asyncsync.generation.tokens"] == [({"server": completion.server}, 4)]
    assert points["asyncsync.generation.staleness"] == [({}, 0)]


def _otel_points(reader: Any) -> dict[str, list[tuple[dict[str, Any], float]]]:
    """Each metric's points as (attributes, value or histogram sum)."""
    out: dict[str, list[tuple[dict[str, Any], float]]] = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                out[metric.name] = [
                    (dict(p.attributes), getattr(p, "sum", getattr(p, "value", None)))
                    for p in metric.data.data_points
                ]
    return out


# ---------------------------------------------------------------------- progress
def test_the_progress_bar_shows_in_a_notebook_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Jupyter kernel's stderr is no terminal; the bar is drawn there anyway (by
    tqdm.auto, as a notebook widget), but still not in CI."""
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("ASYNCSYNC_NO_PROGRESS", raising=False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert not in_notebook()
    assert progress_enabled(None) is False
    kernel_shell = types.SimpleNamespace(kernel=object())
    ipython = types.SimpleNamespace(get_ipython=lambda: kernel_shell)
    monkeypatch.setitem(sys.modules, "IPython", ipython)
    assert in_notebook()
    assert progress_enabled(None) is True
    monkeypatch.setenv("CI", "true")
    assert progress_enabled(None) is False
