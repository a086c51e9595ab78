# SPDX-License-Identifier: GPL-3.0-or-later
"""A rewrite of a traced graph that runs each attention on the SDPA backend measured fastest for
its shapes.

ComfyUI runs attention on NVIDIA GPUs inside ``sdpa_kernel(priority, set_priority=True)``, and
dynamo keeps that call in the graph: ``_sdpa_kernel([backends], True)`` before the
``scaled_dot_product_attention`` call and another after it that puts the previous priority back.
The compiled code then runs whichever backend comes first in ComfyUI's list and can take the
inputs. That list changed between releases: ComfyUI 0.3.64 puts cuDNN's attention first,
ComfyUI 0.33 PyTorch's flash attention. Which one is faster depends on the GPU and the shapes.

``AttentionBackendChoice`` times, on the GPU and once per distinct set of input shapes, each
backend of ComfyUI's list that can run them (flash, cuDNN, memory-efficient; never the math
one), and moves the fastest to the front of that attention's list, when it is at least
``MARGIN`` faster than ComfyUI's own first choice. Nothing else changes: the other backends
keep their order behind it, the call that restores the priority is left as it is, and an
attention outside such a block, with a mask, or on the CPU is left alone. All backends compute
the same attention in fp16/bf16 with fp32 accumulation; the results differ by rounding.

The choices are kept in a JSON file (``cache_file``) keyed by GPU, torch version and shapes, so
that a restart makes the same choice, the graph stays the same and torch's compile caches hit.

``CNA_COMPILE_ATTENTION`` (``mode``): ``auto`` (the default) times only the attentions whose
first backend in ComfyUI's list is flash attention (ComfyUI 0.33's order), ``fastest`` every
attention (0.3.64's cuDNN-first order too), ``off`` none. On an H200 the choice took ComfyUI
0.33's compiled step down at SD1.5 512² and SDXL 1024², and never paid where cuDNN came first.
Plain PyTorch; no ComfyUI import.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..logger import logger

ENV = "CNA_COMPILE_ATTENTION"
ON = "fastest"  # every attention
AUTO = "auto"  # the default: attentions that ComfyUI would run on flash attention first
OFF = "off"
AUTO_FROM = ("FLASH_ATTENTION",)  # the first backends ``auto`` times
MARGIN = 0.03  # another backend must be this much faster than ComfyUI's first choice
CANDIDATES = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")
_SDPA = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)
_KNOWN = {"query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale"}
_FILE_LOCK = threading.Lock()
_WARNED: set[str] = set()  # unknown values of ENV already warned about


def mode() -> str:
    """``CNA_COMPILE_ATTENTION``: ``auto`` when unset or empty (the choice for attentions that
    ComfyUI would run on flash attention first), ``fastest`` for every attention, ``off`` (or
    ``0``) for ComfyUI's own order everywhere. Any other value is ``auto``, with a warning that
    names the variable and its settings (once per value). Read when compiled mode builds its
    settings, which carry the pass for the mode (code compiled under each mode is kept
    apart)."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", AUTO):
        return AUTO
    if value == ON:
        return ON
    if value in ("0", OFF):
        return OFF
    if value not in _WARNED:
        _WARNED.add(value)
        logger.warning(
            "%s=%r is not a setting: use %s (the default), %s (time every attention's "
            "backends) or %s (ComfyUI's attention order); compiled mode uses %s",
            ENV,
            value,
            AUTO,
            ON,
            OFF,
            AUTO,
        )
    return AUTO


def _is_call(node: torch.fx.Node, name: str) -> bool:
    target = node.target
    return (
        node.op == "call_function"
        and getattr(target, "__name__", None) == name
        and getattr(target, "__module__", None) == "torch.nn.attention"
    )


def _backend_name(node) -> str | None:
    """The backend a ``_backend_from_string("NAME")`` node makes, else None."""
    if isinstance(node, torch.fx.Node) and _is_call(node, "_backend_from_string") and node.args:
        name = node.args[0]
        return name if isinstance(name, str) else None
    return None


def _spec(value) -> tuple | None:
    if not isinstance(value, torch.Tensor):
        return None
    return (tuple(value.shape), tuple(value.stride()), str(value.dtype).replace("torch.", ""))


@dataclass(frozen=True)
class Site:
    """One attention inside a priority block: the block's entering call, the attention call,
    the backends in the block's order, and the inputs' (shape, stride, dtype)."""

    enter: torch.fx.Node
    sdpa: torch.fx.Node
    backends: tuple[str, ...]
    inputs: tuple[tuple, ...]
    options: tuple  # (dropout_p, is_causal, scale)
    device: torch.device


