# SPDX-License-Identifier: GPL-3.0-or-later
"""IF nodes in a CUDA graph being captured: work recorded inside ``if_node(graph, pred)`` runs
at a replay only when the one-element bool CUDA tensor ``pred`` is true at that point of the
replay, so the GPU decides and the host never reads ``pred``.

PyTorch records them itself from 2.12 (``CUDAGraph.begin_capture_to_if_node``); on older torch
the pack's extension makes the same CUDA runtime calls (csrc/ops/graph_if.cu, CUDA 12.4+).
Inside the body nothing may synchronise, and under cudaMallocAsync nothing may allocate.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from . import _jit


def _torch_has_if_nodes() -> bool:
    return hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node")


def available() -> str | None:
    """None when IF nodes can be recorded in this process, else why not. Builds the extension
    on its first call where torch has no IF nodes of its own (never call it inside a capture).
    Called at every step where the projections are hoisted: the extension's answer is kept."""
    if _torch_has_if_nodes():
        return None
    if not torch.cuda.is_available():
        return "no CUDA device"
    return _extension_reason(torch.cuda.current_device())


@functools.cache
def _extension_reason(device: int) -> str | None:
    """Why the extension cannot record IF nodes on ``device``, or None once it can (its body
    streams then have their cuBLAS workspace). Final for the process: the extension is built
    or given up on once."""
    mod = _jit.ensure_loaded()
    if mod is None:
        return (
            f"torch {torch.__version__} cannot record IF nodes in a CUDA graph and the pack's "
            "CUDA extension, which can, is not available"
        )
    if not mod.graph_if_supported():
        return f"CUDA {torch.version.cuda} has no conditional graph nodes (12.4 or newer)"
    mod.graph_if_warm(device)
    return None


class PooledGraph(torch.cuda.CUDAGraph):
    """A CUDA graph that knows its memory pool while it is captured (torch before 2.12 gives
    ``pool()`` only after the capture), as ``if_node`` needs there: capture it with
    ``pool=graph.capture_pool``."""

    def __new__(cls, pool, keep_graph: bool = False):
        return super().__new__(cls, keep_graph)

    def __init__(self, pool, keep_graph: bool = False):
        super().__init__(keep_graph)
        self.capture_pool = pool


@contextlib.contextmanager
def if_node(graph: torch.cuda.CUDAGraph, pred: torch.Tensor) -> Iterator[None]:
    """Record the block's CUDA work into an IF node of ``graph``, the graph being captured on
    the current stream, run when ``pred`` is true (``available()`` must have said None). On
    torch before 2.12, ``graph`` must be a ``PooledGraph``."""
    if _torch_has_if_nodes():
        graph.begin_capture_to_if_node(pred)
        try:
            yield
        finally:
            graph.end_capture_to_conditional_node()
        return
    pool = getattr(graph, "capture_pool", None)
    if pool is None:
        raise RuntimeError("IF node: the graph's memory pool is unknown during its capture")
    mod = _jit.module()
    mod.graph_if_begin(pred, int(pool[0]), int(pool[1]))
    try:
        yield
    finally:
        mod.graph_if_end()
