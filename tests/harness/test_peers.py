# SPDX-License-Identifier: GPL-3.0-or-later
"""The benchmark's diffusers peer (harness/peers.py) does stock ComfyUI's arithmetic: on the
tiny models, on the CPU in float32, its latent matches stock's from the same seed, with one and
with two ControlNets; what it cannot run is refused with a message that says why."""

from __future__ import annotations

import gc
import sys

import pytest
import torch
from comfyui_controlnet_accelerator.harness import peers, runner
from comfyui_controlnet_accelerator.harness import workflows as wf

SEED = 7

# Measured on the CPU in float32 (seed 7): T1 124.4 dB, T2 124.1 dB, i.e. the two latents
# (std about 79) differ by about 1e-4, float32 rounding in a different order of operations.
# The bound leaves 14 dB for other CPUs and BLAS builds; each mismatch the peer guards against
# lands far below it (measured on T1): the initial noise scaled by sigma_max instead of
# ComfyUI's sqrt(1 + sigma_max^2) 68 dB, ControlNet strength 0.9 instead of 1.0 49 dB, CLIP's
# penultimate layer instead of the last 27 dB.
MIN_PSNR_DB = 110.0


def _release() -> None:
    """What the stock runs loaded into ComfyUI goes, so later tests start from the same memory."""
    if "comfy.model_management" in sys.modules:
        import comfy.model_management as mm

        mm.unload_all_models()
        mm.soft_empty_cache()
    gc.collect()


@pytest.fixture(scope="module")
def compared(host, tiny_models, models_dir):
    """compared(workload id) -> (stock RunResult, PeerResult): stock ComfyUI's workflow and the
    peer (CPU, float32, no compile) on the same seed, each run once for the module."""
    pytest.importorskip("diffusers")
    import folder_paths

    cache: dict = {}

    def get(wid: str):
        if wid not in cache:
            wl = wf.WORKLOADS[wid]
            hints = wf.write_hint_images(folder_paths.get_input_directory(), wl)
            p, ids = wf.build_prompt(wl, SEED, hints)
            stock = runner.Runner().run(p, ids)
            _release()
            peer = peers.build_peer(wl, models_dir, "cpu", torch.float32)
            try:
                cache[wid] = (stock, peer.run(SEED))
            finally:
                peer.close()
        return cache[wid]

    yield get
    cache.clear()
    _release()


@pytest.mark.host
def test_schedule_is_comfyuis(host):
    """The sigmas the peer computes, and the timestep it gives the models for each, are
    ComfyUI's own, bit for bit: at 20 steps the "normal" schedule's timesteps are fractional,
    and diffusers would interpolate them where ComfyUI takes the nearest training step."""
    import comfy.model_base
    from comfyui_controlnet_accelerator.harness import random_models

    ms = comfy.model_base.model_sampling(
        random_models._model_config("sd15-tiny"), comfy.model_base.ModelType.EPS
    )
    for steps in (4, 20):
        wl = wf.WORKLOADS["T1"].with_(steps=steps)
        mine, comfy_own = peers.normal_sigmas(steps), peers.comfy_sigmas(wl)
        assert mine.shape == (steps + 1,) and torch.equal(mine, comfy_own), (mine, comfy_own)
        ts = peers.comfy_timesteps(mine[:-1])
        assert torch.equal(ts, ms.timestep(comfy_own[:-1]).float())
    assert peers.max_denoise(float(peers.normal_sigmas(4)[0]))
    assert not peers.max_denoise(5.0)


@pytest.mark.host
def test_one_controlnet_matches_stock(compared):
    """T1: the same weights, seed, prompts, hint, sampler and sigmas give stock's latent to
    float32 rounding (see MIN_PSNR_DB for the measured figure and why the bound is where it
    is)."""
    stock, peer = compared("T1")
    assert peer.latent.shape == stock.latent.shape == (1, 4, 8, 8)
    assert peer.latent.dtype == torch.float32 and peer.latent.device.type == "cpu"
    db = runner.psnr(stock.latent, peer.latent)
    assert db >= MIN_PSNR_DB, f"T1 peer vs stock: {db:.1f} dB"


@pytest.mark.host
def test_two_controlnets_match_stock(compared):
    """T2: the two ControlNets' residuals are summed at strength 1.0 each, as stock's chained
    Apply ControlNet nodes do; measured 124.1 dB."""
    stock, peer = compared("T2")
    db = runner.psnr(stock.latent, peer.latent)
    assert db >= MIN_PSNR_DB, f"T2 peer vs stock: {db:.1f} dB"
    one_stock, _ = compared("T1")
    assert runner.psnr(one_stock.latent, peer.latent) < 60  # the second net is really there


