"""Metrics hooks: publish rounds and generations, reported to callbacks you register.

::

    from asyncsync import metrics

    metrics.add_hook(metrics.PrometheusMetrics())      # prometheus_client, if installed
    metrics.add_hook(metrics.OpenTelemetryMetrics())   # opentelemetry-api, if installed

A hook is any object with the methods of `MetricsHook` (subclass it to override only
some; a hook without one of them is not called for that event). Hooks are called on the
event loop's thread, right after the event; they must be quick and must not block. A
hook that raises is logged (logger ``asyncsync.metrics``) and does not disturb the round
or the generation.

What is reported:

- `MetricsHook.on_publish`: a successful round's `PublishReport`
  (version, seconds per phase, bytes, servers, and how close it came to the
  transport's ceiling: ``efficiency``, ``ceiling_gb_per_s``).
- `MetricsHook.on_publish_failed`: the version and the
  `PublishError` of a failed round.
- `MetricsHook.on_generation`: each `Completion` (server, latency,
  tokens, weight versions; ``staleness`` when it came through a `Fleet`).
- `MetricsHook.on_server_health`: a server's move in a fleet's state machine
  (``healthy``, ``suspect``, ``stale``, ``dead``, ``retired``; docs/concepts.md).
"""

from __future__ import annotations

from typing import Any, Protocol

from asyncsync._core import hooks as _hooks
from asyncsync._core.completion import Completion
from asyncsync._core.errors import PublishError
from asyncsync._core.state import HEALTH
from asyncsync._publish.round import PublishReport

__all__ = [
    "MetricsHook",
    "OpenTelemetryMetrics",
    "PrometheusMetrics",
    "add_hook",
    "hooks",
    "remove_hook",
]


class MetricsHook(Protocol):
    """The callbacks asyncsync calls; every method does nothing unless overridden."""

    def on_publish(self, report: PublishReport) -> None:
        """A round was published: at least its ``min_servers`` finished it (the servers
        it lost are ``report.lost``)."""
        return

    def on_publish_failed(self, version: str, error: PublishError) -> None:
        """A round failed (the published version did not change)."""
        return

    def on_generation(self, completion: Completion) -> None:
        """A completion arrived (one per sample; streamed ones when the stream ends)."""
        return

    def on_server_health(self, server: str, old: str, new: str) -> None:
        """A fleet's server moved from health ``old`` to ``new`` (``"healthy"``,
        ``"suspect"``, ``"stale"``, ``"dead"``, ``"retired"``)."""
        return


def add_hook(hook: MetricsHook) -> MetricsHook:
    """Register ``hook`` (process-wide; registering it again does nothing); returns it."""
    _hooks.add(hook)
    return hook


def remove_hook(hook: MetricsHook) -> None:
    """Unregister ``hook`` (no error if it was not registered)."""
    _hooks.remove(hook)


def hooks() -> tuple[MetricsHook, ...]:
    """The registered hooks, in registration order."""
    return _hooks.registered()


#: Histogram buckets for staleness (published versions behind).
STALENESS_BUCKETS = (0.0, 1.0, 2.0, 3.0, 4.0, 8.0, 16.0)


class PrometheusMetrics(MetricsHook):
    """A hook that records into ``prometheus_client`` metrics (``pip install
    prometheus_client``), named ``<namespace>_...``:

    - ``publish_phase_seconds{phase}`` (histogram), ``publish_bytes_total``,
      ``publish_rounds_total{outcome}``, ``published_version_info{version}``,
      ``publish_efficiency`` and ``publish_ceiling_gigabytes_per_second`` (gauges: the
      last round's GB/s over the transport's ceiling, and that ceiling);
    - ``generation_seconds{server}`` (histogram), ``generated_tokens_total{server}``,
      ``generation_staleness`` (histogram, fleet generations only);
    - ``server_health_transitions_total{server, old, new}`` (each move of a server in
      a fleet's state machine) and ``server_health{server, health}`` (1 for the
      server's current health, 0 for the others).

    Args:
        registry: the ``CollectorRegistry`` to register in (default: the global one).
        namespace: the metric name prefix.
    """

    def __init__(self, registry: Any = None, namespace: str = "asyncsync") -> None:
        import prometheus_client as prom

        kw: dict[str, Any] = {"namespace": namespace}
        if registry is not None:
            kw["registry"] = registry
        self.phase_seconds = prom.Histogram(
            "publish_phase_seconds", "Seconds per publish phase", ["phase"], **kw
        )
        self.publish_bytes = prom.Counter("publish_bytes", "Payload bytes published", **kw)
        self.rounds = prom.Counter("publish_rounds", "Publish rounds", ["outcome"], **kw)
        self.version = prom.Info("published_version", "The last published version", **kw)
        self.efficiency = prom.Gauge(
            "publish_efficiency", "The last round's GB/s over the transport's ceiling", **kw
        )
        self.ceiling = prom.Gauge(
            "publish_ceiling_gigabytes_per_second", "The transport's ceiling (GB/s)", **kw
        )
        self.generation_seconds = prom.Histogram(
            "generation_seconds", "Generation latency", ["server"], **kw
        )
        self.tokens = prom.Counter("generated_tokens", "Generated tokens", ["server"], **kw)
        self.staleness = prom.Histogram(
            "generation_staleness",
            "Published versions behind the newest, per completion",
            buckets=STALENESS_BUCKETS,
            **kw,
        )
        self.health_transitions = prom.Counter(
            "server_health_transitions",
            "Moves of a server's health",
            ["server", "old", "new"],
            **kw,
        )
        self.health = prom.Gauge(
            "server_health", "1 for a server's current health", ["server", "health"], **kw
        )

    def on_publish(self, report: PublishReport) -> None:
        for phase, seconds in report.seconds.items():
            self.phase_seconds.labels(phase).observe(seconds)
        self.publish_bytes.inc(report.bytes)
        self.rounds.labels("ok").inc()
        self.version.info({"version": report.version})
        if report.efficiency is not None and report.ceiling_gb_per_s is not None:
            self.efficiency.set(report.efficiency)
            self.ceiling.set(report.ceiling_gb_per_s)

    def on_publish_failed(self, version: str, error: PublishError) -> None:
        self.rounds.labels("failed").inc()

    def on_generation(self, completion: Completion) -> None:
        self.generation_seconds.labels(completion.server).observe(completion.latency)
        self.tokens.labels(completion.server).inc(len(completion.token_ids))
        if completion.staleness is not None:
            self.staleness.observe(completion.staleness)

    def on_server_health(self, server: str, old: str, new: str) -> None:
        self.health_transitions.labels(server, old, new).inc()
        for health in HEALTH:
            self.health.labels(server, health).set(1 if health == new else 0)


