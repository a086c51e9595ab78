# SPDX-License-Identifier: GPL-3.0-or-later
"""Cross-attention key and value projections of the text context, computed once per context.

In a cross-attention ``to_k(context)`` and ``to_v(context)`` depend only on the conditioning and
the weights, so within an image they give the same values at every step (at SDXL 1024² with one
ControlNet, 208 small matrix multiplies per step). Inside a captured step this module moves them
into one CUDA-graph IF node per context tensor: on every replay the graph compares the context's
bits with the ones it last projected and runs the group's projections into fixed buffers only
when they differ (or when told to, ``invalidate``); the attentions read the buffers.

Nothing is assumed about where the context comes from. A new prompt, a conditioning that starts
at some step, or a patch that edits the context is seen by the comparison, which runs on the GPU
at every replay; weights changed in place are seen on the host (their version counters) and
force the projections once. The results are the projections' own, bit for bit: the same matrix
multiply (``torch.mm`` into the buffer, which is what ``F.linear`` runs for a contiguous input
without bias) on the same values.

One ``ContextProjections`` per captured graph, in three phases:
- discover: the warm-up's eager run records which of the given weights ``F.linear`` applies to
  which input tensor (a group per input) and allocates the buffers, outside the capture: memory
  taken inside a capture is not kept between replays under cudaMallocAsync. A projection whose
  result someone modifies in place is left out.
- capture: the first projection of a group records the comparison and the IF node with every
  projection of the group; each projection of it returns its buffer when its input is the same
  tensor, unchanged, and runs as usual otherwise.
- emulated replay (no CUDA graph: CPU tests): the same, with the comparison read on the host.

Compiled mode does not use it: ``F.linear`` runs inside inductor's code there, out of sight.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# A group's input larger than this is not a text context (the projection would hold as much
# memory per weight as an activation, and comparing it would cost a copy's time): left as it is.
MAX_CONTEXT_ELEMENTS = 4 * 1024 * 1024

_SUFFIXES = ("attn2.to_k", "attn2.to_v")

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def available() -> str | None:
    """None when this torch can record IF nodes in a CUDA graph, else why not."""
    if not hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node"):
        return f"torch {torch.__version__} cannot record conditional nodes in a CUDA graph"
    return None


def cross_attention_weights(modules: Iterable[torch.nn.Module | None]) -> list[torch.Tensor]:
    """The key and value projection weights of every cross-attention (``attn2``) in ``modules``
    (a UNet, ControlNets): the projections of the text context. Only plain weights of layers
    without bias, as ``F.linear`` receives them when no cast or patch is in the way."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    for root in modules:
        if root is None:
            continue
        for name, m in root.named_modules():
            if not name.endswith(_SUFFIXES):
                continue
            w = getattr(m, "weight", None)
            if (
                isinstance(w, torch.Tensor)
                and getattr(m, "bias", None) is None
                and w.dim() == 2
                and w.is_floating_point()
                and id(w) not in seen
            ):
                seen.add(id(w))
                out.append(w)
    return out


def _version(t: torch.Tensor) -> int:
    """The tensor's in-place write counter; 0 for inference tensors, which keep none (ComfyUI
    samples under ``torch.inference_mode``)."""
    return 0 if t.is_inference() else t._version


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.element_size()])


