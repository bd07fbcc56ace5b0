"""What the installed vLLM can do, probed from vLLM itself rather than read from its
version number (docs/versions.md). Two decisions read a server's version number instead
(`asyncsync._wire.control`: the RL protocol generation, and ``n > 1`` on the generate
route); tests/test_vllm_caps.py lists every such comparison.

- `engine_contract`: which worker-engine contract vLLM's ``WeightTransferEngine``
  base class expects (its constructor and ``receive_weights`` signatures); the plugin
  registers the matching adapter.
- `probe_server_options`: the command-line options the installed vLLM's OpenAI
  server accepts, read from vLLM's own parser builder in a subprocess, once per
  interpreter and vLLM install (cached on disk); `server_flags` turns them into the
  flags `LocalVLLMServer` passes.
- `installed_trainer_api`: which trainer-side API vLLM's own NCCL and IPC
  engines offer (registered in ``WeightTransferTrainerFactory``: IPC from 0.27, NCCL
  from 0.28; before that the static ``trainer_send_weights``); the ``"nccl"`` and
  ``"ipc"`` backends drive it.
- `ServerFeatures`: what a running server serves (its routes from
  ``/openapi.json``, the fields of a ``/inference/v1/generate`` answer), for code and
  tests that must not rely on what one generation lacks.

Whatever asyncsync needs and the probe does not find raises
`UnsupportedVLLMError` naming the version and what is missing.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from asyncsync._core.errors import AsyncSyncError, UnsupportedVLLMError

__all__ = [
    "ENGINE_CONTRACTS",
    "EngineContract",
    "ProbeError",
    "ServerFeatures",
    "ServerOptions",
    "VLLMTrainerApi",
    "engine_contract",
    "installed_engine_contract",
    "installed_trainer_api",
    "probe_server_options",
    "server_flags",
]

# ------------------------------------------------------------------ engine contract
EngineContract = Literal["worker-owns-round", "engine-owns-round"]

#: The engine contracts asyncsync has adapters for: the required positional parameters
#: of ``WeightTransferEngine.__init__`` and ``receive_weights`` (without ``self``).
#:
#: - ``worker-owns-round`` (vLLM 0.23-0.24): built as ``(config, parallel_config, model)``;
#:   the worker runs layerwise reload and passes ``load_weights`` to ``receive_weights``.
#: - ``engine-owns-round`` (vLLM 0.25 and later): built as ``(config, vllm_config,
#:   device, model)``; the engine's ``start/finish_weight_update`` own layerwise reload.
ENGINE_CONTRACTS: Mapping[EngineContract, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "worker-owns-round": (("config", "parallel_config", "model"), ("update_info", "load_weights")),
    "engine-owns-round": (("config", "vllm_config", "device", "model"), ("update_info",)),
}

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _required(fn: Callable[..., Any] | None) -> tuple[str, ...]:
    if fn is None:
        return ()
    params = list(inspect.signature(fn).parameters.values())
    return tuple(
        p.name
        for p in params
        if p.name != "self" and p.kind in _POSITIONAL and p.default is inspect.Parameter.empty
    )


def engine_contract(base: type, version: str) -> EngineContract:
    """The contract of vLLM's weight-transfer engine base class ``base``.

    Raises:
        UnsupportedVLLMError: the signatures match no contract asyncsync has an adapter for.
    """
    init = _required(base.__init__)  # type: ignore[misc]
    receive = _required(getattr(base, "receive_weights", None))
    for contract, (want_init, want_receive) in ENGINE_CONTRACTS.items():
        if init == want_init and receive == want_receive:
            return contract
    known = "; ".join(f"__init__{i} with receive_weights{r}" for i, r in ENGINE_CONTRACTS.values())
    raise UnsupportedVLLMError(
        version,
        f"its WeightTransferEngine takes __init__{init} and receive_weights{receive}, "
        f"a contract asyncsync has no engine adapter for (known: {known})",
    )


def installed_engine_contract() -> EngineContract:
    """`engine_contract` of the vLLM installed in this interpreter."""
    import vllm

    version = str(getattr(vllm, "__version__", "unknown"))
    try:
        from vllm.distributed.weight_transfer.base import WeightTransferEngine
    except ImportError as exc:
        raise UnsupportedVLLMError(
            version, "it has no pluggable weight transfer (vllm.distributed.weight_transfer)"
        ) from exc
    return engine_contract(WeightTransferEngine, version)


# ------------------------------------------------------------------- trainer API
#: How vLLM's own trainer side of a built-in transport (``"nccl"``, ``"ipc"``) is driven:
#: ``"engine"``: ``WeightTransferTrainerFactory.trainer_init(<Backend>TrainerInitInfo(...),
#: client=..., source=...)`` then ``send_weights()``, the engine calling a synchronous
#: ``VLLMWeightSyncClient`` (IPC from vLLM 0.27, NCCL from 0.28); ``"callback"``: the
#: static ``<Backend>WeightTransferEngine.trainer_send_weights(iterator,
#: <Backend>TrainerSendWeightsArgs(...))``, the caller driving start and finish (vLLM
#: 0.23 up to the release that moved the backend into the factory).
VLLMTrainerApi = Literal["engine", "callback"]

#: The module of each built-in transport's engines in ``vllm.distributed.weight_transfer``.
_ENGINE_MODULES: Mapping[str, tuple[str, str]] = {
    "nccl": ("vllm.distributed.weight_transfer.nccl_engine", "NCCLWeightTransferEngine"),
    "ipc": ("vllm.distributed.weight_transfer.ipc_engine", "IPCWeightTransferEngine"),
}


def trainer_api(in_factory: bool, engine: type | None, version: str) -> VLLMTrainerApi:
    """The trainer API of a vLLM whose ``WeightTransferTrainerFactory`` registers the
    transport (``in_factory``) and whose worker engine class for it is ``engine``
    (None when it has none). vLLM moved the backends into the factory one at a time
    (0.27.1 has IPC there, NCCL still static) and left a static stub that raises behind,
    so the factory wins.

    Raises:
        UnsupportedVLLMError: neither API is there.
    """
    if in_factory:
        return "engine"
    if engine is not None and callable(getattr(engine, "trainer_send_weights", None)):
        return "callback"
    raise UnsupportedVLLMError(
        version,
        "its trainer factory does not register this transport and its engine has no "
        "static trainer_send_weights (vLLM 0.23 and later have one or the other)",
    )


def installed_trainer_api(backend: str) -> VLLMTrainerApi:
    """`trainer_api` of the vLLM installed in this interpreter, for vLLM's built-in
    ``backend`` (``"nccl"`` or ``"ipc"``).

    Raises:
        UnsupportedVLLMError: vLLM is missing, older than 0.23 (no weight transfer), or has
            neither trainer API.
    """
    import importlib

    module_name, engine_name = _ENGINE_MODULES[backend]
    try:
        import vllm
    except ImportError as exc:
        raise UnsupportedVLLMError(
            "(not installed)",
            f"backend {backend!r} drives vLLM's own trainer engine, and this interpreter "
            "has no vllm package",
        ) from exc
    version = str(getattr(vllm, "__version__", "unknown"))
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UnsupportedVLLMError(
            version, f"it has no {module_name} (pluggable weight transfer came in vLLM 0.23)"
        ) from exc
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    except ImportError:
        in_factory = False
    else:
        in_factory = backend in getattr(WeightTransferTrainerFactory, "_registry", {})
    return trainer_api(in_factory, getattr(module, engine_name, None), version)


# ------------------------------------------------------------------- server options
#: Where vLLM keeps ``make_arg_parser`` (moved in 0.29); the probe tries each in turn.
PARSER_MODULES = ("vllm.entrypoints.launchers.cli_args", "vllm.entrypoints.openai.cli_args")

#: vLLM >= 0.30 serves ``/inference/v1/generate`` only with this flag (403 otherwise);
#: earlier servers have no such flag and always serve the route.
SCALE_OUT_FLAG = "--enable-scale-out"

_MARK = "ASYNCSYNC_SERVER_OPTIONS "
PROBE_TIMEOUT = 600.0


class ProbeError(AsyncSyncError, RuntimeError):
    """The probe subprocess could not read the server's options (vLLM missing or broken)."""


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """The options the installed vLLM's OpenAI server accepts (``--model``, ...)."""

    version: str
    options: frozenset[str]

    def accepts(self, flag: str) -> bool:
        return flag in self.options

    def require(self, flag: str, purpose: str) -> str:
        """``flag``, or `UnsupportedVLLMError` if the server lacks it."""
        if flag not in self.options:
            raise UnsupportedVLLMError(
                self.version, f"its server has no {flag} option (needed for {purpose})"
            )
        return flag


