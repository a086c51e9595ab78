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

Under the CUDA Graph node the decision is made on the host before the replay
(``cna_cache_plan``), and each decision (compute / reuse) is its own graph signature, together
with the store's buffer generation.
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
from .fused_apply import FusedControlNet, network_batch

STATS = {"computed": 0, "reused": 0}
_lock = threading.Lock()


def _count(key: str, n: int = 1) -> None:
    with _lock:
        STATS[key] += n


# network (control_model) -> {storage: StorePool}; dropped with the network
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
        self.__dict__.update(cna_owner=owner, cna_real=real, cna_t=t, cna_topts=transformer_options)

    def __getattr__(self, name):
        return getattr(self.__dict__["cna_real"], name)

    def __call__(self, x, hint, timesteps, context, **extra):
        owner, real = self.cna_owner, self.cna_real
        forced = owner.__dict__.get("cna_cache_forced")
        if forced is not None:  # decided on the host by the CUDA Graph glue
            reuse, slot = forced
        else:
            reuse, slot = owner._step_decision(x, self.cna_t, self.cna_topts)
        store = owner._stores.get(slot)
        key = owner._input_key(x)
        if reuse:
            try:
                return store.get()
            except Exception as e:
                if not is_out_of_memory(e) or owner.cna_graph_mode:
                    raise  # inside a capture the graph glue handles it (eager step, retried)
                owner._give_up(e)  # and compute this step instead
                _count("reused", -1)
                _count("computed")
        out = real(x=x, hint=hint, timesteps=timesteps, context=context, **extra)
        if owner.cna_cache_cfg.enabled:
            try:
                if store is None:
                    store = owner._stores[slot] = owner._pool(real).take(out)
                store.put(out)
                if not owner.cna_graph_mode:  # inside a graph the hint is the glue's buffer:
                    owner._keys[slot] = key  # the host recorded the real key in cna_cache_plan
            except Exception as e:
                if not is_out_of_memory(e) or owner.cna_graph_mode:
                    raise
                owner._give_up(e)
        return out


