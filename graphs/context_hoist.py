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

Compiled mode (``lift``): the projections are taken out of the traced graph before inductor
sees it. Each ``linear(context, weight)`` of a cross-attention becomes a new input of the graph,
and the compiled code is called through ``GraphProjections``, which fills those inputs the same
way (the comparison and the IF node while a graph is captured) and appends them. One
``CompiledProjections`` per model and compile settings owns them all.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..kernels import graph_if
from ..logger import logger
from . import static_graph

# A group's input larger than this is not a text context (the projection would hold as much
# memory per weight as an activation, and comparing it would cost a copy's time): left as it is.
MAX_CONTEXT_ELEMENTS = 4 * 1024 * 1024

_SUFFIXES = ("attn2.to_k", "attn2.to_v")

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def available() -> str | None:
    """None when the projections can be hoisted into the CUDA graphs here, else why not: IF
    nodes must be recordable (torch's own, or the pack's extension's on older torch:
    kernels/graph_if.py) and the allocator PyTorch's native one. Call it outside a capture."""
    why = graph_if.available()
    if why is None and static_graph._async_allocator():
        # Seen on an H100 (torch 2.11, the extension's IF nodes): under cudaMallocAsync the
        # hoist's graph tests pass each in a process of its own, but the first of them aborted
        # the process when it ran after the other graph tests in one process. The cause is not
        # known, and a server must not die for a saving of about 1%: the step keeps its
        # projections under that allocator.
        return (
            "not under PyTorch's cudaMallocAsync allocator (ComfyUI's default): start ComfyUI "
            "with --disable-cuda-malloc to hoist them"
        )
    return why


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


def _when_changed(
    x: torch.Tensor,
    prev: torch.Tensor,
    force: torch.Tensor,
    project: Callable[[], None],
    capturing_graph: Callable[[], object | None],
) -> None:
    """Run ``project`` (which also copies ``x`` to ``prev`` and clears ``force``) when ``x``'s
    bits differ from ``prev``'s or ``force`` is set: while a CUDA graph is captured, as an IF
    node the GPU decides at every replay; on the CPU (emulated replay), decided on the host;
    in a CUDA pass outside a capture (a warm-up), always, as the graph would at its first replay."""
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        graph = capturing_graph()
        if graph is None:
            raise RuntimeError("context projections: the CUDA graph being captured is unknown")
        with graph_if.if_node(graph, torch.ne(_bits(x), _bits(prev)).any() | force):
            project()
    elif not x.is_cuda:
        if bool(torch.ne(_bits(x), _bits(prev)).any() | force):
            project()
    else:
        project()


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
        _when_changed(x, g.prev, g.force, lambda: g.project(x), self._capturing_graph)
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


# -- compiled mode -------------------------------------------------------------------------------

_LINEARS = (torch._C._nn.linear, F.linear)
# What dynamo puts on its graph module besides the graph, kept on the edited copy.
_DYNAMO_ATTRS = ("_param_name_to_source", "_source_to_user_stacks", "compile_subgraph_reason")
# Ops whose result is (or may be) a view of their first argument: a lifted projection seen
# through one of them is still the buffer.
_VIEWS = frozenset(
    """view view_as reshape reshape_as transpose swapaxes permute movedim unsqueeze squeeze
    flatten unflatten expand expand_as contiguous narrow select t split split_with_sizes
    tensor_split chunk unbind getitem __getitem__ as_strided unfold detach""".split()
)


def _op_name(node: torch.fx.Node) -> str:
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", "")


def _written_or_escapes(node: torch.fx.Node) -> bool:
    """Whether ``node``'s value, or a view of it, is written in place, written through ``out=``
    or returned from the graph: a buffer handed in for it would then be changed or kept by
    someone else."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for u in n.users:
            if u.op == "output" or "out" in u.kwargs:
                return True
            if u.op not in ("call_function", "call_method"):
                return True  # a submodule or anything else unknown
            name = _op_name(u)
            if name.endswith("_") and not name.endswith("__") and u.args and u.args[0] is n:
                return True
            if name in _VIEWS:
                todo.append(u)
    return False


def _written(node: torch.fx.Node) -> bool:
    """Whether the graph writes into ``node``'s value in place."""
    for u in node.users:
        name = _op_name(u)
        if "out" in u.kwargs or (
            name.endswith("_") and not name.endswith("__") and u.args and u.args[0] is node
        ):
            return True
    return False


def _liftable_input(x) -> bool:
    return (
        isinstance(x, torch.Tensor)
        and x.is_floating_point()
        and x.element_size() in _BITS
        and x.dim() >= 2
        and all(isinstance(s, int) for s in x.shape)
        and x.is_contiguous()
        and x.numel() <= MAX_CONTEXT_ELEMENTS
    )


