# SPDX-License-Identifier: GPL-3.0-or-later
"""ControlNet Feature Cache in real ComfyUI workflows (tiny random-weight models).

Tolerances: a cache that never reuses must give the stock latent to within the fused merge's
rounding (relative L2 ≤ 1e-5 on the CPU, fp32; PSNR ≥ 45 dB on a GPU, fp16), as Apply
ControlNet (Fused) does. Invalidation tests compare a run that follows other runs on the same
objects with the same run in a fresh executor: they must be identical (nothing stale leaks).
"""

from __future__ import annotations

import gc
import sys

import pytest
import torch
from comfyui_controlnet_accelerator.harness import runner
from comfyui_controlnet_accelerator.harness import workflows as wf
from comfyui_controlnet_accelerator.harness.quick import VARIANTS, _chain, _feature_cache

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("graph_backend")]

WL = wf.WORKLOADS["T1"].with_(steps=8)
EVERY2 = _feature_cache(mode="every_n", every_n=2, max_reuse=1)
EVERY3 = _feature_cache(mode="every_n", every_n=3, max_reuse=2)
NEVER = _feature_cache(mode="adaptive", threshold=0.0, max_reuse=3)


def _fc(host):
    return sys.modules[host.pack_module_name].nodes.feature_cache


def _hints(wl):
    import folder_paths

    two = wl.with_(controlnets=("sd15-tiny-cn-a", "sd15-tiny-cn-b"))
    return wf.write_hint_images(folder_paths.get_input_directory(), two)  # [edges, depth]


def _run(r, wl, seed, extra=None, hint=0):
    p, ids = wf.build_prompt(wl, seed, [_hints(wl)[hint]] * 2, extra)
    return r.run(p, ids)


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _same_as_stock(host, stock, got):
    if host.cpu:
        assert _rel(got.latent, stock.latent) <= 1e-5
    else:
        assert runner.psnr(stock.latent, got.latent) >= 45.0


def _delta(host, before):
    now = _fc(host).STATS
    return {k: now[k] - before[k] for k in now}


def test_a_cache_that_never_reuses_gives_the_stock_result(host, tiny_models):
    r = runner.Runner()
    stock = _run(r, WL, 5)
    before = dict(_fc(host).STATS)
    got = _run(r, WL, 5, NEVER)
    d = _delta(host, before)
    _same_as_stock(host, stock, got)
    assert d["reused"] == 0 and d["computed"] == WL.steps  # one CFG batch per step


def test_every_2_reuses_half_the_steps_and_stays_close(host, tiny_models):
    r = runner.Runner()
    stock = _run(r, WL, 6)
    before = dict(_fc(host).STATS)
    got = _run(r, WL, 6, EVERY2)
    d = _delta(host, before)
    # steps 0..7: C R C R C R C C (first and last always computed)
    assert d == {"computed": 5, "reused": 3}
    err = _rel(got.latent, stock.latent)
    assert 0 < err < 0.5, err  # reuse really happened, and the picture is still the same one


def test_cache_off_hands_back_the_same_controlnet(host, tiny_models, models_dir):
    import comfy.controlnet
    import folder_paths

    fc = _fc(host)
    cfg_mod = sys.modules[host.pack_module_name].memory.feature_cache
    path = folder_paths.get_full_path("controlnet", wf.filename_of("sd15-tiny-cn-a"))
    cn = comfy.controlnet.load_controlnet(path)
    assert fc.apply_cache(cn, cfg_mod.CacheConfig(mode="off")) is cn
    assert fc.apply_cache(cn, cfg_mod.CacheConfig(mode="every_n", max_reuse=0)) is cn
    cached = fc.apply_cache(cn, cfg_mod.CacheConfig(mode="every_n"))
    assert isinstance(cached, fc.CachedControlNet) and cached is not cn
    assert isinstance(cached.copy(), fc.CachedControlNet)  # stock Apply copies it


@pytest.mark.parametrize(
    "change",
    ["hint", "strength", "resolution", "batch", "seed"],
)
def test_a_changed_input_never_sees_stale_features(host, tiny_models, change):
    """Run A, then B, on the same loaded objects; B must equal B run in a fresh executor."""
    a_wl, a_hint, b_wl, b_hint = WL, 0, WL, 0
    if change == "hint":
        b_hint = 1
    elif change == "strength":
        b_wl = WL.with_(strength=0.4)
    elif change == "resolution":
        b_wl = WL.with_(width=96, height=80)
    elif change == "batch":
        b_wl = WL.with_(batch_size=2)
    r = runner.Runner()
    _run(r, a_wl, 7, EVERY3, hint=a_hint)
    seed_b = 8 if change == "seed" else 7
    after = _run(r, b_wl, seed_b, EVERY3, hint=b_hint)
    fresh = _run(runner.Runner(), b_wl, seed_b, EVERY3, hint=b_hint)
    assert torch.equal(after.latent, fresh.latent)


def test_memory_is_released_when_sampling_ends(host, tiny_models):
    fc = _fc(host)
    r = runner.Runner()
    _run(r, WL, 9, EVERY2)
    gc.collect()
    nets = [o for o in gc.get_objects() if type(o) is fc.CachedControlNet]
    assert nets, "the run should have made CachedControlNet objects"
    assert sum(n.cache_bytes() for n in nets if not n.cna_graph_pinned) == 0


