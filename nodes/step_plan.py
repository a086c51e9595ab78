# SPDX-License-Identifier: GPL-3.0-or-later
"""The CUDA Graph wrapper's step plan: what a model call's graph is, split by how often it
can change.

Once per sampling run (built at the run's first call, kept in its ``GraphRun``):

- ``ModelPlan``: whether the model can be captured at all, its network and weight fingerprint;
- ``ChainPlan``: the ControlNet chain of a control object (innermost first), whether each net
  can be captured, its start/end range, and the static part of its signature (network,
  strength type, pooling, extra arguments, dtypes, class, settings) and weight fingerprint.

Per call, only what can change: the active mask (one sigma read, and only with a partial
start/end range), each hint's readiness, the Feature Cache's decisions, and the shapes and
dtypes of the inputs. Those form the call's ``dynamic`` signature; when it equals the last
call's, the last call's key, names and graph are used as they are (the fast path: no key is
built or hashed, no cache lookup).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import compat
from .graph_deferral import ControlCall
from .graph_state import GraphRun, ModelGraphState
from .step_control import STEP_KEY, StepControl

ALWAYS_ON_SIGMA = 1e8  # percent_to_sigma(0) is 999999999.9: "from the first step"
FIRST_STEP = "first step of a run: the ControlNet prepares its hint"
CACHE_FILL = "ControlNet Feature Cache: first compute fills its buffers (eager, once)"


@dataclass
class Plan:
    """What one call's graph needs: its key, its input tensors (in ``names`` order), the chain
    and which of its nets run, the weight fingerprints the graph depends on."""

    key: tuple
    names: list[str]
    inputs: list[torch.Tensor]
    chain: list
    active: tuple
    deps: dict
    dynamic: tuple = ()
    entry: object = None  # the graph of the last call with this key (fast path)
    version: int = -1  # its cache's version when it was looked up
    extras: dict = field(default_factory=dict)


def chain_of(control) -> list:
    """The control objects of a chain, innermost (evaluated first) to outermost."""
    out = []
    c = control
    while c is not None:
        out.append(c)
        c = getattr(c, "previous_controlnet", None)
    return out[::-1]


def _lowvram(module) -> bool:
    return bool(getattr(module, "model_lowvram", False))


class ModelPlan:
    """Per run: can this model be captured, and what does a graph of it depend on."""

    def __init__(self, st: ModelGraphState, base_model):
        self.reason: str | None = None
        self.diffusion = getattr(base_model, "diffusion_model", None)
        self.deps: dict = {}
        if self.diffusion is None:
            self.reason = "model has no diffusion_model"
        elif _lowvram(base_model) or _lowvram(self.diffusion):
            self.reason = (
                "model weights are only partly on the GPU (lowvram): they are streamed per step"
            )
        elif (why := compat.capture_blocker(self.diffusion)) is not None:
            self.reason = why  # DynamicVRAM: weights faulted in per layer, evictable
        else:
            self.deps = {id(self.diffusion): st.fingerprint(self.diffusion)}


def capturable_net(net) -> bool:
    """Whether a ControlNet's network is whole on the GPU and not under DynamicVRAM."""
    return net is not None and not _lowvram(net) and compat.capture_blocker(net) is None


