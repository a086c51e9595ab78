# SPDX-License-Identifier: GPL-3.0-or-later
"""The CPU side of "two processes building the extension at once" (issue #9, item 2): a lock
left by a crashed build is cleared, a live one is left alone, and threads of one process that
ask for the extension together build it once. The real two-process build needs nvcc:
tests/kernels/test_build.py::test_two_processes_build_the_extension_at_once."""

from __future__ import annotations

import os
import threading
import time

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
