"""Smoke test of an installed asyncsync wheel (``nox -s package`` runs it).

Run it with the Python of a fresh virtualenv that has the wheel installed with its
``torch`` extra, from a directory outside the source tree, so that nothing but the
installed distribution can be imported::

    python package_smoke.py --wheel dist/asyncsync-X-py3-none-any.whl \
        --sdist dist/asyncsync-X.tar.gz

What it checks:

- the artifacts: the wheel holds ``asyncsync/py.typed`` and nothing outside the package
  (no ``tests/``, no ``.nox``); the sdist holds CHANGELOG.md and no ``.nox`` or ``site``;
- the installed distribution: imported from the virtualenv (not a checkout), metadata
  version = ``asyncsync.__version__`` = the wheel's, the ``asyncsync`` console script and
  the ``vllm.general_plugins`` entry point, a torch without CUDA (the ``torch`` extra
  must not have pulled a CUDA build onto a CPU machine);
- the public API against `asyncsync.testing.FakeVLLMServer` (no vLLM): a greedy
  ``Fleet.generate`` and its `Completion`'s fields; an ``AsyncWeightPublisher(fleet,
  backend="shm")`` round of ``{"w": torch.ones(8)}`` into two fakes whose engine is the
  installed package's own worker-side shm receiver (``asyncsync.vllm_plugin``, what runs
  inside vLLM), so the bytes the servers loaded are compared with the trainer's; the
  next generation carries the new version; the same generate through
  `asyncsync.blocking`.

What it does not cover: a real vLLM server (the ``server`` extra), the gloo, nccl and
ipc transports, and the ``fast``, ``prometheus`` and ``otel`` extras.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

MAX_TOKENS = 4
PROMPT = [1, 2, 3]
#: Every call's deadline: the fakes answer in milliseconds, so a hang fails in seconds.
DEADLINE = 30.0


def check(condition: object, message: str) -> None:
    if not condition:
        raise SystemExit(f"package smoke: FAILED: {message}")


def check_wheel(wheel: Path) -> str:
    """The wheel's contents; returns its version (from the file name)."""
    names = zipfile.ZipFile(wheel).namelist()
    check("asyncsync/py.typed" in names, f"{wheel.name} has no asyncsync/py.typed")
    outside = sorted(
        {n.split("/")[0] for n in names if not n.startswith(("asyncsync/", "asyncsync-"))}
    )
    check(not outside, f"{wheel.name} holds more than the package: {outside}")
    for part in ("tests/", ".nox/", "__pycache__/"):
        bad = [n for n in names if f"/{part}" in f"/{n}"]
        check(not bad, f"{wheel.name} holds {part}: {bad[:3]}")
    check("asyncsync/vllm_plugin/shm_engine.py" in names, "the vLLM plugin is missing")
    print(f"wheel: {len(names)} files, py.typed, nothing but asyncsync/")
    return wheel.name.split("-")[1]


def check_sdist(sdist: Path) -> None:
    with tarfile.open(sdist) as tar:
        names = [n.split("/", 1)[1] for n in tar.getnames() if "/" in n]
    for required in ("CHANGELOG.md", "README.md", "pyproject.toml", "asyncsync/py.typed"):
        check(required in names, f"{sdist.name} has no {required}")
    for part in (".nox/", "site/", ".git/"):
        bad = [n for n in names if n.startswith(part)]
        check(not bad, f"{sdist.name} holds {part}: {bad[:3]}")
    print(f"sdist: {len(names)} files, CHANGELOG.md included, no .nox/site/.git")


def check_installation(version: str) -> None:
    import asyncsync
    import asyncsync.testing

    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    where = Path(asyncsync.__file__).resolve()
    check(where.is_relative_to(site), f"asyncsync imported from {where}, not from {site}")
    meta = importlib.metadata.version("asyncsync")
    check(
        meta == asyncsync.__version__ == version,
        f"versions differ: metadata {meta}, __version__ {asyncsync.__version__}, wheel {version}",
    )
    plugins = importlib.metadata.entry_points(group="vllm.general_plugins")
    check(
        any(e.name == "asyncsync_shm" and e.value == "asyncsync.vllm_plugin:register"
            for e in plugins),
        f"vllm.general_plugins entry point missing: {list(plugins)}",
    )  # fmt: skip
    script = Path(sys.executable).parent / "asyncsync"
    check(script.is_file(), f"no console script {script}")
    out = subprocess.run([script, "--version"], capture_output=True, text=True, check=True)
    check(out.stdout.strip() == version, f"asyncsync --version printed {out.stdout!r}")

    import torch

    check(torch.version.cuda is None, f"torch {torch.__version__} is a CUDA build")
    nvidia = sorted(
        d.metadata["Name"]
        for d in importlib.metadata.distributions()
        if (d.metadata["Name"] or "").lower().startswith("nvidia")
    )
    check(not nvidia, f"the torch extra pulled CUDA libraries: {nvidia}")
    print(f"installed: asyncsync {meta} in {site}, torch {torch.__version__} (no CUDA)")


