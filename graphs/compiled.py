# SPDX-License-Identifier: GPL-3.0-or-later
"""Compile a module's forward with inductor, once per input signature, for the pack's graphs.

``CompiledModule(module, name, options)`` is called like the module. The first call for an
input signature (every tensor's shape, strides, dtype and device, the grad mode, the argument
structure) compiles; later calls with that signature run the compiled code; values (latent,
sigma, text conditioning, ControlNet strength passed as a tensor, weights re-patched by a LoRA)
never compile again, because they are not part of the signature. Each signature gets its own
compiled function (its own code object, so its own dynamo cache entry): at most
``max_shapes`` are kept, least recently used go first, and evicting one frees its compiled code
(not the parts dynamo keeps on the module's own functions past a graph break inside them; see
``RECOMPILE_LIMIT``).

Inductor's own CUDA graphs are always off (``triton.cudagraphs=False``): the pack's
``GraphCache`` captures the compiled kernels into its graphs, one graph per step.

Rules the graph path relies on:
- Nothing compiles inside a CUDA graph capture or its warm-up (both are detected: a capturing
  stream, or torch's sync debug mode set to "error" as ``GraphCache`` does), nor inside
  ``no_compile()``. There a signature that is not compiled yet raises ``CompileNotReady`` and a
  compiled one runs under ``torch.compiler.set_stance("fail_on_recompile")``, so the capture
  fails cleanly instead of recording a compiler. Compile first, with one ordinary call.
- A compiled signature never recompiles silently. If dynamo wants to (a Python number among the
  inputs changed, a global flag the code reads flipped), that signature is given up: it runs
  eager from then on, with the guard that failed in the logged reason (the fix: pass the value
  as a tensor). With ``dynamic="dynamic"`` a signature may recompile twice (a new shape
  specialisation) before that.
- Any failure (no compiler for the device, dynamo cannot trace, inductor fails, the first call
  raises, the output differs from eager in ``verify``) makes that signature run eager, logs the
  reason once through the pack's logger, and never raises into the caller; only an error that
  the eager module raises too reaches the caller, as it would without compiling.

The compile cache on disk (inductor's FX-graph, AOTAutograd, Triton and autotuning caches) is
pointed at a folder named for the pack (``compile_cache_dir()``) so compiles survive restarts;
an explicit ``TORCHINDUCTOR_CACHE_DIR`` is kept.

Plain PyTorch, no ComfyUI import. The module is held weakly: a compiled module never keeps a
model alive after its owner dropped it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import re
import sys
import threading
import time
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils import _pytree as pytree

from ..logger import logger
from . import stream_join

PACK_DIR = "comfyui-controlnet-accelerator"
CACHE_ENV = "CNA_COMPILE_CACHE"
TORCH_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"

MODES = ("default", "max-autotune-no-cudagraphs")
DYNAMIC = ("static", "dynamic")
BACKENDS = ("inductor", "aot_eager", "eager")  # the last two: to tell which stage fails

# Inductor settings diffusers' "diffusion-fast" recipe uses for SD UNets; a candidate to measure
# (CompileOptions(inductor_options=DIFFUSION_OPTIONS); the node's CNA_COMPILE_TUNING=1), not a
# default.
DIFFUSION_OPTIONS: tuple[tuple[str, object], ...] = (
    ("conv_1x1_as_mm", True),
    ("coordinate_descent_tuning", True),
    ("epilogue_fusion", False),
)

# Functions dynamo leaves in a graph that AOTAutograd's cache does not know, marked safe to cache
# (``torch._inductor.config.unsafe_marked_cacheable_functions``). ComfyUI's attention on NVIDIA
# GPUs runs SDPA inside ``sdpa_kernel(priority, set_priority=True)``, which dynamo records as
# calls of these two with the backends as constants of the graph: what they do is fixed by those
# constants, which are part of the cache key. Unmarked, the cache refuses every UNet and
# ControlNet graph, and each restart traces both networks through AOTAutograd again (most of a
# warm restart's compile time, docs/benchmarks.md).
CACHEABLE_FUNCTIONS = (
    "torch.nn.attention._backend_from_string",
    "torch.nn.attention._sdpa_kernel",
)

# Said when a max-autotune compile starts: it benchmarks kernels for every GEMM and convolution
# shape (SD1.5 512² on an H200: over 15 minutes, docs/benchmarks.md).
AUTOTUNE_NOTE = (
    " (max-autotune benchmarks kernels for every GEMM and convolution shape: many minutes, "
    "over 15 for SD1.5 at 512² on an H200)"
)

# Relative L2 error allowed between compiled and eager outputs, by output dtype: inductor fuses
# reductions and keeps fp32 accumulators where eager rounds to the storage dtype in between.
PARITY_TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}
_RECOMPILES = {"static": 0, "dynamic": 2}
# Dynamo's per-code-object limit on compiled entries while the pack compiles. A graph break
# inside a function dynamo inlined (the wait for the ControlNets' stream inside the UNet) leaves
# compiled code on the host's own code objects on the way to it (the UNet's forward, shared by
# every model and size); dropping a signature frees the pack's entry, not those. At torch's
# default of 8 the ninth size or model compiled in a process would run those frames eager. Each
# entry there is the small host-side part of a compile; a recompile of a dropped signature
# reuses it.
RECOMPILE_LIMIT = 64


# A hook of the compile backend: ``lift(gm, example_inputs, target)`` may return a copy of the
# traced graph in which some of its work became new inputs (appended to its placeholders), as
# ``(the copy, their example inputs, wrap, a line for the log)``, where ``wrap(compiled)`` is
# the callable handed back to dynamo (it computes the new inputs and calls the compiled code
# with them); or None. graphs/context_hoist.py's ``CompiledProjections.lift``.
Lift = Callable[
    [torch.fx.GraphModule, list, object],
    "tuple[torch.fx.GraphModule, list, Callable, str] | None",
]


class CompileNotReady(RuntimeError):
    """A call needs a compile where none may run (CUDA graph capture, ``no_compile()``)."""


@dataclass(frozen=True)
class CompileOptions:
    """How to compile. ``mode``: inductor's, without CUDA graphs. ``dynamic``: ``static`` makes
    one compile per input shape with kernels specialised to it; ``dynamic`` one compile for all
    sizes (size 0/1 and rank still split). ``cache_dir``: the on-disk cache (None:
    ``compile_cache_dir()``). ``inductor_options``: extra ``torch._inductor.config`` settings
    as (name, value) pairs; CUDA-graph settings among them are ignored. ``freezing`` is best
    left off: it folds the weights into the compiled code, which then misses weight changes.
    ``graph_passes``: callables run in order on each FX graph dynamo hands the backend, before
    inductor; each edits the graph in place and returns a line for the log (what it changed)
    or None. A pass that raises fails that compile (the signature then runs eager).
    ``dedupe_regions``: each repeated region compiled once (dynamo's graph deduplication).
    ``nested_breaks``: at a graph break inside an inlined function, dynamo resumes in that
    function instead of tracing the enclosing frames again (its ``nested_graph_breaks``).
    ``lift_context``: compiled with the cross-attentions' context projections taken out of the
    graphs (their owner gives the cache its ``lift`` hook: graphs/context_hoist.py); a field
    here so that code compiled with and without them is kept apart. ``traced_join``: where the
    UNet waits for the ControlNets' stream, the wait is an op of its graph
    (graphs/stream_join.py); False: a call dynamo does not trace, the compiled code in parts
    around it. A field for the same reason."""

    mode: str = "default"
    dynamic: str = "static"
    fullgraph: bool = False
    cache_dir: str | None = None
    backend: str = "inductor"
    inductor_options: tuple[tuple[str, object], ...] = ()
    graph_passes: tuple[Callable[[torch.fx.GraphModule], str | None], ...] = ()
    dedupe_regions: bool = False
    nested_breaks: bool = False
    lift_context: bool = False
    traced_join: bool = True

    def __post_init__(self):
        for field, value, allowed in (
            ("mode", self.mode, MODES),
            ("dynamic", self.dynamic, DYNAMIC),
            ("backend", self.backend, BACKENDS),
        ):
            if value not in allowed:
                raise ValueError(f"CompileOptions.{field}={value!r}: one of {', '.join(allowed)}")

    def inductor_config(self) -> dict:
        """The ``torch._inductor.config`` patches this compile runs with."""
        import torch._inductor
        import torch._inductor.config

        cfg = dict(torch._inductor.list_mode_options(self.mode))
        cfg.update((k, v) for k, v in self.inductor_options if not k.startswith("triton.cudagraph"))
        cfg["triton.cudagraphs"] = False  # the pack's graphs capture the compiled kernels
        marked = getattr(torch._inductor.config, "unsafe_marked_cacheable_functions", None)
        if isinstance(marked, dict):
            marked = dict(marked)
            for name in CACHEABLE_FUNCTIONS:
                marked.setdefault(name, torch.__version__)
            cfg["unsafe_marked_cacheable_functions"] = marked
        return cfg


@dataclass(frozen=True)
class CompileProgress:
    """One compile event, for a progress bar and a log line.

    ``phase``: ``start`` (tracing begins), ``lowering`` (dynamo handed graph ``graphs`` to
    the backend), ``lowered`` (that graph is compiled; its first run follows), ``done``,
    ``failed`` (``detail`` says why), ``recompiled`` (a compiled signature compiled again).
    ``elapsed_s`` counts from ``start``."""

    name: str
    signature: str
    phase: str
    elapsed_s: float
    graphs: int = 0
    detail: str = ""


@dataclass(frozen=True)
class Parity:
    """Compiled against eager on one input: worst relative L2 error over the output tensors."""

    ok: bool
    rel_err: float
    max_abs: float
    tol: float
    reason: str | None = None


# -- the on-disk cache ----------------------------------------------------------------------------


def compile_cache_dir() -> Path:
    """``$CNA_COMPILE_CACHE``, else ``<user cache>/comfyui-controlnet-accelerator/inductor``
    (``%LOCALAPPDATA%`` on Windows, ``~/Library/Caches`` on macOS, ``$XDG_CACHE_HOME`` or
    ``~/.cache`` elsewhere)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    if sys.platform == "win32" and os.environ.get("LOCALAPPDATA"):
        base = Path(os.environ["LOCALAPPDATA"])
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / PACK_DIR / "inductor"


@dataclass(frozen=True)
class CacheDir:
    path: Path
    source: str  # "pack" (we set it) or "TORCHINDUCTOR_CACHE_DIR" (the user's, kept)
    fx_graph_cache: bool


# The directory this process pointed torch at, if any: process-wide, like the variable itself.
_CACHE_STATE: dict = {"dir": None, "logged": None}


def _torch_default_cache_dir() -> str:
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        return os.path.abspath(default_cache_dir())
    except Exception:
        return ""


def enable_persistent_cache(path: str | os.PathLike | None = None) -> CacheDir:
    """Point torch's inductor caches (FX graph, AOTAutograd, Triton, autotuning: all live under
    ``TORCHINDUCTOR_CACHE_DIR``) at ``path`` (default ``compile_cache_dir()``).

    A ``TORCHINDUCTOR_CACHE_DIR`` the user set is kept (torch itself fills the variable with its
    temporary-folder default on first use; that value counts as unset). The FX-graph and
    AOTAutograd caches are switched on unless their environment variables turn them off.
    Idempotent; the first call per folder logs one line.
    """
    want = os.path.abspath(os.fspath(path if path is not None else compile_cache_dir()))
    current = os.environ.get(TORCH_CACHE_ENV)
    current = os.path.abspath(current) if current else None
    ours = _CACHE_STATE["dir"]
    if current is not None and current != ours and current != _torch_default_cache_dir():
        chosen, source = current, TORCH_CACHE_ENV
    else:
        chosen, source = want, "pack"
        os.makedirs(chosen, exist_ok=True)
        if current != chosen:
            os.environ[TORCH_CACHE_ENV] = chosen
            try:  # in-memory caches that remember the old folder
                from torch._inductor.utils import clear_caches

                clear_caches()
            except Exception:
                pass
        _CACHE_STATE["dir"] = chosen
    fx = _switch_on_caches()
    if _CACHE_STATE["logged"] != chosen:
        _CACHE_STATE["logged"] = chosen
        extra = ""
        if source != "pack" and os.environ.get(CACHE_ENV):
            extra = f" ({CACHE_ENV} is ignored while {TORCH_CACHE_ENV} is set)"
        logger.info(
            "compile cache: %s (%s)%s%s",
            chosen,
            "the pack's folder" if source == "pack" else f"from {TORCH_CACHE_ENV}",
            "" if fx else "; the FX-graph cache is off, so every restart compiles again",
            extra,
        )
    return CacheDir(Path(chosen), source, fx)


def _switch_on_caches() -> bool:
    try:
        import torch._functorch.config as fconfig
        import torch._inductor.config as iconfig
    except Exception:
        return False
    if "TORCHINDUCTOR_FX_GRAPH_CACHE" not in os.environ:
        iconfig.fx_graph_cache = True
    if "TORCHINDUCTOR_AUTOGRAD_CACHE" not in os.environ and hasattr(
        fconfig, "enable_autograd_cache"
    ):
        fconfig.enable_autograd_cache = True
    return bool(iconfig.fx_graph_cache)


# -- when compiling is allowed --------------------------------------------------------------------

_NO_COMPILE: contextvars.ContextVar[int] = contextvars.ContextVar("cna_no_compile", default=0)


@contextlib.contextmanager
def no_compile() -> Iterator[None]:
    """Within the block no ``CompiledModule`` compiles: a signature not compiled yet raises
    ``CompileNotReady``, a compiled one that would recompile raises it too."""
    token = _NO_COMPILE.set(_NO_COMPILE.get() + 1)
    try:
        yield
    finally:
        _NO_COMPILE.reset(token)


def compile_forbidden() -> str | None:
    """Why a compile may not run here, or None."""
    if _NO_COMPILE.get():
        return "inside no_compile()"
    if torch.cuda.is_initialized():
        if torch.cuda.is_current_stream_capturing():
            return "a CUDA graph capture is in progress"
        if torch.cuda.get_sync_debug_mode() == 2:
            return "host syncs are errors here (a CUDA graph warm-up)"
    return None


def unavailable_reason(device: torch.device, backend: str = "inductor") -> str | None:
    """Why inductor cannot compile for ``device``, or None (checked before the first compile,
    so a missing toolchain gives one clear line instead of a compiler traceback)."""
    if backend != "inductor":
        return None
    if device.type == "cuda":
        try:
            from torch.utils._triton import has_triton

            if not has_triton():
                return (
                    "inductor needs Triton for CUDA and it is not installed or not usable: "
                    "install triton (triton-windows on Windows), or leave compiled mode off"
                )
        except Exception as e:
            return f"cannot check for Triton: {type(e).__name__}: {e}"
    elif device.type == "cpu":
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler

            get_cpp_compiler()
        except Exception as e:
            return f"inductor needs a C++ compiler for the CPU: {type(e).__name__}: {e}"
    return None


def start_compile_workers(device: torch.device, backend: str = "inductor") -> bool:
    """Start inductor's pool of compile workers now, before dynamo traces, for a compile on
    ``device``; returns whether it was asked to start. ``torch.compile``'s own inductor backend
    starts the pool when dynamo hands it a graph; the pack calls inductor's ``compile_fx``
    itself, which does not, so the pool would first be asked for by the first generated kernel
    and, until it is ready, inductor compiles the kernels one at a time in this process.
    Only CUDA compiles use the pool (Triton kernels); idempotent, and any failure here leaves
    inductor to start the pool as it would anyway."""
    if backend != "inductor" or device.type != "cuda":
        return False
    try:
        from torch._inductor.async_compile import maybe_warm_pool

        maybe_warm_pool()
    except Exception as e:
        logger.debug("compile workers not started ahead: %s", e)
        return False
    return True


# -- signatures -----------------------------------------------------------------------------------


def nested_breaks_available() -> bool:
    """Whether this torch's dynamo can resume a graph break in the nested frame it occurs in."""
    return hasattr(torch._dynamo.config, "nested_graph_breaks")


def dedupe_available() -> bool:
    """Whether this torch's dynamo can replace repeated regions by one subgraph."""
    return hasattr(torch._dynamo.config, "use_graph_deduplication")


def graphs_of(gm: torch.fx.GraphModule) -> list[tuple[str, torch.fx.GraphModule]]:
    """``gm`` and every region graph inside it (the subgraphs dynamo's deduplication calls),
    each with where it is, for the log ("" for ``gm`` itself)."""
    out = [("", gm)]
    for name, sub in gm.named_modules():
        if name and isinstance(sub, torch.fx.GraphModule):
            out.append((f", region {name}", sub))
    return out


# Regions with fewer operations than this are put back inline before inductor sees the graph:
# dynamo also dedupes runs of two or three ops (an add, a cast), whose own kernels would only
# stop fusion with their neighbours while saving next to no compile time.
MIN_REGION_OPS = 8


def _invoke_subgraph_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    hop = getattr(getattr(torch.ops, "higher_order", None), "invoke_subgraph", None)
    if hop is None:
        return []
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is hop]


