"""``asyncsync.ray`` without a cluster: the extra is optional and imported lazily, and
every bad argument is refused with an error that says what to do, before anything is
launched. (Real servers on a real Ray cluster: tests/test_ray_vllm.py.) The first two
tests run without Ray installed too (``nox -s unit`` does not install the extra)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_import_asyncsync_never_imports_ray() -> None:
    done = run("""
        import sys
        import asyncsync, asyncsync.fleet, asyncsync.publisher, asyncsync.backends.auto
        assert "ray" not in sys.modules, "asyncsync imported ray"
    """)
    assert done.returncode == 0, done.stderr


def test_without_the_extra_the_import_error_names_it() -> None:
    done = run("""
        import sys
        sys.modules["ray"] = None  # as if Ray were not installed
        try:
            import asyncsync.ray
        except ImportError as exc:
            print(exc)
        else:
            raise SystemExit("imported")
    """)
    assert done.returncode == 0, done.stderr
    assert "pip install -e '.[ray]' in asyncsync's clone" in done.stdout


def test_launch_before_ray_init_says_to_call_it(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    done = run(f"""
        import asyncsync.ray
        try:
            asyncsync.ray.launch_servers({str(tmp_path)!r}, num_servers=1)
        except asyncsync.ray.RayNotInitializedError as exc:
            print(exc)
    """)
    assert done.returncode == 0, done.stderr
    assert "call ray.init() first" in done.stdout


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_servers": 0}, ValueError, "num_servers must be an int >= 1, got 0"),
        ({"num_servers": 1.5}, ValueError, "num_servers must be an int >= 1"),
        ({"num_servers": 2, "placement": "TIGHT"}, ValueError, "placement must be one of PACK"),
        ({"num_servers": 2, "bundle_indices": [0, 1]}, ValueError, "needs your own placement"),
        ({"num_servers": 2, "num_cpus": 0}, ValueError, "needs resources"),
        ({"num_servers": 2, "num_cpus": -1}, ValueError, "num_cpus must be >= 0"),
        ({"num_servers": 2, "cpu_cores": ["0"]}, ValueError, "one core set per server"),
        ({"num_servers": 1, "startup_timeout": 0}, ValueError, "startup_timeout must be"),
        ({"num_servers": 1, "gpu_ids": [0]}, TypeError, "unknown server option.*gpu_ids"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(
    tmp_path: Path, kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    pytest.importorskip("ray")
    import asyncsync.ray as azray

    with pytest.raises(error, match=match):
        azray.launch_servers(tmp_path, **kwargs)  # type: ignore[arg-type]
