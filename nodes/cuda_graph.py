# SPDX-License-Identifier: GPL-3.0-or-later
"""CUDA Graph Sampler: capture the UNet + ControlNet step of a ComfyUI model in CUDA graphs.

How it hooks into ComfyUI (ModelPatcher wrappers only, no ComfyUI file is touched):

- ``CALC_COND_BATCH`` wrapper: swaps each control object in the conds for a memoised proxy, so
  cond/uncond still batch together (ComfyUI batches on ``control is control``) but the proxy's
  ``get_control`` only *records* the call instead of running the ControlNet;
- ``APPLY_MODEL`` wrapper: receives that recorded call with the UNet's inputs, and runs
  ControlNet(s) + UNet as one function: captured once per input signature, replayed afterwards.
  Anything it cannot capture runs exactly as stock ComfyUI would, with the reason logged once;
- ``OUTER_SAMPLE`` wrapper: marks a new sampling run, so weight addresses are re-checked once per
  run (a model unloaded and reloaded, or re-patched by a LoRA, lives at new addresses and its
  graphs are dropped) instead of every step.

What is fed to the graph at each replay rather than baked in: the latent, sigma, text and ADM
conditioning (static input buffers), each ControlNet's hint (its own buffer, refreshed when the
ControlNet prepares a new one) and strength (a device scalar, so changing strength never
recaptures). Start/end percent: with the full 0–1 range there is nothing to check; a partial
range reads sigma on the host once per step (stock ComfyUI does it once per ControlNet) and picks
the graph with or without that ControlNet, so inactive steps skip its compute as stock does.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import is_out_of_memory
from ..graphs import CaptureFailed, GraphCache, backend_name
from ..logger import logger
from ..memory import prefetch
from . import status
from .channels_last import LayoutSwap

WRAPPER_KEY = "cna_cuda_graph"
ALWAYS_ON_SIGMA = 1e8  # percent_to_sigma(0) is 999999999.9: "from the first step"
FIRST_STEP = "first step of a run: the ControlNet prepares its hint"
CACHE_FILL = "ControlNet Feature Cache: first compute fills its buffers (eager, once)"


@dataclass(frozen=True)
class GraphOptions:
    enabled: bool = True
    max_graphs: int = 8
    verify: bool = False
    verify_tol: float = 1e-2
    channels_last: bool = False  # experimental: see channels_last.py
    # ControlNets on a second CUDA stream, overlapping the UNet's input blocks (their residuals
    # are first read at the middle block); see _JoinOnUse. On by default: bit-identical and
    # 4-10% faster per step on the H200 (docs/benchmarks.md).
    concurrent_controlnet: bool = True


# ---------------------------------------------------------------------------------------------
# Deferring the ControlNet call to the UNet call


class _DeferredControl:
    """Stands in for a control object inside one ``calc_cond_batch`` call."""

    __slots__ = ("control",)

    def __init__(self, control):
        self.control = control

    def get_control(self, x_noisy, t, cond, batched_number, transformer_options):
        return ControlCall(self.control, x_noisy, t, cond, batched_number, transformer_options)


class ControlCall:
    """A recorded ``control.get_control(...)``; resolves to ComfyUI's residual dict on demand.

    It also behaves as that dict (resolving on first use), so code that reaches the UNet without
    our APPLY_MODEL wrapper in between still gets exactly what stock ComfyUI would give it.
    """

    def __init__(self, control, x_noisy, t, cond, batched_number, transformer_options):
        self.control = control
        self.args = (x_noisy, t, cond, batched_number, transformer_options)
        self._resolved = None
        self._done = False

    def resolve(self):
        if not self._done:
            self._resolved = self.control.get_control(*self.args)
            self._done = True
        return self._resolved

    # dict protocol, as used by openaimodel.apply_control and friends
    def __contains__(self, k):
        r = self.resolve()
        return r is not None and k in r

    def __getitem__(self, k):
        return self.resolve()[k]

    def get(self, k, default=None):
        r = self.resolve()
        return default if r is None else r.get(k, default)

    def keys(self):
        return (self.resolve() or {}).keys()

    def items(self):
        return (self.resolve() or {}).items()


class _JoinOnUse(dict):
    """The residual dict of ControlNets that ran on a side stream. The UNet's stream waits for
    the side stream just before it first reads a residual (an empty list, like the ``input``
    entry of an SD ControlNet, needs no wait), so the input blocks overlap the ControlNets."""

    def __init__(self, d: dict, event):
        super().__init__(d)
        self._event = event
        self._joined = False

    def _join(self) -> None:
        if not self._joined:
            torch.cuda.current_stream().wait_event(self._event)
            self._joined = True

    def __getitem__(self, k):
        v = super().__getitem__(k)
        if v:  # something the UNet will read
            self._join()
        return v

    def get(self, k, default=None):
        return self[k] if k in self else default

    def values(self):
        self._join()
        return super().values()

    def items(self):
        self._join()
        return super().items()


def _residual_tensors(control: dict) -> list[torch.Tensor]:
    """Every tensor of a ControlNet residual dict (``{"input": [...], "middle": [...], ...}``)."""
    out = []
    for v in control.values():
        for t in v if isinstance(v, (list, tuple)) else (v,):
            if isinstance(t, torch.Tensor):
                out.append(t)
    return out


def _chain(control) -> list:
    """The control objects of a chain, innermost (evaluated first) to outermost."""
    out = []
    c = control
    while c is not None:
        out.append(c)
        c = getattr(c, "previous_controlnet", None)
    return out[::-1]


# ---------------------------------------------------------------------------------------------
# Per-model state


class _ModelState:
    def __init__(self, name: str, options: GraphOptions, backend: str):
        self.cache = GraphCache(name, max_graphs=options.max_graphs, backend=backend)
        self.run_id = 0
        self.fp_run: dict[int, tuple[int, Hashable]] = {}  # id(module) -> (run_id, fingerprint)
        self.eager_reasons: set[str] = set()
        self.lock = threading.Lock()
        self.stats = {"replays": 0, "eager": 0, "captures": 0}

    def side_stream(self, x: torch.Tensor):
        """The stream the ControlNets run on beside the UNet (CUDA only; None elsewhere)."""
        if not x.is_cuda:
            return None
        s = self.__dict__.get("_side")
        if s is None or s.device != x.device:
            s = self._side = torch.cuda.Stream(device=x.device)
        return s

    def count(self, what: str) -> None:
        self.stats[what] = self.stats.get(what, 0) + 1
        TOTALS[what] = TOTALS.get(what, 0) + 1

    def note_eager(self, reason: str, expected: bool = False) -> None:
        """Count an eager step; say why once per reason (debug level for the expected ones)."""
        self.count("eager")
        if reason not in self.eager_reasons:
            self.eager_reasons.add(reason)
            log = logger.debug if expected else logger.info
            log("%s: running eager: %s", self.cache.name, reason)

    def fingerprint(self, module: torch.nn.Module) -> Hashable:
        """Addresses of the module's weights, computed once per sampling run."""
        got = self.fp_run.get(id(module))
        if got is not None and got[0] == self.run_id:
            return got[1]
        fp = hash(tuple((p.data_ptr(), p.dtype, p.device) for p in module.parameters()))
        self.fp_run[id(module)] = (self.run_id, fp)
        return fp