class ShmEngine:
    """A fake server's engine: the installed plugin's shm receiver, loading into a dict
    (like tests/publish_fakes.ShmWorker, which the wheel does not ship)."""

    def __init__(self) -> None:
        import torch

        from asyncsync.vllm_plugin.shm_engine import ShmReceiver

        self.loaded: dict[str, Any] = {}
        self.receiver = ShmReceiver(torch.nn.Module(), None)

    def __call__(self, info: Any) -> None:
        from asyncsync._transport.wire import ShmUpdateFields

        update = ShmUpdateFields.parse(info[0] if isinstance(info, list) else info)
        if update.chunk == 0 and not update.abort:
            self.receiver.begin_round()
        self.receiver.receive(update, self._load, None)

    def _load(self, views: list[tuple[str, Any]]) -> None:
        for name, view in views:
            self.loaded[name] = view.clone()


def check_completion(completion: Any, server: str, version: str) -> None:
    c = completion
    check(c.prompt_token_ids == PROMPT, f"prompt_token_ids {c.prompt_token_ids}")
    check(
        len(c.token_ids) == MAX_TOKENS and all(isinstance(t, int) for t in c.token_ids),
        f"token_ids {c.token_ids}",
    )
    check(c.finish_reason == "length", f"finish_reason {c.finish_reason!r}")
    check(c.server == server, f"server {c.server!r}, expected {server!r}")
    check(c.logprobs is None, "logprobs returned though none were asked for")
    check(c.version == version, f"weight version {c.version!r}, expected {version!r}")
    check(c.token_versions == [version] * MAX_TOKENS, f"token_versions {c.token_versions}")
    check(not c.retokenized, "token ids were re-tokenized")


async def check_api() -> None:
    import torch

    import asyncsync as az
    from asyncsync.testing import FakeVLLMServer

    timeouts = az.Timeouts.uniform(DEADLINE)
    weights = {"w": torch.ones(8)}
    engines = [ShmEngine(), ShmEngine()]
    async with AsyncExitStack() as stack:
        for engine in engines:
            stack.callback(engine.receiver.close)
        fakes = [
            await stack.enter_async_context(FakeVLLMServer(update_hook=engine))
            for engine in engines
        ]
        urls = [fake.url for fake in fakes]
        before = fakes[0].weight_version

        async with az.Fleet(urls[:1], timeouts=timeouts) as fleet:
            first = await fleet.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
            check_completion(first, urls[0], before)
            again = await fleet.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
            check(again.token_ids == first.token_ids, "greedy generation is not repeatable")
        print(f"generate: {first.token_ids} from {first.server}, version {first.version!r}")

        async with (
            az.Fleet(urls, timeouts=timeouts) as fleet,
            az.AsyncWeightPublisher(fleet, backend="shm") as publisher,
        ):
            report = await publisher.publish(weights, version="v1")
            check(publisher.version == "v1", f"published version {publisher.version!r}")
            check(report.version == "v1", f"report.version {report.version!r}")
            check(report.servers == urls, f"report.servers {report.servers}")
            check(all(report.outcomes[url].ok for url in urls), f"outcomes {report.outcomes}")
            check((report.bytes, report.params) == (32, 1), f"report {report!r}")
            for fake, engine in zip(fakes, engines, strict=True):
                check(fake.weight_version == "v1", f"{fake.url} at {fake.weight_version!r}")
                check(set(engine.loaded) == {"w"}, f"{fake.url} loaded {sorted(engine.loaded)}")
                check(torch.equal(engine.loaded["w"], weights["w"]), f"{fake.url}: wrong bytes")
            after = await fleet.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
            check_completion(after, after.server, "v1")
        print(f"publish: {report}")

        # From a worker thread: this thread's loop must stay free to serve the fakes.
        await asyncio.to_thread(check_blocking, urls[0], "v1")
        print("blocking: generate without await")


def check_blocking(url: str, version: str) -> None:
    import asyncsync as az
    from asyncsync import blocking

    with blocking.Fleet([url], timeouts=az.Timeouts.uniform(DEADLINE)) as fleet:
        c = fleet.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
        check_completion(c, url, version)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheel", type=Path, required=True)
    parser.add_argument("--sdist", type=Path, required=True)
    args = parser.parse_args()
    version = check_wheel(args.wheel)
    check_sdist(args.sdist)
    check_installation(version)
    asyncio.run(check_api())
    print("package smoke: OK")


if __name__ == "__main__":
    main()