class _Group:
    """The projections applied to one input tensor."""

    __slots__ = ("weights", "buffers", "prev", "force", "x", "x_version", "emitted", "off")

    def __init__(self, x: torch.Tensor, weights: list[torch.Tensor]):
        self.weights = weights
        lead = tuple(x.shape[:-1])
        self.buffers = {
            id(w): torch.empty(lead + (w.shape[0],), dtype=x.dtype, device=x.device)
            for w in weights
        }
        self.prev = torch.empty_like(x)
        self.force = torch.ones((), dtype=torch.bool, device=x.device)
        self.x: torch.Tensor | None = None
        self.x_version = 0
        self.emitted = False
        self.off = False

    def matches(self, x: torch.Tensor) -> bool:
        return (
            x.shape == self.prev.shape
            and x.dtype == self.prev.dtype
            and x.device == self.prev.device
            and x.is_contiguous()
        )

    def project(self, x: torch.Tensor) -> None:
        x2 = x.view(-1, x.shape[-1])
        for w in self.weights:
            buf = self.buffers[id(w)]
            torch.mm(x2, w.t(), out=buf.view(-1, buf.shape[-1]))
        self.prev.copy_(x)
        self.force.zero_()

    def changed(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ne(_bits(x), _bits(self.prev)).any() | self.force


class ContextProjections:
    """The context projections of one captured graph. ``weights``: those that may be hoisted
    (``cross_attention_weights``); ``capturing_graph()``: the CUDA graph being captured;
    ``run_id``: the sampling run it is captured in (``before_replay``)."""

    def __init__(
        self,
        weights: list[torch.Tensor],
        capturing_graph: Callable[[], object],
        run_id: object = None,
    ):
        self._weights = {id(w): w for w in weights}
        self._capturing_graph = capturing_graph
        self.discovered = False
        self.groups: list[_Group] = []
        self._group_of: dict[int, _Group] = {}
        self._seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._versions: int | None = None
        self._counted: list[torch.Tensor] = []
        self.run_id = run_id  # the sampling run whose projections the buffers hold
        self.hoisted = 0  # projections answered from a buffer in the last pass
        self.computed = 0  # projections of known weights that ran as usual in it

    # -- the pass ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Around one call of the step's function (warm-up, capture or emulated replay)."""
        self.hoisted = self.computed = 0
        for g in self.groups:
            g.emitted = False  # each pass records (or, emulated, decides) its own comparison
        if not self._weights:
            yield
            return
        with _Mode(self):
            try:
                yield
            finally:
                self._end_pass()

    def _end_pass(self) -> None:
        if not self.discovered:
            self._finish_discovery()
            return
        for g in self.groups:
            g.x = None  # no input is kept past its pass

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if not self.discovered:
            out = F.linear(x, w)
            self._seen.append((x, w, out))
            return out
        g = self._group_of.get(id(w))
        if g is None or g.off or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):
            self.computed += 1
            return F.linear(x, w)
        if not g.emitted:
            if not g.matches(x):
                g.off = True
                self.computed += 1
                return F.linear(x, w)
            self._emit(g, x)
        elif x is not g.x or _version(x) != g.x_version:
            self.computed += 1
            return F.linear(x, w)
        self.hoisted += 1
        return g.buffers[id(w)]

    def _emit(self, g: _Group, x: torch.Tensor) -> None:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            graph = self._capturing_graph()
            graph.begin_capture_to_if_node(g.changed(x))
            try:
                g.project(x)
            finally:
                graph.end_capture_to_conditional_node()
        elif not x.is_cuda:  # emulated replay: the same decision, read on the host
            if bool(g.changed(x)):
                g.project(x)
        else:  # a CUDA pass outside a capture (a second warm-up): as the graph would
            g.project(x)
        g.x, g.x_version = x, _version(x)
        g.emitted = True

    def _finish_discovery(self) -> None:
        self.discovered = True
        seen, self._seen = self._seen, []
        by_input: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        uses: dict[int, int] = {}
        for x, w, out in seen:
            uses[id(w)] = uses.get(id(w), 0) + 1
            if _version(out) != 0:  # someone wrote into the projection: it must stay theirs
                uses[id(w)] += 1
            by_input.setdefault(id(x), (x, []))[1].append(w)
        for x, ws in by_input.values():
            ws = [w for w in ws if uses[id(w)] == 1]
            if (
                not ws
                or not x.is_contiguous()
                or not x.is_floating_point()
                or x.element_size() not in _BITS
                or x.dim() < 2
                or x.numel() > MAX_CONTEXT_ELEMENTS
            ):
                continue
            g = _Group(x, ws)
            self.groups.append(g)
            for w in ws:
                self._group_of[id(w)] = g
        # inference tensors keep no write counter: only the others are read before each replay
        self._counted = [w for g in self.groups for w in g.weights if not w.is_inference()]
        self._versions = self._weight_versions()

    # -- between replays -----------------------------------------------------------------------
    def _weight_versions(self) -> int:
        return sum(w._version for w in self._counted)

    def before_replay(self, run_id: object) -> None:
        """Force the projections at the next replay when a new sampling run begins or a weight
        was changed in place since the last one (a LoRA patched into the same memory)."""
        if not self.groups:
            return
        versions = self._weight_versions()
        if run_id != self.run_id or versions != self._versions:
            self.invalidate()
            self.run_id, self._versions = run_id, versions

    def invalidate(self) -> None:
        for g in self.groups:
            g.force.fill_(True)

    def buffer_bytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for g in self.groups for t in (g.prev, *g.buffers.values())
        )


class _Mode(TorchFunctionMode):
    """Routes ``F.linear(x, w)`` with a known weight and no bias to ``ContextProjections``."""

    def __init__(self, owner: ContextProjections):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x = args[0] if args else kwargs.get("input")
            w = args[1] if len(args) > 1 else kwargs.get("weight")
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            known = self.owner._weights.get(id(w))
            if b is None and known is not None and known is w and isinstance(x, torch.Tensor):
                return self.owner.linear(x, w)
        return func(*args, **kwargs)
