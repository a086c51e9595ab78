# SPDX-License-Identifier: GPL-3.0-or-later
"""Test setup: import the pack under one fixed name, find ComfyUI, gate host and CUDA tests.

The repository root is the pack (a package with relative imports) and must not go on sys.path:
its ``nodes/`` would shadow ComfyUI's top-level ``nodes`` module. So the pack is imported as
``comfyui_controlnet_accelerator`` from its ``__init__.py``, and pytest runs with
``--import-mode=importlib`` (set in pyproject.toml).

ComfyUI is found via $COMFYUI_PATH, the parent of the ``custom_nodes`` folder, or
``~/comfy/ComfyUI``; without it every ``host`` test is skipped with that reason in the summary.
``COMFYUI_PATH`` selects the tree (0.3.64 or 0.33); the header line names its version.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACK_NAME = "comfyui_controlnet_accelerator"


def _import_pack():
    if PACK_NAME in sys.modules:
        return sys.modules[PACK_NAME]
    spec = importlib.util.spec_from_file_location(
        PACK_NAME, ROOT / "__init__.py", submodule_search_locations=[str(ROOT)]
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[PACK_NAME] = mod
    spec.loader.exec_module(mod)
    return mod


_import_pack()

from comfyui_controlnet_accelerator.harness import comfy_host  # noqa: E402

try:
    COMFY_ROOT: Path | None = comfy_host.find_comfyui()
    COMFY_MISSING = ""
except comfy_host.ComfyUINotFound as e:
    COMFY_ROOT = None
    COMFY_MISSING = str(e)


COMFY_VERSION = comfy_host.comfyui_version(COMFY_ROOT) if COMFY_ROOT is not None else None


def pytest_configure(config):
    """The run's memory guard (``tests/_rss_guard.py``) for every run, not only host tests."""
    name = "cna_rss_guard_module"
    mod = sys.modules.get(name)
    if mod is None:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / "_rss_guard.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    mod.register(config)


def pytest_report_header(config):
    if COMFY_ROOT is None:
        return f"ComfyUI: NOT FOUND, host tests will be skipped ({COMFY_MISSING})"
    return f"ComfyUI {COMFY_VERSION or '(version unknown)'} at {COMFY_ROOT}"


BUILD_FIRST = "tests/kernels/test_build.py::"


def pytest_collection_modifyitems(config, items):
    skip_host = pytest.mark.skip(reason=f"needs ComfyUI: {COMFY_MISSING}")
    for item in items:
        if "host" in item.keywords and COMFY_ROOT is None:
            item.add_marker(skip_host)
    # The kernel build runs first, while this process is still small: its two compiler jobs
    # (about 3 GB each) then fit the memory bound together, where one job at a time had to do
    # after the host tests had grown the process.
    first = [i for i in items if i.nodeid.startswith(BUILD_FIRST)]
    if first:
        items[:] = first + [i for i in items if not i.nodeid.startswith(BUILD_FIRST)]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    host = [
        r
        for k in ("passed", "failed", "skipped", "error")
        for r in terminalreporter.stats.get(k, [])
        if "host" in getattr(r, "keywords", {})
    ]
    ran = [r for r in host if r.when == "call" and r.outcome in ("passed", "failed")]
    skipped = [r for r in host if r.outcome == "skipped"]
    terminalreporter.write_line(
        f"host tests (real ComfyUI): {len(ran)} ran, {len(skipped)} skipped"
        + (
            f" — {COMFY_MISSING}"
            if COMFY_ROOT is None
            else f" — ComfyUI {COMFY_VERSION or '(version unknown)'} at {COMFY_ROOT}"
        )
    )


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    """Generated random-weight models: $CNA_MODELS_DIR if set (kept between runs), else temp."""
    env = os.environ.get("CNA_MODELS_DIR")
    if env:
        return Path(env).expanduser()
    return tmp_path_factory.mktemp("cna_models") / "models"


@pytest.fixture(scope="session")
def host(models_dir):
    """ComfyUI started in this process (CPU unless a GPU is visible), with the pack loaded."""
    if COMFY_ROOT is None:
        pytest.skip(f"needs ComfyUI: {COMFY_MISSING}")
    started = comfy_host.bootstrap(models_dir=models_dir, cpu=os.environ.get("CNA_TEST_GPU") != "1")
    # What is alive now (torch, ComfyUI and the pack, imported) lives as long as the process:
    # the collector stops walking it, so the full collection after each host test walks only
    # what the tests made since.
    gc.freeze()
    return started


@pytest.fixture(scope="session")
def tiny_models(host, models_dir):
    from comfyui_controlnet_accelerator.harness import random_models

    return random_models.ensure_models(
        ["sd15-tiny", "sd15-tiny-cn-a", "sd15-tiny-cn-b"], models_dir
    )


@pytest.fixture
def standin_compiler(monkeypatch, tmp_path):
    """A kernel build that needs no compiler, for the build's own tests.

    ``install(jit)`` points the given ``kernels._jit`` module (the pack's own, or the one
    ComfyUI loaded) at a CUDA home and a kernel cache under ``tmp_path``, and replaces torch's
    loader by one that writes each object file in turn (as ninja does, a ``.cuda.o`` for a
    ``.cu`` source), then the library, and returns a stand-in module. It returns that module
    and the list of thread ids the loader ran on."""
    from torch.utils import cpp_extension

    def install(jit, *, step_s=0.1):
        monkeypatch.setenv("CNA_KERNELS_CACHE", os.fspath(tmp_path / "kernel-build"))
        monkeypatch.setattr(jit, "cuda_home", lambda: os.fspath(tmp_path))
        monkeypatch.setenv("CUDA_HOME", os.fspath(tmp_path))  # build() points torch at it
        monkeypatch.setattr(cpp_extension, "CUDA_HOME", cpp_extension.CUDA_HOME)  # put back
        monkeypatch.setattr(jit, "PROGRESS_POLL_S", 0.02)
        module = object()
        loads = []

        def load(name, sources, build_directory, **kw):
            loads.append(threading.get_ident())
            for src in sources:
                time.sleep(step_s)
                stem = os.path.basename(src).rsplit(".", 1)[0]
                suffix = ".cuda.o" if src.endswith(".cu") else ".o"
                open(os.path.join(build_directory, stem + suffix), "w").close()
            time.sleep(step_s)  # the link
            open(os.path.join(build_directory, name + ".so"), "w").close()
            return module

        monkeypatch.setattr(cpp_extension, "load", load)
        return module, loads

    return install


@pytest.fixture
def graph_backend(host, monkeypatch):
    """Host tests of the graph path run the emulated backend on the CPU (same code, no CUDA
    capture) and real CUDA graphs on a GPU. Modules opt in with ``usefixtures``, so host tests
    of the CPU's own no-graph path are left alone."""
    if host.cpu:
        monkeypatch.setenv("CNA_GRAPH_BACKEND", "emulate")
    return "emulate" if host.cpu else "cuda"