def _inliner() -> Callable | None:
    """Torch's pass that puts region calls back inline, or None where this torch has none."""
    try:
        from torch._higher_order_ops.passes.inline_invoke_subgraph import (
            inline_invoke_subgraph_nodes,
        )
    except ImportError:
        return None
    return inline_invoke_subgraph_nodes


def inline_small_regions(gm: torch.fx.GraphModule, min_ops: int = MIN_REGION_OPS) -> dict:
    """Put the calls of regions with fewer than ``min_ops`` operations back inline in ``gm``;
    returns what stays: ``{"regions": kept region graphs, "calls": their calls, "inlined":
    calls put back, "small_kept": small calls that stay because this torch has no inliner}``."""
    calls = _invoke_subgraph_nodes(gm)
    size: dict[str, int] = {}
    for node in calls:
        name = str(node.args[0].target)
        if name not in size:
            sub = getattr(gm, name)
            size[name] = sum(1 for n in sub.graph.nodes if n.op == "call_function")
    small = [n for n in calls if size[str(n.args[0].target)] < min_ops]
    small_kept = 0
    if small:
        inline = _inliner()
        if inline is None:
            small_kept, small = len(small), []
        else:
            inline(gm, small)
            gm.delete_all_unused_submodules()
            gm.graph.lint()
            gm.recompile()
    kept = {str(n.args[0].target) for n in calls if n not in small}
    return {
        "regions": len(kept),
        "calls": len(calls) - len(small),
        "inlined": len(small),
        "small_kept": small_kept,
    }


