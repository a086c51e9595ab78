# SPDX-License-Identifier: GPL-3.0-or-later
"""CUDA graphs under both of PyTorch's allocators.

The allocator is fixed when torch first touches CUDA, so each one gets its own pytest process:
ComfyUI's default (``main.py`` selects cudaMallocAsync) and PyTorch's native one. Under
cudaMallocAsync a mishandled failed capture does not raise but aborts the process, so the
failure-path tests matter most there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.host, pytest.mark.cuda, pytest.mark.slow]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.skipif(os.environ.get("CNA_ALLOCATOR_CHILD") == "1", reason="already the child run")
@pytest.mark.parametrize("backend", ["cudaMallocAsync", "native"])
def test_graph_tests_pass_under_allocator(backend, host):
    env = dict(
        os.environ,
        PYTORCH_CUDA_ALLOC_CONF=f"backend:{backend}",
        CNA_ALLOCATOR_CHILD="1",
        CNA_TEST_GPU="1",
        CNA_DYNAMIC_VRAM="0",  # ComfyUI 0.33: graphs capture only with DynamicVRAM off
        COMFYUI_PATH=str(host.root),
    )
    files = ["tests/graphs", "tests/host/test_cuda_graph.py"]
    if backend == "native":
        phases = [(files, "cuda or graph or failure or interrupted or unloaded or resolution")]
    else:
        # After a failed capture PyTorch's async allocator cannot capture again in that process
        # (the pack then runs eager on purpose), so the failure tests get a process of their own.
        # Compiled mode's refusal of this allocator runs only here: a pytest process has imported
        # torch before ComfyUI starts, so it keeps the native allocator unless told otherwise.
        phases = [
            (files, "not failure and not invalidated"),
            (files, "capture_error_leaves or falls_back_to_eager"),
            (["tests/host/test_compiled_mode.py"], "cuda_malloc_async"),
        ]
    for run_files, k in phases:
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-v",
            "-p",
            "no:cacheprovider",
            "-x",
            "-o",
            "log_cli=true",
            "--log-cli-level=WARNING",
            *run_files,
            "-k",
            k,
        ]
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        lines = (out.stdout + out.stderr).splitlines()
        # Test outcomes and the pack's warnings in order, so a failed capture is tied to its test;
        # a child that aborts leaves the running test's name as its last line of output.
        keep = ("PASSED", "FAILED", "WARNING", "ERROR", "Fatal Python error")
        kept = [ln for ln in lines if any(k in ln for k in keep)][:80]
        running = [f"last test started: {ln}" for ln in out.stdout.splitlines()[-1:]]
        tail = "\n".join(kept + running + lines[-25:])
        assert out.returncode == 0, f"{backend} [-k {k}]: rc={out.returncode}\n{tail}"
        assert " passed" in out.stdout, tail
