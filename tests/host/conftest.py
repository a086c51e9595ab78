# SPDX-License-Identifier: GPL-3.0-or-later
"""Host tests share one in-process ComfyUI: release what a test loaded before the next one runs,
so the suite's memory stays bounded (the CI machine has 24 GB for the whole run), and register
the run's memory guard (``tests/_rss_guard.py``)."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import importlib.util
import sys
from pathlib import Path

import pytest

_GUARD = "cna_rss_guard_module"


def _guard_module():
    mod = sys.modules.get(_GUARD)
    if mod is None:
        path = Path(__file__).resolve().parent.parent / "_rss_guard.py"
        spec = importlib.util.spec_from_file_location(_GUARD, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[_GUARD] = mod
        spec.loader.exec_module(mod)
    return mod


def pytest_configure(config):
    _guard_module().register(config)


def _libc():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


_LIBC = _libc()


def release_memory() -> None:
    """Unload every model ComfyUI holds, drop unreachable objects (executors, their output
    caches, captured graphs), and hand freed heap back to the system."""
    mm = sys.modules.get("comfy.model_management")
    if mm is not None:
        mm.unload_all_models()
    gc.collect()  # one full collection, after the unload: nothing becomes garbage after it
    if mm is not None:
        if hasattr(mm, "cleanup_models_gc"):
            mm.cleanup_models_gc()
        mm.soft_empty_cache()
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)  # glibc keeps freed arenas otherwise; RSS would only grow


@pytest.fixture(autouse=True)
def _release_after_each_test():
    yield
    release_memory()


@pytest.fixture(autouse=True)
def _every_step_reported(request, monkeypatch):
    """ComfyUI 0.33 sends the progress hook at most once per 100 ms (``comfy.utils``'s
    ``PROGRESS_THROTTLE_MIN_INTERVAL``), so on a GPU a short run reports only its first and last
    step. Tests that act at a given step (an interrupt at step 3) need every step reported, as
    0.3.64 does: the throttle is off while a test that runs ComfyUI runs. Nothing changes on
    0.3.64."""
    if "host" not in request.fixturenames:
        return
    request.getfixturevalue("host")  # ComfyUI is importable from here on
    import comfy.utils

    if hasattr(comfy.utils, "PROGRESS_THROTTLE_MIN_INTERVAL"):
        monkeypatch.setattr(comfy.utils, "PROGRESS_THROTTLE_MIN_INTERVAL", 0.0)
        monkeypatch.setattr(comfy.utils, "PROGRESS_THROTTLE_MIN_PERCENT", 0.0)


@pytest.fixture(autouse=True)
def _captures_need_graphs(request):
    """Tests marked ``captures`` assert that the CUDA Graph node captures and replays. Where
    ComfyUI's DynamicVRAM is on (0.33+ on an NVIDIA GPU, its default) the node runs every step
    eager by design (``test_dynamic_vram.py`` checks that), so they are skipped there, saying
    how to run them: with ``CNA_DYNAMIC_VRAM=0`` (``tools/gpu.sh tests`` runs both ways)."""
    if request.node.get_closest_marker("captures") is None or "host" not in request.fixturenames:
        return
    if request.getfixturevalue("host").dynamic_vram:
        pytest.skip(
            "DynamicVRAM is on: the CUDA Graph node runs eager by design; these run with "
            "CNA_DYNAMIC_VRAM=0"
        )


@pytest.fixture(autouse=True)
def _every_run_samples(request, monkeypatch):
    """A prompt sent twice in a row to one executor is answered from ComfyUI's output cache: no
    node runs, and a test comparing the second result with the first compares a tensor with
    itself. Every run of a host test must sample (the sampler reports progress), unless the
    test is marked ``cached_rerun`` because the cached answer is what it checks."""
    if "host" not in request.fixturenames or request.node.get_closest_marker("cached_rerun"):
        return
    from comfyui_controlnet_accelerator.harness import runner

    run = runner.Runner.run

    def sampling_run(self, prompt, ids, **kwargs):
        res = run(self, prompt, ids, **kwargs)
        if res.extra.get("sampler_reports", 1) == 0:
            raise AssertionError(
                "the sampler did not run: ComfyUI answered this prompt from its output cache "
                "(the same prompt as the run before on this executor); change the seed, or mark "
                "the test cached_rerun if the cached answer is what it checks"
            )
        return res

    monkeypatch.setattr(runner.Runner, "run", sampling_run)
