# SPDX-License-Identifier: GPL-3.0-or-later
"""CUDA Graph Sampler: capture the UNet + ControlNet step of a ComfyUI model in CUDA graphs.

How it hooks into ComfyUI (ModelPatcher wrappers only, no ComfyUI file is touched):

- ``CALC_COND_BATCH`` wrapper: swaps each control object in the conds for a memoised proxy, so
  cond/uncond still batch together (ComfyUI batches on ``control is control``) but the proxy's
  ``get_control`` only *records* the call instead of running the ControlNet;
- ``APPLY_MODEL`` wrapper: receives that recorded call with the UNet's inputs, and runs
  ControlNet(s) + UNet as one function: captured once per input signature, replayed afterwards.
  Anything it cannot capture runs exactly as stock ComfyUI would, with the reason logged once;
- ``OUTER_SAMPLE`` wrapper: starts a sampling run: puts a fresh ``GraphRun`` (graph_state.py)
  in the run's model options, so weight addresses are re-checked once per run (a model unloaded
  and reloaded, or re-patched by a LoRA, lives at new addresses and its graphs are dropped) and
  the step plan (step_plan.py) is built once per run instead of every step.

What is fed to the graph at each replay rather than baked in: the latent, sigma, text and ADM
conditioning (static input buffers), each ControlNet's hint (its own buffer, refreshed when the
ControlNet prepares a new one) and strength (a device scalar, so changing strength never
recaptures). Start/end percent: with the full 0–1 range there is nothing to check; a partial
range reads sigma on the host once per step (stock ComfyUI does it once per ControlNet) and picks
the graph with or without that ControlNet, so inactive steps skip its compute as stock does.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass

import torch

from ..errors import is_out_of_memory
from ..graphs import CaptureFailed, context_hoist, stream_join
from ..graphs.compiled import CompileOptions, untraced
from ..graphs.hint_encoding import encode, encoder_of
from ..logger import logger
from ..memory import prefetch
from . import compat, compiled_step, status, step_plan
from .channels_last import LayoutSwap
from .graph_deferral import (  # noqa: F401  (ControlCall, _JoinOnUse: used by tests and tools)
    ControlCall,
    _JoinOnUse,
    defer_controls,
    join_stream,
    on_stream,
    residual_tensors,
    traced_join,
)
from .graph_state import (  # noqa: F401  (_STATES, graph_stats: tests and tools)
    _STATES,
    RUN_KEY,
    GraphRun,
    existing_state,
    graph_stats,
    release_after_oom,
    release_for_memory,
    state_for,
)
from .step_plan import CACHE_FILL, FIRST_STEP, Plan, chain_of

WRAPPER_KEY = "cna_cuda_graph"
TIMED_REPLAYS = 4  # replayed calls per run timed with CUDA events for the badge


@dataclass(frozen=True)
class GraphOptions:
    enabled: bool = True
    max_graphs: int = 8
    verify: bool = False
    verify_tol: float = 1e-2
    channels_last: bool = False  # experimental: see channels_last.py
    # ControlNets on a second CUDA stream, overlapping the UNet's input blocks (their residuals
    # are first read at the middle block); see _JoinOnUse. On by default, in compiled mode too:
    # bit-identical (compiled: the same latent), 4-10% faster per step on the H200 with the
    # eager kernels and 3-11% compiled (docs/benchmarks.md).
    concurrent_controlnet: bool = True
    # Compiled mode (compiled_step.py): inductor's code for the UNet and ControlNets inside the
    # graphs. None: the eager kernels, exactly stock.
    compile: CompileOptions | None = None


def _supported_control_types() -> tuple[type, ...]:
    import comfy.controlnet

    from .feature_cache import CachedControlNet
    from .fused_apply import FusedControlNet

    return (comfy.controlnet.ControlNet, FusedControlNet, CachedControlNet)


class CudaGraphPatch:
    """The three wrappers. Per-run state lives in the run's ``GraphRun`` (``transformer_options
    [RUN_KEY]``), per-model state in graph_state's ``_STATES``; the patch itself holds only the
    node's settings and the run template."""

    def __init__(self, options: GraphOptions, node_id=None, classic: bool = False):
        self.options = options
        self.template = GraphRun(options, node_id)
        # the model is ComfyUI's classic copy of a DynamicVRAM one (``apply_cuda_graph``)
        self.classic = classic

    def _run_of(self, transformer_options: dict | None) -> GraphRun:
        run = (transformer_options or {}).get(RUN_KEY)
        return run if run is not None else self.template

    # OUTER_SAMPLE: a new sampling run begins
    def outer_sample_wrapper(self, executor, *args, **kwargs):
        import comfy.model_patcher

        guider = executor.class_obj
        orig_options = guider.model_options
        run = self.template.clone()
        guider.model_options = comfy.model_patcher.create_model_options_clone(orig_options)
        guider.model_options.setdefault("transformer_options", {})[RUN_KEY] = run
        sigmas = args[3] if len(args) > 3 else kwargs.get("sigmas")
        run.total_steps = max(1, len(sigmas) - 1) if sigmas is not None else None
        if len(args) > 5:  # the sampler's progress: the step index on the host
            args = (*args[:5], run.progress_callback(args[5]), *args[6:])
        else:
            kwargs["callback"] = run.progress_callback(kwargs.get("callback"))
        patcher = getattr(guider, "model_patcher", None)
        model = getattr(patcher, "model", None)
        st = existing_state(model)
        if st is not None:
            st.run_id += 1
        if self.options.enabled and model is not None and not compat.is_dynamic(patcher):
            # DynamicVRAM ControlNets in this run's conds: classic copies, before ComfyUI loads
            device = getattr(patcher, "load_device", None) or torch.device("cpu")
            classic_controls(
                getattr(guider, "conds", None), state_for(model, self.options.max_graphs, device)
            )
        st = existing_state(model)
        if st is not None and st.cache.entries:
            with st.lock:
                st.release_moved(_run_networks(model, getattr(guider, "conds", None)))
        t0 = time.perf_counter()
        run.timing = [] if run.node_id is not None and torch.cuda.is_available() else None
        if run.timing is not None:
            torch.cuda.reset_peak_memory_stats()  # the badge's peak is this run's
        comp = comp_off = None
        if self.options.enabled:
            comp, comp_off = compiled_step.begin_run(
                self.options.compile, guider.model_options, model
            )
        # Compiled mode always runs on channels-last weights: inductor keeps activations
        # channels-last, and weights handed to it in ComfyUI's layout are permuted by its code
        # at every call (a copy of every convolution weight per step).
        if self.options.enabled and (self.options.channels_last or comp is not None):
            run.layout = LayoutSwap()
        ok = False
        try:
            out = executor(*args, **kwargs)
            ok = True
            return out
        finally:  # the weights go back to ComfyUI's layout however the run ends
            layout, run.layout = run.layout, None
            if layout is not None:
                layout.restore()
            if ok and run.node_id is not None:
                self._report(model, run, time.perf_counter() - t0, comp, comp_off)
            guider.model_options = orig_options
            run.reset()
            if comp is not None:
                comp.reset()

    def _report(self, model, run: GraphRun, wall_s: float, comp=None, comp_off=None) -> None:
        """The run's figures to this node's badge (nodes/status.py)."""
        try:
            d = {k: run.counts[k] for k in ("captures", "replays", "eager")}
            steps = run.total_steps
            timing = run.timing
            if timing and torch.cuda.is_available():
                torch.cuda.synchronize()
            per: dict[str, list] = {}
            for kind, a, b in timing or []:
                per.setdefault(kind, []).append(a.elapsed_time(b))
            data = {**d, "steps": steps, "plans_built": run.plans_built}
            lines = []
            if not self.options.enabled:
                lines.append("CUDA graph: off")
            else:
                lines.append(
                    f"CUDA graph: {d['replays']} replayed · {d['captures']} captured · "
                    f"{d['eager']} eager"
                )
                if self.classic:
                    data["classic_copies"] = True
                    lines.append("on classic copies (DynamicVRAM is on)")
            if steps:
                data["ms_per_step"] = 1e3 * wall_s / steps
                # CPU time in the pack's wrapper bodies (ComfyUI's model calls and the time
                # blocked in the graph launch excluded; the latter is launch_ms_per_step)
                data["host_ms_per_step"] = run.host_ms_per_step(steps)
                data["launch_ms_per_step"] = run.launch_ms_per_step(steps)
                if run.replay_calls:  # the same, in the calls that replayed a graph only
                    data["host_ms_per_replay"] = run.host_ms_per_replay()
                line = f"{data['ms_per_step']:.1f} ms/step"
                if per.get("replay") and per.get("eager"):
                    data["replay_ms"] = sum(per["replay"]) / len(per["replay"])
                    data["eager_ms"] = sum(per["eager"]) / len(per["eager"])
                    data["speedup_vs_eager"] = data["eager_ms"] / data["replay_ms"]
                    line += f" · {data['speedup_vs_eager']:.1f}× vs eager step"
                line += f" · host {data['host_ms_per_step']:.2f} ms"
                lines.append(line)
            if comp is not None:
                cs = comp.stats()
                data["compiled"] = {"mode": comp.options.mode, "source": comp.source, **cs}
                line = f"compiled ({comp.options.mode})"
                if cs["compiles"]:
                    line += f" · {cs['compiles']} compile(s) in {cs['compile_s']:.0f} s"
                if cs["failed_signatures"]:
                    line += f" · {cs['failed_signatures']} eager (see log)"
                lines.append(line)
            elif comp_off is not None:
                data["compiled"] = {"off": comp_off}
                lines.append("compiled: off (" + status.short(comp_off, 60) + ")")
            unexpected = sorted(r for r in run.eager_reasons if r not in (FIRST_STEP, CACHE_FILL))
            if unexpected:
                data["eager_reasons"] = unexpected
                lines.append("eager: " + status.short(unexpected[0]))
            if timing:  # the model ran on the GPU (a --cpu run on a GPU machine has none)
                data["peak_allocated"] = torch.cuda.max_memory_allocated()
                lines.append(f"peak VRAM {status.mib(data['peak_allocated'])}")
            status.report(run.node_id, "cuda_graph", lines, data)
        except Exception as e:  # a badge must never fail a run
            logger.debug("CUDA Graph: no badge for this run: %s", e)

    # CALC_COND_BATCH: defer control calls to APPLY_MODEL
    def calc_cond_batch_wrapper(
        self, executor, model, conds, x_in, timestep, model_options, *args, **kwargs
    ):
        # arguments a newer ComfyUI adds after these five pass through untouched
        if not self.options.enabled:
            return executor(model, conds, x_in, timestep, model_options, *args, **kwargs)
        t0 = time.perf_counter()
        run = self._run_of(model_options.get("transformer_options"))
        run.evaluations += 1
        st = state_for(model, self.options.max_graphs, x_in.device)
        if step_plan.model_plan(run, st, model).reason is not None:
            # This run cannot capture the model (DynamicVRAM, lowvram): the step is stock's
            # own, ControlNets included (APPLY_MODEL counts it eager, with the reason).
            dt = time.perf_counter() - t0
            run.host_s += dt
            return executor(model, conds, x_in, timestep, model_options, *args, **kwargs)
        new_conds = defer_controls(conds)
        dt = time.perf_counter() - t0
        run.host_s += dt
        run.pending_host_s += dt  # counted with the model call it prepares
        return executor(model, new_conds, x_in, timestep, model_options, *args, **kwargs)

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
        t0 = time.perf_counter()
        if transformer_options is None:
            transformer_options = {}
        run = self._run_of(transformer_options)
        model_s, launch_s, replays = run.model_s, run.launch_s, run.counts["replays"]
        args = (executor, x, t, c_concat, c_crossattn, control, transformer_options, kwargs)
        try:
            if run.timing is not None and x.is_cuda:
                return self._apply_model_timed(run, *args)
            return self._apply_model(run, *args)
        finally:
            run.calls += 1
            waited = (run.model_s - model_s) + (run.launch_s - launch_s)
            dt = time.perf_counter() - t0 - waited
            run.host_s += dt
            if run.counts["replays"] > replays:  # this call replayed a graph
                run.replay_host_s += dt + run.pending_host_s
                run.replay_calls += 1
            run.pending_host_s = 0.0

    def _apply_model_timed(self, run: GraphRun, *args):
        """One pair of CUDA events per call, read at the run's end (the badge's speed-up).
        Replays are timed only until ``TIMED_REPLAYS`` of them are: an event recorded right
        after a graph launch waits, as the launch does, while the GPU is behind, and the
        badge needs their mean, not every one."""
        before = (run.counts["replays"], run.counts["captures"])
        if run.timed_replays >= TIMED_REPLAYS and run.last_replayed:
            out = self._apply_model(run, *args)
            run.last_replayed = run.counts["replays"] > before[0]
            return out
        try:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
        except Exception as e:  # timing is for the badge only: never in the way
            logger.debug("CUDA Graph: step timing off for this run: %s", e)
            run.timing = None
            return self._apply_model(run, *args)
        out = self._apply_model(run, *args)
        end.record()
        if run.counts["captures"] > before[1]:
            kind = "capture"
        elif run.counts["replays"] > before[0]:
            kind = "replay"
            run.timed_replays += 1
        else:
            kind = "eager"
        run.last_replayed = kind == "replay"
        run.timing.append((kind, start, end))
        return out

    def _apply_model(
        self, run, executor, x, t, c_concat, c_crossattn, control, transformer_options, kwargs
    ):
        call = control if isinstance(control, ControlCall) else None

        def eager():
            t0 = time.perf_counter()
            try:
                ctrl = call.resolve() if call is not None else control
                args = (x, t, c_concat, c_crossattn, ctrl, transformer_options)
                try:
                    return executor(*args, **kwargs)
                except Exception as e:
                    # Our graphs' memory pools are invisible to ComfyUI's memory manager: where
                    # the step ran out beside them, they go and the step runs once more.
                    if not is_out_of_memory(e) or not release_for_memory(str(e)):
                        raise
                    del e
                return executor(*args, **kwargs)
            finally:
                run.model_s += time.perf_counter() - t0

        if not self.options.enabled:
            return eager()
        base_model = executor.class_obj
        st = state_for(base_model, self.options.max_graphs, x.device)
        if run.layout is not None and step_plan.model_plan(run, st, base_model).reason is None:
            # Never under DynamicVRAM or lowvram: those weights are ComfyUI's to move or refill
            # while the run goes on, in its own layout.
            run.layout.ensure(getattr(base_model, "diffusion_model", None))
            if call is not None:
                for cn in chain_of(call.control):
                    net = getattr(cn, "control_model", None)
                    if net is not None and not run.layout.seen(net):
                        if step_plan.capturable_net(net):
                            run.layout.ensure(net)
                        else:
                            run.layout.leave(net)
        comp = compiled_step.run_of(transformer_options)
        flags = (
            run.layout is not None,
            self.options.concurrent_controlnet,
            comp.options if comp is not None else None,
            _hoists(comp, st),
        )
        with st.lock:
            plan = step_plan.plan(
                run,
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
                WRAPPER_KEY,
                flags,
                _supported_control_types,
            )
            if isinstance(plan, str):
                st.note_eager(plan, run, expected=plan in (FIRST_STEP, CACHE_FILL))
                return eager()
            return self._run_graph(
                run, st, plan, executor, eager, call, transformer_options, kwargs
            )

    def _run_graph(self, run, st, plan: Plan, executor, eager, call, topts, kwargs):
        cache = st.cache
        if plan.entry is not None and plan.version == cache.version:
            entry = plan.entry  # the last call's graph: nothing dropped since
        else:
            entry = cache.lookup(plan.key)
            if entry is not None and entry.extras.get("deps") != plan.deps:
                cache.evict(
                    lambda e: e is entry,
                    "model or ControlNet weights moved (reloaded or re-patched)",
                )
                entry = None
        if entry is not None:
            stale = _refresh_chain_buffers(entry, plan.chain, st)
            if stale is not None:
                cache.evict(lambda e: e is entry, stale)
                entry = None
        if entry is not None:
            st.count("replays", run)
            hoist = entry.extras.get("context_hoist")
            if hoist is not None:
                hoist.before_replay(st.run_id)
            fn = None  # a real replay runs no Python; the emulated one calls the function
            if cache.backend != "cuda":
                fn = self._graph_fn(run, st, plan, executor, call, topts, kwargs, entry.extras)
            launch_s = cache.launch_s
            out = cache.replay(entry, plan.inputs, fn)
            run.launch_s += cache.launch_s - launch_s
            plan.entry, plan.version, plan.inputs = entry, cache.version, []
            run.last = plan
            return out
        if plan.key in cache.failed:
            st.note_eager(f"capture failed earlier: {cache.failed[plan.key]}", run)
            return eager()
        x = plan.inputs[0]
        cur_extras: dict = {}
        fn = self._graph_fn(run, st, plan, executor, call, topts, kwargs, cur_extras)

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
            e.extras["encoded"] = [
                _encode_hint(cn, h) for cn, h in zip(plan.chain, e.extras["hint"], strict=True)
            ]
            e.extras["encoded_run"] = st.run_id
            comp = compiled_step.run_of(topts)
            if _hoists(comp, st):
                nets = [getattr(executor.class_obj, "diffusion_model", None)]
                nets += [getattr(cn, "control_model", None) for cn in plan.chain]
                e.extras["context_hoist"] = context_hoist.ContextProjections(
                    context_hoist.cross_attention_weights(nets),
                    lambda: cache.capturing_graph,
                    st.run_id,
                )
            elif comp is not None and comp.model.projections is not None:
                # the projections lifted out of the compiled networks (one set per model)
                # (whatever this run's first calls find in their buffers is projected anew)
                comp.model.projections.capturing_graph = lambda: cache.capturing_graph
                comp.model.projections.before_replay(st.run_id)
                e.extras["context_hoist"] = comp.model.projections
            cur_extras.update(e.extras)

        failure = None
        try:
            entry, out = cache.capture(
                plan.key,
                fn,
                plan.inputs,
                prepare=prepare,
                verify=self.options.verify,
                verify_tol=self.options.verify_tol,
                device=x.device,
                compile_first=compiled_step.run_of(topts) is not None,
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
            st.count("failed", run)
            if oom:  # the eager step needs memory now: give back what our graphs hold
                release_after_oom(cache, reason)
            return eager()
        st.count("captures", run)
        plan.entry, plan.version, plan.inputs = entry, cache.version, []
        run.last = plan
        hoist = entry.extras.get("context_hoist")
        logger.info(
            "%s: captured graph %d/%d in %.2f s (%s, %d ControlNet(s)%s%s)",
            cache.name,
            len(cache.entries),
            cache.max_graphs,
            entry.capture_s,
            "x".join(map(str, x.shape)),
            len(plan.chain),
            "" if all(plan.active) else f", active {plan.active}",
            ""
            if hoist is None or not hoist.hoisted
            else f", {hoist.hoisted} context projections once per context, "
            f"{hoist.buffer_bytes() / 2**20:.1f} MiB",
        )
        return out

    def _graph_fn(self, run, st, plan: Plan, executor, call, topts, kwargs, extras: dict):
        """The function a graph records: ControlNet chain + UNet on the static inputs. Called
        at capture (and, emulated, at every replay); a real replay runs none of it."""
        names = plan.names
        comp = compiled_step.run_of(topts)
        concurrent = self.options.concurrent_controlnet
        # Compiled mode: the wait for the ControlNets' stream is an op of the UNet's compiled
        # graph, where the first residual is read (after the middle block for an SD
        # ControlNet), made through stream_join.waiting below. CNA_COMPILE_TRACED_JOIN=0: a
        # call dynamo does not trace, the compiled code then in parts with the wait between.
        wait = None
        if comp is not None:
            wait = traced_join if comp.options.traced_join else untraced(join_stream)

        def fn(*static):
            t0 = time.perf_counter()
            if comp is not None:
                comp.active = True
            by_name = dict(zip(names, static, strict=True))
            kw = {k: by_name.get(k, v) for k, v in kwargs.items()}
            ctrl = side = None
            held: list[torch.Tensor] = []
            hoist = extras.get("context_hoist")
            try:
                with hoist.active() if hoist is not None else contextlib.nullcontext():
                    if call is not None:
                        _, _, cond, batched_number, call_topts = call.args
                        cond_s = {
                            k: by_name.get(f"cond.{k}", by_name.get(k, v)) for k, v in cond.items()
                        }
                        side = st.side_stream(by_name["x"]) if concurrent else None
                        if side is not None:  # fork: the ControlNets wait for the inputs only
                            side.wait_stream(torch.cuda.current_stream())
                        ctl = call_topts.get(step_plan.STEP_KEY)
                        overrides = _chain_overrides(plan.chain, plan.active, extras, comp, st)
                        with overrides, on_stream(side):
                            ctl.graph = True
                            try:
                                ctrl = call.control.get_control(
                                    by_name["x"], by_name["t"], cond_s, batched_number, call_topts
                                )
                            finally:
                                ctl.graph = False
                        if side is not None and isinstance(ctrl, dict):
                            held = residual_tensors(ctrl)
                            ev = torch.cuda.Event()
                            ev.record(side)
                            ctrl = _JoinOnUse(ctrl, ev, wait)
                    joins = (
                        stream_join.waiting(functools.partial(join_stream, ctrl))
                        if isinstance(ctrl, _JoinOnUse)
                        else contextlib.nullcontext()
                    )
                    with joins:
                        return executor(
                            by_name["x"],
                            by_name["t"],
                            by_name.get("c_concat"),
                            by_name.get("c_crossattn"),
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
                        # to another allocation while they run (an illegal memory access at
                        # SDXL, one run in three). Held to here, freed after the wait.
                        side.wait_stream(cur)
                        ctrl = None
                        held.clear()
                    cur.wait_stream(side)
                if comp is not None:
                    comp.active = False
                run.model_s += time.perf_counter() - t0

        return fn


def _encode_hint(cn, hint) -> torch.Tensor | None:
    """The ControlNet's hint encoder run on ``hint`` outside the graph, or None when its
    network runs whole inside the graph (no hint this step, or an encoder that cannot run once
    per hint: see graphs/hint_encoding.py)."""
    encoder = encoder_of(cn.control_model) if hint is not None else None
    return None if encoder is None else encode(encoder, hint)


def _refresh_chain_buffers(entry, chain, st) -> str | None:
    """Bring each ControlNet's hint, hint encoding and strength buffers up to date before a
    replay. The encoding is recomputed with a new hint, and once per sampling run (a patch of
    the encoder's weights between runs is then seen as the graph sees it). Returns why the
    graph cannot be replayed (an encoding it reads can no longer be made), else None."""
    hints, srcs = entry.extras["hint"], entry.extras["hint_src"]
    strengths, vals = entry.extras["strength"], entry.extras["strength_val"]
    encoded = entry.extras.get("encoded") or [None] * len(chain)
    new_run = entry.extras.get("encoded_run") != st.run_id
    entry.extras["encoded_run"] = st.run_id
    for i, cn in enumerate(chain):
        fresh = new_run
        if hints[i] is not None and srcs[i] is not cn.cond_hint:
            hints[i].copy_(cn.cond_hint)
            srcs[i] = cn.cond_hint
            fresh = True
        if fresh and encoded[i] is not None:
            enc = _encode_hint(cn, hints[i])
            if enc is None or enc.shape != encoded[i].shape:
                return "a ControlNet's hint encoder changed"
            encoded[i].copy_(enc)
        s = float(cn.strength)
        if vals[i] != s:
            strengths[i].fill_(s)
            vals[i] = s
    return None


class _chain_overrides:
    """While the graph's function runs: each ControlNet reads our hint and strength buffers and
    skips its host-side range check (decided on the host already). ComfyUI's ``get_control``
    reads these from the object and offers no other way in, so they are swapped for the call
    and put back after it. An inactive stock ControlNet passes the previous one's residuals
    through, exactly as stock ``get_control`` would; the pack's fused nets read the host's
    decision from the call's StepControl instead. A network whose hint was encoded outside
    the graph (``extras["encoded"]``) is its ``EncodedHintNet`` for the call, which reads that
    encoding; in compiled mode each network (or the one without its encoder) runs compiled
    (compiled_step.CompiledNet)."""

    def __init__(self, chain, active, extras, comp=None, st=None):
        from .fused_apply import FusedControlNet

        self.chain, self.active, self.extras, self.comp, self.st = chain, active, extras, comp, st
        self.fused = FusedControlNet
        self.saved: list[tuple] = []
        self.encoded_nets: list = []

    def __enter__(self):
        hints = self.extras.get("hint", [])
        strengths = self.extras.get("strength", [])
        encoded = self.extras.get("encoded", [])
        for i, cn in enumerate(self.chain):
            self.saved.append(
                (
                    cn.timestep_range,
                    cn.strength,
                    cn.cond_hint,
                    "get_control" in cn.__dict__,
                    cn.control_model,
                )
            )
            cn.timestep_range = None
            hn = None
            if self.st is not None and i < len(encoded) and encoded[i] is not None:
                hn = self.st.hint_net(cn.control_model)
            if hn is not None:
                hn.use(hints[i], encoded[i])
                if self.comp is None:
                    hn.inner = hn.whole = None
                else:  # compiled, also for a hint it has no encoding for (a sliced batch)
                    hn.inner = self.comp.model.net_for(hn.headless)
                    hn.whole = self.comp.model.net_for
                self.encoded_nets.append(hn)
                cn.control_model = hn
            elif self.comp is not None and cn.control_model is not None:
                cn.control_model = self.comp.model.net_for(cn.control_model)
            if i < len(strengths):
                cn.strength = strengths[i]
            if i < len(hints) and hints[i] is not None:
                cn.cond_hint = hints[i]
            if not self.active[i] and not isinstance(cn, self.fused):
                cn.get_control = _passthrough(cn)
        return self

    def __exit__(self, *exc):
        for cn, saved in zip(self.chain, self.saved, strict=False):
            rng, strength, hint, had_get_control, net = saved
            cn.control_model = net
            cn.timestep_range = rng
            cn.strength = strength
            cn.cond_hint = hint
            if not had_get_control:
                cn.__dict__.pop("get_control", None)
        for hn in self.encoded_nets:
            hn.use(None, None)
        return False


def _passthrough(cn):
    def get_control(x_noisy, t, cond, batched_number, transformer_options):
        prev = cn.previous_controlnet
        if prev is None:
            return None
        return prev.get_control(x_noisy, t, cond, batched_number, transformer_options)

    return get_control


def apply_cuda_graph(model, options: GraphOptions, node_id=None, node_name: str = "CUDA Graph"):
    """A clone of ``model`` (a ComfyUI ModelPatcher) whose sampling steps run in CUDA graphs.

    Under ComfyUI's DynamicVRAM no graph can hold the model's weights (they are loaded as layers
    run and evictable between them). The clone is then made of ComfyUI's classic copy of the
    model (``compat.classic_delegate``), and each run's DynamicVRAM ControlNets get classic
    copies too (``classic_controls``), so the step is captured as with DynamicVRAM off. Where no
    classic copy can be had (no room, a custom loader, a Memory Pool model), the model is handed
    back as it came, not cloned and not wrapped: compiled mode needs a graph, so the node has
    nothing to add, and in measurements its eager run was slower than stock's. The log says so
    once per process and node type (``node_name``, the node the user placed), the node's badge
    each time the node runs."""
    if compat.is_dynamic(model) and not options.enabled:
        return model  # a disabled KSampler (CUDA Graph) samples as KSampler does
    classic_copy = compat.is_dynamic(model)
    if classic_copy:
        classic, why = (
            (None, "the Memory Pool manages it")
            if _pooled(model)
            else compat.classic_delegate(model)
        )
        if classic is None:
            said = compat.dynamic_pass_through(why)
            compat.warn_once(f"graph:dynamic:{node_name}", "%s: %s", node_name, said)
            status.report(
                node_id,
                "cuda_graph",
                [
                    "off: DynamicVRAM manages this model (--disable-dynamic-vram to use graphs)"
                    if compat.restart_helps(why)
                    else "off: DynamicVRAM streams this model (too large for a graph here)"
                ],
                {"passed_through": said},
            )
            return model
        compat.info_once(
            f"graph:classic:{node_name}",
            "%s: DynamicVRAM is on: the graphs run ComfyUI's classic copy of the model, and "
            "classic copies of its ControlNets, loaded whole on the GPU",
            node_name,
        )
        model = classic
    import comfy.patcher_extension as pe

    m = model.clone()
    for wtype in ("OUTER_SAMPLE", "CALC_COND_BATCH", "APPLY_MODEL"):
        if not hasattr(pe.WrappersMP, wtype):
            logger.warning(
                "CUDA Graph: this ComfyUI has no %s wrapper; the model runs eager", wtype
            )
            return m
    patch = CudaGraphPatch(options, node_id, classic=classic_copy)
    for wtype in ("OUTER_SAMPLE", "CALC_COND_BATCH", "APPLY_MODEL", "DIFFUSION_MODEL"):
        if hasattr(pe.WrappersMP, wtype):
            m.remove_wrappers_with_key(getattr(pe.WrappersMP, wtype), WRAPPER_KEY)
    m.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, patch.outer_sample_wrapper)
    m.add_wrapper_with_key(
        pe.WrappersMP.CALC_COND_BATCH, WRAPPER_KEY, patch.calc_cond_batch_wrapper
    )
    m.add_wrapper_with_key(pe.WrappersMP.APPLY_MODEL, WRAPPER_KEY, patch.apply_model_wrapper)
    if hasattr(pe.WrappersMP, "DIFFUSION_MODEL"):  # compiled mode's UNet (compiled_step.py)
        m.add_wrapper_with_key(
            pe.WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY, compiled_step.diffusion_model_wrapper
        )
    if hasattr(pe, "CallbacksMP") and hasattr(pe.CallbacksMP, "ON_DETACH"):
        m.remove_callbacks_with_key(pe.CallbacksMP.ON_DETACH, WRAPPER_KEY)
        m.add_callback_with_key(pe.CallbacksMP.ON_DETACH, WRAPPER_KEY, _on_detach)
    return m


def _pooled(model) -> bool:
    """Whether the Memory Pool's wrappers are on ``model`` (its INT8 and streamed layers are
    object patches made for that model's own weights)."""
    from .memory_pool import WRAPPER_KEY as POOL_KEY

    wrappers = getattr(model, "wrappers", None) or {}
    return any(POOL_KEY in (w or {}) for w in wrappers.values())


def classic_controls(conds, st) -> None:
    """Under DynamicVRAM, give this run's ControlNet chains classic copies of their networks, so
    the graphs can hold them (the model itself is ComfyUI's classic copy: ``apply_cuda_graph``).

    ``conds`` is the guider's per-run copy of its conditioning (``CFGGuider.sample`` copies every
    entry before the OUTER_SAMPLE wrappers run, and drops the copy after): an entry whose chain
    has a DynamicVRAM ControlNet is replaced in it by an entry whose chain is new control objects
    (``copy()``, as the Apply ControlNet nodes make them) on the classic networks, which ComfyUI
    then loads, prepares and cleans up as it does the originals. The originals, other nodes'
    cached outputs, are not touched. A network's classic copy is made once and kept with the
    model's graph state for as long as the original lives (``ModelGraphState.classic_net``).
    Chains shared by several entries (cond and uncond) stay shared."""
    if not isinstance(conds, dict):
        return
    made: dict[int, object] = {}  # id(original control) -> its copy, for this run
    for key, entries in list(conds.items()):
        if not isinstance(entries, list):
            continue
        out, changed = [], False
        for entry in entries:
            control = entry.get("control") if isinstance(entry, dict) else None
            if control is not None:
                twin = _classic_chain(control, made, st)
                if twin is not control:
                    entry = {**entry, "control": twin}
                    changed = True
            out.append(entry)
        if changed:
            conds[key] = out


def _classic_chain(control, made: dict, st):
    chain = chain_of(control)
    dynamic = [compat.is_dynamic(getattr(cn, "control_model_wrapped", None)) for cn in chain]
    if not any(dynamic):
        return control
    supported = _supported_control_types()
    if any(type(cn) not in supported for cn in chain):
        return control  # the step plan runs it eager and says why
    prev = None
    for cn, dyn in zip(chain, dynamic, strict=True):
        got = made.get(id(cn))
        if got is None:
            classic = st.classic_net(cn.control_model_wrapped) if dyn else None
            if dyn and classic is None:
                return control  # eager, DynamicVRAM's: the log said why
            got = cn.copy()
            if classic is not None:
                got.control_model = classic.model
                got.control_model_wrapped = classic
            got.set_previous_controlnet(prev)
            made[id(cn)] = got
        prev = got
    return prev


def _run_networks(model, conds) -> list:
    """The networks a run's graphs read weights of: the diffusion model and every ControlNet
    network in the run's conditioning."""
    nets = [getattr(model, "diffusion_model", None)]
    for entries in (conds or {}).values() if isinstance(conds, dict) else ():
        for entry in entries if isinstance(entries, list) else ():
            control = entry.get("control") if isinstance(entry, dict) else None
            nets.extend(getattr(cn, "control_model", None) for cn in chain_of(control))
    return [n for n in dict.fromkeys(nets) if isinstance(n, torch.nn.Module)]


def _on_detach(patcher, unpatch_all=True) -> None:
    """ComfyUI is unloading the model (memory pressure, another model): free its graphs now.

    Their memory pool is invisible to ComfyUI's memory manager, and the weights they point at
    are about to move anyway (they would be dropped at the next run's address check).
    """
    if not unpatch_all:
        # Another clone of the same model is taking over (ComfyUI detaches clones with
        # unpatch_all=False): the weights stay where they are, and so do the graphs.
        return
    st = existing_state(getattr(patcher, "model", None))
    if st is not None and st.cache.entries:
        with st.lock:
            st.release_all("model unloaded from the GPU")


def _hoists(comp, st) -> bool:
    """Whether this model's exact graphs hoist the context projections
    (``compiled_step.context_hoist_on``; compiled mode lifts them out of its compiled code)."""
    if not compiled_step.context_hoist_on() or comp is not None:
        return False
    if st.cache.backend != "cuda":
        return True
    why = context_hoist.available()
    if why is not None:
        compiled_step.log_once(
            ("hoist", why), "CUDA Graph: the context projections run at every step: %s", why
        )
    return why is None
