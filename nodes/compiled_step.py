# SPDX-License-Identifier: GPL-3.0-or-later
"""Compiled mode of the CUDA Graph nodes: inside the pack's graphs, the UNet and every ControlNet
run code compiled by inductor (graphs/compiled.py) instead of PyTorch's eager kernels.

How it hooks in (ModelPatcher wrappers and the graph function; no ComfyUI file is touched):

- The UNet: a ``DIFFUSION_MODEL`` wrapper. ComfyUI's ``UNetModel.forward`` runs its wrappers
  around ``_forward``; inside the graph function ours calls the compiled ``_forward`` instead.
  Outside it (the run's first step, a Feature Cache fill, a step that runs eager for a reason)
  the wrapper passes the call through, so those steps are exactly stock.
- Each ControlNet: ComfyUI's ``get_control`` reads its network from ``control_model`` and offers
  no other way in, so inside the graph function that attribute is a ``CompiledNet`` for the
  call and is put back after it (``cuda_graph._chain_overrides``).
- Compiles run on the first call of a new input signature, before its capture
  (``GraphCache.capture(compile_first=True)``), never inside one. ComfyUI's progress bar and
  one log line per compile say what compiles and for which shape. Strength, start/end, prompt,
  seed and LoRA strength are values fed to the graph, so they cost no compile; a new
  resolution or batch costs one per network.
- A model patched by ComfyUI's *TorchCompileModel*: its ``APPLY_MODEL`` wrapper would compile
  inside the capture (and its modes with CUDA graphs of their own cannot be captured), so it is
  left out of this run's copy of the model options and its settings become the compiled mode's
  (``graphs.compiled.options_from_torch_compile``), with one log line.
- Anything that fails to compile runs eager inside the graph, with the reason logged once; the
  prompt never fails for it.
- Under the cudaMallocAsync allocator (ComfyUI's default on most NVIDIA setups) compiled kernels
  cannot be captured: the launcher of inductor's Triton kernels asks the driver about every
  pointer it is handed, and memory that a capture allocates is not mapped until the graph runs,
  so the capture fails with "CUDA driver error: invalid argument" (measured with torch 2.11), and
  after a failed capture cudaMallocAsync cannot capture again in that process. So compiled mode
  stays off there, says why once (start ComfyUI with ``--disable-cuda-malloc``), and the graphs
  run the eager kernels, exactly as with compile off.

State: a ``CompileRun`` per sampling run in ``transformer_options[COMPILE_RUN_KEY]`` (with
``reset()``/``clone()``), and per model a ``ModelCompile`` in ``_MODELS``, a cache with weak
keys (bounded by the models alive; each holds at most ``MAX_MODULES`` compiled networks of at
most ``MAX_SHAPES`` input signatures each).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import weakref

from ..graphs.compiled import (
    DIFFUSION_OPTIONS,
    CompileCache,
    CompileOptions,
    CompileProgress,
    compile_cache_dir,
    options_from_torch_compile,
)
from ..graphs.context_hoist import CompiledProjections
from ..kernels import attention_choice, fx_rewrites
from ..kernels.fx_rewrites import GegluRewrite
from ..logger import logger

COMPILE_RUN_KEY = "cna.compile_run"  # transformer_options entry: the run's CompileRun
TORCH_COMPILE_KEY = "torch.compile"  # ComfyUI's TorchCompileModel wrapper key (APPLY_MODEL)
TORCH_COMPILE_KWARGS = "torch_compile_kwargs"  # where that node keeps its settings
BACKEND_ENV = "CNA_COMPILE_BACKEND"  # inductor (default); aot_eager traces without codegen
# 1: one compile for every image size and batch (symbolic sizes) instead of one per size, the
# kernels then not specialised to a size. Opt-in, to measure the trade (docs/benchmarks.md).
DYNAMIC_ENV = "CNA_COMPILE_DYNAMIC"
# 1: each repeated region of the UNet and the ControlNets (blocks of one width and size) is
# compiled once and called where it recurs (graphs.compiled.CompileOptions.dedupe_regions), to
# shorten the first compile. Opt-in: on the H200 at SD1.5 512² it took 4 s off a 92 s first run
# and made the step 13.5% slower (docs/benchmarks.md).
DEDUPE_ENV = "CNA_COMPILE_DEDUP"
# 1: inductor's settings of diffusers' SD recipe (graphs.compiled.DIFFUSION_OPTIONS: 1x1
# convolutions as matrix multiplies, Triton kernel configurations tuned by coordinate descent on
# the first run, no epilogue fusion). Opt-in, to measure the step against the longer first run.
TUNING_ENV = "CNA_COMPILE_TUNING"
# 1: at the graph break where the UNet waits for the ControlNets' stream, dynamo resumes inside
# the function that waits instead of tracing the UNet's enclosing frames again
# (graphs.compiled.CompileOptions.nested_breaks). Opt-in: torch marks it experimental.
NESTED_ENV = "CNA_COMPILE_NESTED_BREAKS"
# With the ControlNets beside the UNet, the UNet's stream waits for theirs where it first reads
# a residual. "0": that wait is a call dynamo does not trace, and the UNet's compiled code
# breaks there into parts (dynamo then traces the enclosing frames again on every compile and
# restart). Otherwise it is an op kept in the one compiled graph (graphs/stream_join.py),
# which inductor compiles in the traced program's order so that the op stays where it is.
TRACED_JOIN_ENV = "CNA_COMPILE_TRACED_JOIN"
# The cross-attentions' key and value projections of the text context run once per context, in
# a CUDA-graph IF node, instead of at every step (graphs/context_hoist.py). "1": in the exact
# graphs (bit-identical) and in compiled mode (lifted out of the compiled code); "0": in neither.
# Unset (or any other value): in compiled mode only, where on an H100 it took 1.4 ms (3.1%) off
# SDXL 1024²'s step with the same latent; the exact graphs gained 0.5-1.0 ms there and keep it
# opt-in (docs/benchmarks.md). Either way it needs PyTorch's native allocator.
CONTEXT_HOIST_ENV = "CNA_CONTEXT_HOIST"


def traced_join_on() -> bool:
    """Whether compiled mode's wait for the ControlNets' stream is an op of the UNet's graph
    (``$CNA_COMPILE_TRACED_JOIN``, above)."""
    return os.environ.get(TRACED_JOIN_ENV, "").strip() != "0"


def context_hoist_on(compiled: bool = False) -> bool:
    """Whether the context projections run once per context: in compiled mode when
    ``compiled``, else in the exact graphs (``$CNA_CONTEXT_HOIST``, above)."""
    value = os.environ.get(CONTEXT_HOIST_ENV, "").strip()
    if value in ("0", "1"):
        return value == "1"
    return compiled


# The rewrite of the traced graphs before inductor (kernels/fx_rewrites.py): each feed-forward
# projection with its GEGLU runs as one matrix multiply that applies the GEGLU before storing
# (opt-in, CNA_COMPILE_GEGLU=1). It has not paid in a whole step yet; options_for leaves it out
# when it is off.
GRAPH_PASSES = (GegluRewrite(),)
# Each attention on the SDPA backend measured fastest for its shapes, the choices kept beside
# the compile cache (kernels/attention_choice.py). CNA_COMPILE_ATTENTION: by default (auto) for
# the attentions ComfyUI would run on flash attention first; fastest: every attention; off: none.
ATTENTION_FILE = "attention_backends.json"
ATTENTION_CHOICE = attention_choice.AttentionBackendChoice(
    cache_file=lambda: compile_cache_dir() / ATTENTION_FILE
)
ATTENTION_CHOICE_AUTO = ATTENTION_CHOICE.only_first(attention_choice.AUTO_FROM)
# The node's choices. max-autotune tries several kernels per GEMM/conv on the first compile of a
# shape (longer compile, sometimes faster steps); inductor's own CUDA graphs stay off in both.
CHOICES: dict[str, CompileOptions | None] = {
    "off": None,
    "inductor": CompileOptions(graph_passes=GRAPH_PASSES),
    "inductor max-autotune": CompileOptions(
        mode="max-autotune-no-cudagraphs", graph_passes=GRAPH_PASSES
    ),
}
MAX_MODULES = 8  # compiled networks per model: the UNet and up to 7 ControlNets
# Compile settings kept per model: switching the node between two settings and back (or two
# nodes on one model with different settings) does not compile again.
MAX_OPTION_SETS = 2
MAX_SHAPES = 4  # input signatures (resolution, batch) kept compiled per network
# A compile's progress bar counts to this (per mille of the compile); a sampler's bar counts its
# steps, so timing code that follows step progress can tell the two apart.
PROGRESS_TOTAL = 1000


def options_for(choice: str) -> CompileOptions | None:
    """The compile settings for the node's ``compile`` choice (None: off). ``$CNA_COMPILE_BACKEND``
    picks another torch.compile backend for checking a machine (``aot_eager``: dynamo traces,
    nothing is generated). Unless ``CNA_COMPILE_GEGLU=1`` turns it on, the GEGLU rewrite is
    left out of the settings, so code compiled with it is not reused without it (and the other
    way).
    ``CNA_COMPILE_ATTENTION`` adds the attention-backend choice for its mode (by default for the
    attentions ComfyUI runs on flash attention first) the same way.
    ``CNA_COMPILE_DYNAMIC=1`` compiles with dynamic shapes (one compile for all sizes) instead
    of static ones (one per size). ``CNA_COMPILE_DEDUP=1`` compiles each repeated region once.
    ``CNA_COMPILE_TUNING=1`` adds the inductor settings of diffusers' SD recipe.
    ``CNA_COMPILE_NESTED_BREAKS=1`` resumes a graph break in the frame where it is.
    The context projections are lifted out of the compiled graphs unless ``CNA_CONTEXT_HOIST=0``.
    ``CNA_COMPILE_TRACED_JOIN=0`` makes the wait for the ControlNets' stream a graph break."""
    base = CHOICES[choice]
    if base is None:
        return None
    if not fx_rewrites.geglu_enabled():
        passes = tuple(p for p in base.graph_passes if not isinstance(p, GegluRewrite))
        base = dataclasses.replace(base, graph_passes=passes)
    attention = {
        attention_choice.ON: ATTENTION_CHOICE,
        attention_choice.AUTO: ATTENTION_CHOICE_AUTO,
    }.get(attention_choice.mode())
    if attention is not None:
        base = dataclasses.replace(base, graph_passes=(*base.graph_passes, attention))
    if os.environ.get(DYNAMIC_ENV, "0").strip() == "1":
        base = dataclasses.replace(base, dynamic="dynamic")
    if os.environ.get(DEDUPE_ENV, "0").strip() == "1":
        base = dataclasses.replace(base, dedupe_regions=True)
    if os.environ.get(NESTED_ENV, "0").strip() == "1":
        base = dataclasses.replace(base, nested_breaks=True)
    if os.environ.get(TUNING_ENV, "0").strip() == "1":
        base = dataclasses.replace(
            base, inductor_options=(*base.inductor_options, *DIFFUSION_OPTIONS)
        )
    if context_hoist_on(compiled=True):
        base = dataclasses.replace(base, lift_context=True)
    if not traced_join_on():
        base = dataclasses.replace(base, traced_join=False)
    backend = os.environ.get(BACKEND_ENV)
    if backend:
        base = dataclasses.replace(base, backend=backend)  # CompileOptions validates it
    return base