@functools.cache
def untraced(fn: Callable) -> Callable:
    """``fn`` as a call dynamo never traces: compiled code that reaches it stops its graph there,
    runs it as Python, and goes on in a graph of its own (a graph break where the call is). One
    object per ``fn``, so the compiled code's guards on it hold from call to call."""
    return torch.compiler.disable(fn, recursive=True)


def _tensor_meta(v: torch.Tensor, dynamic: str) -> tuple:
    if dynamic == "static":
        shape: tuple = (tuple(v.shape), tuple(v.stride()))
    else:
        shape = (
            tuple(d if d < 2 else -1 for d in v.shape),
            v.dim() == 4 and v.is_contiguous(memory_format=torch.channels_last),
        )
    return (shape, v.dtype, v.device, v.requires_grad, v.is_inference())


def _structure(spec) -> Hashable:
    try:
        hash(spec)
        return spec
    except TypeError:
        return repr(spec)


def signature(args: tuple, kwargs: dict, dynamic: str = "static") -> Hashable:
    """What selects a compiled function: the argument structure, every tensor's metadata
    (``static``: sizes and strides; ``dynamic``: rank, which sizes are 0 or 1, and the memory
    format), its dtype, device, requires_grad and inference flag, and the grad mode. Values of
    tensors and of other arguments are not part of it."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    metas: list = [torch.is_grad_enabled(), torch.is_inference_mode_enabled()]
    _leaf_metas(leaves, dynamic, metas)
    return _structure(spec), tuple(metas)


def _leaf_metas(leaves: list, dynamic: str, metas: list) -> None:
    for v in leaves:
        if isinstance(v, torch.Tensor):
            metas.append(_tensor_meta(v, dynamic))
        elif isinstance(v, dict) and type(v) is not dict:
            # A dict subclass is one leaf to pytree (the ControlNets' residuals joined on use):
            # its type, and its contents as a plain dict's, read without its own methods.
            inner, inner_spec = pytree.tree_flatten(dict(dict.items(v)))
            metas.append((type(v), _structure(inner_spec)))
            _leaf_metas(inner, dynamic, metas)
        else:
            metas.append(type(v))


def describe(args: tuple, kwargs: dict) -> str:
    """A short text for logs: the first tensor's shape, dtype and device, and how many more."""
    tensors = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
    if not tensors:
        return "no tensors"
    t = tensors[0]
    dtype = str(t.dtype).removeprefix("torch.")
    more = f" (+{len(tensors) - 1} tensors)" if len(tensors) > 1 else ""
    return f"{'x'.join(map(str, t.shape))} {dtype} {t.device}{more}"


