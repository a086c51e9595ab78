# SPDX-License-Identifier: GPL-3.0-or-later
"""GraphCache: static buffers, LRU, remembered failures, verification (no ComfyUI needed).

The emulate backend runs everywhere (CI); the ``cuda`` tests capture real graphs on a GPU.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
from comfyui_controlnet_accelerator.graphs import CaptureFailed, GraphCache

CUDA = torch.cuda.is_available()


def _fn(w):
    def fn(x, y):
        return torch.relu(x @ w) + y.sum()

    return fn


@pytest.mark.parametrize("backend", ["emulate", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_replay_reads_fresh_inputs_every_time(backend):
    if backend == "cuda" and not CUDA:
        pytest.skip("no CUDA device")
    dev = "cuda" if backend == "cuda" else "cpu"
    g = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn(16, 16, device=dev, generator=g)
    fn = _fn(w)
    cache = GraphCache("t", backend=backend)
    for _i in range(4):
        x = torch.randn(8, 16, device=dev, generator=g)
        y = torch.randn(3, device=dev, generator=g)
        out = cache.run("k", fn, [x, y])
        torch.testing.assert_close(out, fn(x, y), rtol=1e-5, atol=1e-5)
    assert cache.captures == 1 and cache.lookup("k").replays == 3


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="no CUDA device")
def test_host_input_equal_to_the_last_one_is_not_copied_again():
    """A CPU input (ComfyUI's text conditioning) is staged through pinned buffers; a new tensor
    with the same values is not copied again (the host would wait on the GPU for nothing), and
    a changed one is, for every replay after it."""
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(16, 16, device="cuda", generator=g)
    fn = _fn(w)
    cache = GraphCache("t", backend="cuda")
    x = torch.randn(8, 16, device="cuda", generator=g)
    y0 = torch.randn(3)
    cache.run("k", fn, [x, y0.clone()], device=torch.device("cuda"))  # capture
    entry = cache.lookup("k")
    outs = []
    for y in (y0.clone(), y0.clone(), y0 + 1, (y0 + 1).clone(), y0.clone()):
        outs.append((cache.run("k", fn, [x, y]), fn(x, y.cuda())))
    for got, want in outs:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # copied: the first replay (a new ring), y0 + 1 and the return to y0; skipped: the other two
    assert entry.host_copies_skipped == 2
    assert not torch.equal(outs[1][0], outs[2][0])


def test_host_inputs_are_compared_by_their_bytes():
    """The staging skip compares bytes: equal bytes skip the copy (NaNs included), any changed
    byte copies (-0.0 against 0.0 too: the bytes differ), other shapes or dtypes never match,
    and a non-contiguous input is compared by value."""
    from comfyui_controlnet_accelerator.graphs.static_graph import _same_bytes

    a = torch.randn(2, 77, 768).half()
    assert _same_bytes(a, a.clone())
    b = a.clone()
    b.view(-1)[-1] += 1
    assert not _same_bytes(a, b)
    b = a.clone()
    b.view(torch.int16).view(-1)[0] ^= 1  # one bit of the first element
    assert not _same_bytes(a, b)
    n = torch.tensor([float("nan"), 1.0])
    assert _same_bytes(n, n.clone())
    assert not _same_bytes(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert not _same_bytes(a, a.float())
    assert not _same_bytes(a, a.reshape(154, 768))
    t = a.transpose(1, 2)
    assert _same_bytes(t.contiguous(), t) and not _same_bytes(t.contiguous(), t + 1)
    assert _same_bytes(torch.empty(0, 3), torch.empty(0, 3))


def test_returned_output_is_not_overwritten_by_the_next_replay():
    cache = GraphCache("t", backend="emulate")
    fn = _fn(torch.eye(4))
    a = cache.run("k", fn, [torch.ones(2, 4), torch.zeros(1)])
    b = cache.run("k", fn, [torch.ones(2, 4), torch.zeros(1)])
    c = cache.run("k", fn, [2 * torch.ones(2, 4), torch.zeros(1)])
    assert torch.equal(a, b) and not torch.equal(b, c)


def test_lru_keeps_at_most_max_graphs():
    cache = GraphCache("t", max_graphs=2, backend="emulate")
    fn = _fn(torch.eye(4))
    for k in ("a", "b", "a", "c"):  # "a" was used after "b", so "b" goes
        cache.run(k, fn, [torch.ones(2, 4), torch.zeros(1)])
    assert list(cache.entries) == ["a", "c"]


def test_failure_during_capture_is_remembered_and_eager_result_returned(caplog):
    cache = GraphCache("t", backend="emulate")
    calls = {"n": 0}

    def fn(x):
        calls["n"] += 1
        if cache.capturing:
            raise RuntimeError("not capturable")
        return x * 2

    with caplog.at_level(logging.WARNING, logger="ControlNetAccelerator"):
        for _ in range(3):
            assert torch.equal(cache.run("k", fn, [torch.ones(3)]), torch.full((3,), 2.0))
    assert "not capturable" in cache.failed["k"]
    assert sum("not capturable" in r.message for r in caplog.records) == 1  # logged once
    # one warm-up + one failed capture + one eager rerun, then one eager call per later step
    assert calls["n"] == 3 + 2


def test_verify_rejects_a_graph_that_disagrees_with_eager():
    cache = GraphCache("t", backend="emulate")
    state = {"n": 0}

    def fn(x):  # a function whose replays differ from its first call
        state["n"] += 1
        return x + state["n"]

    out = cache.run("k", fn, [torch.zeros(4)], verify=True)
    assert "verify" in cache.failed["k"]
    assert "k" not in cache.entries
    assert out.shape == (4,)


def test_evict_by_predicate_and_clear():
    cache = GraphCache("t", backend="emulate")
    fn = _fn(torch.eye(4))
    for k in ("a", "b"):
        cache.run(k, fn, [torch.ones(2, 4), torch.zeros(1)])
    assert cache.evict(lambda e: e.key == "a", "test") == 1
    assert list(cache.entries) == ["b"]
    cache.clear()
    assert not cache.entries


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="no CUDA device")
def test_cuda_capture_error_leaves_cuda_usable():
    """A host sync inside capture is a real capture violation: it must end in CaptureFailed,
    the eager result, and a CUDA context that still works (graphs too)."""
    cache = GraphCache("t", backend="cuda")

    def bad(x):
        y = x * 3
        if y.sum().item() > -1:  # .item() during capture is illegal
            return y + 1
        return y

    x = torch.arange(6.0, device="cuda")
    out = cache.run("bad", bad, [x])
    assert torch.equal(out, x * 3 + 1)
    # caught by the sync check of the eager warm-up, before any capture began
    assert "bad" in cache.failed and "warm-up" in cache.failed["bad"]
    assert not torch.cuda.is_current_stream_capturing()
    good = cache.run("good", lambda t: t * 5, [x])
    good = cache.run("good", lambda t: t * 5, [x + 1])
    assert torch.equal(good, (x + 1) * 5)
    torch.cuda.synchronize()


def test_capture_failed_is_a_runtime_error():
    assert issubclass(CaptureFailed, RuntimeError)


def _async_allocator() -> bool:
    return CUDA and torch.cuda.memory.get_allocator_backend() == "cudaMallocAsync"


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="no CUDA device")
@pytest.mark.skipif(
    _async_allocator(),
    reason="known limit: under cudaMallocAsync PyTorch aborts when a tensor allocated inside a "
    "capture the driver invalidated is freed (even a C++ temporary); the warm-up sync check "
    "(test_cuda_capture_error_leaves_cuda_usable) keeps syncs from reaching capture",
)
def test_cuda_capture_invalidated_by_the_driver_is_survived():
    """A sync only while capturing (not in warm-up) really invalidates the capture: the cache
    must end it, keep the process alive (native allocator), and serve the eager result."""
    cache = GraphCache("t", backend="cuda")

    def sneaky(x):
        y = x * 3
        if cache.capturing:
            float(y.sum())  # illegal: invalidates the capture
        return y + 1

    x = torch.arange(6.0, device="cuda")
    out = cache.run("sneaky", sneaky, [x])
    assert torch.equal(out, x * 3 + 1)
    assert "capture" in cache.failed["sneaky"]
    assert not torch.cuda.is_current_stream_capturing()
    y = cache.run("fine", lambda t: t - 1, [x])
    y = cache.run("fine", lambda t: t - 1, [x * 2])
    assert torch.equal(y, x * 2 - 1)
    torch.cuda.synchronize()


def test_after_a_failed_capture_under_cuda_malloc_async_no_capture_is_tried(monkeypatch):
    """PyTorch's async allocator cannot capture again after a failed capture, so the cache
    stops trying (eager with a reason) instead of tripping its internal assert per signature."""
    from comfyui_controlnet_accelerator.graphs import static_graph as sg

    monkeypatch.setattr(sg, "_ASYNC_BROKEN", [])
    cache = GraphCache("t", backend="emulate")
    cache.async_allocator = True  # what a "cuda" cache under cudaMallocAsync sets itself

    def bad(x):
        if cache.capturing:
            raise RuntimeError("boom")
        return x + 1

    assert torch.equal(cache.run("a", bad, [torch.zeros(2)]), torch.ones(2))
    assert sg._ASYNC_BROKEN and "restart ComfyUI" in sg._ASYNC_BROKEN[0]
    assert torch.equal(cache.run("b", lambda x: x * 2, [torch.ones(2)]), torch.full((2,), 2.0))
    assert "cudaMallocAsync" in cache.failed["b"] and "b" not in cache.entries


def _child_case(*allocators: str):
    """The marks of a CUDA case that runs in a child process under each of ``allocators``
    (``_assert_child_passes``); the allocator runs of this file do not nest it."""

    def mark(fn):
        fn = pytest.mark.parametrize("allocator", list(allocators))(fn)
        fn = pytest.mark.skipif(
            os.environ.get("CNA_ALLOCATOR_CHILD") == "1",
            reason="the allocator runs do not nest this",
        )(fn)
        fn = pytest.mark.skipif(not CUDA, reason="no CUDA device")(fn)
        return pytest.mark.cuda(fn)

    return mark


_CUBLAS_CHILD = "CNA_CUBLAS_CHILD"


@_child_case("native")
def test_graph_survives_cublas_workspaces_cleared_by_someone_else(allocator):
    """torch.compile's CUDA graphs (ComfyUI's TorchCompileModel, backend "cudagraphs") clear
    every cached cuBLAS workspace; ComfyUI then empties the cache. A graph of ours that baked in
    a workspace from outside its pool then reads unmapped memory on replay: a sticky CUDA error
    that ends the process (seen on the H200). So the case runs in a child process. Native
    allocator only: graph trees refuse to run under cudaMallocAsync, and there a workspace
    allocated inside our capture would belong to the graph's memory nodes."""
    if os.environ.get(_CUBLAS_CHILD) == "1":
        if torch.cuda.memory.get_allocator_backend() != allocator:
            pytest.skip(f"this child runs {torch.cuda.memory.get_allocator_backend()}")
        torch.manual_seed(0)
        w = torch.randn(1280, 1280, device="cuda", dtype=torch.float16) / 36

        def fn(x):
            for _ in range(4):
                x = torch.nn.functional.linear(x, w)  # cuBLASLt GEMMs, which use a workspace
            return x

        cache = GraphCache("t", backend="cuda")
        x = torch.randn(4096, 1280, device="cuda", dtype=torch.float16)
        cache.run("a", fn, [x])
        cache.clear()  # an earlier pool, as after models were unloaded
        ref = fn(x)
        cache.run("b", fn, [x])  # captured into a fresh pool
        torch._C._cuda_clearCublasWorkspaces()  # what torch.compile's graph trees do
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # what ComfyUI does between and inside runs
        junk = [torch.full((1 << 20,), float("nan"), device="cuda") for _ in range(64)]
        out = cache.run("b", fn, [x])
        torch.cuda.synchronize()
        del junk
        assert cache.lookup("b").replays == 1
        torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)
        return
    _assert_child_passes(
        "test_graph_survives_cublas_workspaces_cleared_by_someone_else", allocator, _CUBLAS_CHILD
    )