_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Process-wide counters (states die with their models; these do not): for tests and logs.
TOTALS: dict[str, int] = {"captures": 0, "replays": 0, "eager": 0, "failed": 0, "released": 0}
_STATES_LOCK = threading.Lock()


def _state_for(base_model, options: GraphOptions, device: torch.device) -> _ModelState:
    with _STATES_LOCK:
        st = _STATES.get(base_model)
        if st is None:
            name = f"CUDA Graph [{type(base_model).__name__}]"
            st = _ModelState(name, options, backend_name(device))
            _STATES[base_model] = st
        st.cache.max_graphs = options.max_graphs
        return st


def graph_stats() -> list[dict]:
    """What each model's graph cache holds: for logs, tests and the front end."""
    out = []
    for model, st in list(_STATES.items()):
        out.append(
            {
                "model": type(model).__name__,
                "backend": st.cache.backend,
                "graphs": len(st.cache.entries),
                "failed": dict(st.cache.failed),
                "captures": st.cache.captures,
                "capture_s": st.cache.total_capture_s,
                "eager_reasons": sorted(st.eager_reasons),
                **st.stats,
            }
        )
    return out


# ---------------------------------------------------------------------------------------------
# The patch


def _fused_groups(chain, active) -> dict[int, list]:
    """id(net) -> the active nets of its fused group, for each FusedControlNet of the chain:
    a run of consecutive FusedControlNets is evaluated together (FusedControlNet.get_control),
    and whether it runs on the positive chunk alone depends on all of its active nets."""
    from .fused_apply import FusedControlNet

    groups: dict[int, list] = {}
    run: list = []
    for cn, on in [*zip(chain, active, strict=True), (None, False)]:
        if isinstance(cn, FusedControlNet):
            run.append((cn, on))
            continue
        group = [c for c, o in run if o]
        groups.update((id(c), group) for c, _ in run)
        run = []
    return groups


