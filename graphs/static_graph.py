# SPDX-License-Identifier: GPL-3.0-or-later
"""Capture a function into a CUDA graph once per input signature and replay it.

``GraphCache.run(key, fn, inputs)`` is the whole interface:
- the first call for a ``key`` copies ``inputs`` into static buffers, runs ``fn`` eagerly on a
  side stream (warm-up: cuBLAS/cuDNN handles, lazy inits; its result is this call's answer),
  then captures ``fn`` on those buffers into a ``torch.cuda.CUDAGraph`` (under cudaMallocAsync
  also launches it once, so that its output exists before anyone can free it: ``_first_launch``);
- later calls copy the new inputs into the static buffers, replay, and return a clone of the
  static output (so nothing the caller keeps is overwritten by the next replay);
- any exception during warm-up or capture ends the capture cleanly, marks the key as failed with
  the reason (logged once), and every later call for that key runs ``fn`` eagerly: a failing
  signature is never retried every step;
- ``verify=True`` replays once right after capture and compares with the eager result; a
  mismatch beyond ``verify_tol`` marks the key failed and the eager result is used;
- at most ``max_graphs`` graphs are kept (least recently used go first); all share one memory
  pool, which is safe because replays never run concurrently and each graph recomputes its
  intermediates on every replay.

Capture uses ``capture_error_mode="thread_local"`` so that other host threads (previews, the UI
server) calling CUDA during a capture do not invalidate it.

The ``emulate`` backend runs the same bookkeeping on any device without CUDA graphs: "replay"
calls ``fn`` on the static buffers. CPU tests use it to check that the caller refreshes every
static buffer it should, which real replays would otherwise silently read stale.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
import time
import traceback
import types
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

from ..kernels import graph_if
from ..logger import logger


class CaptureFailed(RuntimeError):
    """Capture (or its warm-up or verification) failed; the reason is in the message."""


def backend_name(device: torch.device | None = None) -> str:
    """``cuda`` when real CUDA graphs can be used for ``device``, else ``none``.

    ``$CNA_GRAPH_BACKEND=emulate`` selects the emulation on any device (tests), ``=none`` turns
    graphs off everywhere.
    """
    forced = os.environ.get("CNA_GRAPH_BACKEND")
    if forced in ("cuda", "emulate", "none"):
        return forced
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        return "cuda"
    return "none"


_STAGING_DEPTH = 4  # pinned buffers per host input: a replay waits only when the host is
# this many replays ahead of the GPU


def _libc_memcmp():
    try:
        libc = ctypes.cdll.msvcrt if sys.platform == "win32" else ctypes.CDLL(None)
        f = libc.memcmp
    except (OSError, AttributeError):  # no C library to load (then torch.equal is used)
        return None
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return f


_MEMCMP = _libc_memcmp()


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two host tensors of one shape and dtype hold the same bytes.

    One ``memcmp`` over the storage when both are contiguous: a single-threaded scan of a few
    hundred KB, microseconds. ``torch.equal`` compares values through the intra-op thread pool,
    whose wake-ups cost far more than the comparison on a busy host, and it is used only where
    the bytes cannot be compared directly. Equal bytes are what matters here: the static buffer
    then already holds exactly what the copy would write."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if _MEMCMP is not None and a.is_contiguous() and b.is_contiguous():
        n = a.numel() * a.element_size()
        return n == 0 or _MEMCMP(a.data_ptr(), b.data_ptr(), n) == 0
    return torch.equal(a, b)


def _copy_from_host(entry: GraphEntry, i: int, dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for a tensor in pageable host memory, without blocking the host.

    A copy from pageable memory returns only when it is done, so the host would wait for all the
    GPU work queued before it (the previous step). Staged through pinned buffers, the copy is
    queued like a kernel; each buffer is written again only once its last copy out has run (an
    event per buffer), and a ring of them keeps that wait off the normal path.

    Most host inputs are the same values every step (the text conditioning, rebuilt by
    ComfyUI's cond batching as a new tensor of equal values): when ``src`` equals what was
    staged last, ``dst`` already holds it (nothing else writes a graph's static inputs) and
    nothing is copied, so the host never waits on the GPU for it. Time spent waiting anyway is
    added to ``entry.host_wait_s``."""
    ring = entry.staging.get(i)
    if ring is None or ring[0][0].shape != src.shape or ring[0][0].dtype != src.dtype:
        ring = entry.staging[i] = [
            (torch.empty_like(src, pin_memory=True), torch.cuda.Event())
            for _ in range(_STAGING_DEPTH)
        ]
    elif entry.staged.get(i) and _same_bytes(ring[-1][0], src):
        entry.host_copies_skipped += 1
        return
    buf, done = ring.pop(0)
    ring.append((buf, done))
    if not done.query():
        t0 = time.perf_counter()
        done.synchronize()
        entry.host_wait_s += time.perf_counter() - t0
    buf.copy_(src)
    dst.copy_(buf, non_blocking=True)
    done.record()
    entry.staged[i] = True


