# SPDX-License-Identifier: GPL-3.0-or-later
"""The CPU side of the extension's build.

Two processes building at once: a lock left by a crashed build is cleared, a live one is left
alone, and threads of one process that ask for the extension together build it once (the real
two-process build needs nvcc: tests/kernels/test_build.py). A build's progress: reported from
the caller's thread, one step per source and one for the link, with a stand-in for torch's
loader. ``prepare_cuda``: builds only where the ops would use the kernels."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from comfyui_controlnet_accelerator.kernels import _jit


def test_a_stale_build_lock_is_removed_and_a_live_one_kept(tmp_path, caplog):
    stale, live = tmp_path / "stale", tmp_path / "live"
    for d in (stale, live):
        d.mkdir()
        (d / "lock").write_text("")
    old = time.time() - _jit.STALE_LOCK_S - 60
    os.utime(stale / "lock", (old, old))
    with caplog.at_level("WARNING", logger="ControlNetAccelerator"):
        _jit._clear_stale_lock(stale)
        _jit._clear_stale_lock(live)
        _jit._clear_stale_lock(tmp_path / "no-such-build")
    assert not (stale / "lock").exists()
    assert (live / "lock").exists()  # another process may be compiling right now
    assert [r.message for r in caplog.records if "stale build lock" in r.message]
    assert len(caplog.records) == 1


def test_threads_asking_at_once_build_once(monkeypatch):
    _jit.reset_for_tests()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    calls = []
    module = object()

    def slow_build(*a, **k):
        calls.append(threading.get_ident())
        time.sleep(0.3)
        return module

    monkeypatch.setattr(_jit, "build", slow_build)
    got = []
    try:
        threads = [
            threading.Thread(target=lambda: got.append(_jit.ensure_loaded())) for _ in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(calls) == 1 and got == [module] * 4
    finally:
        _jit.reset_for_tests()


def test_a_fresh_build_reports_each_source_and_the_link_from_the_callers_thread(
    standin_compiler,
):
    module, loads = standin_compiler(_jit, step_s=0.15)
    seen = []
    me = threading.get_ident()
    got = _jit.build("9.0", on_progress=lambda d, t: seen.append((d, t, threading.get_ident())))
    total = len(_jit.SOURCES) + 1
    assert got is module
    assert loads and loads[0] != me  # compiled on a helper thread
    assert {th for _, _, th in seen} == {me}  # reported where the caller can show it
    done = [d for d, _, _ in seen]
    assert all(t == total for _, t, _ in seen)
    assert done[0] == 0 and done[-1] == total and done == sorted(set(done))
    assert len(done) >= 4  # steps in between, not only the start and the end

    # The same build again is a cache hit: loaded in this thread, nothing reported.
    seen.clear()
    assert _jit.build("9.0", on_progress=lambda d, t: seen.append(d)) is module
    assert seen == [] and loads[-1] == me


def test_a_failing_reported_build_raises_its_error_and_a_broken_bar_never_stops_it(
    monkeypatch, standin_compiler
):
    from torch.utils import cpp_extension

    module, _ = standin_compiler(_jit, step_s=0.15)

    def bar(done, total):
        raise RuntimeError("the progress bar is gone")

    assert _jit.build("9.0", on_progress=bar) is module

    def broken(name, sources, build_directory, **kw):
        raise RuntimeError("nvcc: error")

    monkeypatch.setattr(cpp_extension, "load", broken)
    with pytest.raises(RuntimeError, match="nvcc: error"):
        _jit.build("8.9", on_progress=lambda d, t: None)  # another arch: a fresh build


def test_compiler_jobs_fit_the_free_memory_unless_max_jobs_says(monkeypatch):
    monkeypatch.delenv("MAX_JOBS", raising=False)
    gib, n = 1 << 30, len(_jit.SOURCES)
    assert n >= 2  # otherwise the cap below could not show
    assert _jit.build_jobs(available=128 * gib, cpus=64) == n  # one per source at most
    assert _jit.build_jobs(available=128 * gib, cpus=2) == 2  # one per CPU at most
    assert _jit.build_jobs(available=_jit.BUILD_RESERVE_BYTES + 2 * _jit.JOB_BYTES, cpus=64) == 2
    assert _jit.build_jobs(available=1 * gib, cpus=64) == 1  # never none
    monkeypatch.setenv("MAX_JOBS", "7")
    assert _jit.build_jobs(available=1 * gib, cpus=64) is None  # the user's choice stands


def test_a_fresh_build_runs_the_jobs_that_fit_and_puts_max_jobs_back(
    monkeypatch, standin_compiler, caplog
):
    from torch.utils import cpp_extension

    module, _ = standin_compiler(_jit, step_s=0.0)
    monkeypatch.delenv("MAX_JOBS", raising=False)
    monkeypatch.setattr(_jit, "available_memory_bytes", lambda: _jit.BUILD_RESERVE_BYTES + 1)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    seen = []
    standin = cpp_extension.load

    def load(**kw):
        seen.append(os.environ.get("MAX_JOBS"))
        return standin(**kw)

    monkeypatch.setattr(cpp_extension, "load", load)
    with caplog.at_level("INFO"):
        assert _jit.build("9.0") is module
    assert seen == ["1"] and "MAX_JOBS" not in os.environ
    assert any("1 compiler job(s) at once" in r.getMessage() for r in caplog.records)

    monkeypatch.setenv("MAX_JOBS", "3")  # set by the user: passed on as it is, and kept
    assert _jit.build("8.9") is module
    assert seen == ["1", "3"] and os.environ["MAX_JOBS"] == "3"


def test_prepare_cuda_builds_only_where_the_ops_would_use_the_kernels(monkeypatch):
    from comfyui_controlnet_accelerator import kernels
    from comfyui_controlnet_accelerator.kernels import registry

    calls = []
    module = object()

    def ensure_loaded(on_progress=None):
        calls.append(on_progress)
        return module

    monkeypatch.setattr(_jit, "ensure_loaded", ensure_loaded)
    monkeypatch.setattr(_jit, "is_loaded", lambda: False)
    report = object()
    why = {"now": "no CUDA GPU visible"}
    monkeypatch.setattr(registry, "_cuda_static_reason", lambda: why["now"])
    assert kernels.prepare_cuda(report) is False and calls == []
    why["now"] = None
    monkeypatch.setattr(registry, "_cuda_by_default", lambda op=None: False)  # not validated
    assert kernels.prepare_cuda(report) is False and calls == []
    monkeypatch.setattr(registry, "_cuda_by_default", lambda op=None: True)
    assert kernels.prepare_cuda(report) is True and calls == [report]
    monkeypatch.setattr(_jit, "is_loaded", lambda: True)
    assert kernels.prepare_cuda(report) is True and len(calls) == 1