def _supported_control_types() -> tuple[type, ...]:
    import comfy.controlnet

    from .feature_cache import CachedControlNet
    from .fused_apply import FusedControlNet

    return (comfy.controlnet.ControlNet, FusedControlNet, CachedControlNet)


def _tensor_sig(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.dtype, t.device.type, t.device.index)


def _lowvram(module) -> bool:
    return bool(getattr(module, "model_lowvram", False))


class CudaGraphPatch:
    """The three wrappers; the per-model graph state lives in ``_STATES``."""

    def __init__(self, options: GraphOptions, node_id=None):
        self.options = options
        self.node_id = node_id  # the node that made this patch: its badge gets the run's figures
        self._layout: LayoutSwap | None = None  # channels-last weights of the current run
        self._timing: list | None = None  # (kind, start event, end event) per model call

    # OUTER_SAMPLE: a new sampling run begins
    def outer_sample_wrapper(self, executor, *args, **kwargs):
        base_model = getattr(executor.class_obj, "inner_model", None)
        patcher = getattr(executor.class_obj, "model_patcher", None)
        model = getattr(patcher, "model", base_model)
        if model is not None:
            st = _STATES.get(model)
            if st is not None:
                st.run_id += 1
        before = dict(TOTALS)
        t0 = time.perf_counter()
        self._timing = [] if self.node_id is not None and torch.cuda.is_available() else None
        if self._timing is not None:
            torch.cuda.reset_peak_memory_stats()  # the badge's peak is this run's
        if self.options.enabled and self.options.channels_last:
            self._layout = LayoutSwap()
        ok = False
        try:
            out = executor(*args, **kwargs)
            ok = True
            return out
        finally:  # the weights go back to ComfyUI's layout however the run ends
            layout, self._layout = self._layout, None
            if layout is not None:
                layout.restore()
            timing, self._timing = self._timing, None
            if ok and self.node_id is not None:
                sigmas = args[3] if len(args) > 3 else kwargs.get("sigmas")
                self._report(model, before, time.perf_counter() - t0, sigmas, timing)

    def _report(self, model, before: dict, wall_s: float, sigmas, timing) -> None:
        """The run's figures to this node's badge (nodes/status.py)."""
        try:
            d = {k: TOTALS[k] - before.get(k, 0) for k in ("captures", "replays", "eager")}
            steps = max(1, len(sigmas) - 1) if sigmas is not None else None
            if timing and torch.cuda.is_available():
                torch.cuda.synchronize()
            per = {}
            for kind, a, b in timing or []:
                per.setdefault(kind, []).append(a.elapsed_time(b))
            data = {**d, "steps": steps}
            lines = []
            if not self.options.enabled:
                lines.append("CUDA graph: off")
            else:
                lines.append(
                    f"CUDA graph: {d['replays']} replayed · {d['captures']} captured · "
                    f"{d['eager']} eager"
                )
            if steps:
                data["ms_per_step"] = 1e3 * wall_s / steps
                line = f"{data['ms_per_step']:.1f} ms/step"
                if per.get("replay") and per.get("eager"):
                    data["replay_ms"] = sum(per["replay"]) / len(per["replay"])
                    data["eager_ms"] = sum(per["eager"]) / len(per["eager"])
                    data["speedup_vs_eager"] = data["eager_ms"] / data["replay_ms"]
                    line += f" · {data['speedup_vs_eager']:.1f}× vs eager step"
                lines.append(line)
            st = _STATES.get(model)
            reasons = sorted(st.eager_reasons) if st is not None else []
            unexpected = [r for r in reasons if r not in (FIRST_STEP, CACHE_FILL)]
            if unexpected:
                data["eager_reasons"] = unexpected
                lines.append("eager: " + status.short(unexpected[0]))
            if timing:  # the model ran on the GPU (a --cpu run on a GPU machine has none)
                data["peak_allocated"] = torch.cuda.max_memory_allocated()
                lines.append(f"peak VRAM {status.mib(data['peak_allocated'])}")
            status.report(self.node_id, "cuda_graph", lines, data)
        except Exception as e:  # a badge must never fail a run
            logger.debug("CUDA Graph: no badge for this run: %s", e)

    # CALC_COND_BATCH: defer control calls to APPLY_MODEL
    def calc_cond_batch_wrapper(self, executor, model, conds, x_in, timestep, model_options):
        if not self.options.enabled:
            return executor(model, conds, x_in, timestep, model_options)
        proxies: dict[int, _DeferredControl] = {}
        new_conds = []
        for cond_list in conds:
            if cond_list is None:
                new_conds.append(None)
                continue
            out = []
            for d in cond_list:
                ctrl = d.get("control") if isinstance(d, dict) else None
                if ctrl is not None:
                    p = proxies.get(id(ctrl))
                    if p is None:
                        p = proxies[id(ctrl)] = _DeferredControl(ctrl)
                    d = dict(d)
                    d["control"] = p
                out.append(d)
            new_conds.append(out)
        return executor(model, new_conds, x_in, timestep, model_options)

    # APPLY_MODEL: ControlNet(s) + UNet, captured or eager
    def apply_model_wrapper(
        self,
        executor,
        x,
        t,
        c_concat=None,
        c_crossattn=None,
        control=None,
        transformer_options=None,
        **kwargs,
    ):
        if transformer_options is None:
            transformer_options = {}
        timing = self._timing
        if timing is not None and x.is_cuda:  # one pair of events per call, read at run end
            before = (TOTALS["replays"], TOTALS["captures"])
            try:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
            except Exception as e:  # timing is for the badge only: never in the way
                logger.debug("CUDA Graph: step timing off for this run: %s", e)
                self._timing = None
                return self._apply_model(
                    executor, x, t, c_concat, c_crossattn, control, transformer_options, kwargs
                )
            out = self._apply_model(
                executor, x, t, c_concat, c_crossattn, control, transformer_options, kwargs
            )
            end.record()
            kind = (
                "capture"
                if TOTALS["captures"] > before[1]
                else "replay"
                if TOTALS["replays"] > before[0]
                else "eager"
            )
            timing.append((kind, start, end))
            return out
        return self._apply_model(
            executor, x, t, c_concat, c_crossattn, control, transformer_options, kwargs
        )

    def _apply_model(
        self, executor, x, t, c_concat, c_crossattn, control, transformer_options, kwargs
    ):
        call = control if isinstance(control, ControlCall) else None

        def eager():
            ctrl = call.resolve() if call is not None else control
            return executor(x, t, c_concat, c_crossattn, ctrl, transformer_options, **kwargs)

        if not self.options.enabled:
            return eager()
        base_model = executor.class_obj
        if self._layout is not None:
            self._layout.ensure(getattr(base_model, "diffusion_model", None))
            if call is not None:
                for cn in _chain(call.control):
                    self._layout.ensure(getattr(cn, "control_model", None))
        st = _state_for(base_model, self.options, x.device)
        with st.lock:
            try:
                plan = self._plan(
                    st,
                    base_model,
                    x,
                    t,
                    c_concat,
                    c_crossattn,
                    control,
                    call,
                    transformer_options,
                    kwargs,
                )
                if isinstance(plan, str):
                    st.note_eager(plan, expected=plan in (FIRST_STEP, CACHE_FILL))
                    return eager()
                return self._run_graph(
                    st,
                    plan,
                    executor,
                    x,
                    t,
                    c_concat,
                    c_crossattn,
                    call,
                    transformer_options,
                    kwargs,
                )
            finally:
                if call is not None:  # Feature Cache decisions pinned for this call only
                    for cn in _chain(call.control):
                        cn.__dict__.pop("cna_cache_forced", None)

    # -----------------------------------------------------------------------------------------

    def _plan(self, st, base_model, x, t, c_concat, c_crossattn, control, call, topts, kwargs):
        """The capture key and what the graph needs, or a string saying why not to capture."""
        if st.cache.backend == "none":
            return f"no CUDA device for this model (input on {x.device.type}): graphs need a GPU"
        if st.cache.backend == "cuda" and x.device.type != "cuda":
            return f"input on {x.device.type}, not CUDA"
        if st.cache.backend == "cuda" and torch.cuda.is_current_stream_capturing():
            return "another CUDA graph capture is in progress"
        if control is not None and call is None:
            return (
                "ControlNet residuals were computed outside this wrapper (another node "
                "wraps the cond batch)"
            )
        bad = [k for k in ("patches", "patches_replace") if topts.get(k)]
        if bad:
            names = sorted({n for k in bad for n in topts[k]})
            return f"model has per-block patches ({', '.join(names)}) that may change per step"
        others = []
        for wtype in ("apply_model", "diffusion_model"):
            for key in topts.get("wrappers", {}).get(wtype, {}):
                if key != WRAPPER_KEY:
                    others.append(f"{wtype}:{key}")
        if others:
            return f"other wrappers run inside the model call ({', '.join(others)})"
        diffusion = getattr(base_model, "diffusion_model", None)
        if diffusion is None:
            return "model has no diffusion_model"
        if _lowvram(base_model) or _lowvram(diffusion):
            return "model weights are only partly on the GPU (lowvram): they are streamed per step"

        tensors: list[tuple[str, torch.Tensor]] = [("x", x), ("t", t)]
        sig: list = []
        for name, v in (
            ("c_concat", c_concat),
            ("c_crossattn", c_crossattn),
            *sorted(kwargs.items()),
        ):
            if isinstance(v, torch.Tensor):
                tensors.append((name, v))
            elif v is None or isinstance(v, (bool, int, float, str)):
                sig.append((name, v))
            else:
                return f"argument {name!r} of type {type(v).__name__} cannot be fed to a graph"
        sig.extend((n, _tensor_sig(v)) for n, v in tensors)
        sig.append(("cond_or_uncond", tuple(topts.get("cond_or_uncond", ()))))
        deps = {id(diffusion): st.fingerprint(diffusion)}

        chain_sig = []
        active: list[bool] = []
        chain = []
        if call is not None:
            x_noisy, t_call, cond, batched_number, _ = call.args
            if x_noisy is not x or t_call is not t:
                return "ControlNet and UNet were called with different inputs"
            chain = _chain(call.control)
            types = _supported_control_types()
            for cn in chain:
                if type(cn) not in types:
                    return f"control type {type(cn).__name__} is not supported by the graph path"
                if cn.model_sampling_current is None:
                    return "ControlNet not prepared for sampling (pre_run has not run)"
                if cn.control_model is None or _lowvram(cn.control_model):
                    return "ControlNet weights are only partly on the GPU (lowvram)"
            sigma = None
            for cn in chain:
                rng = cn.timestep_range
                if rng is None or (rng[0] >= ALWAYS_ON_SIGMA and rng[1] <= 0.0):
                    active.append(True)
                    continue
                if sigma is None:
                    sigma = float(t[0])  # one host read per step, as stock does per ControlNet
                active.append(not (sigma > rng[0] or sigma < rng[1]))
            groups = _fused_groups(chain, active)
            for cn, on in zip(chain, active, strict=True):
                if not on:  # skipped this step, as stock skips it: its hint is not read
                    chain_sig.append((id(cn.control_model), False))
                    continue
                hint = cn.cond_hint
                if hint is None:
                    return FIRST_STEP
                if (
                    hint.shape[2] != x.shape[2] * cn.compression_ratio
                    or hint.shape[3] != x.shape[3] * cn.compression_ratio
                    or x.shape[0] % hint.shape[0]  # 1, the batch, or one CFG chunk
                ):
                    return "ControlNet hint does not match this latent size yet (re-preparing it)"
                cache_part: tuple = ()
                if hasattr(cn, "cna_cache_plan"):  # ControlNet Feature Cache: compute or reuse
                    cache_part = cn.cna_cache_plan(x, t, call.args[4], groups.get(id(cn)))
                    if cache_part is None:
                        return CACHE_FILL
                extra = tuple(sorted((k, repr(v)) for k, v in cn.extra_args.items()))
                chain_sig.append(
                    (
                        id(cn.control_model),
                        True,
                        str(cn.strength_type),
                        cn.global_average_pooling,
                        _tensor_sig(hint),
                        extra,
                        tuple(cn.extra_conds),
                        cn.manual_cast_dtype,
                        cn.compression_ratio,
                        cache_part,
                        type(cn).__name__,
                        getattr(cn, "cna_positive_only", False),
                    )
                )
                deps[id(cn.control_model)] = st.fingerprint(cn.control_model)
            # tensors the ControlNet reads from the cond dict must be static too
            known = {id(v) for _, v in tensors}
            for k, v in sorted(cond.items()):
                if isinstance(v, torch.Tensor) and id(v) not in known:
                    tensors.append((f"cond.{k}", v))
                    sig.append((f"cond.{k}", _tensor_sig(v)))
            sig.append(("batched_number", batched_number))
        # the weights' memory layout is baked into the captured kernels
        key = (
            id(base_model),
            tuple(sig),
            tuple(chain_sig),
            self._layout is not None,
            self.options.concurrent_controlnet,
        )
        return _Plan(key, tensors, chain, active, deps)

    def _run_graph(self, st, plan, executor, x, t, c_concat, c_crossattn, call, topts, kwargs):
        cache = st.cache
        entry = cache.lookup(plan.key)
        if entry is not None and entry.extras.get("deps") != plan.deps:
            cache.evict(
                lambda e: e is entry, "model or ControlNet weights moved (reloaded or re-patched)"
            )
            entry = None
        names = [n for n, _ in plan.tensors]
        inputs = [v for _, v in plan.tensors]
        cur_extras: dict = {}  # the buffers of the entry being captured or (emulated) replayed

        def fn(*static):
            by_name = dict(zip(names, static, strict=True))
            kw = {k: by_name.get(k, v) for k, v in kwargs.items()}
            ctrl = side = None
            held: list[torch.Tensor] = []
            if call is not None:
                _, _, cond, batched_number, call_topts = call.args
                cond_s = {k: by_name.get(f"cond.{k}", by_name.get(k, v)) for k, v in cond.items()}
                side = st.side_stream(by_name["x"]) if self.options.concurrent_controlnet else None
                if side is not None:  # fork: the ControlNets wait for the step's inputs only
                    side.wait_stream(torch.cuda.current_stream())
                with _chain_overrides(plan.chain, plan.active, cur_extras), _on_stream(side):
                    ctrl = call.control.get_control(
                        by_name["x"], by_name["t"], cond_s, batched_number, call_topts
                    )
                if side is not None and isinstance(ctrl, dict):
                    held = _residual_tensors(ctrl)
                    ev = torch.cuda.Event()
                    ev.record(side)
                    ctrl = _JoinOnUse(ctrl, ev)
            try:
                return executor(
                    by_name["x"],
                    by_name["t"],
                    by_name.get("c_concat", c_concat),
                    by_name.get("c_crossattn", c_crossattn),
                    ctrl,
                    topts,
                    **kw,
                )
            finally:
                # the Memory Pool's weights prepared ahead on their side streams join first
                # (inside a capture, every forked stream must be joined before it ends)
                prefetch.end_pass()
                if side is not None:  # join, whatever the UNet read
                    cur = torch.cuda.current_stream()
                    if held:
                        # The residuals were allocated on the side stream, so their memory is
                        # freed there: that free must follow the UNet's reads on this stream.
                        # Dropped as the UNet pops them, they were freed in the side stream's
                        # order only; in a graph captured under cudaMallocAsync such a free is
                        # a node the reads need not precede, and the replay may hand the memory
                        # to another allocation while they run (session 6's illegal memory
                        # access at SDXL, one run in three). Held to here, freed after the wait.
                        side.wait_stream(cur)
                        ctrl = None
                        held.clear()
                    cur.wait_stream(side)

        if plan.key in cache.failed:
            st.note_eager(f"capture failed earlier: {cache.failed[plan.key]}")
            return _eager_from(call, executor, x, t, c_concat, c_crossattn, topts, kwargs)
        if entry is not None:
            _refresh_chain_buffers(entry, plan.chain)
            st.count("replays")
            cur_extras.update(entry.extras)
            return cache.replay(entry, inputs, fn)

        def prepare(e):
            e.extras["deps"] = plan.deps
            e.extras["hint"] = [
                cn.cond_hint.detach().clone() if on else None
                for cn, on in zip(plan.chain, plan.active, strict=True)
            ]
            e.extras["hint_src"] = [
                cn.cond_hint if on else None for cn, on in zip(plan.chain, plan.active, strict=True)
            ]
            e.extras["strength"] = [
                torch.tensor(float(cn.strength), dtype=torch.float32, device=x.device)
                for cn in plan.chain
            ]
            e.extras["strength_val"] = [float(cn.strength) for cn in plan.chain]
            cur_extras.update(e.extras)

        failure = None
        try:
            entry, out = cache.capture(
                plan.key,
                fn,
                inputs,
                prepare=prepare,
                verify=self.options.verify,
                verify_tol=self.options.verify_tol,
                device=x.device,
            )
        except Exception as e:
            # CaptureFailed says where it failed; anything else (static buffers) says what
            why = str(e) if isinstance(e, CaptureFailed) else f"{type(e).__name__}: {e}"
            failure = (why, is_out_of_memory(e))
        if failure is not None:
            # Out of the except block: the exception's frames hold the failed capture's
            # buffers, and the eager step must not run while they are still alive.
            reason, oom = failure
            cache.mark_failed(plan.key, reason)
            st.count("failed")
            if oom:  # the eager step needs memory now: give back what our graphs hold
                _release_after_oom(cache, reason)
            return _eager_from(call, executor, x, t, c_concat, c_crossattn, topts, kwargs)
        st.count("captures")
        logger.info(
            "%s: captured graph %d/%d in %.2f s (%s, %d ControlNet(s)%s)",
            cache.name,
            len(cache.entries),
            cache.max_graphs,
            entry.capture_s,
            "x".join(map(str, x.shape)),
            len(plan.chain),
            "" if all(plan.active) else f", active {plan.active}",
        )
        return out