def server_flags(options: ServerOptions, *, tokenizer: bool, backend: str | None) -> list[str]:
    """The flags a test or demo server needs, as this vLLM spells them."""
    flags = [SCALE_OUT_FLAG] if options.accepts(SCALE_OUT_FLAG) else []
    if not tokenizer:
        flags.append(options.require("--skip-tokenizer-init", "a token-only server"))
    if backend is not None:
        flag = options.require("--weight-transfer-config", "weight transfer")
        flags += [flag, json.dumps({"backend": backend})]
    return flags


_lock = threading.Lock()
_cache: dict[str, ServerOptions] = {}


def probe_server_options(python: str | None = None) -> ServerOptions:
    """The server options of the vLLM installed for ``python`` (default: this one).

    Blocking (run it in a thread from async code). The first call per interpreter and
    vLLM install builds vLLM's own argument parser in a subprocess (it imports vLLM:
    15-30 s on 2 cores); the answer is kept in memory and in the user's cache directory,
    keyed by the interpreter and the installed vLLM files, so later calls are free.

    Raises:
        ProbeError: the subprocess failed (vLLM not installed, import error, timeout).
    """
    python = python or sys.executable
    with _lock:
        key = _cache_key(python)
        if key in _cache:
            return _cache[key]
        path = _cache_dir() / f"server-options-{key}.json"
        options = _read_cached(path)
        if options is None:
            options = _run_probe(python)
            _write_cached(path, options)
        _cache[key] = options
        return options


