# SPDX-License-Identifier: GPL-3.0-or-later
"""State of the CUDA Graph wrapper: per model (the captured graphs, kept across runs) and per
sampling run (``GraphRun``: counters, timing and plans of one run, EasyCache-style holder).

``ModelGraphState`` lives in ``_STATES``, a cache keyed by the model object with weak keys: it
is bounded by the models alive, each holds at most ``max_graphs`` graphs, and it goes with its
model. Each state counts what happened to its model's graphs (``stats``, also in
``graph_stats()``). A run's own figures are in its ``GraphRun``, which the node's badge reports.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Hashable

import torch

from ..graphs import GraphCache, backend_name
from ..graphs.hint_encoding import EncodedHintNet, encoder_of
from ..logger import logger
from . import compat, status

RUN_KEY = "cna.graph_run"  # the transformer_options entry that holds the run's GraphRun

COUNTERS = ("captures", "replays", "eager", "failed", "released")


class ModelGraphState:
    """One model's graphs and what is kept about them across sampling runs."""

    def __init__(self, name: str, max_graphs: int, backend: str):
        self.cache = GraphCache(name, max_graphs=max_graphs, backend=backend)
        self.run_id = 0
        self.fp_run: dict[int, tuple[int, Hashable]] = {}  # id(module) -> (run_id, fingerprint)
        self.eager_reasons: set[str] = set()
        # Reentrant: a step that runs out of memory under it releases every model's graphs,
        # this one's included (release_for_memory).
        self.lock = threading.RLock()
        # model calls replayed / captured / run eager, captures that failed, graphs released
        self.stats = dict.fromkeys(COUNTERS, 0)
        self._side = None
        # ControlNet network -> its stand-in that reads the hint encoded outside the graph
        # (graphs/hint_encoding.py); weak keys: bounded by the networks alive
        self.hint_nets: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # DynamicVRAM ControlNet network -> the classic ModelPatcher of its classic copy
        # (cuda_graph.classic_controls); weak keys: the copy goes with the original
        self.classic_nets: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # the same, for networks no copy can be made of for a lasting reason (too large, the
        # copy failed): why, so later runs neither try again nor say it again
        self.no_classic: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def side_stream(self, x: torch.Tensor):
        """The stream the ControlNets run on beside the UNet (CUDA only; None elsewhere)."""
        if not x.is_cuda:
            return None
        s = self._side
        if s is None or s.device != x.device:
            s = self._side = torch.cuda.Stream(device=x.device)
        return s

    def count(self, what: str, run: GraphRun | None = None) -> None:
        self.stats[what] = self.stats.get(what, 0) + 1
        if run is not None:
            run.counts[what] = run.counts.get(what, 0) + 1

    def note_eager(self, reason: str, run: GraphRun | None, expected: bool = False) -> None:
        """Count an eager step; say why once per reason (debug level for the expected ones)."""
        self.count("eager", run)
        if run is not None:
            run.eager_reasons.add(reason)
        if reason not in self.eager_reasons:
            self.eager_reasons.add(reason)
            log = logger.debug if expected else logger.info
            log("%s: running eager: %s", self.cache.name, reason)

    def hint_net(self, net) -> EncodedHintNet | None:
        """The stand-in for a ControlNet network whose hint encoder can run outside the
        graph, or None (the network then runs whole inside it)."""
        if net is None or encoder_of(net) is None:
            return None
        got = self.hint_nets.get(net)
        if got is None:
            got = self.hint_nets[net] = EncodedHintNet(net)
        return got

    def classic_net(self, patcher):
        """The classic ModelPatcher of a classic copy of the ControlNet network ``patcher``
        manages under DynamicVRAM, made once per network (``compat.classic_control_patcher``);
        None, with the reason logged once, when none can be made. A lasting reason is kept
        with the network: later runs do not try again (a copy that failed is not repeated at
        every prompt); a passing one (free RAM) is asked again at the next run."""
        net = getattr(patcher, "model", None)
        if net is None:
            return None
        got = self.classic_nets.get(net)
        if got is None:
            if net in self.no_classic:
                return None
            got, why = compat.classic_control_patcher(patcher)
            if got is None:
                compat.warn_once(  # once per network: the reason can carry figures
                    f"graph:classic-cn:{id(net)}",
                    "CUDA Graph: a DynamicVRAM ControlNet runs eager, as DynamicVRAM's (no "
                    "classic copy: %s)",
                    why,
                )
                if getattr(why, "lasting", False):
                    self.no_classic[net] = why
                return None
            logger.info(
                "CUDA Graph: DynamicVRAM manages a ControlNet; made a classic copy the graphs "
                "can hold (%.2f GiB)",
                got.model_size() / 1024**3,
            )
            self.classic_nets[net] = got
        return got

    def fingerprint(self, module: torch.nn.Module) -> Hashable:
        """Addresses of the module's weights, computed once per sampling run."""
        got = self.fp_run.get(id(module))
        if got is not None and got[0] == self.run_id:
            return got[1]
        fp = _addresses(module)
        self.fp_run[id(module)] = (self.run_id, fp)
        return fp

    def release_all(self, reason: str) -> int:
        n = len(self.cache.entries)
        if n:
            self.cache.evict(lambda e: True, reason)
            self.stats["released"] += n
        return n

    def release_moved(self, modules) -> int:
        """Drop the graphs that read weights of ``modules`` at addresses those no longer have
        (ComfyUI unloaded them partly or wholly since, to make room for another model). Called
        as a run starts, before ComfyUI loads its models: the graphs would be dropped at their
        next lookup anyway, and until then their memory pool, which ComfyUI's memory manager
        cannot see, would stand in the way of the load and of the first (eager) step."""
        if not self.cache.entries:
            return 0
        now = {id(m): _addresses(m) for m in modules if m is not None}

        def moved(e) -> bool:
            deps = e.extras.get("deps") or {}
            return any(k in now and v != now[k] for k, v in deps.items())

        n = self.cache.evict(moved, "model or ControlNet weights moved since the last run")
        self.stats["released"] += n
        return n