def sites(gm: torch.fx.GraphModule) -> list[Site]:
    """The attentions of ``gm`` the choice can take: each alone inside a ``sdpa_kernel(backends,
    set_priority=True)`` block, without a mask, on tensors whose shapes the trace recorded. A
    block is a pair of ``_sdpa_kernel`` calls, the context manager's entry and exit, taken in
    graph order; only an entry is ever a site's ``enter``, and an attention outside a block
    (ComfyUI 0.33 runs small ones so) is none."""
    found: list[Site] = []
    enter: torch.fx.Node | None = None  # the entry of the block the walk is in
    inside: list[torch.fx.Node] = []
    for node in gm.graph.nodes:
        if _is_call(node, "_sdpa_kernel"):
            if enter is None:
                enter, inside = node, []
                continue
            set_priority = (
                enter.args[1] if len(enter.args) > 1 else enter.kwargs.get("set_priority")
            )
            if set_priority is True and len(inside) == 1:
                site = _site(enter, inside[0])
                if site is not None:
                    found.append(site)
            enter = None
        elif enter is not None and node.op == "call_function" and node.target in _SDPA:
            inside.append(node)
    return found


def _site(enter: torch.fx.Node, sdpa: torch.fx.Node) -> Site | None:
    backends = enter.args[0] if enter.args else None
    if not isinstance(backends, list | tuple) or not backends:
        return None
    names = tuple(_backend_name(b) for b in backends)
    if any(n is None for n in names):
        return None
    args, kw = list(sdpa.args), dict(sdpa.kwargs)
    if set(kw) - _KNOWN or len(args) > 6:
        return None  # an argument the timing would not pass (enable_gqa …)
    qkv = [args[i] if len(args) > i else kw.get(k) for i, k in enumerate(("query", "key", "value"))]
    mask = args[3] if len(args) > 3 else kw.get("attn_mask")
    if mask is not None:
        return None
    values = [q.meta.get("example_value") if isinstance(q, torch.fx.Node) else None for q in qkv]
    specs = tuple(_spec(v) for v in values)
    if any(s is None for s in specs):
        return None
    opts = (
        args[4] if len(args) > 4 else kw.get("dropout_p", 0.0),
        args[5] if len(args) > 5 else kw.get("is_causal", False),
        kw.get("scale"),
    )
    if any(isinstance(o, torch.fx.Node) for o in opts) or opts[0]:
        return None  # a traced option or dropout: not timed
    return Site(enter, sdpa, names, specs, opts, values[0].device)