class ChainPlan:
    """Per run: one control object's chain and the static part of its graph signature."""

    def __init__(self, st: ModelGraphState, control, types: tuple[type, ...]):
        from .feature_cache import CachedControlNet
        from .fused_apply import FusedControlNet

        self.chain = chain_of(control)
        self.reason: str | None = None
        for cn in self.chain:
            if type(cn) not in types:
                self.reason = f"control type {type(cn).__name__} is not supported by the graph path"
            elif cn.model_sampling_current is None:
                self.reason = "ControlNet not prepared for sampling (pre_run has not run)"
            elif cn.control_model is None or _lowvram(cn.control_model):
                self.reason = "ControlNet weights are only partly on the GPU (lowvram)"
            elif (why := compat.capture_blocker(cn.control_model)) is not None:
                self.reason = why
            if self.reason is not None:
                return
        # start/end: None for a net on at every step, else (sigma_start, sigma_end)
        self.ranges = []
        for cn in self.chain:
            rng = cn.timestep_range
            always = rng is None or (rng[0] >= ALWAYS_ON_SIGMA and rng[1] <= 0.0)
            self.ranges.append(None if always else (rng[0], rng[1]))
        self.partial = any(r is not None for r in self.ranges)
        self.all_on = (True,) * len(self.chain)
        self.fused = [isinstance(cn, FusedControlNet) for cn in self.chain]
        self.cached = [
            isinstance(cn, CachedControlNet) and cn.cache_cfg.enabled for cn in self.chain
        ]
        self.static_sig = tuple(
            (
                id(cn.control_model),
                str(cn.strength_type),
                cn.global_average_pooling,
                tuple(sorted((k, repr(v)) for k, v in cn.extra_args.items())),
                tuple(cn.extra_conds),
                cn.manual_cast_dtype,
                cn.compression_ratio,
                type(cn).__name__,
                getattr(getattr(cn, "fused_settings", None), "positive_only", False),
            )
            for cn in self.chain
        )
        self.deps = {id(cn.control_model): st.fingerprint(cn.control_model) for cn in self.chain}
        self._groups: dict[tuple, dict] = {}

    def active(self, ctl: StepControl, t) -> tuple:
        if not self.partial:
            return self.all_on
        sigma = ctl.sigma(t)  # one host read per step, as stock does per ControlNet
        return tuple(rng is None or not (sigma > rng[0] or sigma < rng[1]) for rng in self.ranges)

    def groups(self, active: tuple) -> dict[int, list]:
        """id(net) -> the active nets of its fused group, for each FusedControlNet of the
        chain: a run of consecutive FusedControlNets is evaluated together
        (FusedControlNet.get_control), and whether it runs on the positive chunk alone depends
        on all of its active nets. Memoised per active mask (a run sees one or a few)."""
        got = self._groups.get(active)
        if got is not None:
            return got
        groups: dict[int, list] = {}
        run: list = []
        for cn, fused, on in [*zip(self.chain, self.fused, active, strict=True), (None, 0, 0)]:
            if fused:
                run.append((cn, on))
                continue
            group = [c for c, o in run if o]
            groups.update((id(c), group) for c, _ in run)
            run = []
        self._groups[active] = groups
        return groups


def model_plan(run: GraphRun, st: ModelGraphState, base_model) -> ModelPlan:
    """The run's ModelPlan of ``base_model`` (built at its first call of the run)."""
    key = ("model", id(base_model))
    mp = run.plans.get(key)
    if mp is None:
        mp = run.plans[key] = ModelPlan(st, base_model)
    return mp


def _chain_plan(run: GraphRun, st: ModelGraphState, control, types) -> ChainPlan:
    key = ("chain", id(control))
    cp = run.plans.get(key)
    if cp is None or cp.chain[-1] is not control:
        cp = run.plans[key] = ChainPlan(st, control, types())
    return cp


def step_control_for(run: GraphRun, topts: dict) -> StepControl:
    """This evaluation's StepControl (one per evaluation, shared by its calls)."""
    ctl = topts.get(STEP_KEY)
    if ctl is None or ctl.evaluation != run.evaluations:
        ctl = StepControl(run.step_index(), run.total_steps, run.evaluations)
    return ctl