# -- compiled modules -----------------------------------------------------------------------------


@dataclass
class _Entry:
    fn: Callable
    code: types.CodeType
    label: str
    compile_s: float
    graphs: int
    recompiles: int = 0
    calls: int = 0


def _forward_for(ref: Callable[[], Callable | None], tag: str, method: str | None) -> Callable:
    """A function calling ``ref()`` (or its ``method``) with its own code object: dynamo keeps
    compiled code per code object, so each signature's compile lives (and is freed) on its own."""
    if method is None:

        def forward(*args, **kwargs):
            return ref()(*args, **kwargs)

    else:

        def forward(*args, **kwargs):
            return getattr(ref(), method)(*args, **kwargs)

    code = forward.__code__.replace(co_name=tag)
    if hasattr(code, "co_qualname"):
        code = code.replace(co_qualname=tag)
    return types.FunctionType(code, forward.__globals__, tag, None, forward.__closure__)


def _first_line(e: BaseException, limit: int = 300) -> str:
    inner = getattr(e, "inner_exception", None)  # dynamo wraps the backend's own error
    if isinstance(inner, BaseException):
        e = inner
    text = str(e).strip().splitlines()
    msg = text[0] if text else ""
    return f"{type(e).__name__}: {msg[:limit]}"


def _guard_failure(e: BaseException) -> str:
    """The guard lines of dynamo's "Detected recompile" error, shortened."""
    found = []
    for ln in str(e).splitlines():
        m = re.match(r"\s*-\s*\d+/\d+:\s*(.*)", ln)
        if m:
            found.append(m.group(1).split("#")[0].strip())
    return "; ".join(found[:2])[:300] or "a guard failed"