def _release_after_oom(cache: GraphCache, reason: str) -> None:
    """Out of memory while capturing (or allocating a graph's static buffers): drop this
    model's other graphs too, so their memory pool goes back to the allocator, and hand the
    cached blocks to the driver. The step and later ones run eager (the reason is kept in
    ``cache.failed``); signatures that did capture are captured again when memory allows."""
    n = len(cache.entries)
    cache.evict(lambda e: True, f"out of memory during capture ({status.short(reason, 120)})")
    TOTALS["released"] += n
    gc.collect()
    try:
        import comfy.model_management as mm

        mm.soft_empty_cache()
    except Exception as e:  # without ComfyUI (tools): torch's own cache release
        logger.debug("CUDA Graph: soft_empty_cache unavailable (%s)", e)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


@dataclass
class _Plan:
    key: Hashable
    tensors: list
    chain: list
    active: list
    deps: dict


class _on_stream:
    """``torch.cuda.stream(s)``, or nothing when ``s`` is None."""

    def __init__(self, s):
        self.s = s
        self.ctx = None

    def __enter__(self):
        if self.s is not None:
            self.ctx = torch.cuda.stream(self.s)
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


def _eager_from(call, executor, x, t, c_concat, c_crossattn, topts, kwargs):
    ctrl = call.resolve() if call is not None else None
    return executor(x, t, c_concat, c_crossattn, ctrl, topts, **kwargs)