def plan(
    run: GraphRun,
    st: ModelGraphState,
    base_model,
    x,
    t,
    c_concat,
    c_crossattn,
    control,
    call: ControlCall | None,
    topts: dict,
    kwargs: dict,
    wrapper_key: str,
    flags: tuple,
    supported,
) -> Plan | str:
    """The capture key and what the graph needs, or a string saying why not to capture.
    ``flags``: the wrapper's settings that change what is captured (layout, streams);
    ``supported()``: the control classes the graph path knows (asked once per run and chain).

    With a ControlNet call, its transformer_options get this evaluation's StepControl (the
    active mask and cache decisions), whether the step then runs as a graph or eager.
    """
    backend = st.cache.backend
    if backend == "none":
        return f"no CUDA device for this model (input on {x.device.type}): graphs need a GPU"
    if backend == "cuda":
        if not x.is_cuda:
            return f"input on {x.device.type}, not CUDA"
        if torch.cuda.is_current_stream_capturing():
            return "another CUDA graph capture is in progress"
    mp = model_plan(run, st, base_model)
    if mp.reason is not None:
        return mp.reason
    if control is not None and call is None:
        return (
            "ControlNet residuals were computed outside this wrapper (another node "
            "wraps the cond batch)"
        )
    if topts.get("patches") or topts.get("patches_replace"):
        names = sorted({n for k in ("patches", "patches_replace") for n in topts.get(k) or {}})
        return f"model has per-block patches ({', '.join(names)}) that may change per step"
    wrappers = topts.get("wrappers")
    if wrappers:
        others = [
            f"{wtype}:{key}"
            for wtype in ("apply_model", "diffusion_model")
            for key in wrappers.get(wtype, {})
            if key != wrapper_key
        ]
        if others:
            return f"other wrappers run inside the model call ({', '.join(others)})"

    # the inputs fed to the graph, and their shapes and dtypes
    names = ["x", "t"]
    inputs = [x, t]
    dyn: list = [id(base_model), x.shape, x.dtype, t.shape, t.dtype]
    for name, v in (("c_concat", c_concat), ("c_crossattn", c_crossattn), *sorted(kwargs.items())):
        if isinstance(v, torch.Tensor):
            names.append(name)
            inputs.append(v)
            dyn.append((name, v.shape, v.dtype))
        elif v is None or isinstance(v, (bool, int, float, str)):
            dyn.append((name, v))
        else:
            return f"argument {name!r} of type {type(v).__name__} cannot be fed to a graph"
    dyn.append(tuple(topts.get("cond_or_uncond", ())))

    chain: list = []
    active: tuple = ()
    cp = None
    if call is not None:
        x_noisy, t_call, cond, batched_number, call_topts = call.args
        if x_noisy is not x or t_call is not t:
            return "ControlNet and UNet were called with different inputs"
        ctl = step_control_for(run, call_topts)
        call_topts = {**call_topts, STEP_KEY: ctl}
        call.with_options(call_topts)
        cp = _chain_plan(run, st, call.control, supported)
        if cp.reason is not None:
            return cp.reason
        chain = cp.chain
        active = cp.active(ctl, t)
        groups = cp.groups(active)
        dyn.append((active, batched_number))
        for cn, on, cached in zip(chain, active, cp.cached, strict=True):
            if not on:  # skipped this step, as stock skips it: its hint is not read
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
            if cached:  # ControlNet Feature Cache: compute or reuse, decided here
                cache_part = cn.plan_step(x, t, call_topts, groups.get(id(cn)))
                if cache_part is None:
                    return CACHE_FILL
            dyn.append((hint.shape, hint.dtype, cache_part))
        # tensors the ControlNet reads from the cond dict are fed too
        known = {id(v) for v in inputs}
        for k, v in sorted(cond.items()):
            if isinstance(v, torch.Tensor) and id(v) not in known:
                names.append(f"cond.{k}")
                inputs.append(v)
                dyn.append((f"cond.{k}", v.shape, v.dtype))
        ctl.active = dict(zip(map(id, chain), active, strict=True))
    # The key names networks, not control objects (an Apply node's new copy, made for a new
    # strength or hint, replays the graphs of the one before); the fast path also needs the
    # same control object, whose chain (and per-run plan) it reuses.
    dynamic = (id(call.control) if call is not None else None, tuple(dyn))
    last = run.last
    if last is not None and last.dynamic == dynamic:  # the fast path
        return Plan(
            last.key,
            last.names,
            inputs,
            chain,
            active,
            last.deps,
            dynamic,
            last.entry,
            last.version,
        )
    run.plans_built += 1
    deps = mp.deps if cp is None else {**mp.deps, **cp.deps}
    devices = sorted({(v.device.type, v.device.index or 0) for v in inputs})
    static = (id(base_model), () if cp is None else cp.static_sig, tuple(devices), flags)
    return Plan((static, dynamic[1]), names, inputs, chain, active, deps, dynamic)