def _cache_key(python: str) -> str:
    """The interpreter plus the identity of its vLLM install (no vLLM import)."""
    parts = [os.path.realpath(python)]
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        spec = importlib.util.find_spec("vllm")
        if spec is not None and spec.origin is not None:
            package = Path(spec.origin).parent
            for name in ("_version.py", "__init__.py"):
                try:
                    stat = (package / name).stat()
                except OSError:
                    continue
                parts.append(f"{package / name}:{stat.st_mtime_ns}:{stat.st_size}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


def _cache_dir() -> Path:
    explicit = os.environ.get("ASYNCSYNC_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "asyncsync"


def _read_cached(path: Path) -> ServerOptions | None:
    try:
        data = json.loads(path.read_text())
        return ServerOptions(str(data["version"]), frozenset(map(str, data["options"])))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent or unreadable: probe again


def _write_cached(path: Path, options: ServerOptions) -> None:
    data = {"version": options.version, "options": sorted(options.options)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs the next process another probe


def _run_probe(python: str) -> ServerOptions:
    cmd = [python, "-m", "asyncsync._vllm.caps"]
    try:
        done = subprocess.run(
            cmd, check=False, capture_output=True, text=True, timeout=PROBE_TIMEOUT
        )
    except subprocess.TimeoutExpired as exc:
        raise ProbeError(f"{' '.join(cmd)} took longer than {PROBE_TIMEOUT:.0f} s") from exc
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(_MARK)]
    if done.returncode != 0 or not lines:
        tail = "\n".join((done.stderr or done.stdout).splitlines()[-15:])
        raise ProbeError(
            f"could not read the vLLM server's options ({' '.join(cmd)} exited with "
            f"{done.returncode}):\n{tail}"
        )
    data = json.loads(lines[-1][len(_MARK) :])
    return ServerOptions(str(data["version"]), frozenset(data["options"]))


def _print_server_options() -> None:
    """The probe itself (``python -m asyncsync._vllm.caps``): builds the parser the
    server builds, and prints every option string it accepts."""
    import importlib

    import vllm

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # older layout
        from vllm.utils import FlexibleArgumentParser
    for name in PARSER_MODULES:
        try:
            make_arg_parser = importlib.import_module(name).make_arg_parser
            break
        except (ImportError, AttributeError):
            continue
    else:
        raise SystemExit(f"vLLM {vllm.__version__}: no make_arg_parser in {PARSER_MODULES}")
    parser = make_arg_parser(FlexibleArgumentParser())
    options = sorted({opt for action in parser._actions for opt in action.option_strings})
    data = {"version": str(vllm.__version__), "options": options}
    print(_MARK + json.dumps(data), flush=True)


# ------------------------------------------------------------------ server features
#: The generate request whose answer `ServerFeatures.from_answers` reads.
GENERATE_PROBE: dict[str, Any] = {
    "token_ids": [1, 2],
    # not greedy: vLLM refuses n > 1 with temperature 0 (400 "n must be 1 when using
    # greedy sampling")
    "sampling_params": {"max_tokens": 1, "n": 2, "seed": 0},
}

#: Features a running server may lack, and what each one is (vLLM versions that have it).
FEATURES: Mapping[str, str] = {
    "generate:weight_versions": "server-side weight-version spans in /inference/v1/generate "
    "answers (vLLM >= 0.32; elsewhere asyncsync tags tokens client-side)",
    "generate:prompt_token_ids": "prompt_token_ids in /inference/v1/generate answers "
    "(vLLM >= 0.30)",
}


@dataclass(frozen=True, slots=True)
class ServerFeatures:
    """What one running vLLM server serves, read from its answers.

    Attributes:
        version: what ``GET /version`` answered.
        routes: every path in the server's ``/openapi.json``.
        generate_fields: the keys of a choice in a non-streamed generate answer.
        generate_choices: how many choices that answer had for ``n=2`` (vLLM < 0.29 may
            answer fewer when samples end at different steps: not a reliable probe).
    """

    version: str
    routes: frozenset[str]
    generate_fields: frozenset[str]
    generate_choices: int

    @classmethod
    def from_answers(
        cls, version: str, openapi: Mapping[str, Any], generate: Mapping[str, Any]
    ) -> ServerFeatures:
        """From the answers to ``GET /openapi.json`` and `GENERATE_PROBE`."""
        choices = generate.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise ValueError(f"a generate answer without choices: {generate!r:.200}")
        return cls(
            version=version,
            routes=frozenset(openapi.get("paths") or ()),
            generate_fields=frozenset(choices[0]) | frozenset(generate),
            generate_choices=len(choices),
        )

    def lacks(self, feature: str) -> str | None:
        """Why this server lacks ``feature`` (``"route:/weight_checker"`` or a key of
        `FEATURES`), or None when it has it."""
        kind, _, name = feature.partition(":")
        if kind == "route":
            has = name in self.routes
            what = f"the route {name}"
        elif feature in FEATURES:
            has = name in self.generate_fields
            what = FEATURES[feature]
        else:
            raise ValueError(
                f"unknown feature {feature!r}: 'route:<path>' or one of {list(FEATURES)}"
            )
        return None if has else f"vLLM {self.version} lacks {what} (probed)"


if __name__ == "__main__":
    _print_server_options()
