# SPDX-License-Identifier: GPL-3.0-or-later
"""Weights made ready one layer ahead, on a side stream: the Memory Pool's streamed layers
(weights in pinned system RAM) copy the *next* layer's weight to the GPU while the current
layer computes.

- **Order learned, never assumed.** Which layer follows which is recorded as they run (one
  *lane* per consumer stream: with concurrent ControlNets the UNet and the ControlNets each have
  their own). A wrong guess (a ControlNet skipped at this step) costs only the wasted copy: the
  layer then copies its weight itself. Nothing is guessed across the end of a model call
  (``end_pass``): the last layer of a step never prepares the first of the next, so a captured
  CUDA graph holds no work it does not use.
- **Stream-safe memory.** The prepared weight is allocated on the consumer's stream before the
  side stream waits for everything queued there so far; the consumer waits for the side stream
  before reading it; a weight prepared but not used is freed only after the consumer has waited
  for it. So the caching allocator (and a CUDA graph's private pool) reuses the memory in stream
  order, with no ``record_stream`` (which, during graph capture, would keep every block until
  the capture ends).
- **Memory.** At most one prepared weight per lane beyond the one in use.

Measured on the H200 (docs/benchmarks.md, Memory Pool): for the *INT8* layers, expanding one
layer ahead this way was slower than expanding in place under CUDA graphs (SD1.5, two
ControlNets: 22.16 -> 25.19 ms/step): the two cross-stream dependencies per layer (~850 a
step) cost more than the copies they hid. For streamed layers the copy is the long pole (PCIe),
so overlapping it is the point.

On the CPU, and for weights that need a cast on the way, layers get their weights
synchronously (tests can turn lanes on for the CPU: ``lanes_on_cpu``).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref
from dataclasses import dataclass

import torch

from ..logger import logger

ENABLED = True  # off: every layer gets its weight where it runs (tests, debugging)
COUNTS = ("prepared", "used", "wasted", "direct")
# The counters of the ``counting()`` blocks the current code runs in (innermost last).
_COUNTING: contextvars.ContextVar[tuple] = contextvars.ContextVar("cna_prefetch", default=())
_cpu_lanes = False
_lock = threading.Lock()
_LANES: dict[tuple, Lane] = {}


@dataclass
class _Pending:
    layer: weakref.ref
    dtype: torch.dtype
    tensor: torch.Tensor
    event: object  # torch.cuda.Event, or None on the CPU


class Lane:
    """The layers run on one stream of one device, and the one weight prepared for them."""

    def __init__(self, device: torch.device, consumer=None):
        self.device = device
        self.consumer = consumer  # the stream the layers run on (None on the CPU)
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.next: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.prev: weakref.ref | None = None
        self.pending: _Pending | None = None

    def weight(self, layer, dtype: torch.dtype) -> torch.Tensor:
        """``layer``'s weight in ``dtype`` on this lane's device, ready on the consumer stream;
        then the layer that followed it last time is prepared on the side stream."""
        w = None
        p, self.pending = self.pending, None
        if p is not None:
            self._wait(p)
            if p.layer() is layer and p.dtype == dtype:
                w = p.tensor
                _count("used")
            else:
                _count("wasted")
            del p
        if w is None:
            w = layer.expand_weight(dtype, self.device)
            _count("direct")
        prev = self.prev() if self.prev is not None else None
        if prev is not None and prev is not layer:
            self.next[prev] = weakref.ref(layer)
        self.prev = weakref.ref(layer)
        nref = self.next.get(layer)
        nxt = nref() if nref is not None else None
        if nxt is not None and nxt is not layer:
            self._prepare(nxt, dtype)
        return w

    def _prepare(self, layer, dtype: torch.dtype) -> None:
        out = layer.empty_weight(dtype, self.device)
        if out is None:  # not prepared here (its weights are elsewhere): it expands itself
            return
        if self.side is None:
            layer.expand_weight_into(out)
            self.pending = _Pending(weakref.ref(layer), dtype, out, None)
        else:
            self.side.wait_stream(self.consumer)
            with torch.cuda.stream(self.side):
                layer.expand_weight_into(out)
                ev = torch.cuda.Event()
                ev.record(self.side)
            self.pending = _Pending(weakref.ref(layer), dtype, out, ev)
        _count("prepared")

    def _wait(self, p: _Pending) -> None:
        if p.event is not None:
            self.consumer.wait_event(p.event)

    def end_pass(self) -> None:
        """The end of a model call: join what was prepared, and the last layer forgets what
        followed it (a pass that ended without this call, say after an error, taught it the
        first layer of the next pass)."""
        p, self.pending = self.pending, None
        last = self.prev() if self.prev is not None else None
        if last is not None:
            self.next.pop(last, None)
        self.prev = None
        if p is not None:
            try:
                self._wait(p)
            finally:
                _count("wasted")


def _count(what: str) -> None:
    for counts in _COUNTING.get():
        counts[what] += 1


@contextlib.contextmanager
def counting():
    """Count what the lanes do inside the block: weights ``prepared`` ahead, ``used``,
    ``wasted`` (prepared for a layer that did not come next) and fetched ``direct``ly. Yields
    the counts (a dict); blocks nest, each counting what runs inside it (the Memory Pool counts
    each sampling run this way)."""
    counts = dict.fromkeys(COUNTS, 0)
    token = _COUNTING.set((*_COUNTING.get(), counts))
    try:
        yield counts
    finally:
        _COUNTING.reset(token)


def weight(layer, x: torch.Tensor) -> torch.Tensor:
    """The weight of ``layer`` (a streamed module) for input ``x``: prepared ahead when
    possible."""
    dev = x.device
    if not ENABLED or (dev.type != "cuda" and not (_cpu_lanes and dev.type == "cpu")):
        return layer.expand_weight(x.dtype, dev)
    stream = torch.cuda.current_stream(dev) if dev.type == "cuda" else None
    key = (dev.type, dev.index, None if stream is None else stream.cuda_stream)
    lane = _LANES.get(key)
    if lane is None:
        with _lock:
            lane = _LANES.get(key)
            if lane is None:
                lane = _LANES[key] = Lane(dev, stream)
    return lane.weight(layer, x.dtype)


def end_pass() -> None:
    """Called where a model call ends (the CUDA Graph node's step function, the Memory Pool's
    step wrapper): every lane's prepared weight is joined to its consumer and dropped."""
    failed = None
    for lane in list(_LANES.values()):
        try:
            lane.end_pass()
        except Exception as e:  # an aborted graph capture: its events are gone with it
            failed = e
    if failed is not None:
        logger.debug("Memory Pool prefetch: end of pass after an error: %s", failed)


def reset() -> None:
    """Forget every lane (and its learned order): after an error, and between tests."""
    with _lock:
        _LANES.clear()


@contextlib.contextmanager
def lanes_on_cpu():
    """Tests: run the lanes on the CPU too (prepared synchronously, same bookkeeping)."""
    global _cpu_lanes
    old, _cpu_lanes = _cpu_lanes, True
    try:
        yield
    finally:
        _cpu_lanes = old
        reset()


@contextlib.contextmanager
def enabled(on: bool):
    """Prefetch on or off for the duration (tests, debugging)."""
    global ENABLED
    old, ENABLED = ENABLED, bool(on)
    try:
        yield
    finally:
        ENABLED = old
