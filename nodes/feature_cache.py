# SPDX-License-Identifier: GPL-3.0-or-later
"""ControlNet Feature Cache: a ControlNet object that reuses its own residuals across sampling
steps (``memory/feature_cache.py`` holds the storage and the reuse rule).

``CachedControlNet`` is a ``FusedControlNet`` (so the hint is encoded once per run too) whose
network call goes through ``_CachingModel``: on a step the policy marks for reuse it returns the
stored residuals (dequantized from INT8) instead of running the network; otherwise it runs it
and stores the result. It caches the network's raw output, before strength is applied, so the
stock or fused Apply node scales and merges it exactly as usual: a strength change never sees
stale features. ``copy()`` keeps the class, so stock *Apply ControlNet* works with it too.

Invalidation: each Apply makes a new copy, and ``pre_run`` (every sampling run: new model,
seed, sampler) forgets what is stored; the store key holds the input's shape and dtype and the
hint's identity (resolution, batch, hint change → compute). ``cleanup`` (end of sampling) frees
the buffers, except those a CUDA graph has captured. Buffers live in a ``StorePool`` per network
(and storage), from which each copy takes its stores for a run and to which it gives them back
at cleanup: a new copy (a changed prompt, hint or strength, or ComfyUI re-running the nodes)
then finds the buffers its graphs were captured with, and does not recapture.

Under the CUDA Graph node the decision is made on the host before the replay (``plan_step``)
and handed to the network call through ``transformer_options`` (``step_control.StepControl``);
each decision (compute / reuse) is its own graph signature, together with the store's buffer
generation. There the step index comes from the sampler's progress (no device read in
``every_n`` mode); the adaptive rule reads sigma once per step, shared with the range check.

State: ``cache_settings`` (the node's choice, frozen, carried by ``copy``) and ``_crun`` (this
sampling run's policy, stores, decisions and badge figures; reset by ``pre_run``).
"""

from __future__ import annotations

import dataclasses
import threading
import weakref

import torch

from ..errors import is_out_of_memory
from ..logger import logger
from ..memory.feature_cache import (
    CacheConfig,
    Decision,
    ResidualStore,
    ReusePolicy,
    StorePool,
    step_of,
)
from . import status
from .fused_apply import FusedControlNet, network_batch, network_of
from .step_control import StepControl, step_control

_lock = threading.Lock()

# Cache of store pools, keyed by network (control_model) then storage; bounded by the live
# networks (weak keys) and the two storages; a pool keeps at most StorePool.keep free stores.
_POOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _pool_for(control_model, storage: str) -> StorePool:
    with _lock:
        pools = _POOLS.setdefault(control_model, {})
        if storage not in pools:
            pools[storage] = StorePool(storage)
        return pools[storage]


class _CachingModel:
    """Stands in for ``control_model`` during one ``get_control``: forwards attributes, and
    routes the forward call through the owner's cache."""

    def __init__(self, owner: CachedControlNet, real, t, transformer_options):
        self.__dict__.update(_owner=owner, _real=real, _t=t, _topts=transformer_options)

    def __getattr__(self, name):
        return getattr(self.__dict__["_real"], name)

    def __call__(self, x, hint, timesteps, context, **extra):
        owner, real = self._owner, self._real
        run = owner._crun
        ctl = step_control(self._topts)
        in_graph = ctl is not None and ctl.graph
        forced = ctl.cache.get(id(owner)) if ctl is not None else None
        if forced is not None:  # decided on the host by the CUDA Graph wrapper
            reuse, slot = forced
        else:
            reuse, slot = owner._step_decision(x, self._t, self._topts)
        store = run.stores.get(slot)
        key = owner._input_key(x)
        if reuse:
            try:
                return store.get()
            except Exception as e:
                if not is_out_of_memory(e) or in_graph:
                    raise  # inside a capture the graph wrapper handles it (eager step, retried)
                owner._give_up(e)  # and compute this step instead
                run.calls["reused"] -= 1
                run.calls["computed"] += 1
        out = real(x=x, hint=hint, timesteps=timesteps, context=context, **extra)
        if run.cfg.enabled:
            try:
                if store is None:
                    store = run.stores[slot] = owner._pool(real).take(out)
                store.put(out)
                if not in_graph:  # inside a graph the hint is the wrapper's buffer:
                    run.keys[slot] = key  # the host recorded the real key in plan_step
            except Exception as e:
                if not is_out_of_memory(e) or in_graph:
                    raise
                owner._give_up(e)
        return out