def time_backend(site: Site, backend: str, iters: int = 20) -> float | None:
    """Milliseconds per call of the site's attention on ``backend`` alone, on random inputs of
    its shapes (CUDA events on a GPU, the wall clock elsewhere); None where that backend cannot
    run them."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with unset_fake_temporarily():  # the compile's fake mode: real tensors and kernels here
        return _time(site, getattr(SDPBackend, backend), sdpa_kernel, iters)


def _time(site: Site, backend, sdpa_kernel, iters: int) -> float | None:
    dev = site.device
    q, k, v = (
        torch.empty_strided(shape, stride, dtype=getattr(torch, dtype), device=dev).normal_()
        for shape, stride, dtype in site.inputs
    )
    _, causal, scale = site.options
    cuda = dev.type == "cuda"
    try:
        with torch.no_grad(), sdpa_kernel([backend]):
            for _ in range(3):
                F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
            if cuda:
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
            t0 = time.perf_counter()
            for _ in range(iters):
                F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
            if not cuda:
                return (time.perf_counter() - t0) * 1e3 / iters
            end.record()
            end.synchronize()
    except RuntimeError:  # no kernel of this backend for these inputs
        return None
    return start.elapsed_time(end) / iters


@dataclass
class AttentionBackendChoice:
    """A graph pass: each attention's fastest backend first (see the module). ``timer(site,
    backend)`` gives milliseconds or None (``time_backend`` on a GPU); ``cache_file()`` the JSON
    file the choices are kept in (None: kept for this process only). ``force`` times sites on
    any device (the tests, with their own timer). ``first_in``: only the attentions whose first
    backend in ComfyUI's list is one of these are timed (None: every attention)."""

    cache_file: Callable[[], Path | None] = lambda: None
    timer: Callable[[Site, str], float | None] = time_backend
    force: bool = False
    first_in: tuple[str, ...] | None = None
    _choices: dict = field(default_factory=dict, repr=False, compare=False)
    _loaded: set = field(default_factory=set, repr=False, compare=False)
    # how many times faster than ComfyUI's first choice each site timed in this process ran
    # alone on the chosen backend; said in the log line, so the margin can be checked against
    # what the whole step gains
    _gains: dict = field(default_factory=dict, repr=False, compare=False)

    def __hash__(self) -> int:
        return hash((type(self), self.first_in))

    def __eq__(self, other) -> bool:
        return (
            type(other) is type(self)
            and other.force == self.force
            and other.first_in == self.first_in
        )

    def only_first(self, backends: tuple[str, ...]) -> AttentionBackendChoice:
        """The same choice (its timings, memory and file shared) for the attentions whose first
        backend is one of ``backends``."""
        return dataclasses.replace(
            self,
            first_in=tuple(backends),
            _choices=self._choices,
            _loaded=self._loaded,
            _gains=self._gains,
        )

    def __call__(self, gm: torch.fx.GraphModule) -> str | None:
        gains: list[float] = []
        moved = self.rewrite(gm, gains)
        if not moved:
            return None
        said = ", ".join(f"{n} on {b.lower().replace('_attention', '')}" for b, n in moved.items())
        if gains:
            lo, hi = min(gains), max(gains)
            span = f"{lo:.2f}×" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}–{hi:.2f}×"
            said += f" ({span} as fast alone as ComfyUI's first choice)"
        return f"attention moved to the backend measured fastest: {said}"

    def _key(self, site: Site) -> str:
        dev = site.device
        gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
        return json.dumps([gpu, torch.__version__, site.inputs, site.options, site.backends])

    def _load(self, path: Path | None) -> None:
        if path is None or str(path) in self._loaded:
            return
        self._loaded.add(str(path))
        try:
            data = json.loads(path.read_text())
            if isinstance(data, dict):
                self._choices.update({k: v for k, v in data.items() if v in CANDIDATES})
        except (OSError, ValueError):
            pass  # no file yet, or one another version wrote: choose again

    def _save(self, path: Path | None) -> None:
        if path is None:
            return
        with _FILE_LOCK:
            try:
                kept = json.loads(path.read_text())  # another process's choices stay
                kept = kept if isinstance(kept, dict) else {}
            except (OSError, ValueError):
                kept = {}
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                kept.update(self._choices)
                tmp.write_text(json.dumps(kept, indent=0, sort_keys=True))
                os.replace(tmp, path)
            except OSError:
                pass  # a read-only cache: the choice holds for this process

    def choose(self, site: Site) -> str:
        """The backend to put first for ``site``: ComfyUI's first unless another measured at
        least ``MARGIN`` faster; remembered per GPU, torch version and shapes."""
        key = self._key(site)
        if key in self._choices:
            return self._choices[key]
        first = site.backends[0]
        timed = {b: self.timer(site, b) for b in site.backends if b in CANDIDATES or b == first}
        timed = {b: t for b, t in timed.items() if t is not None}
        best = first
        if timed:
            fastest = min(timed, key=timed.get)
            base = timed.get(first)
            if fastest in CANDIDATES and (base is None or timed[fastest] < base * (1 - MARGIN)):
                best = fastest
                if base is not None and timed[fastest] > 0:
                    self._gains[key] = base / timed[fastest]
        self._choices[key] = best
        return best

    def rewrite(self, gm: torch.fx.GraphModule, gains: list | None = None) -> dict[str, int]:
        """Reorders the entering call of each timed site in place; returns how many sites were
        moved to each backend. ``gains`` gets, for each moved site timed in this process, how
        many times faster than ComfyUI's first choice it ran alone."""
        found = [
            s
            for s in sites(gm)
            if (self.force or s.device.type == "cuda")
            and (self.first_in is None or s.backends[0] in self.first_in)
        ]
        if not found:
            return {}
        path = self.cache_file()
        self._load(path)
        before = len(self._choices)
        moved: dict[str, int] = {}
        for site in found:
            best = self.choose(site)
            if best == site.backends[0] or best not in site.backends:
                continue
            backends = list(site.enter.args[0])
            i = site.backends.index(best)
            backends.insert(0, backends.pop(i))
            site.enter.args = (backends, *site.enter.args[1:])
            moved[best] = moved.get(best, 0) + 1
            gain = self._gains.get(self._key(site))
            if gains is not None and gain is not None:
                gains.append(gain)
        if len(self._choices) != before:
            self._save(path)
        if moved:
            gm.graph.lint()
            gm.recompile()
        return moved
