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

import importlib.util
import os
import sys
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
    return comfy_host.bootstrap(models_dir=models_dir, cpu=os.environ.get("CNA_TEST_GPU") != "1")


@pytest.fixture(scope="session")
def tiny_models(host, models_dir):
    from comfyui_controlnet_accelerator.harness import random_models

    return random_models.ensure_models(
        ["sd15-tiny", "sd15-tiny-cn-a", "sd15-tiny-cn-b"], models_dir
    )


@pytest.fixture
def graph_backend(host, monkeypatch):
    """Host tests of the graph path run the emulated backend on the CPU (same code, no CUDA
    capture) and real CUDA graphs on a GPU. Modules opt in with ``usefixtures``, so host tests
    of the CPU's own no-graph path are left alone."""
    if host.cpu:
        monkeypatch.setenv("CNA_GRAPH_BACKEND", "emulate")
    return "emulate" if host.cpu else "cuda"