def _refresh_chain_buffers(entry, chain) -> None:
    """Bring each ControlNet's hint and strength buffers up to date before a replay."""
    hints, srcs = entry.extras["hint"], entry.extras["hint_src"]
    strengths, vals = entry.extras["strength"], entry.extras["strength_val"]
    for i, cn in enumerate(chain):
        if hints[i] is not None and srcs[i] is not cn.cond_hint:
            hints[i].copy_(cn.cond_hint)
            srcs[i] = cn.cond_hint
        s = float(cn.strength)
        if vals[i] != s:
            strengths[i].fill_(s)
            vals[i] = s


class _chain_overrides:
    """While the graph's function runs: each ControlNet reads our hint and strength buffers,
    skips its host-side range check (decided on the host already), and an inactive one passes
    the previous ControlNet's residuals through, exactly as stock ``get_control`` would."""

    def __init__(self, chain, active, extras):
        self.chain, self.active, self.extras = chain, active, extras
        self.saved: list[dict[str, Any]] = []

    def __enter__(self):
        hints = self.extras.get("hint", [])
        strengths = self.extras.get("strength", [])
        for i, cn in enumerate(self.chain):
            self.saved.append(
                {
                    "timestep_range": cn.timestep_range,
                    "strength": cn.strength,
                    "cond_hint": cn.cond_hint,
                    "had_get_control": "get_control" in cn.__dict__,
                }
            )
            cn.timestep_range = None
            # FusedControlNet protocol: the host decided activity; the hint buffer is refreshed
            # before each replay, so its encoding must run inside the graph (no caching).
            cn.cna_force_active = bool(self.active[i])
            cn.cna_graph_mode = True
            cn.cna_ran_in_graph = True  # for its badge (cleared at cleanup)
            if i < len(strengths):
                cn.strength = strengths[i]
            if i < len(hints) and hints[i] is not None:
                cn.cond_hint = hints[i]
            if not self.active[i]:
                cn.get_control = _passthrough(cn)
        return self

    def __exit__(self, *exc):
        for cn, s in zip(self.chain, self.saved, strict=False):
            cn.timestep_range = s["timestep_range"]
            cn.strength = s["strength"]
            cn.cond_hint = s["cond_hint"]
            if not s["had_get_control"]:
                cn.__dict__.pop("get_control", None)
            cn.__dict__.pop("cna_force_active", None)
            cn.__dict__.pop("cna_graph_mode", None)
        return False