class _Lifted:
    """The buffers of the projections of one graph input (a group), filled by ``fill``."""

    __slots__ = ("buffers", "prev", "force", "weight_ids", "counted", "seen_versions")

    def __init__(self, x: torch.Tensor, weights: list[torch.Tensor]):
        lead = tuple(x.shape[:-1])
        self.buffers = [
            torch.empty(lead + (w.shape[0],), dtype=x.dtype, device=x.device) for w in weights
        ]
        self.prev = torch.empty_like(x)
        self.force = torch.ones((), dtype=torch.bool, device=x.device)
        self.use(weights)

    def use(self, weights: list[torch.Tensor]) -> None:
        """The weights the buffers are for (projected at the next fill)."""
        self.weight_ids = [id(w) for w in weights]
        # weak: the buffers must not keep an unloaded model's weights alive
        self.counted = [weakref.ref(w) for w in weights if not w.is_inference()]
        self.seen_versions = self.versions()

    def fits(self, x: torch.Tensor, weights: list[torch.Tensor]) -> bool:
        return (
            x.shape == self.prev.shape
            and x.dtype == self.prev.dtype
            and x.device == self.prev.device
            and x.is_contiguous()
            and len(weights) == len(self.buffers)
            and all(
                w.dim() == 2 and w.dtype == x.dtype and w.shape[0] == b.shape[-1]
                for w, b in zip(weights, self.buffers, strict=True)
            )
        )

    def project(self, x: torch.Tensor, weights: list[torch.Tensor]) -> None:
        x2 = x.view(-1, x.shape[-1])
        for w, buf in zip(weights, self.buffers, strict=True):
            torch.mm(x2, w.t(), out=buf.view(-1, buf.shape[-1]))
        self.prev.copy_(x)
        self.force.zero_()

    def versions(self) -> int:
        return sum(w._version for w in (r() for r in self.counted) if w is not None)


class GraphProjections:
    """The projections lifted out of one compiled graph: ``plan`` holds, per group, the index of
    its context among the graph's inputs and those of its weights. ``wrap(compiled)`` is what
    the compile backend returns: it fills the buffers (``CompiledProjections`` decides how) and
    calls the compiled code with them appended to its inputs."""

    def __init__(self, owner: CompiledProjections, plan: list[tuple[int, list[int]]]):
        self._owner = owner
        self.plan = plan
        self.count = sum(len(ws) for _, ws in plan)
        self.lifted: list[_Lifted | None] = [None] * len(plan)

    def wrap(self, compiled: Callable) -> Callable:
        def call(*args):
            return compiled(*args, *self.fill(args))

        return call

    def fill(self, args) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        owner = self._owner
        for k, (xi, wis) in enumerate(self.plan):
            x, ws = args[xi], [args[i] for i in wis]
            lifted = self.lifted[k]
            capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
            if lifted is None or not lifted.fits(x, ws):
                if capturing:  # buffers kept across replays are never taken inside a capture
                    out += [F.linear(x, w) for w in ws]
                    owner.computed += len(ws)
                    continue
                lifted = self.lifted[k] = _Lifted(x, ws)
            if lifted.weight_ids != [id(w) for w in ws]:  # other weight tensors: project anew
                if capturing:
                    out += [F.linear(x, w) for w in ws]
                    owner.computed += len(ws)
                    continue
                lifted.use(ws)
                lifted.force.fill_(True)
            _when_changed(
                x,
                lifted.prev,
                lifted.force,
                lambda g=lifted, x=x, ws=ws: g.project(x, ws),
                owner.capturing_graph,
            )
            out += lifted.buffers
            owner.hoisted += len(ws)
        return out

    def groups(self) -> list[_Lifted]:
        return [g for g in self.lifted if g is not None]


def _torch_capturing_graph():
    get = getattr(torch.cuda.CUDAGraph, "get_currently_capturing_graph", None)
    return get() if get is not None else None