def _addresses(module: torch.nn.Module) -> Hashable:
    return hash(tuple((p.data_ptr(), p.dtype, p.device) for p in module.parameters()))


_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_STATES_LOCK = threading.Lock()


def state_for(base_model, max_graphs: int, device: torch.device) -> ModelGraphState:
    with _STATES_LOCK:
        st = _STATES.get(base_model)
        if st is None:
            name = f"CUDA Graph [{type(base_model).__name__}]"
            st = ModelGraphState(name, max_graphs, backend_name(device))
            _STATES[base_model] = st
        st.cache.max_graphs = max_graphs
        return st


def existing_state(model) -> ModelGraphState | None:
    return _STATES.get(model) if model is not None else None


def graph_stats() -> list[dict]:
    """What each model's graph cache holds: for logs, tests and the front end."""
    out = []
    for model, st in list(_STATES.items()):
        out.append(
            {
                "model": type(model).__name__,
                "backend": st.cache.backend,
                "graphs": len(st.cache.entries),
                "failed_signatures": dict(st.cache.failed),
                "captures": st.cache.captures,
                "capture_s": st.cache.total_capture_s,
                "eager_reasons": sorted(st.eager_reasons),
                **st.stats,
            }
        )
    return out


def release_after_oom(cache: GraphCache, reason: str) -> None:
    """Out of memory while capturing (or allocating a graph's static buffers): drop this
    model's other graphs too, so their memory pool goes back to the allocator, and hand the
    cached blocks to the driver. The step and later ones run eager (the reason is kept in
    ``cache.failed``); signatures that did capture are captured again when memory allows."""
    n = len(cache.entries)
    cache.evict(lambda e: True, f"out of memory during capture ({status.short(reason, 120)})")
    for st in list(_STATES.values()):  # the state that owns this cache counts the release
        if st.cache is cache:
            st.stats["released"] += n
    _hand_back_cache()


def release_for_memory(reason: str) -> int:
    """A step ran out of memory: drop every graph the pack holds, for every model, and hand
    the cached blocks back. Their memory pools are the one part of the GPU's memory that
    ComfyUI's memory manager cannot see, so they go first; the caller then runs the step again.
    Returns how many graphs were dropped (0: nothing of ours to give back)."""
    n = 0
    for st in list(_STATES.values()):
        with st.lock:
            n += st.release_all(f"out of memory in a step ({status.short(reason, 120)})")
    if n:
        _hand_back_cache()
    return n