def _assert_child_passes(test: str, allocator: str, child_flag: str) -> None:
    """Run ``test[allocator]`` of this file in a child pytest under ``allocator`` (fixed when
    torch first touches CUDA) with ``child_flag`` set, for cases whose failure is an abort."""
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=f"backend:{allocator}", **{child_flag: "1"})
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    out = subprocess.run(
        [*cmd, f"{__file__}::{test}[{allocator}]"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    tail = "\n".join((out.stdout + out.stderr).splitlines()[-30:])
    assert out.returncode == 0 and " passed" in out.stdout, f"rc={out.returncode}\n{tail}"


_EVICT_CHILD = "CNA_EVICT_CHILD"


@_child_case("cudaMallocAsync", "native")
def test_dropping_graphs_that_never_replayed(allocator):
    """A signature that runs one step only (the last steps after a ControlNet's end_percent) is
    captured and never replayed; the LRU later drops it. Under cudaMallocAsync its output exists
    only once the graph has been launched, and freeing it before then aborted the process (both
    soak servers on the H200). Runs in a child process, since the failure is an abort."""
    if os.environ.get(_EVICT_CHILD) == "1":
        if torch.cuda.memory.get_allocator_backend() != allocator:
            pytest.skip(f"this child runs {torch.cuda.memory.get_allocator_backend()}")
        torch.manual_seed(0)
        w = torch.randn(256, 256, device="cuda") / 16
        fn = _fn(w)
        cache = GraphCache("t", max_graphs=2, backend="cuda")
        ys = [torch.randn(3, device="cuda") for _ in range(2)]
        for n in range(1, 9):  # every size a new signature, each captured and dropped unused
            x = torch.randn(n * 8, 256, device="cuda")
            out = cache.run(("once", n), fn, [x, ys[n % 2]])
            torch.testing.assert_close(out, fn(x, ys[n % 2]), rtol=1e-4, atol=1e-4)
        assert cache.captures == 8 and len(cache.entries) == 2
        x = torch.randn(64, 256, device="cuda")
        for _ in range(3):  # the survivors still replay correctly
            out = cache.run(("once", 8), fn, [x, ys[0]])
        torch.testing.assert_close(out, fn(x, ys[0]), rtol=1e-4, atol=1e-4)
        cache.run(("once", 9), fn, [torch.randn(72, 256, device="cuda"), ys[1]])
        cache.clear("models unloaded")  # drops a replayed graph and a never-replayed one
        torch.cuda.synchronize()
        assert not cache.entries
        return
    _assert_child_passes("test_dropping_graphs_that_never_replayed", allocator, _EVICT_CHILD)


_FITS_CHILD = "CNA_FITS_CHILD"


@_child_case("native")
def test_cuda_capture_fits_where_the_warm_up_left_its_memory_cached(allocator):
    """The warm-up's temporaries end in the ordinary pool's cache and the graph's pool needs as
    much again. With room for one helping only (as on a small card), the capture must still
    fit: the cache is handed back before it begins. In a child process: a capture that failed
    earlier in the same process (another test's, on purpose) can leave PyTorch's allocator
    unable to hand cached blocks back. Native allocator only: the memory fraction limits it."""
    if os.environ.get(_FITS_CHILD) != "1":
        _assert_child_passes(
            "test_cuda_capture_fits_where_the_warm_up_left_its_memory_cached",
            allocator,
            _FITS_CHILD,
        )
        return
    cache = GraphCache("t", backend="cuda")
    big = 256 * 2**20  # floats: 1 GiB of temporaries per call

    def fn(x):
        t = torch.ones(big, device=x.device)
        return x + t[:4].sum()

    x = torch.zeros(4, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    _, total = torch.cuda.mem_get_info()
    room = torch.cuda.memory_reserved() + int(1.5 * 2**30)  # one helping, not two
    torch.cuda.set_per_process_memory_fraction(room / total)
    try:
        out = cache.run("k", fn, [x])
        assert "k" not in cache.failed, cache.failed.get("k")
        assert cache.lookup("k") is not None
        assert torch.equal(out, x + 4)
        assert torch.equal(cache.run("k", fn, [x + 1]), x + 5)  # replays
    finally:
        cache.clear()
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