class CompiledProjections:
    """The context projections of one model's compiled networks: ``lift`` is the compile
    backend's hook (``graphs.compiled.CompiledModule.lift``); the graph-function side has the
    same calls as ``ContextProjections`` (``active``, ``before_replay``, ``hoisted``,
    ``buffer_bytes``). ``capturing_graph``: returns the CUDA graph being captured (by default
    torch's own record of it, where torch keeps one)."""

    def __init__(self, capturing_graph: Callable[[], object | None] | None = None):
        self.capturing_graph = capturing_graph or _torch_capturing_graph
        self._graphs: weakref.WeakSet[GraphProjections] = weakref.WeakSet()
        self.run_id: object = None
        self.hoisted = 0  # projections answered from a buffer in the last pass
        self.computed = 0  # lifted projections computed outside their buffers in it
        self.said: set[str] = set()  # why the projections stayed in the code, logged once each

    # -- the compile backend's side -------------------------------------------------------------
    def lift(self, gm: torch.fx.GraphModule, example_inputs, target) -> tuple | None:
        """Take the cross-attention context projections of ``target`` (the compiled module) out
        of ``gm``, the graph dynamo traced: each ``linear(context, weight)`` whose context and
        weight are inputs of the graph, with no bias and a result nobody writes into, becomes
        a new input. Returns ``(extra example inputs, wrap, log line)``, or None (nothing
        lifted, ``gm`` untouched)."""
        if not isinstance(target, torch.nn.Module):
            return None
        weights = {id(w): w for w in cross_attention_weights([target])}
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if not weights or len(placeholders) != len(example_inputs):
            return None
        if any("autocast" in _op_name(n) for n in gm.graph.nodes if n.op == "call_function"):
            return None  # the projection's dtype would not be its input's
        index = {n: i for i, n in enumerate(placeholders)}
        found: dict[int, list[tuple[int, torch.fx.Node]]] = {}
        for n in gm.graph.nodes:
            if n.op != "call_function" or n.target not in _LINEARS or len(n.args) < 2:
                continue
            x, w = n.args[0], n.args[1]
            bias = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
            if bias is not None or x not in index or w not in index or len(w.users) != 1:
                continue
            xe, we = example_inputs[index[x]], example_inputs[index[w]]
            if weights.get(id(we)) is not we or not _liftable_input(xe) or we.dtype != xe.dtype:
                continue
            if _written(x) or _written_or_escapes(n):
                continue
            found.setdefault(index[x], []).append((index[w], n))
        if not found:
            return None
        if example_inputs[next(iter(found))].is_cuda:
            why = available()
            if why is not None:  # no IF node here: the projections stay in the compiled code
                if why not in self.said:
                    self.said.add(why)
                    logger.info("context projections stay in the compiled code: %s", why)
                return None
        # Dynamo reads its graph's placeholders again after the backend returns: the edit is
        # made on a copy, which keeps what AOTAutograd reads from dynamo's graph module.
        memo: dict = {}
        graph = torch.fx.Graph(tracer_cls=gm.graph._tracer_cls)
        result, old_output = graph.graph_copy(gm.graph, memo, return_output_node=True)
        graph._codegen = copy.deepcopy(gm.graph._codegen)
        graph.output(result, type_expr=getattr(old_output, "type", None)).meta = copy.copy(
            old_output.meta
        )
        for n in placeholders:
            if hasattr(n, "_dynamo_source"):
                memo[n]._dynamo_source = n._dynamo_source
        out = torch.fx.GraphModule(gm, graph)
        out.meta.update(gm.meta)
        for name in _DYNAMO_ATTRS:
            if hasattr(gm, name):
                setattr(out, name, getattr(gm, name))
        last = memo[placeholders[-1]]
        extra: list[torch.Tensor] = []
        plan: list[tuple[int, list[int]]] = []
        for xi, members in found.items():
            xe = example_inputs[xi]
            for wi, old in members:
                n = memo[old]
                with graph.inserting_after(last):
                    p = graph.placeholder(f"context_projection_{len(extra)}")
                for key in ("example_value", "val", "tensor_meta"):
                    if key in n.meta:
                        p.meta[key] = n.meta[key]
                # an input dynamo did not make: no source to guard (AOTAutograd reads this)
                p._dynamo_source = None
                n.replace_all_uses_with(p)
                graph.erase_node(n)
                last = p
                # dynamo's own fake value of the projection: a real tensor here would be made
                # fake with sizes of its own, which the guards could not name
                ev = n.meta.get("example_value")
                if ev is None:
                    ev = xe.new_empty(tuple(xe.shape[:-1]) + (example_inputs[wi].shape[0],))
                extra.append(ev)
            plan.append((xi, [wi for wi, _ in members]))
        graph.lint()
        out.recompile()
        lifted = GraphProjections(self, plan)
        self._graphs.add(lifted)
        return (
            out,
            extra,
            lifted.wrap,
            f"{lifted.count} context projections computed once per context "
            f"({len(plan)} context input(s))",
        )

    # -- the graph function's side --------------------------------------------------------------
    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        self.hoisted = self.computed = 0
        yield

    def groups(self) -> list[_Lifted]:
        return [g for gp in list(self._graphs) for g in gp.groups()]

    def before_replay(self, run_id: object) -> None:
        """As ``ContextProjections.before_replay``, for every lifted group of the model: a
        group projects again at its next fill when a new run begins or one of its weights was
        changed in place since it last checked."""
        new_run = run_id != self.run_id
        self.run_id = run_id
        for g in self.groups():
            versions = g.versions()
            if new_run or versions != g.seen_versions:
                g.force.fill_(True)
                g.seen_versions = versions

    def invalidate(self) -> None:
        for g in self.groups():
            g.force.fill_(True)

    def buffer_bytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for g in self.groups() for t in (g.prev, *g.buffers)
        )