def _is_recompile_error(e: BaseException) -> bool:
    return "Detected recompile" in str(e)


def _strong_or_weak(target: Callable) -> Callable[[], Callable | None]:
    if isinstance(target, torch.nn.Module):
        return weakref.ref(target)
    return lambda: target  # functions: their closures are the caller's business


class CompiledModule:
    """``target`` (an ``nn.Module`` or function) compiled per input signature; see the module
    docstring. ``name`` appears in logs and progress events. ``on_progress(CompileProgress)``
    is called during compiles; its exceptions are ignored. ``method``: compile and call this
    method of the module instead of calling the module (e.g. a forward body that a host's
    wrappers call, so the wrappers themselves stay outside the compiled code). ``lift``: a hook
    that may take work out of each traced graph before inductor compiles it, as new inputs of
    the graph (``Lift``); static shapes only."""

    def __init__(
        self,
        target: Callable,
        name: str,
        options: CompileOptions | None = None,
        *,
        max_shapes: int = 4,
        on_progress: Callable[[CompileProgress], None] | None = None,
        method: str | None = None,
        lift: Lift | None = None,
    ):
        if max_shapes < 1:
            raise ValueError("max_shapes must be at least 1")
        target, adopted = unwrap_compiled(target)
        if method is not None and not callable(getattr(target, method, None)):
            raise TypeError(f"{name}: {type(target).__name__} has no method {method!r}")
        self._ref = _strong_or_weak(target)
        self.method = method
        self.name = name
        self.options = options or CompileOptions()
        self.max_shapes = max_shapes
        self.on_progress = on_progress
        self.lift = lift
        self.entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self.failed: dict[Hashable, str] = {}
        self._logged: set[str] = set()
        self._lock = threading.RLock()
        self._serial = 0
        self._current: tuple[str, float] | None = None  # (signature text, start) while compiling
        self.compiles = 0  # signatures compiled (first calls that produced compiled code)
        self.recompiles = 0
        self.graphs = 0  # graphs handed to the backend (more than compiles: graph breaks)
        self.compile_s = 0.0
        self.backend_s = 0.0  # of compile_s: in the backend (graph passes, AOTAutograd, inductor)
        self.eager_calls = 0
        if adopted:
            logger.debug("%s: compiling the module under an existing torch.compile wrapper", name)

    # -- state -------------------------------------------------------------------------------

    @property
    def target(self) -> Callable | None:
        return self._ref()

    def _callee(self, target):
        """What an eager call runs: the target, or its method."""
        return target if self.method is None else getattr(target, self.method)

    def reset(self) -> None:
        """Drop every compiled signature and remembered failure (the on-disk cache stays, so
        compiling a signature again is mostly a cache hit)."""
        with self._lock:
            for key in list(self.entries):
                self._drop(key)
            self.failed.clear()
            self._logged.clear()

    def clone(self) -> CompiledModule:
        """The same target and settings with nothing compiled yet."""
        target = self._ref()
        if target is None:
            raise ReferenceError(f"{self.name}: the compiled module was freed")
        return CompiledModule(
            target,
            self.name,
            self.options,
            max_shapes=self.max_shapes,
            on_progress=self.on_progress,
            method=self.method,
            lift=self.lift,
        )

    def is_compiled(self, *args, **kwargs) -> bool:
        """Whether these arguments' signature runs compiled code (compiled, not failed)."""
        return signature(args, kwargs, self.options.dynamic) in self.entries

    def stats(self) -> dict:
        return {
            "compiled_signatures": len(self.entries),
            "failed_signatures": len(self.failed),
            "compiles": self.compiles,
            "recompiles": self.recompiles,
            "graphs": self.graphs,
            "compile_s": round(self.compile_s, 3),
            "backend_s": round(self.backend_s, 3),
            "eager_calls": self.eager_calls,
        }

    def _drop(self, key: Hashable) -> None:
        entry = self.entries.pop(key)
        reset_code = getattr(torch._dynamo, "reset_code", None)
        if reset_code is not None:
            try:
                reset_code(entry.code)  # frees the compiled graph now, not at exit
            except Exception as e:
                logger.debug("%s: could not release a compiled signature: %s", self.name, e)
        entry.fn = None

    # -- calling -----------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        target = self._ref()
        if target is None:
            raise ReferenceError(f"{self.name}: the compiled module was freed")
        key = signature(args, kwargs, self.options.dynamic)
        with self._lock:
            if key in self.failed:
                self.eager_calls += 1
                return self._callee(target)(*args, **kwargs)
            entry = self.entries.get(key)
            if entry is None:
                why = compile_forbidden()
                if why is not None:
                    raise CompileNotReady(
                        f"{self.name}: not compiled for {describe(args, kwargs)} and no "
                        f"compile may run now ({why}); call it once outside first"
                    )
                return self._compile_and_run(key, target, args, kwargs)
            self.entries.move_to_end(key)
            return self._run(key, entry, target, args, kwargs)

    def _run(self, key, entry: _Entry, target, args, kwargs):
        frozen = compile_forbidden()
        strict = frozen is not None or entry.recompiles >= _RECOMPILES[self.options.dynamic]
        graphs = self.graphs
        t0 = time.perf_counter()
        self._current = (entry.label, t0)
        try:
            stance = torch.compiler.set_stance("fail_on_recompile") if strict else None
            with stance if stance is not None else self._dynamo_settings():
                out = entry.fn(*args, **kwargs)
        except Exception as e:
            if _is_recompile_error(e):
                guard = _guard_failure(e)
                if frozen is not None:
                    raise CompileNotReady(
                        f"{self.name}: would recompile for {entry.label} ({guard}) and no "
                        f"compile may run now ({frozen})"
                    ) from None
                return self._fail(
                    key,
                    f"dynamo would recompile ({guard}): a value it specialised on changed; "
                    "pass values that change per call as tensors",
                    target,
                    args,
                    kwargs,
                )
            if frozen is not None:
                raise  # inside a capture: the capture fails, its caller runs eager
            return self._fail(key, f"compiled call failed: {_first_line(e)}", target, args, kwargs)
        finally:
            self._current = None
        entry.calls += 1
        if self.graphs > graphs:  # dynamic policy: a new specialisation compiled
            entry.recompiles += 1
            self.recompiles += 1
            elapsed = time.perf_counter() - t0
            self.compile_s += elapsed
            self._progress("recompiled", entry.label, elapsed, self.graphs - graphs)
            logger.info(
                "%s: recompiled for %s in %.1f s (recompile %d of at most %d)",
                self.name,
                entry.label,
                elapsed,
                entry.recompiles,
                _RECOMPILES[self.options.dynamic],
            )
        return out

    def _compile_and_run(self, key, target, args, kwargs):
        label = describe(args, kwargs)
        device = next(
            (v.device for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)),
            torch.device("cpu"),
        )
        why = unavailable_reason(device, self.options.backend)
        if why is not None:
            return self._fail(key, why, target, args, kwargs, label=label)
        cache = None
        if self.options.backend == "inductor":  # the other backends write no cache
            try:
                cache = enable_persistent_cache(self.options.cache_dir)
            except Exception as e:  # an unwritable folder: compile anyway, not persisted
                self._log_once(f"cache: {_first_line(e)}", "compile cache folder unusable: %s", e)
        start_compile_workers(device, self.options.backend)  # they start while dynamo traces
        self._serial += 1
        tag = re.sub(r"\W", "_", f"cna_{self.name}_{self._serial}")
        forward = _forward_for(self._ref, tag, self.method)
        fn = torch.compile(
            forward,
            backend=self._backend,
            dynamic=self.options.dynamic == "dynamic",
            fullgraph=self.options.fullgraph,
        )
        logger.info(
            "%s: compiling for %s (%s, mode %s, %s shapes); the first time for a shape takes "
            "a while%s, later runs read the cache%s",
            self.name,
            label,
            self.options.backend,
            self.options.mode,
            self.options.dynamic,
            AUTOTUNE_NOTE if self.options.mode.startswith("max-autotune") else "",
            f" in {cache.path}" if cache is not None else "",
        )
        graphs, backend_s = self.graphs, self.backend_s
        t0 = time.perf_counter()
        self._current = (label, t0)
        self._progress("start", label, 0.0, 0)
        try:
            with self._dynamo_settings():
                out = fn(*args, **kwargs)
        except Exception as e:
            return self._fail(
                key, f"compile failed: {_first_line(e)}", target, args, kwargs, label=label, t0=t0
            )
        finally:
            self._current = None
        elapsed = time.perf_counter() - t0
        made = self.graphs - graphs
        if made == 0:
            return self._fail(
                key,
                "dynamo compiled nothing (it skipped the function; TORCH_LOGS=graph_breaks "
                "says why)",
                target,
                args,
                kwargs,
                label=label,
                t0=t0,
                ran=out,
            )
        self.entries[key] = _Entry(fn, forward.__code__, label, elapsed, made, calls=1)
        self.compiles += 1
        self.compile_s += elapsed
        while len(self.entries) > self.max_shapes:
            old = next(iter(self.entries))
            logger.info(
                "%s: dropped the compiled code for %s (max_shapes=%d)",
                self.name,
                self.entries[old].label,
                self.max_shapes,
            )
            self._drop(old)
        self._progress("done", label, elapsed, made)
        in_backend = self.backend_s - backend_s
        logger.info(
            "%s: compiled for %s in %.1f s (%d graph%s%s; %.1f s compiling the graphs or "
            "reading them from the cache, %.1f s tracing the Python and the first run)",
            self.name,
            label,
            elapsed,
            made,
            "" if made == 1 else "s",
            "" if made == 1 else f", {made - 1} graph break(s) run Python between them",
            in_backend,
            max(0.0, elapsed - in_backend),
        )
        return out

    def _backend(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs += 1
        label, t0 = self._current or ("?", time.perf_counter())
        started = time.perf_counter()
        self._progress("lowering", label, started - t0, self.graphs)
        if self.options.dedupe_regions:
            got = inline_small_regions(gm)
            if got["calls"] or got["inlined"]:
                logger.info(
                    "%s: %s, graph %d: %d repeated regions compiled once for %d calls "
                    "(%d calls of regions under %d ops put back inline)",
                    self.name,
                    label,
                    self.graphs,
                    got["regions"],
                    got["calls"],
                    got["inlined"],
                    MIN_REGION_OPS,
                )
            if got["small_kept"]:
                self._log_once(
                    "inline",
                    "%s: this torch cannot put regions back inline "
                    "(no torch._higher_order_ops.passes.inline_invoke_subgraph): %d calls of "
                    "regions under %d ops stay regions, each a fusion barrier",
                    self.name,
                    got["small_kept"],
                    MIN_REGION_OPS,
                )
        graphs = graphs_of(gm) if self.options.dedupe_regions else [("", gm)]
        for graph_pass in self.options.graph_passes:
            for where, graph in graphs:
                said = graph_pass(graph)
                if said:
                    logger.info(
                        "%s: %s, graph %d%s: %s", self.name, label, self.graphs, where, said
                    )
        wrap = None
        if self.lift is not None and self.options.dynamic == "static" and len(graphs) == 1:
            lifted = self.lift(gm, example_inputs, self.target)
            if lifted is not None:
                gm, extra, wrap, said = lifted
                example_inputs = [*example_inputs, *extra]
                logger.info("%s: %s, graph %d: %s", self.name, label, self.graphs, said)
        if self.options.backend == "inductor":
            from torch._inductor.compile_fx import compile_fx

            config = self.options.inductor_config()
            if stream_join.holds(gm):  # keep the wait for the ControlNets' stream in place
                config.update(stream_join.ORDER_OPTIONS)
            out = compile_fx(gm, example_inputs, config_patches=config)
        else:
            out = torch._dynamo.lookup_backend(self.options.backend)(gm, example_inputs)
        if wrap is not None:
            out = wrap(out)
        done = time.perf_counter()
        self.backend_s += done - started
        self._progress("lowered", label, done - t0, self.graphs)
        return out

    def _fail(self, key, reason, target, args, kwargs, *, label=None, t0=None, ran=None):
        """Give the signature up: eager from now on, the reason logged once; this call's result
        comes from the eager module (or ``ran``, when the compiled call already ran it)."""
        label = label or describe(args, kwargs)
        if key in self.entries:
            self._drop(key)
        self.failed[key] = reason
        elapsed = time.perf_counter() - t0 if t0 is not None else 0.0
        self._progress("failed", label, elapsed, 0, reason)
        self._log_once(
            reason, "%s: compiled mode off for %s, running eager: %s", self.name, label, reason
        )
        if ran is not None:
            return ran
        self.eager_calls += 1
        return self._callee(target)(*args, **kwargs)

    def _dynamo_settings(self):
        """Dynamo's settings for a call that may trace: the recompile limit (``RECOMPILE_LIMIT``),
        and what the options ask for where this torch has it (else one log line each)."""
        cfg = torch._dynamo.config
        patch: dict = {}
        for name in ("recompile_limit", "cache_size_limit"):  # the second: its older name
            if hasattr(cfg, name):
                patch[name] = max(getattr(cfg, name), RECOMPILE_LIMIT)
                break
        wanted = (  # (asked for, this torch has it, dynamo's setting, what it does, else)
            (
                self.options.dedupe_regions,
                dedupe_available(),
                "use_graph_deduplication",
                "compile repeated regions once",
                "each is compiled where it occurs",
            ),
            (
                self.options.nested_breaks,
                nested_breaks_available(),
                "nested_graph_breaks",
                "resume a graph break in the function where it is",
                "the enclosing frames are traced again",
            ),
        )
        for asked, available, setting, does, instead in wanted:
            if asked and available:
                patch[setting] = True
            elif asked:
                self._log_once(
                    setting,
                    "%s: this torch cannot %s (no torch._dynamo.config.%s); %s",
                    self.name,
                    does,
                    setting,
                    instead,
                )
        return cfg.patch(**patch) if patch else contextlib.nullcontext()

    def _log_once(self, reason: str, fmt: str, *fargs) -> None:
        if reason in self._logged:
            logger.debug(fmt, *fargs)
            return
        self._logged.add(reason)
        logger.warning(fmt, *fargs)

    def _progress(self, phase, label, elapsed, graphs, detail=""):
        if self.on_progress is None:
            return
        try:
            self.on_progress(CompileProgress(self.name, label, phase, elapsed, graphs, detail))
        except Exception as e:  # a progress bar must never break a compile
            logger.debug("%s: progress callback failed: %s", self.name, e)

    # -- checking ----------------------------------------------------------------------------

    def verify(self, *args, tol: float | None = None, **kwargs) -> Parity:
        """Run eager and compiled on these inputs and compare; on a mismatch the signature is
        given up (eager from then on, reason logged once). Compiles first if needed."""
        target = self._ref()
        if target is None:
            raise ReferenceError(f"{self.name}: the compiled module was freed")
        result = check_parity(self, self._callee(target), args, kwargs, tol=tol)
        key = signature(args, kwargs, self.options.dynamic)
        if not result.ok and key in self.entries:
            with self._lock:
                self._drop(key)
                self.failed[key] = f"verify: {result.reason}"
            self._log_once(
                f"verify: {result.reason}",
                "%s: compiled mode off for %s, running eager: verify: %s",
                self.name,
                describe(args, kwargs),
                result.reason,
            )
        return result


def check_parity(
    compiled: Callable,
    reference: Callable,
    args: tuple,
    kwargs: dict | None = None,
    *,
    tol: float | None = None,
) -> Parity:
    """Compare ``compiled(*args, **kwargs)`` with ``reference(...)`` on the same inputs.

    The outputs must have the same structure; the error is the worst relative L2 norm over the
    tensors (``tol`` default: ``PARITY_TOL`` for the first output tensor's dtype). Exceptions
    from either call become a failed ``Parity`` with the reason.
    """
    kwargs = kwargs or {}
    try:
        want = reference(*args, **kwargs)
        got = compiled(*args, **kwargs)
    except Exception as e:
        return Parity(False, float("inf"), float("inf"), tol or 0.0, _first_line(e))
    w_leaves, w_spec = pytree.tree_flatten(want)
    g_leaves, g_spec = pytree.tree_flatten(got)
    w_t = [v for v in w_leaves if isinstance(v, torch.Tensor)]
    g_t = [v for v in g_leaves if isinstance(v, torch.Tensor)]
    if tol is None:
        tol = PARITY_TOL.get(w_t[0].dtype, 1e-2) if w_t else 0.0
    if w_spec != g_spec or len(w_t) != len(g_t):
        return Parity(False, float("inf"), float("inf"), tol, "outputs differ in structure")
    worst = max_abs = 0.0
    for i, (a, b) in enumerate(zip(g_t, w_t, strict=True)):
        if a.shape != b.shape:
            return Parity(
                False, float("inf"), float("inf"), tol, f"output {i}: shape {a.shape} != {b.shape}"
            )
        a64, b64 = a.detach().double(), b.detach().double()
        den = b64.norm().item()
        err = (a64 - b64).norm().item() / (den if den > 0 else 1.0)
        if not err == err:  # NaN
            return Parity(False, float("nan"), float("nan"), tol, f"output {i} is NaN")
        worst = max(worst, err)
        max_abs = max(max_abs, (a64 - b64).abs().max().item() if a.numel() else 0.0)
    ok = worst <= tol
    reason = None if ok else f"relative L2 error {worst:.3g} > {tol:g} (max abs {max_abs:.3g})"
    return Parity(ok, worst, max_abs, tol, reason)


# -- modules compiled elsewhere (ComfyUI's TorchCompileModel) -------------------------------------


def unwrap_compiled(obj):
    """``(module, True)`` for a ``torch.compile``-wrapped module (an ``OptimizedModule``),
    ``(obj, False)`` otherwise. The pack compiles the module underneath itself: its own settings
    (no inductor CUDA graphs) and signatures, so that the result can be captured."""
    inner = getattr(obj, "_orig_mod", None)
    if inner is not None and isinstance(obj, torch.nn.Module):
        return inner, True
    return obj, False


def options_from_torch_compile(
    kwargs: dict | None, base: CompileOptions | None = None
) -> tuple[CompileOptions, list[str]]:
    """Options matching another node's ``torch.compile`` settings (ComfyUI's TorchCompileModel
    keeps them in ``model_options["torch_compile_kwargs"]``: backend, mode, fullgraph, dynamic,
    options), with what had to change and why."""
    base = base or CompileOptions()
    kwargs = kwargs or {}
    notes: list[str] = []
    backend = kwargs.get("backend") or "inductor"
    if backend not in BACKENDS:
        notes.append(
            f"backend {backend!r} replaced by inductor: the pack's CUDA graphs capture the "
            "compiled kernels themselves"
        )
        backend = "inductor"
    mode = kwargs.get("mode") or base.mode
    if mode not in MODES:
        new = "max-autotune-no-cudagraphs" if "max-autotune" in mode else "default"
        notes.append(f"mode {mode!r} became {new!r}: inductor's CUDA graphs stay off")
        mode = new
    dyn = kwargs.get("dynamic")
    dynamic = base.dynamic if dyn is None else ("dynamic" if dyn else "static")
    extra = dict(base.inductor_options)
    for k, v in (kwargs.get("options") or {}).items():
        if k.startswith("triton.cudagraph"):
            notes.append(f"inductor option {k} ignored: the pack's graphs capture instead")
            continue
        extra[k] = v
    opts = CompileOptions(
        mode=mode,
        dynamic=dynamic,
        fullgraph=bool(kwargs.get("fullgraph", base.fullgraph)),
        cache_dir=base.cache_dir,
        backend=backend,
        inductor_options=tuple(sorted(extra.items())),
        graph_passes=base.graph_passes,
        dedupe_regions=base.dedupe_regions,
        nested_breaks=base.nested_breaks,
        lift_context=base.lift_context,
        traced_join=base.traced_join,
    )
    return opts, notes


# -- one place for a run's compiled modules -------------------------------------------------------


class CompileCache:
    """``CompiledModule``s by module (identity, held weakly), at most ``max_modules``, least
    recently used dropped first. One per node setting: UNet and each ControlNet get theirs."""

    def __init__(
        self,
        options: CompileOptions | None = None,
        *,
        max_modules: int = 8,
        max_shapes: int = 4,
        on_progress: Callable[[CompileProgress], None] | None = None,
        lift: Lift | None = None,
    ):
        if max_modules < 1:
            raise ValueError("max_modules must be at least 1")
        self.options = options or CompileOptions()
        self.max_modules = max_modules
        self.max_shapes = max_shapes
        self.on_progress = on_progress
        self.lift = lift  # given to every CompiledModule it makes
        self._mods: OrderedDict[tuple, tuple[weakref.ref, CompiledModule]] = OrderedDict()

    def get(self, module: torch.nn.Module, name: str, method: str | None = None) -> CompiledModule:
        """The module's ``CompiledModule`` (for ``method``, when given), made on first use."""
        module, _ = unwrap_compiled(module)
        self._prune()
        key = (id(module), method)
        hit = self._mods.get(key)
        if hit is not None and hit[0]() is module:
            self._mods.move_to_end(key)
            hit[1].on_progress = self.on_progress
            return hit[1]
        cm = CompiledModule(
            module,
            name,
            self.options,
            max_shapes=self.max_shapes,
            on_progress=self.on_progress,
            method=method,
            lift=self.lift,
        )
        self._mods[key] = (weakref.ref(module), cm)
        while len(self._mods) > self.max_modules:
            _, (_, old) = self._mods.popitem(last=False)
            old.reset()
        return cm

    def _prune(self) -> None:
        for k in [k for k, (ref, _) in self._mods.items() if ref() is None]:
            self._mods.pop(k)[1].reset()

    def modules(self) -> list[CompiledModule]:
        self._prune()
        return [cm for _, cm in self._mods.values()]

    def reset(self) -> None:
        for _, cm in self._mods.values():
            cm.reset()
        self._mods.clear()

    def clone(self) -> CompileCache:
        return CompileCache(
            self.options,
            max_modules=self.max_modules,
            max_shapes=self.max_shapes,
            on_progress=self.on_progress,
            lift=self.lift,
        )
