"""Retry policy and timeouts: pure functions, no network, no sleeping."""

from __future__ import annotations

import email.utils

import pytest

from asyncsync import RetryPolicy, ServerError, ServerTimeout, ServerUnavailableError, Timeouts
from asyncsync._http.retry import (
    NO_RETRY,
    backoff_delay,
    is_retryable,
    parse_retry_after,
    retry_delay,
)


def test_defaults_and_off_switch() -> None:
    policy = RetryPolicy()
    assert policy.attempts == 3
    assert RetryPolicy.off() is NO_RETRY
    assert NO_RETRY.attempts == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"attempts": 0}, "attempts"),
        ({"jitter": 1.5}, "jitter"),
        ({"base_delay": -1.0}, "delays"),
    ],
)
def test_policy_validation(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]


def test_which_errors_are_retryable() -> None:
    policy = RetryPolicy()
    assert is_retryable(ServerUnavailableError("refused"), policy)
    assert is_retryable(ServerError("busy", status=503), policy)
    assert is_retryable(ServerError("slow down", status=429), policy)
    assert not is_retryable(ServerError("bad", status=400), policy)
    assert not is_retryable(ServerError("worker failed", status=500), policy)
    assert not is_retryable(ServerError("malformed 200", status=200), policy)
    assert not is_retryable(ServerTimeout("hung"), policy)
    assert is_retryable(ServerTimeout("hung"), RetryPolicy(retry_timeouts=True))
    assert not is_retryable(ValueError("bug"), policy)


def test_backoff_is_exponential_capped_and_jittered() -> None:
    policy = RetryPolicy(base_delay=0.1, max_delay=1.0, jitter=0.0)
    assert [backoff_delay(n, policy, 0.5) for n in (1, 2, 3, 4, 5, 6)] == pytest.approx(
        [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    )
    full = RetryPolicy(base_delay=0.1, max_delay=1.0, jitter=1.0)
    assert backoff_delay(3, full, 0.0) == 0.0
    assert backoff_delay(3, full, 0.5) == pytest.approx(0.2)
    assert backoff_delay(10, full, 0.999) < 1.0
    half = RetryPolicy(base_delay=1.0, max_delay=10.0, jitter=0.5)
    assert backoff_delay(1, half, 0.0) == pytest.approx(0.5)
    assert backoff_delay(1, half, 1.0) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="1-based"):
        backoff_delay(0, policy, 0.5)


def test_retry_after_parsing() -> None:
    assert parse_retry_after(None) is None
    assert parse_retry_after("") is None
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after("1.5") == 1.5
    assert parse_retry_after("-4") == 0.0
    assert parse_retry_after("soon") is None
    now = 1_800_000_000.0
    date = email.utils.formatdate(now + 7, usegmt=True)
    assert parse_retry_after(date, now=now) == pytest.approx(7.0)
    assert parse_retry_after(email.utils.formatdate(now - 60, usegmt=True), now=now) == 0.0


def test_retry_after_wins_over_backoff_and_is_capped() -> None:
    policy = RetryPolicy(base_delay=0.1, jitter=0.0, max_retry_after=5.0)
    err = ServerError("busy", status=503)
    assert retry_delay(1, err, policy, rand=lambda: 0.5) == pytest.approx(0.1)
    err.retry_after = 2.0  # type: ignore[attr-defined]
    assert retry_delay(1, err, policy, rand=lambda: 0.5) == 2.0
    err.retry_after = 120.0  # type: ignore[attr-defined]
    assert retry_delay(1, err, policy, rand=lambda: 0.5) == 5.0


def test_timeouts_validation_and_phases() -> None:
    t = Timeouts()
    assert t.for_phase("control") == t.control
    assert t.for_phase("update") == t.update
    assert Timeouts(control=None).for_phase("control") is None
    assert Timeouts.uniform(2.0) == Timeouts(connect=2.0, control=2.0, update=2.0, generate=2.0)
    with pytest.raises(ValueError, match="control"):
        Timeouts(control=0)
    with pytest.raises(ValueError, match="update"):
        Timeouts(update=float("inf"))
    with pytest.raises(TypeError, match="connect"):
        Timeouts(connect="5")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="generate"):
        Timeouts(generate=True)
    with pytest.raises(AttributeError):
        t.control = 1.0  # type: ignore[misc]


def _planned_calls() -> list[tuple[str, str, str, bool]]:
    """Every ``Call(op, method, route, ...)`` asyncsync plans, read from its source, and
    every route of the control routes' table (`asyncsync._wire.routes`):
    (file, method, route, idempotent)."""
    import ast
    import importlib
    from pathlib import Path

    import asyncsync
    from asyncsync._wire import routes

    package = Path(asyncsync.__file__).parent
    found = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text())
        module = None
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Call"):
                continue
            method, route = node.args[1], node.args[2]
            if isinstance(method, ast.Attribute):  # Route.plan: the table's, below
                continue
            if isinstance(route, ast.Name):  # a module constant such as MODELS_ROUTE
                parts = path.relative_to(package.parent).with_suffix("").parts
                module = module or importlib.import_module(".".join(parts))
                value = getattr(module, route.id, f"<{route.id}>")  # or a local: a variable
            else:
                value = ast.literal_eval(route)
            idempotent = any(
                k.arg == "idempotent" and ast.literal_eval(k.value) is True for k in node.keywords
            )
            rel = str(path.relative_to(package))
            found.append((rel, ast.literal_eval(method), str(value), idempotent))
    found += [  # the control routes' table: one Call for all
        ("_wire/routes.py", r.method, r.path, r.retry == "idempotent")
        for r in routes.ROUTES.values()
    ]
    return found


def test_the_retried_calls_are_the_gets_and_client_md_lists_them() -> None:
    """Only idempotent calls are retried: every GET asyncsync plans, and nothing else.
    docs/client.md's "Retries" lists exactly their routes."""
    import re
    from pathlib import Path

    calls = _planned_calls()
    assert len(calls) > 20, "found too few planned calls: is the walk still right?"
    wrong = [c for c in calls if (c[1] == "GET") != c[3]]
    assert not wrong, f"a GET not retried, or a retried call that is not a GET: {wrong}"
    retried = {route for _, _, route, idempotent in calls if idempotent}
    page = (Path(__file__).resolve().parent.parent / "docs" / "client.md").read_text()
    paragraph = page.split("## Retries", 1)[1].split("\n\n", 2)[1]
    assert set(re.findall(r"`(/[\w/]+)`", paragraph)) == retried, paragraph
