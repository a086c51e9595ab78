# SPDX-License-Identifier: GPL-3.0-or-later
"""What the CUDA Graph wrapper decided on the host for one model evaluation, handed to the
pack's ControlNet objects through ``transformer_options`` (ComfyUI passes that dict to every
``get_control`` of a chain), so nothing is set on the ControlNet objects themselves.

No ComfyUI import: ``fused_apply.py`` and ``feature_cache.py`` read it, ``step_plan.py`` fills it.
"""

from __future__ import annotations

import torch

STEP_KEY = "cna.step"  # the transformer_options entry that holds a StepControl


class StepControl:
    """One model evaluation (one ``calc_cond_batch`` call) as the graph wrapper planned it.

    ``graph``: the ControlNets run inside the graph's function (capture, or an emulated replay):
    a fused net's hint encoding must be computed there, not taken from its per-run cache.
    ``active``: id(net) → whether it runs at this step (the host read sigma once for the whole
    chain, and only when a net has a partial start/end range); followed inside the graph's
    function only: an eager step keeps ComfyUI's own range check.
    ``cache``: id(net) → (reuse, slot), the Feature Cache's decision made on the host.
    ``step``/``total``: the sampler's step index and step count, known on the host from the
    sampler's own progress callback (None when the sampler gives none: then read sigma).
    ``evaluation``: the run's model-evaluation counter (one per ``calc_cond_batch``), which the
    cache uses to tell a new evaluation from a later cond batch of the same one.
    """

    __slots__ = ("graph", "active", "cache", "step", "total", "evaluation", "_t", "_sigma")

    def __init__(self, step: int | None, total: int | None, evaluation: int):
        self.graph = False
        self.active: dict[int, bool] | None = None
        self.cache: dict[int, tuple[bool, int]] = {}
        self.step, self.total, self.evaluation = step, total, evaluation
        self._t = None
        self._sigma: float | None = None

    def sigma(self, t: torch.Tensor) -> float:
        """sigma of this evaluation as a float: read from the device once, shared by the range
        check and the cache (a read is a host sync: callers ask only when they need it)."""
        if self._t is not t:
            self._sigma = float(t[0]) if isinstance(t, torch.Tensor) else float(t)
            self._t = t
        return self._sigma


def step_control(transformer_options: dict | None) -> StepControl | None:
    """The StepControl of this call, or None (eager sampling without the graph wrapper)."""
    if not transformer_options:
        return None
    return transformer_options.get(STEP_KEY)