@pytest.mark.host
def test_step_times_and_no_compile_time(compared):
    """Like runner.RunResult.step_ms: one time per step after the first; compile_s is None
    when nothing was compiled."""
    stock, peer = compared("T1")
    steps = wf.WORKLOADS["T1"].steps
    assert len(peer.step_ms) == steps - 1 == len(stock.step_ms)
    assert all(ms > 0 for ms in peer.step_ms)
    assert peer.compile_s is None
    assert peer.wall_s >= sum(peer.step_ms) / 1e3


def test_missing_diffusers_is_named_with_its_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "diffusers", None)  # import diffusers now fails
    with pytest.raises(peers.PeerUnavailable, match="pip install --no-deps diffusers=="):
        peers.require_diffusers()
    with pytest.raises(ImportError, match=r"diffusers==\d"):
        peers.build_peer("T1", device="cpu")


def test_bad_compile_mode_is_refused_before_anything_loads(monkeypatch):
    monkeypatch.setitem(sys.modules, "diffusers", None)  # the mode is checked first
    with pytest.raises(ValueError, match="unknown compile mode 'fastest'.*reduce-overhead"):
        peers.build_peer("T1", device="cpu", compile_mode="fastest")
    assert peers.check_compile_mode(None) is None
    assert peers.check_compile_mode("max-autotune-no-cudagraphs") == "max-autotune-no-cudagraphs"


@pytest.mark.host
@pytest.mark.parametrize("arch", ["sd15", "sdxl"])
def test_full_size_models_convert_completely(host, arch):
    """W1-W5's models cannot run on the CPU here, but their shapes can be checked: every
    network of the peer (the VAE too) is built from the layout of the files the pack writes,
    on the meta device, and each UNet and ControlNet tensor of the files lands on one parameter
    of the same shape, none missing and none left over (the text encoders' files add only a
    logit scale, CLIP-L's unused projection and its position ids)."""
    pytest.importorskip("diffusers")
    from comfyui_controlnet_accelerator.harness import random_models as rm

    counts = peers.layout_check(arch)
    ckpt = rm.build_state_dict(rm.SPECS[arch], meta=True)
    cn = rm.build_state_dict(rm.SPECS[f"{arch}-cn-a"], meta=True)
    unet = sum(t.numel() for k, t in ckpt.items() if k.startswith("model.diffusion_model."))
    vae = sum(t.numel() for k, t in ckpt.items() if k.startswith("first_stage_model."))
    assert counts["unet"] == unet
    assert counts["controlnet"] == sum(t.numel() for t in cn.values())
    assert counts["vae"] == vae
    assert ("text_encoder_2" in counts) == (arch == "sdxl")


@pytest.mark.host
def test_quick_benchmark_runs_the_peer_beside_stock_and_says_what_it_cannot_run(
    host, tiny_models, models_dir
):
    """``--peers`` in the quick benchmark: the peer's row sits beside stock's from the same
    rounds, with its latent PSNR against that round's stock latent; a workload the peer cannot
    run (no ControlNet) lists the peer as not run with the reason, and stock still runs."""
    pytest.importorskip("diffusers")
    from comfyui_controlnet_accelerator.harness import quick

    prog = quick.Progress(100)
    try:
        rows = quick.run_workload("T1", ["stock"], 1, False, 3, models_dir, prog, peers=("eager",))
        rows0 = quick.run_workload("T0", ["stock"], 1, False, 3, models_dir, prog, peers=("eager",))
    finally:
        prog.close()
    by = {r.variant: r for r in rows}
    peer = by[quick.peer_variant("eager")]
    assert set(by) == {"stock", quick.peer_variant("eager")}
    assert peer.psnr_vs_stock_db >= MIN_PSNR_DB, peer.psnr_vs_stock_db
    assert len(peer.extra["step_ms_last_round"]) == 2 and peer.extra["compile_s"] is None
    assert peer.extra["finite"] and peer.extra["peer"].startswith("diffusers ")
    assert [r.variant for r in rows0] == ["stock"]
    (why,) = [n["why"] for n in prog.not_run if n["workload"] == "T0"]
    assert "needs one" in why, why
    _release()
