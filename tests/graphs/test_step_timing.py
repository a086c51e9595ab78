# SPDX-License-Identifier: GPL-3.0-or-later
"""The CUDA Graph node's badge timing (nodes/cuda_graph.py) without ComfyUI or a GPU: which
model calls get a pair of CUDA events. Every eager call and capture is timed; replays only until
``TIMED_REPLAYS`` of them are, since an event recorded right after a graph launch waits for the
GPU as the launch does."""

from __future__ import annotations

import torch
from comfyui_controlnet_accelerator.nodes import cuda_graph as cg


class _Event:
    recorded = 0

    def __init__(self, enable_timing=False):
        assert enable_timing

    def record(self, stream=None):
        _Event.recorded += 1


def _patch(monkeypatch, kinds: list[str]):
    """A patch whose model calls capture, replay or run eager in the order of ``kinds``."""
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    _Event.recorded = 0
    patch = cg.CudaGraphPatch(cg.GraphOptions(), node_id="7")
    run = patch.template.clone()
    run.timing = []
    calls = iter(kinds)

    def apply_model(run_, *args):
        kind = next(calls)
        if kind != "eager":
            run_.counts[{"replay": "replays", "capture": "captures"}[kind]] += 1
        return kind

    monkeypatch.setattr(patch, "_apply_model", apply_model)
    return patch, run


def test_replays_are_timed_until_enough_then_not(monkeypatch):
    kinds = ["eager", "capture"] + ["replay"] * 10
    patch, run = _patch(monkeypatch, kinds)
    assert [patch._apply_model_timed(run) for _ in kinds] == kinds  # results pass through
    timed = [k for k, _, _ in run.timing]
    assert timed == ["eager", "capture"] + ["replay"] * cg.TIMED_REPLAYS
    assert _Event.recorded == 2 * len(timed)
    assert run.counts["replays"] == 10  # every replay still counted


def test_a_call_after_an_untimed_replay_that_does_not_replay_is_timed_next_time(monkeypatch):
    n = cg.TIMED_REPLAYS
    kinds = ["eager"] + ["replay"] * (n + 1) + ["eager", "eager", "replay"]
    patch, run = _patch(monkeypatch, kinds)
    for _ in kinds:
        patch._apply_model_timed(run)
    timed = [k for k, _, _ in run.timing]
    # the eager call right after an untimed replay is not timed (it was not known to be
    # eager); the one after it is, and so is the replay that follows an eager call
    assert timed == ["eager"] + ["replay"] * n + ["eager", "replay"]


def test_a_new_run_times_its_replays_again(monkeypatch):
    patch, run = _patch(monkeypatch, ["replay"] * (cg.TIMED_REPLAYS + 2))
    for _ in range(cg.TIMED_REPLAYS + 2):
        patch._apply_model_timed(run)
    fresh = patch.template.clone()
    assert fresh.timed_replays == 0 and not fresh.last_replayed
    run.reset()
    assert run.timed_replays == 0 and not run.last_replayed
