# SPDX-License-Identifier: GPL-3.0-or-later
"""Property test: random combinations of our nodes in their exact modes (graphs serial or
concurrent, fused apply, Memory Pool with weights as loaded, Feature Cache off, all stacked),
strengths, start/end ranges, 1–3 nets, sizes, batch, steps and seeds give stock ComfyUI's
output (fp32 on the CPU: relative error ≤ 1e-5, the fused merge's bound; the graph path alone
is exact)."""

from __future__ import annotations

import os

import pytest

hypothesis = pytest.importorskip("hypothesis")
from comfyui_controlnet_accelerator.harness import runner  # noqa: E402
from comfyui_controlnet_accelerator.harness import workflows as wf  # noqa: E402
from comfyui_controlnet_accelerator.harness.quick import VARIANTS  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = [pytest.mark.host, pytest.mark.slow]
NETS = ("sd15-tiny-cn-a", "sd15-tiny-cn-b", "sd15-tiny-cn-a")


@pytest.fixture(scope="module")
def shared_runner(host, tiny_models):
    prev = os.environ.get("CNA_GRAPH_BACKEND")
    if host.cpu:
        os.environ["CNA_GRAPH_BACKEND"] = "emulate"
    yield runner.Runner()
    if prev is None:
        os.environ.pop("CNA_GRAPH_BACKEND", None)
    else:
        os.environ["CNA_GRAPH_BACKEND"] = prev


@settings(
    max_examples=int(os.environ.get("CNA_PROPERTY_EXAMPLES", "12")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    nets=st.integers(1, 3),
    strength=st.sampled_from([0.0, 0.35, 1.0, 1.75]),
    window=st.sampled_from([(0.0, 1.0), (0.0, 0.5), (0.3, 1.0), (0.2, 0.7)]),
    size=st.sampled_from([(64, 64), (80, 64), (64, 96)]),
    batch=st.integers(1, 2),
    steps=st.integers(2, 6),
    seed=st.integers(0, 2**16),
    variant=st.sampled_from(
        ["cuda_graph", "fused", "fused+graph", "fused+graph_serial", "pool_offload", "exact_stack"]
    ),
)
def test_random_configurations_match_stock(
    host, shared_runner, nets, strength, window, size, batch, steps, seed, variant
):
    import folder_paths

    wl = wf.WORKLOADS["T1"].with_(
        controlnets=NETS[:nets],
        strength=strength,
        start_percent=window[0],
        end_percent=window[1],
        width=size[0],
        height=size[1],
        batch_size=batch,
        steps=steps,
    )
    hints = wf.write_hint_images(folder_paths.get_input_directory(), wl)
    p, ids = wf.build_prompt(wl, seed, hints)
    stock = shared_runner.run(p, ids)
    p, ids = wf.build_prompt(wl, seed, hints, VARIANTS[variant])
    got = shared_runner.run(p, ids)
    if host.cpu:
        rel = (
            (got.latent.double() - stock.latent.double()).norm() / stock.latent.double().norm()
        ).item()
        assert rel <= 1e-5, (variant, rel)
    else:
        assert runner.psnr(stock.latent, got.latent) >= 45.0
