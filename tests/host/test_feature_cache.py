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
from comfyui_controlnet_accelerator.harness import badges, runner
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
    """Run the workflow; the result carries its nodes' badges (the run's own figures)."""
    p, ids = wf.build_prompt(wl, seed, [_hints(wl)[hint]] * 2, extra)
    return badges.run(r, p, ids)


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _same_as_stock(host, stock, got):
    if host.cpu:
        assert _rel(got.latent, stock.latent) <= 1e-5
    else:
        assert runner.psnr(stock.latent, got.latent) >= 45.0


def _calls(res) -> dict:
    """The run's ControlNet network calls computed and reused, from the Feature Cache badges."""
    return badges.summed(res, "feature_cache", ("computed", "reused"), sub="calls")


def test_a_cache_that_never_reuses_gives_the_stock_result(host, tiny_models):
    r = runner.Runner()
    stock = _run(r, WL, 5)
    got = _run(r, WL, 5, NEVER)
    d = _calls(got)
    _same_as_stock(host, stock, got)
    assert d["reused"] == 0 and d["computed"] == WL.steps  # one CFG batch per step


# Fidelity bounds for the lossy settings, against the uncached run on the same seed. The README
# promises image SSIM ≥ 0.997 for the default setting (every 5th step) and docs/benchmarks.md
# gives latent PSNR 43-46 dB with it on real-size random-weight models. On the tiny CPU models
# (64×64 images, fp32) the two settings below measured:
#   every 2, at most 1 reuse in a row, 8 steps (3 reused):  latent 49.7 dB, image SSIM 0.9993
#   defaults (every 5, up to 4 in a row), 20 steps (15 reused): latent 42.7 dB, image SSIM 0.9979
# The SSIM bound is the documented promise itself; the latent bounds sit ~3-5 dB under what was
# measured (fp32 rounding across CPUs moves them by far less), so a change that makes the reuse
# cost a few dB more fails them, where the old bound (50% relative latent error) accepted a
# different picture.
LOSSY_MIN_LATENT_DB, LOSSY_MIN_SSIM = 45.0, 0.997
DEFAULT_MIN_LATENT_DB, DEFAULT_MIN_SSIM = 40.0, 0.997


def _fidelity(host, stock, got) -> tuple[float, float]:
    """(latent PSNR dB, decoded image SSIM) of a cached run against the uncached one."""
    return runner.psnr(stock.latent, got.latent), runner.ssim(stock.image, got.image)


def test_every_2_reuses_half_the_steps_within_the_promised_fidelity(host, tiny_models):
    r = runner.Runner()
    wl = WL.with_(decode=True)
    stock = _run(r, wl, 6)
    got = _run(r, wl, 6, EVERY2)
    d = _calls(got)
    # steps 0..7: C R C R C R C C (first and last always computed)
    assert d == {"computed": 5, "reused": 3}
    latent_db, image_ssim = _fidelity(host, stock, got)
    assert latent_db < 200, "no reuse made a difference: the cache did not really reuse"
    assert latent_db >= LOSSY_MIN_LATENT_DB and image_ssim >= LOSSY_MIN_SSIM, (
        latent_db,
        image_ssim,
    )


def test_default_settings_keep_the_documented_fidelity(host, tiny_models):
    """The node's defaults (every 5th step, up to 4 reuses in a row, INT8) over 20 steps, the
    setting the README's SSIM ≥ 0.997 figure is for."""
    r = runner.Runner()
    wl = WL.with_(steps=20, decode=True)
    stock = _run(r, wl, 25)
    got = _run(r, wl, 25, _feature_cache(mode="every_n"))
    d = _calls(got)
    # steps 0..19: computed at 0, 5, 10, 15 and the last; reused in between
    assert d == {"computed": 5, "reused": 15}, d
    latent_db, image_ssim = _fidelity(host, stock, got)
    assert latent_db < 200, "no reuse made a difference: the cache did not really reuse"
    assert latent_db >= DEFAULT_MIN_LATENT_DB and image_ssim >= DEFAULT_MIN_SSIM, (
        latent_db,
        image_ssim,
    )


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
    """Run A, then B, on the same loaded objects; B must equal B run in a fresh executor.

    Where stock itself does not repeat bit for bit between a used and a fresh executor, B may
    differ from the fresh run by no more than a few times what stock's B does. Features left
    from run A would differ by the size of the features themselves."""
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
    if torch.equal(after.latent, fresh.latent):
        return
    r = runner.Runner()
    _run(r, a_wl, 7, None, hint=a_hint)
    stock_after = _run(r, b_wl, seed_b, None, hint=b_hint)
    stock_fresh = _run(runner.Runner(), b_wl, seed_b, None, hint=b_hint)
    drift = (stock_after.latent.double() - stock_fresh.latent.double()).abs().max().item()
    got = (after.latent.double() - fresh.latent.double()).abs().max().item()
    assert 0 < drift and got <= 4 * drift, (
        f"after other runs the cached run differs from a fresh one by {got:.3g}; "
        f"stock's own run differs by {drift:.3g}"
    )