class CachedControlNet(FusedControlNet):
    cna_cache_cfg: CacheConfig = CacheConfig(mode="off")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._reset_cache_state()

    def _reset_cache_state(self) -> None:
        self._policy = ReusePolicy(self.cna_cache_cfg)
        self._stores: dict[int, ResidualStore] = getattr(self, "_stores", {})
        self._keys: dict[int, tuple] = {}
        self._memo: tuple | None = None  # (sigma, Decision, calls so far this step)
        self._run_counts = {"computed": 0, "reused": 0}  # steps, for the node's badge
        self._schedule: tuple | None = None  # (the run's sigmas tensor, its values as floats)
        self.cna_graph_pinned = False
        self._cfg_saved: CacheConfig | None = None  # the node's settings while given up (OOM)
        self.cna_cache_off_reason: str | None = None

    @classmethod
    def from_controlnet(cls, cn, cfg: CacheConfig | None = None) -> CachedControlNet:
        c = super().from_controlnet(cn)
        c.cna_cache_cfg = cfg if cfg is not None else getattr(cn, "cna_cache_cfg", c.cna_cache_cfg)
        c._reset_cache_state()
        c._stores = {}
        return c

    def copy(self) -> CachedControlNet:
        return CachedControlNet.from_controlnet(self, self._cfg_saved or self.cna_cache_cfg)

    def pre_run(self, model, percent_to_timestep_function):
        super().pre_run(model, percent_to_timestep_function)
        if self._cfg_saved is not None:  # an earlier run ran out of memory: try again
            self.cna_cache_cfg = self._cfg_saved
        stores = self._stores
        self._reset_cache_state()
        self._stores = stores  # buffers kept (a graph may hold them); contents forgotten

    def _pool(self, network=None) -> StorePool:
        """The pool of the network (the real one: inside ``get_control`` ``control_model`` is
        the caching proxy)."""
        net = network if network is not None else self.control_model
        return _pool_for(net, self.cna_cache_cfg.storage)

    def cleanup(self):
        if self.__dict__.get("cna_cache_node_id") is not None:
            self._report_cache()
        pool = self._pool() if self._stores else None
        for s in self._stores.values():
            if not self.cna_graph_pinned:
                s.clear()  # eager use: memory back to ComfyUI when sampling ends
            pool.give(s)  # a graph's buffers stay, for the next copy's run
        self._stores = {}
        self._policy.reset()
        self._keys = {}
        self._memo = None
        super().cleanup()

    def _report_cache(self) -> None:
        """This run's reuse to the Feature Cache node's badge (nodes/status.py)."""
        c = self._run_counts
        total = c["computed"] + c["reused"]
        off = self.cna_cache_off_reason
        if total == 0 and off is None:
            return
        cfg = self.cna_cache_cfg
        lines = [
            f"feature cache: {c['reused']}/{total} steps reused "
            f"({100 * c['reused'] / max(1, total):.0f}%)",
            f"{cfg.storage} store {status.mib(self.cache_bytes())}",
        ]
        data = {**c, "hit_rate": c["reused"] / max(1, total), "bytes": self.cache_bytes()}
        if off is not None:
            lines.append("cache off this run: " + status.short(off))
            data["off_reason"] = off
        status.report(self.cna_cache_node_id, "feature_cache", lines, data)

    def inference_memory_requirements(self, dtype):
        """What sampling will need on top of the weights, for ComfyUI's loader (it frees this
        much VRAM before loading): the buffers this network's stores hold or held (kept ones in
        the pool, checked-out ones here; 0 before the first run; an upper bound when one network
        is applied twice in a chain), plus the chain's own."""
        own = sum(s.nbytes() for s in self._stores.values()) + self._pool().nbytes()
        return own + super().inference_memory_requirements(dtype)

    def _give_up(self, exc: BaseException) -> None:
        """Out of memory allocating or reading the stores: free them and run uncached (the
        ControlNet on every step, as without this node) for the rest of this run; the next
        run tries again."""
        reason = f"out of memory ({type(exc).__name__}: {status.short(str(exc), 160)})"
        for s in self._stores.values():
            s.clear()
        self._stores = {}
        self._keys = {}
        self._cfg_saved = self.cna_cache_cfg
        self.cna_cache_cfg = dataclasses.replace(self.cna_cache_cfg, mode="off")
        self.cna_cache_off_reason = reason
        logger.warning(
            "ControlNet Feature Cache: %s; this ControlNet runs uncached for the rest of the run",
            reason,
        )
        import comfy.model_management as mm

        mm.soft_empty_cache()

    def cache_bytes(self) -> int:
        return sum(s.nbytes() for s in self._stores.values())

    # -- the decision, once per step --------------------------------------------------------

    def _input_key(self, x: torch.Tensor) -> tuple:
        h = self.cond_hint
        hint_id = None if h is None else (id(h), h.data_ptr(), tuple(h.shape))
        return (tuple(x.shape), x.dtype, x.device, hint_id)

    def _step_index(self, sigma: float, topts: dict) -> tuple[int, int] | None:
        sigmas = (topts or {}).get("sample_sigmas")
        if sigmas is None:
            return None
        if self._schedule is None or self._schedule[0] is not sigmas:
            self._schedule = (sigmas, [float(v) for v in sigmas.detach().float().cpu()])
        return step_of(sigma, self._schedule[1])

    def _usable(self, slot: int, key: tuple) -> bool:
        store = self._stores.get(slot)
        return store is not None and store.filled and self._keys.get(slot) == key

    def _step_decision(self, x_in, t, topts) -> tuple[bool, int]:
        """(reuse?, slot) for this network call, counted in ``STATS``. Counted here, where the
        eager path and the CUDA Graph glue both decide, because a graph replay runs no Python:
        counted at the network call, replayed steps went uncounted."""
        reuse, slot = self._decide(x_in, t, topts)
        _count("reused" if reuse else "computed")
        return reuse, slot

    def _decide(self, x_in, t, topts) -> tuple[bool, int]:
        """The step's decision is made at its first call (slot 0) and followed by its later
        calls (one per cond batch), each with its own store; a call whose store cannot serve
        computes."""
        sigma = float(t[0]) if isinstance(t, torch.Tensor) else float(t)
        key = self._input_key(x_in)
        if self._memo is not None and self._memo[0] == sigma:
            _, d, calls = self._memo
            self._memo = (sigma, d, calls + 1)
            return d.reuse and self._usable(calls, key), calls
        d = Decision(False, None, "cache off")
        pos = self._step_index(sigma, topts) if self.cna_cache_cfg.enabled else None
        if pos is not None:
            step, total = pos
            d = self._policy.decide(step, total, x_in, sigma, key)
            if d.reuse and not self._usable(0, key):
                d = Decision(False, d.estimate, "nothing stored for this input")
            if d.reuse:
                self._policy.reused_one()
            else:
                self._policy.filled(step, x_in, sigma, key)
            self._run_counts["reused" if d.reuse else "computed"] += 1
        self._memo = (sigma, d, 1)
        return d.reuse, 0

    def cna_cache_plan(
        self, x_noisy: torch.Tensor, t: torch.Tensor, topts: dict, group: list | None = None
    ) -> tuple | None:
        """CUDA Graph glue: decide this call on the host, before capture or replay, and pin
        the decision for the graph's own network call (``cna_cache_forced``, cleared by the
        glue afterwards). Returns the part of the graph signature the cache decides: () when
        the cache is off, None when this call must run eager (its store is not allocated yet:
        buffers are allocated outside any capture, once per object). ``group``: the active nets
        of this net's fused group; with positive_only the network sees the positive chunk only,
        and the decision (key, adaptive reference) is made on that chunk, as in eager steps."""
        if not self.cna_cache_cfg.enabled:
            return ()
        if group is not None:
            x_noisy, t = network_batch(group, x_noisy, t, topts)
        dtype = self.manual_cast_dtype or self.control_model.dtype
        if self.cna_cache_cfg.mode == "adaptive":  # the only rule that reads the values
            x_in = self.model_sampling_current.calculate_input(t, x_noisy).to(dtype)
        else:  # shape and dtype are all the key needs: no device work per step
            x_in = x_noisy.to(dtype)
        reuse, slot = self._step_decision(x_in, t, topts)
        self.cna_cache_forced = (reuse, slot)
        store = self._stores.get(slot)
        if store is None or not store.filled:
            return None  # the first compute fills the buffers eagerly; graphs from then on
        if not reuse:
            self._keys[slot] = self._input_key(x_in)
        self.cna_graph_pinned = True
        return ("reuse" if reuse else "compute", slot, store.generation)

    # -- the network call -----------------------------------------------------------------

    def _wrap_model(self, model, t, transformer_options):
        if not self.cna_cache_cfg.enabled:
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
    c = CachedControlNet.from_controlnet(control_net, cfg)
    c.cna_cache_node_id = node_id
    return c