def _hand_back_cache() -> None:
    """Collect what dropped graphs leave unreachable and give the allocator's cached blocks
    back to the driver, through ComfyUI as it does it."""
    gc.collect()
    try:
        import comfy.model_management as mm

        mm.soft_empty_cache()
    except Exception as e:  # without ComfyUI (tools): torch's own cache release
        logger.debug("CUDA Graph: soft_empty_cache unavailable (%s)", e)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class GraphRun:
    """One sampling run of one CUDA Graph node, held in ``transformer_options[RUN_KEY]``.

    The node's model carries a template (``options``, ``node_id``); the OUTER_SAMPLE wrapper
    puts a ``clone()`` in the run's model options and ``reset()``s it when the run ends, as
    ComfyUI's EasyCache does with its holder. What a run keeps: its counters and timing (the
    badge), the host time spent in the pack's wrappers, the sampler's progress (the step index
    on the host), the channels-last layout swap, and the step plans (``step_plan.py``).
    """

    def __init__(self, options, node_id=None):
        self.options = options
        self.node_id = node_id
        self.reset()

    def reset(self) -> None:
        self.counts = {"captures": 0, "replays": 0, "eager": 0, "failed": 0}
        self.eager_reasons: set[str] = set()
        self.timing: list | None = None  # (kind, start event, end event) per timed model call
        self.timed_replays = 0  # replayed calls in ``timing``
        self.last_replayed = False  # whether the last model call replayed a graph
        self.layout = None  # channels-last weights of this run (channels_last.LayoutSwap)
        self.host_s = 0.0  # seconds in the pack's wrapper bodies, ComfyUI's model excluded
        self.model_s = 0.0  # seconds inside ComfyUI's model calls made from those bodies
        # seconds inside the graph launch call: the driver returns only once the GPU has taken
        # up the previous step's launch, so this is waiting for the GPU, not the pack's work
        self.launch_s = 0.0
        # the same, in the calls that replayed a graph (with the cond batch that led to each):
        # the per-step cost once a run is planned and captured
        self.replay_host_s = 0.0
        self.replay_calls = 0
        self.pending_host_s = 0.0  # the current evaluation's cond-batch host time
        self.calls = 0  # APPLY_MODEL calls
        self.evaluations = 0  # CALC_COND_BATCH calls (model evaluations)
        self.callbacks = 0  # the sampler's progress callbacks seen
        self.next_step = 0  # the step the next evaluation belongs to (from the callbacks)
        self.total_steps: int | None = None
        self.plans: dict = {}  # step_plan: per model and per control object, built once a run
        self.last = None  # step_plan: the last signature and what it resolved to
        self.plans_built = 0  # calls whose signature differed from the last one (slow path)

    def clone(self) -> GraphRun:
        return GraphRun(self.options, self.node_id)

    def step_index(self) -> int | None:
        """The step the current evaluation belongs to, known on the host: the first evaluation
        is step 0; after that, one more than the last step the sampler reported. None when the
        sampler reports no progress (then the caller reads sigma)."""
        if self.total_steps is None or (self.callbacks == 0 and self.evaluations > 1):
            return None
        return min(self.next_step, self.total_steps - 1)

    def progress_callback(self, callback):
        """The sampler's callback, wrapped to follow its progress (ComfyUI's samplers call it
        once per step, after the step, with the step index first)."""

        def on_step(step, *args, **kwargs):
            self.callbacks += 1
            self.next_step = int(step) + 1
            if callback is not None:
                return callback(step, *args, **kwargs)
            return None

        return on_step

    def host_ms_per_step(self, steps: int) -> float:
        return 1e3 * self.host_s / max(1, steps)

    def host_ms_per_replay(self) -> float:
        return 1e3 * self.replay_host_s / max(1, self.replay_calls)

    def launch_ms_per_step(self, steps: int) -> float:
        return 1e3 * self.launch_s / max(1, steps)