def test_memory_is_released_when_sampling_ends(host, tiny_models):
    fc = _fc(host)
    gc.collect()
    earlier = {id(o) for o in gc.get_objects() if type(o) is fc.CachedControlNet}
    r = runner.Runner()
    _run(r, WL, 9, EVERY2)
    gc.collect()
    nets = [o for o in gc.get_objects() if type(o) is fc.CachedControlNet and id(o) not in earlier]
    assert nets, "the run should have made CachedControlNet objects"
    assert sum(n.cache_bytes() for n in nets) == 0  # every store went back to its pool
    # and, no graph holding them (a fresh executor loads its own networks), the pools of this
    # run's networks kept none of their memory
    assert sum(n._pool().nbytes() for n in nets) == 0


@pytest.mark.captures
def test_works_under_the_cuda_graph_node(host, tiny_models):
    """Graph + cache equals eager + cache: the host makes the same decisions, and each decision
    (compute / reuse) is its own graph."""
    r = runner.Runner()
    eager = _run(r, WL, 10, EVERY2)
    d_eager = _calls(eager)
    eager_11 = _run(r, WL, 11, EVERY2)  # the reference of the second graph run, below
    graph = _run(r, WL, 10, _chain(EVERY2, VARIANTS["cuda_graph"]))
    d = _calls(graph)
    if host.cpu:
        assert torch.equal(graph.latent, eager.latent)
    else:
        assert runner.psnr(eager.latent, graph.latent) >= 45.0
    g = badges.graph_counts(graph)
    assert g["captures"] >= 2 and g["replays"] >= 3, g
    # the counters see replayed steps too (a replay runs no Python): the same as eager
    assert d == d_eager and d["reused"] >= 1, (d, d_eager)
    # a second run on the same objects (another seed: the same prompt would be answered from
    # ComfyUI's output cache) replays the same two graphs: no new capture, eager's result
    again = _run(r, WL, 11, _chain(EVERY2, VARIANTS["cuda_graph"]))
    g = badges.graph_counts(again)
    assert g["captures"] == 0 and g["replays"] >= 3, g
    if host.cpu:
        assert torch.equal(again.latent, eager_11.latent)
    else:
        assert runner.psnr(eager_11.latent, again.latent) >= 45.0
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
    wl_b = WL.with_(strength=0.6)
    b = _run(r, wl_b, 10, _chain(EVERY2, VARIANTS["cuda_graph"]))
    g = badges.graph_counts(b)
    assert g["captures"] == 0 and g["replays"] >= 3, g
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
        seen.append((x.detach().clone(), float(self._t[0]), flat))
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


@pytest.mark.captures
def test_two_workflows_alternating_on_one_network_keep_their_graphs(host, tiny_models):
    """The benchmark's case (found on the H200): a cached workflow with the ControlNet on the
    whole CFG batch and one with positive_only (half the batch: other buffer shapes) take turns.
    Each must find its own buffers in the pool: after the first round, no capture."""
    from comfyui_controlnet_accelerator.harness.quick import _positive_only

    whole = _chain(EVERY2, VARIANTS["cuda_graph"])
    half = _chain(EVERY2, _positive_only, VARIANTS["cuda_graph"])
    r = runner.Runner()
    _run(r, WL, 12, whole)
    _run(r, WL, 12, half)
    later = []
    for _ in range(2):
        later += [_run(r, WL, 12, whole), _run(r, WL, 12, half)]
    g = badges.graph_counts(later)
    assert g["captures"] == 0 and g["replays"] >= 4 * 3, g


@pytest.mark.captures
def test_every_n_under_graphs_reads_nothing_from_the_device(host, tiny_models, monkeypatch):
    """every_n needs only the step index, which the graph wrapper knows on the host (the
    sampler's progress): no sigma is read from the device to decide, in any step. The adaptive
    rule does read it, once per step, shared with the range check."""
    fc = _fc(host)
    sc = sys.modules[host.pack_module_name].nodes.step_control
    reads: list = []
    orig_sigma = sc.StepControl.sigma
    orig_index = fc.CachedControlNet._step_index

    def sigma(self, t):
        reads.append(self.evaluation)
        return orig_sigma(self, t)

    def step_index(self, s, topts):
        reads.append(("by sigma", s))
        return orig_index(self, s, topts)

    monkeypatch.setattr(sc.StepControl, "sigma", sigma)
    monkeypatch.setattr(fc.CachedControlNet, "_step_index", step_index)
    r = runner.Runner()
    got = _run(r, WL, 13, _chain(EVERY2, VARIANTS["cuda_graph"]))
    assert _calls(got) == {"computed": 5, "reused": 3}
    assert reads == []
    _run(r, WL, 13, _chain(NEVER, VARIANTS["cuda_graph"]))
    assert len(reads) == WL.steps and len(set(reads)) == WL.steps, reads
    reads.clear()
    _run(r, WL, 13, EVERY2)  # without the graph node: the step comes from sigma
    assert len(reads) == WL.steps, reads