@dataclasses.dataclass(frozen=True)
class CacheSettings:
    """What the ControlNet Feature Cache node chose, fixed when it makes the object."""

    cfg: CacheConfig = CacheConfig(mode="off")
    node_id: str | None = None  # the Feature Cache node that made it: its badge


class CacheRun:
    """One sampling run of a CachedControlNet: the reuse policy, the stores checked out of the
    network's pool, the decisions so far and the badge figures. ``reset`` at the run's start
    (the node's settings back on after an out-of-memory run); ``clone`` gives a fresh one."""

    def __init__(self, cfg: CacheConfig):
        self.node_cfg = cfg
        self.stores: dict[int, ResidualStore] = {}
        self.reset()

    def reset(self) -> None:
        """Forget the run. The stores stay checked out (``cleanup`` gives them back): a graph
        captured in this run may hold their buffers."""
        self.cfg = self.node_cfg  # "off" for the rest of a run that ran out of memory
        self.off_reason: str | None = None
        self.policy = ReusePolicy(self.cfg)
        self.keys: dict[int, tuple] = {}
        self.memo: tuple | None = None  # (evaluation key, Decision, calls so far)
        self.counts = {"computed": 0, "reused": 0}  # steps, for the node's badge
        self.calls = {"computed": 0, "reused": 0}  # network calls (one per cond batch)
        self.schedule: tuple | None = None  # (the run's sigmas tensor, its values as floats)
        self.last_step: int | None = None  # the step index of the latest decision
        self.graph_pinned = False  # a CUDA graph holds the stores' buffers

    def clone(self) -> CacheRun:
        return CacheRun(self.node_cfg)