def _passthrough(cn):
    def get_control(x_noisy, t, cond, batched_number, transformer_options):
        prev = cn.previous_controlnet
        if prev is None:
            return None
        return prev.get_control(x_noisy, t, cond, batched_number, transformer_options)

    return get_control


def apply_cuda_graph(model, options: GraphOptions, node_id=None):
    """A clone of ``model`` (a ComfyUI ModelPatcher) whose sampling steps run in CUDA graphs."""
    import comfy.patcher_extension as pe

    m = model.clone()
    for wtype in ("OUTER_SAMPLE", "CALC_COND_BATCH", "APPLY_MODEL"):
        if not hasattr(pe.WrappersMP, wtype):
            logger.warning(
                "CUDA Graph: this ComfyUI has no %s wrapper; the model runs eager", wtype
            )
            return m
    patch = CudaGraphPatch(options, node_id)
    for wtype in ("OUTER_SAMPLE", "CALC_COND_BATCH", "APPLY_MODEL"):
        m.remove_wrappers_with_key(getattr(pe.WrappersMP, wtype), WRAPPER_KEY)
    m.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, patch.outer_sample_wrapper)
    m.add_wrapper_with_key(
        pe.WrappersMP.CALC_COND_BATCH, WRAPPER_KEY, patch.calc_cond_batch_wrapper
    )
    m.add_wrapper_with_key(pe.WrappersMP.APPLY_MODEL, WRAPPER_KEY, patch.apply_model_wrapper)
    if hasattr(pe, "CallbacksMP") and hasattr(pe.CallbacksMP, "ON_DETACH"):
        m.remove_callbacks_with_key(pe.CallbacksMP.ON_DETACH, WRAPPER_KEY)
        m.add_callback_with_key(pe.CallbacksMP.ON_DETACH, WRAPPER_KEY, _on_detach)
    return m


def _on_detach(patcher, unpatch_all=True) -> None:
    """ComfyUI is unloading the model (memory pressure, another model): free its graphs now.

    Their memory pool is invisible to ComfyUI's memory manager, and the weights they point at
    are about to move anyway (they would be dropped at the next run's address check).
    """
    if not unpatch_all:
        # Another clone of the same model is taking over (ComfyUI detaches clones with
        # unpatch_all=False): the weights stay where they are, and so do the graphs.
        return
    st = _STATES.get(getattr(patcher, "model", None))
    if st is not None and st.cache.entries:
        with st.lock:
            n = len(st.cache.entries)
            st.cache.evict(lambda e: True, "model unloaded from the GPU")
            TOTALS["released"] += n
