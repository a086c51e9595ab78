# SPDX-License-Identifier: GPL-3.0-or-later
"""ControlNet Feature Cache + Apply ControlNet (Fused) ``positive_only``, with and without the
CUDA Graph node: both paths must make the same reuse decision at every step and give the same
latent.

With ``positive_only`` the ControlNet sees the positive half of the CFG batch. The eager path
keys the cache on that half; the graph wrapper decides on the host (``plan_step``) and must
key it on the same half, or the step after the eager fill finds "nothing stored for this
input" and computes, shifting every later reuse by one step.

Tolerance: fp32 on the CPU, relative L2 ≤ 1e-5 (the graph path is emulated there, so it is
in fact bit-identical); on a GPU, PSNR ≥ 45 dB as in test_feature_cache.py.
"""

from __future__ import annotations

import sys

import pytest
from comfyui_controlnet_accelerator.harness import badges, runner
from comfyui_controlnet_accelerator.harness import workflows as wf
from comfyui_controlnet_accelerator.harness.quick import (
    VARIANTS,
    _chain,
    _feature_cache,
    _positive_only,
)

pytestmark = [pytest.mark.host, pytest.mark.captures, pytest.mark.usefixtures("graph_backend")]

# 9 steps, every 3rd computed, at most 2 reuses in a row: C R R C R R C R C (5 reused). A graph
# path that refuses the first reuse after the eager fill gives C C R R C R R C C (a different
# count too, so the badge shows it).
WL = wf.WORKLOADS["T1"].with_(steps=9)
EVERY3 = _feature_cache(mode="every_n", every_n=3, max_reuse=2)
EVERY2 = _feature_cache(mode="every_n", every_n=2, max_reuse=1)


def _pack(host):
    return sys.modules[host.pack_module_name]


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _run(host, r, wl, extra):
    """One run: its latent and each Feature Cache node's computed/reused steps (its badge)."""
    import folder_paths

    hints = wf.write_hint_images(folder_paths.get_input_directory(), wl)
    p, ids = wf.build_prompt(wl, 11, hints, extra)
    got = badges.run(r, p, ids)
    fused = badges.summed(got, "fused_apply", ("positive_only",))
    assert fused["positive_only"] > 0, "positive_only not used"
    nodes = sorted(k for k, v in p.items() if v["class_type"] == "CNA_ControlNetFeatureCache")
    data = [got.extra["badges"][n]["data"] for n in nodes]
    return got, [{k: b[k] for k in ("computed", "reused")} for b in data]


@pytest.fixture
def decisions(host, monkeypatch):
    """Each net's reuse decision at each step, (step, reuse), in call order (the first network
    call of a step decides it)."""
    fc = _pack(host).nodes.feature_cache
    orig = fc.CachedControlNet._step_decision
    seen: list = []

    def spy(self, x_in, t, topts, key=None):
        reuse, slot = orig(self, x_in, t, topts, key)
        if slot == 0:  # a later call of the same evaluation follows it, with slot 1, 2, ...
            seen.append((self._crun.last_step, reuse))
        return reuse, slot

    monkeypatch.setattr(fc.CachedControlNet, "_step_decision", spy)
    return seen


def _eager_and_graph(host, wl, cache, decisions):
    """The same run without and with the CUDA Graph node (emulated on the CPU): each path's
    latent, per-net counts and per-step decisions; checks the graph path really ran."""
    r = runner.Runner()
    eager, eager_counts = _run(host, r, wl, _chain(cache, _positive_only))
    eager_steps = list(decisions)
    decisions.clear()
    ids = wf.build_prompt(wl, 11, ["x"])[1]
    before = badges.model_graph_counts(r, ids)
    graph, graph_counts = _run(host, r, wl, _chain(cache, _positive_only, VARIANTS["cuda_graph"]))
    failed = badges.model_graph_counts(r, ids)["failed"] - before["failed"]
    g = badges.graph_counts(graph)
    assert g["replays"] + g["captures"] >= wl.steps - 1 and failed == 0, (g, failed)
    return (eager, eager_counts, eager_steps), (graph, graph_counts, list(decisions))


def _same_latent(host, a, b):
    if host.cpu:
        assert _rel(b.latent, a.latent) <= 1e-5, _rel(b.latent, a.latent)
    else:
        assert runner.psnr(a.latent, b.latent) >= 45.0


def test_every_3_positive_only_same_reuse_with_and_without_graphs(host, tiny_models, decisions):
    """harness/quick.py's cache_every3+graph with positive_only on, against it without graphs."""
    (eager, e_counts, e_steps), (graph, g_counts, g_steps) = _eager_and_graph(
        host, WL, EVERY3, decisions
    )
    assert e_steps == [(i, i in (1, 2, 4, 5, 7)) for i in range(WL.steps)], e_steps
    assert e_counts == [{"computed": 4, "reused": 5}], e_counts
    assert g_steps == e_steps, g_steps
    assert g_counts == e_counts, g_counts
    _same_latent(host, eager, graph)


def test_two_nets_every_2_positive_only_same_reuse_with_and_without_graphs(
    host, tiny_models, decisions
):
    """Two ControlNets, each with its Feature Cache, fused in one group that runs on the
    positive chunk: each net's decisions match too."""
    wl = wf.WORKLOADS["T2"].with_(steps=9)
    (eager, e_counts, e_steps), (graph, g_counts, g_steps) = _eager_and_graph(
        host, wl, EVERY2, decisions
    )
    # C R C R C R C R C for each net (two decisions a step, one per net)
    assert e_steps == [(i, i % 2 == 1) for i in range(wl.steps) for _ in range(2)], e_steps
    assert e_counts == [{"computed": 5, "reused": 4}] * 2, e_counts
    assert g_steps == e_steps, g_steps
    assert g_counts == e_counts, g_counts
    _same_latent(host, eager, graph)
