"""The benchmarks' helpers: the controller-runtime baseline's cache key, and the CPU sampler.

``benchmarks/baselines/build.py`` builds the baseline once per source and Go
version; ``benchmarks/operators/sampled.py`` gives each CPU sample of the shim to
the first frame of a known owner, from the innermost outward.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from types import FrameType, ModuleType

import pytest

ROOT = Path(__file__).parents[2]
PACKAGE = ROOT / "operator" / "kopf_reconcile"


def load(path: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def build(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load(ROOT / "benchmarks" / "baselines" / "build.py", "baseline_build", monkeypatch)


@pytest.fixture
def sampled(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load(ROOT / "benchmarks" / "operators" / "sampled.py", "sampled_operator", monkeypatch)


def test_the_baseline_requires_a_controller_runtime_release(build: ModuleType) -> None:
    assert build.controller_runtime_version().startswith("v0.")


def test_a_changed_source_or_go_builds_anew(build: ModuleType, tmp_path: Path) -> None:
    source = tmp_path / "source"
    shutil.copytree(build.SOURCE, source)
    cache = tmp_path / "cache"
    first = build.binary_path(cache, source, "go version go1.26.8 linux/amd64")
    assert first.name == "devices-operator"
    assert first.parent.name.startswith(f"controller-runtime-{build.controller_runtime_version()}-")
    assert build.binary_path(cache, source, "go version go1.26.8 linux/amd64") == first
    assert build.binary_path(cache, source, "go version go1.27.0 linux/amd64") != first
    (source / "main.go").write_text((source / "main.go").read_text() + "\n// changed\n")
    assert build.binary_path(cache, source, "go version go1.26.8 linux/amd64") != first


def test_go_mod_without_controller_runtime_is_refused(build: ModuleType, tmp_path: Path) -> None:
    (tmp_path / "go.mod").write_text("module example.invalid/x\n\ngo 1.26.0\n")
    with pytest.raises(ValueError, match="controller-runtime"):
        build.controller_runtime_version(tmp_path)


class Code:
    def __init__(self, filename: str) -> None:
        self.co_filename = filename


class Frame:
    """The two attributes of a frame the sampler reads."""

    def __init__(self, filename: str, back: Frame | None = None) -> None:
        self.f_code = Code(filename)
        self.f_back = back


def stack(*filenames: str) -> FrameType:
    """A stack whose innermost frame is the last filename."""
    frame: Frame | None = None
    for filename in filenames:
        frame = Frame(filename, frame)
    assert frame is not None
    return frame  # type: ignore[return-value]


@pytest.fixture
def sampler(sampled: ModuleType, tmp_path: Path) -> object:
    kopf = tmp_path / "site-packages" / "kopf"
    return sampled.Sampler(tmp_path / "handlers.py", PACKAGE, kopf)


def test_a_library_frame_counts_for_its_caller(sampler: object, tmp_path: Path) -> None:
    asyncio_frame = "/usr/lib/python3.11/asyncio/events.py"
    aiohttp_frame = str(tmp_path / "site-packages" / "aiohttp" / "client.py")
    handlers = str(tmp_path / "handlers.py")
    loop = str(PACKAGE / "loop.py")
    assert sampler.owner_of(stack(asyncio_frame, loop, handlers, aiohttp_frame)) == "reconciler"
    prometheus = str(tmp_path / "site-packages" / "prometheus_client" / "metrics.py")
    assert sampler.owner_of(stack(asyncio_frame, loop, prometheus)) == "loop"
    assert sampler.owner_of(stack(asyncio_frame, str(PACKAGE / "workqueue.py"))) == "loop"


def test_the_rest_of_the_project_kopf_and_nothing(sampler: object, tmp_path: Path) -> None:
    asyncio_frame = "/usr/lib/python3.11/asyncio/base_events.py"
    cache = str(PACKAGE / "cache.py")
    shim = str(PACKAGE / "integration" / "kopf_shim.py")
    kopf = str(tmp_path / "site-packages" / "kopf" / "_core" / "reactor.py")
    assert sampler.owner_of(stack(asyncio_frame, cache)) == "kopf_reconcile"
    assert sampler.owner_of(stack(asyncio_frame, shim)) == "kopf_reconcile"
    assert sampler.owner_of(stack(asyncio_frame, kopf)) == "kopf"
    assert sampler.owner_of(stack(asyncio_frame)) == "other"
    assert sampler.owner_of(None) == "other"


def test_samples_are_written_as_numbered_snapshots(
    sampled: ModuleType, sampler: object, tmp_path: Path
) -> None:
    import json

    out = tmp_path / "samples.json"
    sampler.sample(0, stack(str(PACKAGE / "loop.py")))
    sampler.sample(0, None)
    sampler.dump(out)
    sampler.sample(0, None)
    sampler.dump(out)
    snapshot = json.loads(out.read_text())
    assert snapshot == {
        "seq": 2,
        "interval": sampled.INTERVAL,
        "samples": {"loop": 1, "other": 2},
    }


def test_a_connection_is_traced_to_the_process_holding_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """side_by_side.py tells which replica wrote by the kernel's owner of the connection."""
    import os
    import socket

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    side_by_side = load(ROOT / "benchmarks" / "side_by_side.py", "side_by_side", monkeypatch)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        with socket.create_connection(server.getsockname()) as client:
            accepted, _ = server.accept()
            with accepted:
                port, server_port = client.getsockname()[1], server.getsockname()[1]
                assert side_by_side.socket_owner(port, server_port) == os.getpid()
                assert side_by_side.socket_owner(server_port, port) == os.getpid()
        assert side_by_side.socket_owner(port, server_port) is None  # closed