@dataclass
class GraphEntry:
    """One captured signature: static inputs, the graph, its static output."""

    key: Hashable
    static_inputs: list[torch.Tensor]
    static_output: torch.Tensor | None
    graph: object  # torch.cuda.CUDAGraph (None when emulated)
    capture_s: float
    replays: int = 0
    # Caller-owned extras captured by address (e.g. per-ControlNet hint and strength buffers).
    extras: dict = field(default_factory=dict)
    # input index -> (pinned host buffer, event after its last copy out): inputs that arrive in
    # pageable host memory go through these, so a replay does not block the host
    staging: dict = field(default_factory=dict)
    host_wait_s: float = 0.0  # host time spent waiting for a staging buffer to come free
    staged: dict = field(default_factory=dict)  # input index -> its last staged buffer is valid
    host_copies_skipped: int = 0  # host inputs equal to the last staged values: not copied


class GraphCache:
    def __init__(self, name: str, max_graphs: int = 8, backend: str = "cuda"):
        if max_graphs < 1:
            raise ValueError("max_graphs must be at least 1")
        self.name = name
        self.max_graphs = max_graphs
        self.backend = backend
        self.entries: OrderedDict[Hashable, GraphEntry] = OrderedDict()
        self.failed: dict[Hashable, str] = {}
        self._pool = None
        self._stream = None
        self.capturing = False  # True while fn runs for a capture (tests inject faults on it)
        self.capturing_graph = None  # the CUDA graph being captured, while fn runs for it
        # Whether captures go through cudaMallocAsync (its failure handling differs).
        self.async_allocator = backend == "cuda" and _async_allocator()
        self.captures = 0
        self.total_capture_s = 0.0
        # Host seconds inside the driver's graph launch, summed over replays: the launch returns
        # only once the GPU has taken up the previous one, so it is time spent waiting.
        self.launch_s = 0.0
        # Bumped whenever a graph is dropped: a caller holding an entry from an earlier lookup
        # may keep using it while the version is unchanged (no lookup, no key hash).
        self.version = 0

    # -- bookkeeping ---------------------------------------------------------------------------

    def lookup(self, key: Hashable) -> GraphEntry | None:
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    def mark_failed(self, key: Hashable, reason: str) -> None:
        if key not in self.failed:
            logger.warning(
                "%s: CUDA graph disabled for this input signature, running eager: %s",
                self.name,
                reason,
            )
        self.failed[key] = reason

    def evict(self, predicate: Callable[[GraphEntry], bool], reason: str) -> int:
        gone = [k for k, e in self.entries.items() if predicate(e)]
        for k in gone:
            self._drop(k)
        if gone:
            logger.info("%s: dropped %d CUDA graph(s): %s", self.name, len(gone), reason)
        return len(gone)

    def clear(self, reason: str = "cleared") -> None:
        self.evict(lambda e: True, reason)
        self.failed.clear()

    def _drop(self, key: Hashable) -> None:
        entry = self.entries.pop(key)
        self.version += 1
        _release(entry)

    # -- running -------------------------------------------------------------------------------

    def replay(
        self,
        entry: GraphEntry,
        inputs: Sequence[torch.Tensor],
        fn: Callable[..., torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Copy inputs into the static buffers, replay, return a fresh copy of the output.

        ``fn`` matters only to the emulate backend, which calls it (default: the captured
        function) on the static buffers where a real replay would run the recorded kernels.
        """
        for i, (dst, src) in enumerate(zip(entry.static_inputs, inputs, strict=True)):
            if dst is src:
                continue
            if self.backend == "cuda" and dst.is_cuda and src.device.type == "cpu":
                _copy_from_host(entry, i, dst, src)
            else:
                dst.copy_(src)
        if self.backend == "cuda":
            t0 = time.perf_counter()
            entry.graph.replay()
            self.launch_s += time.perf_counter() - t0
        else:
            if fn is None:
                raise ValueError("the emulate backend replays by calling fn: pass it")
            entry.static_output = fn(*entry.static_inputs)
        entry.replays += 1
        return entry.static_output.clone()

    def capture(
        self,
        key: Hashable,
        fn: Callable[..., torch.Tensor],
        inputs: Sequence[torch.Tensor],
        *,
        extras: dict | None = None,
        warmup: int = 1,
        verify: bool = False,
        verify_tol: float = 1e-3,
        prepare: Callable[[GraphEntry], None] | None = None,
        device: torch.device | None = None,
        compile_first: bool = False,
    ) -> tuple[GraphEntry, torch.Tensor]:
        """Capture ``fn`` for ``key``; returns the entry and this call's (eager) result.

        Static buffers live on ``device`` (default: each input's own device). Inputs that arrive
        on the CPU (ComfyUI keeps conditioning there) are copied in before each replay, outside
        the graph: a copy from pageable host memory cannot be captured.
        ``prepare(entry)`` runs after the static buffers exist and before warm-up, so the caller
        can point its own objects at ``entry.extras`` buffers. ``compile_first``: ``fn`` compiles
        code on its first call for these inputs (graphs/compiled.py), which may not happen in
        the checked warm-up or the capture; one ordinary call on the static buffers runs first.
        Raises ``CaptureFailed``.
        """
        if self.async_allocator and _ASYNC_BROKEN:
            raise CaptureFailed(_ASYNC_BROKEN[0])
        t0 = time.perf_counter()
        static = [t.detach().to(device or t.device, copy=True) for t in inputs]
        entry = GraphEntry(key, static, None, None, 0.0, extras=dict(extras or {}))
        if prepare is not None:
            prepare(entry)
        if self.backend == "cuda":
            if compile_first:
                try:
                    fn(*static)
                except Exception as e:
                    raise CaptureFailed(f"compile: {type(e).__name__}: {e}") from e
            eager = self._capture_cuda(entry, fn, warmup)
        else:
            eager = fn(*static)
            self.capturing = True
            try:
                entry.static_output = fn(*static)
            except Exception as e:
                if self.async_allocator:
                    _note_async_failure(f"capture: {type(e).__name__}: {e}")
                raise CaptureFailed(f"capture: {type(e).__name__}: {e}") from e
            finally:
                self.capturing = False
            entry.graph = None  # keeping fn would keep everything it closes over alive
        if verify:
            got = self.replay(entry, static, fn)
            err = _rel_err(got, eager)
            if not err <= verify_tol:  # also catches NaN
                _release(entry)
                raise CaptureFailed(
                    f"verify: first replay differs from eager by {err:.3g} (relative L2) "
                    f"> {verify_tol:g}"
                )
        entry.capture_s = time.perf_counter() - t0
        self.entries[key] = entry
        self.captures += 1
        self.total_capture_s += entry.capture_s
        while len(self.entries) > self.max_graphs:
            oldest = next(iter(self.entries))
            self._drop(oldest)
            logger.info(
                "%s: evicted the least recently used CUDA graph (max_graphs=%d)",
                self.name,
                self.max_graphs,
            )
        return entry, eager

    def _capture_cuda(self, entry: GraphEntry, fn, warmup: int) -> torch.Tensor:
        if self._pool is None or not self.entries:
            # A fresh pool whenever no graph of ours is alive: PyTorch (2.11+) refuses to capture
            # into a pool whose graphs were all released ("use_count > 0 INTERNAL ASSERT" in
            # the host caching allocator, seen on the H200 after models were unloaded), and that
            # failed capture_begin then leaves cudaMallocAsync unable to capture at all.
            self._pool = torch.cuda.graph_pool_handle()
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        side = self._stream
        cur = torch.cuda.current_stream()
        side.wait_stream(cur)
        with torch.cuda.stream(side), _sync_check():
            # A host sync in the function would invalidate the capture; under cudaMallocAsync
            # an invalidated capture cannot be cleaned up (see _end_failed_capture). So syncs
            # are caught here, in eager warm-up, where they are harmless.
            eager = None
            try:
                for _ in range(max(1, warmup)):
                    eager = fn(*entry.static_inputs)
            except Exception as e:
                raise CaptureFailed(f"warm-up: {type(e).__name__}: {e}") from e
        cur.wait_stream(side)
        torch.cuda.synchronize()
        gc.collect()
        # The warm-up's temporaries went back to the ordinary pool's cache, where the graph's
        # own pool cannot reuse them: the capture needs the same memory again. On a card with
        # little free memory (a 16 GB card under DynamicVRAM, with the classic copies loaded)
        # that second helping is not there, and an allocation that fails inside the capture
        # invalidates it. Handing the cache back first lets the graph's pool take it.
        torch.cuda.empty_cache()
        if not self.async_allocator:
            _clear_cublas_workspaces()
        graph = graph_if.PooledGraph(self._pool)  # IF nodes recorded in it need the pool
        with torch.cuda.stream(side):
            try:
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            except Exception as e:
                msg = f"capture_begin: {type(e).__name__}: {e}"
                if self.async_allocator:
                    _note_async_failure(msg)
                raise CaptureFailed(msg) from e
            self.capturing = True
            self.capturing_graph = graph
            try:
                out = fn(*entry.static_inputs)
            except BaseException as e:
                msg = f"capture: {type(e).__name__}: {e}"
                tb = e.__traceback__
                del e
                self.capturing = False
                self.capturing_graph = None
                _end_failed_capture(graph, tb)
                del tb
                if self.async_allocator:
                    _note_async_failure(msg)
                raise CaptureFailed(msg) from None
            self.capturing = False
            self.capturing_graph = None
            try:
                graph.capture_end()
            except Exception as e:
                msg = f"capture_end: {type(e).__name__}: {e}"
                if self.async_allocator:
                    _note_async_failure(msg)
                raise CaptureFailed(msg) from e
        cur.wait_stream(side)
        if self.async_allocator:
            _first_launch(graph, out)
        entry.graph = graph
        entry.static_output = out
        return eager

    def run(
        self,
        key: Hashable,
        fn: Callable[..., torch.Tensor],
        inputs: Sequence[torch.Tensor],
        **capture_kw,
    ) -> torch.Tensor:
        """Replay the graph for ``key``, capturing it first if needed; eager if ``key`` failed."""
        if key in self.failed:
            return fn(*inputs)
        entry = self.lookup(key)
        if entry is not None:
            return self.replay(entry, inputs, fn)
        try:
            _, out = self.capture(key, fn, inputs, **capture_kw)
            return out
        except CaptureFailed as e:
            self.mark_failed(key, str(e))
        except Exception as e:  # warm-up raised: the eager path will raise it again if real
            self.mark_failed(key, f"warm-up: {type(e).__name__}: {e}")
        return fn(*inputs)


# Under cudaMallocAsync one failed capture leaves PyTorch's allocator unable to capture again
# (seen on the H200, torch 2.11: "capture_free_streams.empty() INTERNAL ASSERT FAILED" at the
# next capture: when cudaStreamEndCapture fails, the allocator's capture_underway flag is never
# reset, so every later free is logged as a capture free). After the first failure no further
# capture is attempted in this process: every graph request runs eager, with this reason, until
# ComfyUI restarts. The list is process-wide, shared by every copy of this module (the pack can
# be imported under two names), because the allocator state it describes is.
_PROCESS_STATE = sys.modules.setdefault(
    "_cna_graph_process_state", types.ModuleType("_cna_graph_process_state")
)
if not hasattr(_PROCESS_STATE, "async_broken"):
    _PROCESS_STATE.async_broken = []
_ASYNC_BROKEN: list[str] = _PROCESS_STATE.async_broken


def _note_async_failure(msg: str) -> None:
    if not _ASYNC_BROKEN:
        _ASYNC_BROKEN.append(
            "an earlier CUDA graph capture failed under the cudaMallocAsync allocator, after "
            f"which PyTorch cannot capture again in this process ({msg}); restart ComfyUI, or "
            "start it with --disable-cuda-malloc to keep graphs after such a failure"
        )
        logger.error("CUDA Graph: %s", _ASYNC_BROKEN[0])


# Tracebacks of captures the CUDA driver invalidated under cudaMallocAsync. Their frames hold
# tensors allocated inside the invalid capture; freeing those would fail inside a C++ destructor
# and abort the process, so they are kept for the life of the process (an extra reference makes
# sure interpreter shutdown does not free them either). Bounded: one partial step per failure,
# and a failed signature is never captured again.
_QUARANTINE: list = []


def _end_failed_capture(graph, tb) -> None:
    """End a capture whose body raised, leaving the stream out of capture mode whatever happened.

    If the capture is still valid, the tensors the body allocated are freed *before* ending it
    (as captured frees): freed after, they would point into a graph that never ran, and
    cudaMallocAsync aborts on that. If the driver already invalidated it (an illegal call such
    as a host sync), native-allocator tensors are freed normally and cudaMallocAsync ones are
    quarantined.
    """
    still_valid = torch.cuda.is_current_stream_capturing()
    if still_valid or not _async_allocator():
        traceback.clear_frames(tb)
        gc.collect()
    else:
        if not _QUARANTINE:
            import ctypes

            ctypes.pythonapi.Py_IncRef(ctypes.py_object(_QUARANTINE))
        _QUARANTINE.append(tb)
        logger.warning(
            "CUDA graph capture was invalidated by the driver under cudaMallocAsync; its partial "
            "allocations are kept (not freed) to avoid a crash. Start ComfyUI with "
            "--disable-cuda-malloc if this repeats."
        )
    try:
        graph.capture_end()
    except Exception:
        pass
    try:
        graph.reset()
    except Exception:
        pass
    try:
        torch.cuda.synchronize()
    except Exception as e:  # a sticky CUDA error cannot be mended here; say so once
        logger.error("CUDA reported an error after a failed graph capture: %s", e)


# Captured graphs (with their outputs) whose first launch failed under cudaMallocAsync: their
# outputs were never allocated, so they cannot be freed (see _first_launch). Kept for the life of
# the process, like _QUARANTINE; one entry per failed signature, never captured again.
_NEVER_LAUNCHED: list = []


def _first_launch(graph, out) -> None:
    """Launch a graph just captured under cudaMallocAsync once, so its output exists.

    Under cudaMallocAsync the memory a capture allocates and does not free (the static output)
    belongs to the graph's memory nodes and only exists once the graph has been launched.
    Freeing it before then, which is what dropping a graph that was captured but never replayed
    does (the LRU evicting a signature that ran one step only, such as the last steps after a
    ControlNet's end_percent), makes cudaFreeAsync fail with "invalid argument" inside a tensor
    destructor, and the C++ exception there aborts the whole process (a soak run on
    the H200: both ComfyUI servers died, SIGABRT). Launched once here, while its inputs are
    still the ones the warm-up ran on, the graph repeats the warm-up's writes with the same
    values, and its output is an ordinary live allocation from then on.
    """
    try:
        graph.replay()
    except BaseException as e:
        if not _NEVER_LAUNCHED:
            import ctypes

            ctypes.pythonapi.Py_IncRef(ctypes.py_object(_NEVER_LAUNCHED))
        _NEVER_LAUNCHED.append((graph, out))
        raise CaptureFailed(f"first launch: {type(e).__name__}: {e}") from e


def _clear_cublas_workspaces() -> None:
    """Drop PyTorch's cached cuBLAS/cuBLASLt workspaces just before a capture.

    The warm-up ran outside the capture, so the workspace cuBLAS uses on the capture streams
    was allocated from the ordinary allocator, and the graph would bake in its address. Anyone
    may free it later: torch.compile's CUDA graphs (TorchCompileModel, backend "cudagraphs")
    clear all cuBLAS workspaces around each recording, after which ComfyUI's empty_cache hands
    the memory back or reuses it. Our next replay then read unmapped memory ("unspecified launch
    failure" on the H200, native allocator: fused+graph after a TorchCompileModel
    run). Cleared here, the workspace is allocated inside the capture, from our graph pool,
    which stays mapped while any of our graphs lives. PyTorch's own graph trees do the same.
    Native allocator only: under cudaMallocAsync a buffer allocated inside a capture belongs to
    the graph's memory nodes, and graph trees (the ones that clear workspaces) refuse to run
    there at all ("cudaMallocAsync does not yet support checkPoolLiveAllocations").
    """
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def _release(entry: GraphEntry) -> None:
    """Free an entry: its captured output first, then the graph."""
    entry.static_output = None
    entry.static_inputs.clear()
    entry.extras.clear()
    if hasattr(entry.graph, "reset"):
        entry.graph.reset()
    entry.graph = None


def _async_allocator() -> bool:
    try:
        return torch.cuda.memory.get_allocator_backend() == "cudaMallocAsync"
    except Exception:
        return False


class _sync_check:
    """Make host syncs raise (torch's sync debug mode) for the duration of the block."""

    def __enter__(self):
        self.prev = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode(self.prev)
        return False


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.double()
    b = b.double()
    den = b.norm().item()
    return (a - b).norm().item() / (den if den > 0 else 1.0)