class CompiledNet:
    """Stands in for a ControlNet's network during one graph-function call: calls run the
    compiled network; attribute reads (``dtype``, ``input_hint_block`` …) reach the real one."""

    def __init__(self, compiled):
        self.__dict__["_compiled"] = compiled

    def __getattr__(self, name):
        target = self.__dict__["_compiled"].target
        if target is None:
            raise AttributeError(name)
        return getattr(target, name)

    def __call__(self, *args, **kwargs):
        return self.__dict__["_compiled"](*args, **kwargs)


class ModelCompile:
    """One model's compiled networks, kept across runs (compiling is the expensive part)."""

    def __init__(self, options: CompileOptions):
        self.options = options
        # the context projections lifted out of every compiled network of the model
        self.projections = CompiledProjections() if options.lift_context else None
        self.cache = CompileCache(
            options,
            max_modules=MAX_MODULES,
            max_shapes=MAX_SHAPES,
            lift=self.projections.lift if self.projections is not None else None,
        )
        # network -> its stand-in, stable across calls (the Feature Cache keys its buffer
        # pools by the network object it is handed)
        self.nets: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def net_for(self, module) -> CompiledNet:
        got = self.nets.get(module)
        if got is None:
            got = self.nets[module] = CompiledNet(self.cache.get(module, "ControlNet"))
        return got

    def unet(self, module):
        return self.cache.get(module, "UNet", method="_forward")

    def stats(self) -> dict:
        out = {
            "compiles": 0,
            "compile_s": 0.0,
            "backend_s": 0.0,
            "failed_signatures": 0,
            "eager_calls": 0,
        }
        for cm in self.cache.modules():
            s = cm.stats()
            for k in out:
                out[k] += s[k]
        return out


