# SPDX-License-Identifier: GPL-3.0-or-later
"""IF nodes in a captured CUDA graph (kernels/graph_if.py): the body runs at a replay exactly
when the predicate is true, its matrix multiplies give ``F.linear``'s bits, and what follows
the node sees the body's writes. Both ways of recording the node are checked where torch has
its own: torch's, and the pack's extension's (the only one on torch before 2.12). Each runs
under PyTorch's native allocator here and under cudaMallocAsync in a process of its own (the
allocator is chosen at start-up).

Tier 1 (CPU): what ``available()`` answers without a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from comfyui_controlnet_accelerator.kernels import _jit, graph_if

ROOT = Path(__file__).resolve().parents[2]


def test_without_a_gpu_no_if_node_is_offered(monkeypatch):
    monkeypatch.setattr(graph_if, "_torch_has_if_nodes", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert graph_if.available() == "no CUDA device"


def test_the_extensions_answer_is_asked_once_per_process(monkeypatch):
    """available() runs at every step where the projections are hoisted: the extension is
    asked once, and its answer (here: not available) kept."""
    asked = []
    monkeypatch.setattr(graph_if, "_torch_has_if_nodes", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_jit, "ensure_loaded", lambda: asked.append(1))
    graph_if._extension_reason.cache_clear()
    try:
        whys = [graph_if.available() for _ in range(3)]
    finally:
        graph_if._extension_reason.cache_clear()
    assert len(asked) == 1
    assert whys[0] == whys[2] and "extension, which can, is not available" in whys[0]


def _ways() -> list[str]:
    ways = ["extension"]
    if hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node"):
        ways.append("torch")
    return ways


def _record_with(way: str, monkeypatch) -> None:
    """Skip without a GPU and the extension; else make ``graph_if`` record the way asked."""
    if not torch.cuda.is_available() or _jit.ensure_loaded() is None:
        pytest.skip("no CUDA device or CUDA extension")
    if way == "extension":
        monkeypatch.setattr(graph_if, "_torch_has_if_nodes", lambda: False)


def check_if_node(way: str) -> None:
    """Capture ``x @ w.T`` into buffers inside an IF node (predicate: the input's bits differ
    from the last projected copy), then an attention that reads the buffers; replay with the
    input unchanged and changed, and compare with the same network without a graph. ``way``:
    who records the node (the caller makes ``graph_if`` use it)."""
    assert graph_if._torch_has_if_nodes() == (way == "torch"), way
    why = graph_if.available()
    assert why is None, why
    dev = "cuda"
    torch.manual_seed(0)
    B, T, C, N = 2, 77, 1024, 640
    ws = [torch.randn(N, C, device=dev, dtype=torch.float16) * 0.02 for _ in range(4)]
    x = torch.randn(B, T, C, device=dev, dtype=torch.float16)
    prev = torch.empty_like(x)
    force = torch.ones((), dtype=torch.bool, device=dev)
    bufs = [torch.empty(B, T, N, device=dev, dtype=torch.float16) for _ in ws]
    q = torch.randn(B, 256, N, device=dev, dtype=torch.float16)
    ran = torch.zeros((), dtype=torch.int32, device=dev)  # counts the body's runs

    def project():
        for w, b in zip(ws, bufs, strict=True):
            torch.mm(x.view(-1, C), w.t(), out=b.view(-1, N))
        prev.copy_(x)
        force.zero_()
        ran.add_(1)

    def attend(ks):
        out = q
        for k in ks:
            h = k.view(B, T, 10, 64).transpose(1, 2)
            a = F.scaled_dot_product_attention(q.view(B, 256, 10, 64).transpose(1, 2), h, h)
            out = out + a.transpose(1, 2).reshape(B, 256, N)
        return out

    def step(graph):
        changed = torch.ne(x.view(torch.int16), prev.view(torch.int16)).any() | force
        if graph is None:
            if bool(changed):
                project()
        else:
            with graph_if.if_node(graph, changed):
                project()
        return attend(bufs)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(None)  # warm-up: cuBLAS and the attention pick their kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = graph_if.PooledGraph(torch.cuda.graph_pool_handle())
    with torch.cuda.graph(g, pool=g.capture_pool, stream=side):
        out = step(g)
    force.fill_(True)
    ran.zero_()
    plan = [("forced", None), ("same", None), ("new", 1), ("same", None), ("new", 2)]
    for i, (what, seed) in enumerate(plan):
        if seed is not None:
            x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).half())
        g.replay()
        torch.cuda.synchronize()
        want = attend([F.linear(x, w) for w in ws])
        assert torch.equal(out, want), (way, i, what)
    assert int(ran) == 3, (way, int(ran))  # forced, then the two new inputs only
    ws[0].mul_(1.5)  # a weight changed in place: only forcing the node brings it in
    force.fill_(True)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, attend([F.linear(x, w) for w in ws])), way
    assert int(ran) == 4


@pytest.mark.cuda
@pytest.mark.parametrize("way", _ways())
def test_if_node_runs_its_body_only_when_the_predicate_holds(way, monkeypatch):
    _record_with(way, monkeypatch)
    check_if_node(way)


@pytest.mark.cuda
@pytest.mark.parametrize("way", _ways())
def test_if_node_under_cuda_malloc_async(way):
    """The same in a process whose allocator is cudaMallocAsync (ComfyUI's default)."""
    if not torch.cuda.is_available() or _jit.ensure_loaded() is None:
        pytest.skip("no CUDA device or CUDA extension")
    code = (
        "import importlib.util, sys, torch\n"
        "spec = importlib.util.spec_from_file_location('comfyui_controlnet_accelerator',"
        " sys.argv[1] + '/__init__.py', submodule_search_locations=[sys.argv[1]])\n"
        "pack = importlib.util.module_from_spec(spec)\n"
        "sys.modules['comfyui_controlnet_accelerator'] = pack\n"
        "spec.loader.exec_module(pack)\n"
        "from comfyui_controlnet_accelerator.kernels import graph_if\n"
        f"if {way!r} == 'extension': graph_if._torch_has_if_nodes = lambda: False\n"
        "spec = importlib.util.spec_from_file_location('t', sys.argv[2])\n"
        "t = importlib.util.module_from_spec(spec); spec.loader.exec_module(t)\n"
        "assert torch.cuda.get_allocator_backend() == 'cudaMallocAsync'\n"
        f"t.check_if_node({way!r}); print('ok')\n"
    )
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync")
    out = subprocess.run(
        [sys.executable, "-c", code, str(ROOT), __file__],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.cuda
@pytest.mark.parametrize("way", _ways())
def test_nested_if_nodes(way, monkeypatch):
    """An IF node inside another's body: the inner body runs only when both predicates hold."""
    _record_with(way, monkeypatch)
    assert graph_if.available() is None
    outer = torch.zeros((), dtype=torch.bool, device="cuda")
    inner = torch.zeros((), dtype=torch.bool, device="cuda")
    count = torch.zeros(2, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    g = graph_if.PooledGraph(torch.cuda.graph_pool_handle())
    with torch.cuda.graph(g, pool=g.capture_pool, stream=side):
        with graph_if.if_node(g, outer.clone()):
            count[0].add_(1)
            with graph_if.if_node(g, inner.clone()):
                count[1].add_(1)
    runs = [(False, False), (False, True), (True, False), (True, True), (True, True)]
    for o, i in runs:
        outer.fill_(o)
        inner.fill_(i)
        g.replay()
    torch.cuda.synchronize()
    assert count.tolist() == [3, 2], (way, count.tolist())