class CachedControlNet(FusedControlNet):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cache_settings = CacheSettings()
        self._crun = CacheRun(self.cache_settings.cfg)

    @property
    def cache_cfg(self) -> CacheConfig:
        """The settings in force this run (mode "off" after an out-of-memory give-up)."""
        return self._crun.cfg

    @classmethod
    def from_controlnet(cls, cn, settings: CacheSettings | None = None) -> CachedControlNet:
        c = super().from_controlnet(cn)
        if settings is None:
            settings = getattr(cn, "cache_settings", None) or CacheSettings()
        c.cache_settings = settings
        c._crun = CacheRun(settings.cfg)
        return c

    def copy(self) -> CachedControlNet:
        return CachedControlNet.from_controlnet(self)

    def pre_run(self, model, percent_to_timestep_function):
        super().pre_run(model, percent_to_timestep_function)
        self._crun.reset()  # buffers kept (a graph may hold them); contents forgotten

    def _pool(self, network=None) -> StorePool:
        """The pool of the network (the real one: inside ``get_control`` ``control_model`` is
        the caching proxy)."""
        net = network_of(network) if network is not None else self.control_model
        return _pool_for(net, self.cache_settings.cfg.storage)

    def cleanup(self):
        run = self._crun
        if self.cache_settings.node_id is not None:
            self._report_cache()
        pool = self._pool() if run.stores else None
        for s in run.stores.values():
            if not run.graph_pinned:
                s.clear()  # eager use: memory back to ComfyUI when sampling ends
            pool.give(s)  # a graph's buffers stay, for the next copy's run
        run.stores = {}
        run.reset()
        super().cleanup()

    def _report_cache(self) -> None:
        """This run's reuse to the Feature Cache node's badge (nodes/status.py)."""
        run = self._crun
        c = run.counts
        total = c["computed"] + c["reused"]
        off = run.off_reason
        if total == 0 and off is None:
            return
        lines = [
            f"feature cache: {c['reused']}/{total} steps reused "
            f"({100 * c['reused'] / max(1, total):.0f}%)",
            f"{self.cache_settings.cfg.storage} store {status.mib(self.cache_bytes())}",
        ]
        data = {
            **c,
            "calls": dict(run.calls),
            "hit_rate": c["reused"] / max(1, total),
            "bytes": self.cache_bytes(),
        }
        if off is not None:
            lines.append("cache off this run: " + status.short(off))
            data["off_reason"] = off
        status.report(self.cache_settings.node_id, "feature_cache", lines, data)

    def inference_memory_requirements(self, dtype):
        """What sampling will need on top of the weights, for ComfyUI's loader (it frees this
        much VRAM before loading): the buffers this network's stores hold or held (kept ones in
        the pool, checked-out ones here; 0 before the first run; an upper bound when one network
        is applied twice in a chain), plus the chain's own."""
        own = self.cache_bytes() + self._pool().nbytes()
        return own + super().inference_memory_requirements(dtype)

    def _give_up(self, exc: BaseException) -> None:
        """Out of memory allocating or reading the stores: free them and run uncached (the
        ControlNet on every step, as without this node) for the rest of this run; the next
        run tries again."""
        run = self._crun
        reason = f"out of memory ({type(exc).__name__}: {status.short(str(exc), 160)})"
        for s in run.stores.values():
            s.clear()
        run.stores = {}
        run.keys = {}
        run.cfg = dataclasses.replace(run.cfg, mode="off")
        run.off_reason = reason
        logger.warning(
            "ControlNet Feature Cache: %s; this ControlNet runs uncached for the rest of the run",
            reason,
        )
        import comfy.model_management as mm

        mm.soft_empty_cache()

    def cache_bytes(self) -> int:
        return sum(s.nbytes() for s in self._crun.stores.values())

    # -- the decision, once per model evaluation ------------------------------------------

    def _input_key(self, x: torch.Tensor) -> tuple:
        return self._key_of(tuple(x.shape), x.dtype, x.device)

    def _key_of(self, shape: tuple, dtype, device) -> tuple:
        """The store key: the network input's shape, dtype and device, and the hint's identity
        (built from metadata: nothing is cast or read to make it)."""
        h = self.cond_hint
        hint_id = None if h is None else (id(h), h.data_ptr(), tuple(h.shape))
        return (shape, dtype, device, hint_id)

    def _step_index(self, sigma: float, topts: dict) -> tuple[int, int] | None:
        sigmas = (topts or {}).get("sample_sigmas")
        if sigmas is None:
            return None
        run = self._crun
        if run.schedule is None or run.schedule[0] is not sigmas:
            run.schedule = (sigmas, [float(v) for v in sigmas.detach().float().cpu()])
        return step_of(sigma, run.schedule[1])

    def _usable(self, slot: int, key: tuple) -> bool:
        run = self._crun
        store = run.stores.get(slot)
        return store is not None and store.filled and run.keys.get(slot) == key

    def _step_decision(self, x_in, t, topts, key: tuple | None = None) -> tuple[bool, int]:
        """(reuse?, slot) for this network call, counted in the run's ``calls`` (the badge's
        figures). Counted here, where the eager path and the CUDA Graph wrapper both decide,
        because a graph replay runs no Python: counted at the network call, replayed steps went
        uncounted."""
        reuse, slot = self._decide(x_in, t, topts, key)
        self._crun.calls["reused" if reuse else "computed"] += 1
        return reuse, slot

    def _decide(self, x_in, t, topts, key: tuple | None) -> tuple[bool, int]:
        """The evaluation's decision is made at its first call (slot 0) and followed by its
        later calls (one per cond batch), each with its own store; a call whose store cannot
        serve computes. ``x_in``: what the network sees (read by the adaptive rule only; may be
        None in the other modes when ``key`` is given)."""
        run = self._crun
        cfg = run.cfg
        ctl: StepControl | None = step_control(topts)
        if key is None:
            key = self._input_key(x_in)
        adaptive = cfg.enabled and cfg.mode == "adaptive"
        by_step = ctl is not None and ctl.step is not None
        if by_step:
            # the graph wrapper knows the step on the host: no device read unless adaptive
            memo_key: object = ("evaluation", ctl.evaluation)
        else:
            sigma = (
                ctl.sigma(t)
                if ctl is not None
                else (float(t[0]) if isinstance(t, torch.Tensor) else float(t))
            )
            memo_key = sigma
        if run.memo is not None and run.memo[0] == memo_key:
            _, d, calls = run.memo
            run.memo = (memo_key, d, calls + 1)
            return d.reuse and self._usable(calls, key), calls
        d = Decision(False, None, "cache off")
        pos = None
        if cfg.enabled and by_step:
            pos = (ctl.step, ctl.total)
            sigma = ctl.sigma(t) if adaptive else 0.0
        elif cfg.enabled:
            pos = self._step_index(sigma, topts)
        if pos is not None:
            step, total = pos
            run.last_step = step
            d = run.policy.decide(step, total, x_in, sigma, key)
            if d.reuse and not self._usable(0, key):
                d = Decision(False, d.estimate, "nothing stored for this input")
            if d.reuse:
                run.policy.reused_one()
            else:
                run.policy.filled(step, x_in, sigma, key)
            run.counts["reused" if d.reuse else "computed"] += 1
        run.memo = (memo_key, d, 1)
        return d.reuse, 0

    def plan_step(
        self, x_noisy: torch.Tensor, t: torch.Tensor, topts: dict, group: list | None = None
    ) -> tuple | None:
        """CUDA Graph wrapper: decide this call on the host, before capture or replay, and
        record the decision in the call's StepControl (``topts``) for the graph's own network
        call. Returns the part of
        the graph signature the cache decides: () when the cache is off, None when this call
        must run eager (its store is not allocated yet: buffers are allocated outside any
        capture, once per object). ``group``: the active nets of this net's fused group; with
        positive_only the network sees the positive chunk only, and the decision (key,
        adaptive reference) is made on that chunk, as in eager steps."""
        run = self._crun
        if not run.cfg.enabled:
            return ()
        ctl = step_control(topts)
        if group is not None:
            x_noisy, t = network_batch(group, x_noisy, t, topts)
        dtype = self.manual_cast_dtype or self.control_model.dtype
        key = self._key_of(tuple(x_noisy.shape), dtype, x_noisy.device)
        if run.cfg.mode == "adaptive":  # the only rule that reads the values
            x_in = self.model_sampling_current.calculate_input(t, x_noisy).to(dtype)
        else:  # the key is metadata: no device work per step
            x_in = None
        reuse, slot = self._step_decision(x_in, t, topts, key)
        ctl.cache[id(self)] = (reuse, slot)
        store = run.stores.get(slot)
        if store is None or not store.filled:
            return None  # the first compute fills the buffers eagerly; graphs from then on
        if not reuse:
            run.keys[slot] = key
        run.graph_pinned = True
        return ("reuse" if reuse else "compute", slot, store.generation)

    # -- the network call -----------------------------------------------------------------

    def _wrap_model(self, model, t, transformer_options):
        if not self._crun.cfg.enabled:
            return model
        return _CachingModel(self, model, t, transformer_options)


def apply_cache(control_net, cfg: CacheConfig, node_id=None):
    """What the node does: a copy of ``control_net`` that caches its residuals."""
    from .fused_apply import why_not_fusable

    if not cfg.enabled:
        return control_net
    why = why_not_fusable(control_net)
    if why is not None:
        logger.warning("ControlNet Feature Cache: %s is not cached (runs as it is)", why)
        return control_net
    return CachedControlNet.from_controlnet(control_net, CacheSettings(cfg, node_id))