class OpenTelemetryMetrics(MetricsHook):
    """A hook that records into OpenTelemetry instruments (``pip install
    opentelemetry-api``; an SDK ``MeterProvider`` exports them):

    - ``asyncsync.publish.duration`` (histogram, s, attribute ``phase``),
      ``asyncsync.publish.bytes`` (counter, By), ``asyncsync.publish.rounds`` (counter,
      attribute ``outcome``), ``asyncsync.publish.efficiency`` (histogram, 1: a round's
      GB/s over the transport's ceiling) and ``asyncsync.publish.ceiling`` (histogram,
      GBy/s);
    - ``asyncsync.generation.duration`` (histogram, s, attribute ``server``),
      ``asyncsync.generation.tokens`` (counter), ``asyncsync.generation.staleness``
      (histogram, fleet generations only);
    - ``asyncsync.server.health_transitions`` (counter, attributes ``server``, ``old``,
      ``new``).

    Args:
        meter: the meter to create the instruments on (default: the global provider's
            meter ``"asyncsync"``).
    """

    def __init__(self, meter: Any = None) -> None:
        if meter is None:
            from opentelemetry import metrics as otel

            meter = otel.get_meter("asyncsync")
        self.phase_seconds = meter.create_histogram(
            "asyncsync.publish.duration", unit="s", description="Seconds per publish phase"
        )
        self.publish_bytes = meter.create_counter(
            "asyncsync.publish.bytes", unit="By", description="Payload bytes published"
        )
        self.rounds = meter.create_counter("asyncsync.publish.rounds", description="Rounds")
        self.efficiency = meter.create_histogram(
            "asyncsync.publish.efficiency",
            unit="1",
            description="A round's GB/s over the transport's ceiling",
        )
        self.ceiling = meter.create_histogram(
            "asyncsync.publish.ceiling", unit="GBy/s", description="The transport's ceiling"
        )
        self.generation_seconds = meter.create_histogram(
            "asyncsync.generation.duration", unit="s", description="Generation latency"
        )
        self.tokens = meter.create_counter(
            "asyncsync.generation.tokens", description="Generated tokens"
        )
        self.staleness = meter.create_histogram(
            "asyncsync.generation.staleness",
            description="Published versions behind the newest, per completion",
        )
        self.health_transitions = meter.create_counter(
            "asyncsync.server.health_transitions", description="Moves of a server's health"
        )

    def on_publish(self, report: PublishReport) -> None:
        for phase, seconds in report.seconds.items():
            self.phase_seconds.record(seconds, {"phase": phase})
        self.publish_bytes.add(report.bytes)
        self.rounds.add(1, {"outcome": "ok"})
        if report.efficiency is not None and report.ceiling_gb_per_s is not None:
            self.efficiency.record(report.efficiency)
            self.ceiling.record(report.ceiling_gb_per_s)

    def on_publish_failed(self, version: str, error: PublishError) -> None:
        self.rounds.add(1, {"outcome": "failed"})

    def on_generation(self, completion: Completion) -> None:
        server = {"server": completion.server}
        self.generation_seconds.record(completion.latency, server)
        self.tokens.add(len(completion.token_ids), server)
        if completion.staleness is not None:
            self.staleness.record(completion.staleness)

    def on_server_health(self, server: str, old: str, new: str) -> None:
        self.health_transitions.add(1, {"server": server, "old": old, "new": new})
