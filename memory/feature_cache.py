# SPDX-License-Identifier: GPL-3.0-or-later
"""Quantized Feature Cache: keep a ControlNet's residuals from one sampling step and reuse them
on later steps, stored INT8 with one scale per (sample, channel) plane. Plain PyTorch, no
ComfyUI import; ``nodes/feature_cache.py`` wires it into ComfyUI's ControlNet objects.

Two parts:

``ResidualStore`` holds one ControlNet output, the ``{"input"|"middle"|"output": [tensor |
None, ...]}`` dict a ControlNet returns (13 tensors for SD1.5), either INT8 + fp32 scales
(``kernels.quantize_int8``: ~0.5 bytes per fp16 value) or as an fp16/bf16 copy. Its buffers
are allocated once per shape and then overwritten in place, so a CUDA graph that writes them
(the step that computes) and one that reads them (the steps that reuse) agree on addresses.

``ReusePolicy`` decides, once per sampling step, whether to compute the ControlNet or reuse the
store. Modes: ``off`` (always compute: the stock result exactly), ``every_n`` (compute every
n-th step), ``adaptive`` (reuse while the estimated error stays under ``threshold``). Always:
the first and last step are computed, reuse only inside [reuse_start, reuse_end] of the run, at
most ``max_reuse`` reuses in a row, and never across a change of input shape or hint.

The adaptive estimate is the relative L1 change of the ControlNet's input (the scaled latent
it sees) since the step that filled the store, plus the relative change of its timestep:
``|x - x_ref|₁ / |x_ref|₁ + |t - t_ref| / t_ref``. The residuals are smooth functions of both,
so their relative error grows with this sum; tests/host/test_feature_cache.py checks the
estimate against the error actually made (rank correlation across the steps of a run). Cost:
one reduction on the device and one host read per step. ``every_n`` reads nothing from the
device: it needs only the step index (``decide`` takes ``x=None`` there).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import torch

from .. import kernels

MODES = ("off", "every_n", "adaptive")
_GENERATIONS = itertools.count(1)
STORAGES = ("int8", "fp16")


@dataclass(frozen=True)
class CacheConfig:
    """What the ControlNet Feature Cache node sets. ``mode="off"`` disables everything."""

    mode: str = "every_n"
    # every 5th step: with two or more ControlNets ≥ 1.4× over fused + graphs at SSIM 0.997 on
    # the H200 (docs/benchmarks.md); lower values stay closer to the uncached image
    every_n: int = 5
    threshold: float = 0.15
    max_reuse: int = 4
    storage: str = "int8"
    reuse_start: float = 0.0
    reuse_end: float = 1.0

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r}: choose one of {MODES}")
        if self.storage not in STORAGES:
            raise ValueError(f"storage {self.storage!r}: choose one of {STORAGES}")
        if self.every_n < 1 or self.max_reuse < 0 or self.threshold < 0:
            raise ValueError("every_n >= 1, max_reuse >= 0 and threshold >= 0 are required")
        if not 0.0 <= self.reuse_start <= self.reuse_end <= 1.0:
            raise ValueError("0 <= reuse_start <= reuse_end <= 1 is required")

    @property
    def enabled(self) -> bool:
        return self.mode != "off" and self.max_reuse > 0


# -- storage --------------------------------------------------------------------------------------


class ResidualStore:
    """One ControlNet output, kept between steps. ``put`` overwrites, ``get`` returns fresh
    tensors (the caller may scale them in place, as ComfyUI's control_merge does)."""

    def __init__(self, storage: str = "int8"):
        if storage not in STORAGES:
            raise ValueError(f"storage {storage!r}: choose one of {STORAGES}")
        self.storage = storage
        # (keys, ((key, index, (shape, dtype, device) | None), ...))
        self.layout: tuple | None = None
        self.buffers: list[tuple[torch.Tensor, torch.Tensor | None] | None] = []
        self._one: torch.Tensor | None = None
        # New number whenever the buffers are (re)allocated: CUDA graphs that read or write them
        # carry it in their signature, so no graph ever touches buffers freed since its capture.
        self.generation = next(_GENERATIONS)

    @staticmethod
    def _layout_of(out: dict) -> tuple:
        lay = []
        for key in out:
            for i, t in enumerate(out[key] or []):
                lay.append((key, i, None if t is None else (tuple(t.shape), t.dtype, t.device)))
        return (tuple(out), tuple(lay))

    @property
    def filled(self) -> bool:
        return self.layout is not None

    def nbytes(self) -> int:
        return sum(
            b.numel() * b.element_size() + (0 if s is None else s.numel() * s.element_size())
            for entry in self.buffers
            if entry is not None
            for b, s in [entry]
        )

    def clear(self) -> None:
        """Free the buffers (the next ``put`` allocates new ones, under a new generation)."""
        self.layout, self.buffers, self._one = None, [], None
        self.generation = next(_GENERATIONS)

    def put(self, out: dict) -> None:
        """Store ``out`` (tensors (B, C, H, W) or None), reusing the buffers when the layout
        (keys, shapes, dtypes, devices) matches the stored one."""
        layout = self._layout_of(out)
        lay = layout[1]
        dev = next((m[2] for _, _, m in lay if m is not None), None)
        if dev is not None and (self._one is None or self._one.device != dev):
            self._one = torch.ones((), dtype=torch.float32, device=dev)
        if layout != self.layout:
            self.buffers = [None] * len(lay)
            self.layout = layout
            self.generation = next(_GENERATIONS)
        for j, (key, i, meta) in enumerate(lay):
            if meta is None:
                continue
            t = out[key][i]
            if self.storage == "int8":
                q, scale = kernels.quantize_int8(t)
                if self.buffers[j] is None:
                    self.buffers[j] = (q, scale)
                else:
                    self.buffers[j][0].copy_(q)
                    self.buffers[j][1].copy_(scale)
            else:
                if self.buffers[j] is None:
                    self.buffers[j] = (t.detach().clone(), None)
                else:
                    self.buffers[j][0].copy_(t)

    def get(self) -> dict:
        """The stored output, dequantized into new tensors of the original dtype."""
        if self.layout is None:
            raise RuntimeError("ResidualStore.get before put")
        keys, lay = self.layout
        out: dict = {k: [] for k in keys}
        for (key, _, meta), entry in zip(lay, self.buffers, strict=True):
            lst = out[key]
            if meta is None:
                lst.append(None)
                continue
            shape, dtype, device = meta
            b, scale = entry
            if scale is None:
                lst.append(b.clone())
                continue
            h = torch.zeros(shape, dtype=dtype, device=device)
            kernels.dequant_add_(h, b, scale, self._one)
            lst.append(h)
        return out


class StorePool:
    """Stores handed from one ControlNet copy to the next, so their buffers (and the CUDA graphs
    captured against them) outlive the copy. *Apply ControlNet* makes a new copy whenever its
    inputs change (prompt, hint, strength) or ComfyUI re-runs the node; without the pool every
    such copy would start with new buffers and recapture its graphs. ``take`` gives a store to
    one user at a time, preferring one already laid out for the output about to be stored (two
    workflows alternating on one network, at different sizes, keep their own buffers); ``give``
    returns it. At most ``keep`` free stores are kept; the least recently returned is freed."""

    def __init__(self, storage: str, keep: int = 4):
        self.storage = storage
        self.keep = keep
        self._free: list[ResidualStore] = []
        self._lock = threading.Lock()

    def take(self, out: dict | None = None) -> ResidualStore:
        """A store for ``out`` (the output about to be put), or any free one if None."""
        with self._lock:
            if self._free:
                if out is None:
                    return self._free.pop(0)
                layout = ResidualStore._layout_of(out)
                for pick in (lambda s: s.layout == layout, lambda s: s.layout is None):
                    for i, s in enumerate(self._free):
                        if pick(s):
                            return self._free.pop(i)
        return ResidualStore(self.storage)  # never re-lays out another workflow's buffers

    def give(self, store: ResidualStore) -> None:
        with self._lock:
            if all(s is not store for s in self._free):
                self._free.append(store)
            while len(self._free) > self.keep:
                self._free.pop(0).clear()

    def nbytes(self) -> int:
        with self._lock:
            return sum(s.nbytes() for s in self._free)

    def clear(self) -> None:
        with self._lock:
            for s in self._free:
                s.clear()
            self._free = []


# -- the decision ---------------------------------------------------------------------------------


def input_change(x: torch.Tensor, x_ref: torch.Tensor) -> torch.Tensor:
    """Relative L1 change |x - x_ref|₁ / |x_ref|₁ as a 0-dim float32 device tensor."""
    xf, rf = x.float(), x_ref.float()
    return (xf - rf).abs().sum() / rf.abs().sum().clamp_min(1e-12)


@dataclass
class Decision:
    reuse: bool
    estimate: float | None  # the adaptive estimate at this step (None: not computed)
    reason: str


class ReusePolicy:
    """Per-run state: which step filled the store, with what input, and how many reuses since.

    ``decide`` is called once per step (callers memoize by step); ``filled`` after a compute.
    """

    def __init__(self, cfg: CacheConfig):
        self.cfg = cfg
        self.reset()

    def reset(self) -> None:
        self.ref_step: int | None = None
        self.ref_x: torch.Tensor | None = None
        self.ref_t: float | None = None
        self.ref_key: tuple | None = None
        self.streak = 0
        self.computed = 0
        self.reused = 0

    def decide(
        self, step: int, total: int, x: torch.Tensor | None, t: float, key: tuple
    ) -> Decision:
        """Reuse at ``step`` (0-based) of ``total`` steps, for input ``x`` (what the ControlNet
        sees), timestep ``t``, and ``key`` (shapes, hint identity: any change forces compute)?
        ``x`` and ``t`` are read by the adaptive rule only (None / 0 will do otherwise)."""
        cfg = self.cfg
        if not cfg.enabled:
            return Decision(False, None, "cache off")
        if self.ref_step is None or key != self.ref_key:
            return Decision(False, None, "nothing stored for this input")
        if step <= 0 or step >= total - 1:
            return Decision(False, None, "first or last step")
        frac = step / max(total - 1, 1)
        if not cfg.reuse_start <= frac <= cfg.reuse_end:
            return Decision(False, None, "outside the reuse range")
        if self.streak >= cfg.max_reuse:
            return Decision(False, None, "reused max_reuse times in a row")
        if cfg.mode == "every_n":
            due = (step - self.ref_step) % cfg.every_n == 0
            return Decision(not due, None, "every_n")
        est = float(input_change(x, self.ref_x)) + abs(t - self.ref_t) / max(abs(self.ref_t), 1e-6)
        return Decision(est <= cfg.threshold, est, "adaptive")

    def filled(self, step: int, x: torch.Tensor | None, t: float, key: tuple) -> None:
        self.ref_step, self.ref_t, self.ref_key = step, float(t), key
        if self.cfg.mode == "adaptive":
            if self.ref_x is not None and self.ref_x.shape == x.shape:
                self.ref_x.copy_(x)
            else:
                self.ref_x = x.detach().clone()
        self.streak = 0
        self.computed += 1

    def reused_one(self) -> None:
        self.streak += 1
        self.reused += 1


def step_of(sigma: float, schedule: list[float]) -> tuple[int, int] | None:
    """(index, number of steps) of ``sigma`` in the run's sigma schedule (steps + 1 values,
    the last one 0), or None if it is not one of them (a sampler evaluating between steps)."""
    if len(schedule) < 2:
        return None
    idx = min(range(len(schedule) - 1), key=lambda i: abs(schedule[i] - sigma))
    if abs(schedule[idx] - sigma) > 1e-4 * max(1.0, abs(sigma)):
        return None
    return idx, len(schedule) - 1