# Per model (weak keys): bounded by the models alive. Each holds its ModelCompiles by settings,
# most recently used last, at most MAX_OPTION_SETS; see ModelCompile for what each holds.
_MODELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def model_compile(model, options: CompileOptions) -> ModelCompile:
    """The model's compiled networks for ``options``. The least recently used settings' code
    is dropped when a model has more than ``MAX_OPTION_SETS``."""
    with _lock:
        sets = _MODELS.get(model)
        if sets is None:
            sets = _MODELS[model] = {}
        mc = sets.pop(options, None)
        if mc is None:
            mc = ModelCompile(options)
        sets[options] = mc  # most recently used last
        while len(sets) > MAX_OPTION_SETS:
            oldest = next(iter(sets))
            sets.pop(oldest).cache.reset()
        return mc


class CompileRun:
    """One sampling run of compiled mode: the model's compiled networks, whether the graph
    function is running (only then do calls go to compiled code), and the progress bar."""

    def __init__(self, model: ModelCompile, source: str = "node"):
        self.model = model
        self.source = source  # "node" or "TorchCompileModel"
        self.reset()

    def reset(self) -> None:
        self.active = False
        self._bar = None
        self.stats_before = self.model.stats()

    def clone(self) -> CompileRun:
        return CompileRun(self.model, self.source)

    @property
    def options(self) -> CompileOptions:
        return self.model.options

    def stats(self) -> dict:
        """This run's compiles (the model's totals minus those at the run's start)."""
        now = self.model.stats()
        return {k: now[k] - self.stats_before.get(k, 0) for k in now}

    def on_progress(self, ev: CompileProgress) -> None:
        """ComfyUI's progress bar on the node while a network compiles (the log lines come
        from the compiled module)."""
        try:
            import comfy.utils

            n = PROGRESS_TOTAL
            if ev.phase == "start":
                self._bar = comfy.utils.ProgressBar(n)
                self._bar.update_absolute(n // 50)
            elif self._bar is not None:
                if ev.phase == "lowering":  # dynamo handed a graph to inductor
                    self._bar.update_absolute(min(n * 8 // 10, n // 10 + n // 5 * ev.graphs))
                elif ev.phase == "lowered":
                    self._bar.update_absolute(min(n * 95 // 100, n * 3 // 10 + n // 5 * ev.graphs))
                elif ev.phase in ("done", "failed"):
                    self._bar.update_absolute(n)
                    self._bar = None
        except Exception as e:  # a progress bar must never break a compile
            logger.debug("compiled mode: no progress bar: %s", e)


def allocator_problem() -> str | None:
    """Why compiled kernels cannot be captured in this process, or None."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        backend = torch.cuda.get_allocator_backend()
    except Exception:
        return None
    if backend == "cudaMallocAsync":
        return (
            "compiled kernels cannot be captured under the cudaMallocAsync allocator "
            "(inductor's kernel launcher checks each pointer, and memory allocated inside a "
            "capture is not mapped yet); start ComfyUI with --disable-cuda-malloc to use "
            "compiled mode. The graphs run the eager kernels."
        )
    return None


def begin_run(
    options: CompileOptions | None, model_options: dict, model
) -> tuple[CompileRun | None, str | None]:
    """At a sampling run's start, on the run's own copy of the model options: put a
    ``CompileRun`` in its transformer_options when compiled mode is on, or when ComfyUI's
    TorchCompileModel patched the model (its wrapper is left out of the copy, its settings
    used). Returns ``(run, None)``, ``(None, None)`` when compiled mode is off, or
    ``(None, reason)`` when it was asked for and cannot run here."""
    topts = model_options.setdefault("transformer_options", {})
    wrappers = (topts.get("wrappers") or {}).get("apply_model") or {}
    asked = options is not None or TORCH_COMPILE_KEY in wrappers
    if not asked or model is None:
        return None, None
    why = allocator_problem()
    if why is not None:
        _log_once(("allocator",), "CUDA Graph: compiled mode off: %s", why)
        return None, why
    source = "node"
    if TORCH_COMPILE_KEY in wrappers:
        wrappers.pop(TORCH_COMPILE_KEY)  # the run's copy only (create_model_options_clone)
        if options is None:
            options, notes = options_from_torch_compile(  # with the pack's switches on top
                model_options.get(TORCH_COMPILE_KWARGS), options_for("inductor")
            )
            source = "TorchCompileModel"
            _log_once(
                ("adopt", options),
                "CUDA Graph: the model comes from TorchCompileModel; its compile runs inside "
                "the CUDA graphs (%s, mode %s)%s",
                options.backend,
                options.mode,
                ("; " + "; ".join(notes)) if notes else "",
            )
        else:
            _log_once(
                ("replace", options),
                "CUDA Graph: compiled mode is on, so TorchCompileModel's wrapper is not used "
                "for this model; the node's compile setting applies",
            )
    run = CompileRun(model_compile(model, options), source)
    run.model.cache.on_progress = run.on_progress
    topts[COMPILE_RUN_KEY] = run
    return run, None


def run_of(transformer_options) -> CompileRun | None:
    if not isinstance(transformer_options, dict):
        return None
    return transformer_options.get(COMPILE_RUN_KEY)


def diffusion_model_wrapper(executor, *args, **kwargs):
    """``DIFFUSION_MODEL`` wrapper: inside the graph function the UNet's ``_forward`` runs
    compiled; everywhere else the call passes through untouched."""
    topts = args[5] if len(args) > 5 else kwargs.get("transformer_options")
    run = run_of(topts)
    if run is None or not run.active:
        return executor(*args, **kwargs)
    if getattr(executor, "idx", 0) != len(getattr(executor, "wrappers", ())) - 1:
        _log_once(
            ("inner",),
            "CUDA Graph: other diffusion-model wrappers run inside this one; the UNet runs "
            "eager in compiled mode",
        )
        return executor(*args, **kwargs)
    # The UNet writes its own entries (original_shape, transformer_index …) into the options it
    # is handed; a copy per call keeps the compiled signature the same on every call.
    if len(args) > 5:
        args = (*args[:5], dict(topts), *args[6:])
    else:
        kwargs["transformer_options"] = dict(topts)
    return run.model.unet(executor.class_obj)(*args, **kwargs)


_LOGGED: set = set()  # messages said once per process (bounded by the distinct settings seen)


def log_once(key, fmt: str, *args) -> None:
    """One INFO line per ``key`` and process (later ones at DEBUG)."""
    _log_once(key, fmt, *args)


def _log_once(key, fmt: str, *args) -> None:
    if key in _LOGGED:
        logger.debug(fmt, *args)
        return
    if len(_LOGGED) < 256:
        _LOGGED.add(key)
    logger.info(fmt, *args)