def test_works_under_the_cuda_graph_node(host, tiny_models):
    """Graph + cache equals eager + cache: the host makes the same decisions, and each decision
    (compute / reuse) is its own graph."""
    graph_mod = sys.modules[host.pack_module_name].nodes.cuda_graph
    r = runner.Runner()
    d0 = dict(_fc(host).STATS)
    eager = _run(r, WL, 10, EVERY2)
    d_eager = _delta(host, d0)
    before = dict(graph_mod.TOTALS)
    d0 = dict(_fc(host).STATS)
    graph = _run(r, WL, 10, _chain(EVERY2, VARIANTS["cuda_graph"]))
    d = _delta(host, d0)
    if host.cpu:
        assert torch.equal(graph.latent, eager.latent)
    else:
        assert runner.psnr(eager.latent, graph.latent) >= 45.0
    g = {k: graph_mod.TOTALS[k] - before.get(k, 0) for k in graph_mod.TOTALS}
    assert g["captures"] >= 2 and g["replays"] >= 3, g
    # the counters see replayed steps too (a replay runs no Python): the same as eager
    assert d == d_eager and d["reused"] >= 1, (d, d_eager)
    # a second run on the same objects replays the same two graphs: no new capture
    before = dict(graph_mod.TOTALS)
    again = _run(r, WL, 10, _chain(EVERY2, VARIANTS["cuda_graph"]))
    assert torch.equal(again.latent, graph.latent) or not host.cpu
    assert graph_mod.TOTALS["captures"] - before["captures"] == 0
    # ComfyUI's loader is told what the kept buffers take (it frees that much VRAM first)
    kept = [
        o
        for o in __import__("gc").get_objects()
        if type(o) is _fc(host).CachedControlNet and o._pool().nbytes() > 0
    ]
    assert kept and all(o.inference_memory_requirements(torch.float32) > 0 for o in kept)
    # A stock prompt in between drops ComfyUI's cached node outputs, so the next run makes a
    # new Feature Cache object and new Apply copies (here with a new strength, too). They take
    # the buffers the graphs were captured with from the network's pool: still no capture, and
    # the result is the one a fresh process gives.
    _run(r, WL, 10)
    before = dict(graph_mod.TOTALS)
    wl_b = WL.with_(strength=0.6)
    b = _run(r, wl_b, 10, _chain(EVERY2, VARIANTS["cuda_graph"]))
    assert graph_mod.TOTALS["captures"] - before["captures"] == 0
    assert graph_mod.TOTALS["replays"] - before["replays"] >= 3
    fresh = _run(runner.Runner(), wl_b, 10, _chain(EVERY2, VARIANTS["cuda_graph"]))
    if host.cpu:
        assert torch.equal(b.latent, fresh.latent)
    else:
        assert runner.psnr(fresh.latent, b.latent) >= 45.0


def _spearman(a: list[float], b: list[float]) -> float:
    ra = torch.tensor(a).argsort().argsort().double()
    rb = torch.tensor(b).argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def test_adaptive_estimate_tracks_the_real_error(host, tiny_models, monkeypatch):
    """Record what the ControlNet sees and returns at every step of a real run, then compare,
    for every pair of steps up to 4 apart, the cache's estimate with the relative error that
    reusing the earlier output would really make. They must rank alike."""
    fc = _fc(host)
    mem = sys.modules[host.pack_module_name].memory.feature_cache
    seen = []
    orig = fc._CachingModel.__call__

    def spy(self, x, hint, timesteps, context, **extra):
        out = orig(self, x, hint, timesteps, context, **extra)
        flat = torch.cat([t.flatten().double() for k in out for t in out[k] if t is not None])
        seen.append((x.detach().clone(), float(self.cna_t[0]), flat))
        return out

    monkeypatch.setattr(fc._CachingModel, "__call__", spy)
    _run(runner.Runner(), wf.WORKLOADS["T1"].with_(steps=12), 11, NEVER)
    assert len(seen) == 12
    est, real = [], []
    for i in range(1, len(seen) - 1):
        for j in range(i + 1, min(i + 5, len(seen))):
            (xi, ti, oi), (xj, tj, oj) = seen[i], seen[j]
            est.append(float(mem.input_change(xj, xi)) + abs(tj - ti) / ti)
            real.append(float((oj - oi).norm() / oj.norm()))
    rho = _spearman(est, real)
    assert rho >= 0.7, (rho, list(zip(est, real, strict=True)))


def test_two_workflows_alternating_on_one_network_keep_their_graphs(host, tiny_models):
    """The benchmark's case (found on the H200): a cached workflow with the ControlNet on the
    whole CFG batch and one with positive_only (half the batch: other buffer shapes) take turns.
    Each must find its own buffers in the pool: after the first round, no capture."""
    from comfyui_controlnet_accelerator.harness.quick import _positive_only

    graph_mod = sys.modules[host.pack_module_name].nodes.cuda_graph
    whole = _chain(EVERY2, VARIANTS["cuda_graph"])
    half = _chain(EVERY2, _positive_only, VARIANTS["cuda_graph"])
    r = runner.Runner()
    _run(r, WL, 12, whole)
    _run(r, WL, 12, half)
    before = dict(graph_mod.TOTALS)
    for _ in range(2):
        _run(r, WL, 12, whole)
        _run(r, WL, 12, half)
    assert graph_mod.TOTALS["captures"] - before["captures"] == 0
