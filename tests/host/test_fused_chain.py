# SPDX-License-Identifier: GPL-3.0-or-later
"""One ControlNet applied N times through chained *Apply ControlNet (Fused)* nodes (each feeding
the next's positive/negative, strength 1/N), stock KSampler, eager and under *CUDA Graph*.

The fused merge runs every chained net in one op; its CUDA kernel takes at most a few nets per
launch (``kernels.constraints.CUDA_LIMITS``), so longer chains must be split, never handed to
the kernel whole. Every chain length must sample, and match the same chain merged by the eager
PyTorch path.

- On the CPU the merge is routed to the CUDA dispatch with a checking double of the kernels
  (``tests/kernels/test_limits.StrictKernels``: every ``TORCH_CHECK`` of the CUDA entry points,
  then the same math), so a launch outside the limits fails the test. fp32 throughout: the
  split adds one rounding of the running sum per further group, relative L2 error ≤ 1e-5.
- On a GPU (``CNA_TEST_GPU=1``) the real kernels run; fp16 latents after 4 steps must be within
  45 dB PSNR (the pack's "exact" bound) of the eager merge.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from comfyui_controlnet_accelerator.harness import runner
from comfyui_controlnet_accelerator.harness import workflows as wf
from comfyui_controlnet_accelerator.harness.quick import VARIANTS, _chain

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("graph_backend")]

# Every count from 1 to 12 on a GPU; on the CPU (CI) the counts around the kernel's limit of 4
# nets per launch: two launches and three.
GPU = os.environ.get("CNA_TEST_GPU") == "1"
COUNTS = list(range(1, 13)) if GPU else [5, 9]


def _one_loader(p: dict, ids: dict) -> None:
    """Every apply node takes the first loader's ControlNet: one net applied N times."""
    for node in p.values():
        if node["class_type"] in ("ControlNetApplyAdvanced", "CNA_ControlNetApplyFused"):
            node["inputs"]["control_net"] = [ids["cn_0"], 0]
    for key in [k for k in ids if k.startswith("cn_") and k != "cn_0"]:
        del p[ids[key]]


def _workload(n: int) -> wf.Workload:
    return wf.WORKLOADS["T1"].with_(
        controlnets=("sd15-tiny-cn-a",) * n, strength=1.0 / n, steps=4 if GPU else 2
    )


def _run(r, wl, extra):
    import folder_paths

    hints = wf.write_hint_images(folder_paths.get_input_directory(), wl)
    p, ids = wf.build_prompt(wl, 23, hints, extra)
    return r.run(p, ids)


def _ops(host):
    return sys.modules[host.pack_module_name].kernels.ops


def _registry(host):
    return sys.modules[host.pack_module_name].kernels.registry


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture
def kernel_route(host, monkeypatch):
    """Route the merge to the CUDA dispatch: the checking double on a CPU, the real kernels on
    a GPU. Yields the double (None on a GPU) so a test can count its launches."""
    if not host.cpu:
        if _ops(host)._jit.ensure_loaded() is None:
            pytest.skip(
                "the CUDA kernels are not available: " + str(_registry(host).list_backends())
            )
        monkeypatch.setattr(_registry(host), "_cuda_by_default", lambda op=None: True)
        yield None
        return
    from tests.kernels.test_limits import StrictKernels

    double = StrictKernels()
    real_select = _registry(host).select

    def select(op, tensors):
        return "cuda" if op == "control_merge" else real_select(op, tensors)

    monkeypatch.setattr(_ops(host), "_cna", lambda: double)
    monkeypatch.setattr(_registry(host), "select", select)
    yield double


@pytest.fixture
def eager_merge(host, monkeypatch):
    """A context in which the merge runs on the eager PyTorch path."""

    def on():
        m = pytest.MonkeyPatch()
        m.setattr(_registry(host), "select", lambda op, tensors: "eager")
        return m

    return on


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda_graph"])
@pytest.mark.parametrize("n", COUNTS)
def test_chained_fused_applies_sample_and_match_the_eager_merge(
    host, tiny_models, kernel_route, eager_merge, n, graph
):
    wl = _workload(n)
    fused = _chain(VARIANTS["fused"], _one_loader)
    variant = _chain(fused, VARIANTS["cuda_graph"]) if graph else fused
    m = eager_merge()
    try:  # a runner each: the same prompt would otherwise come from the executor's cache
        want = _run(runner.Runner(), wl, fused)
    finally:
        m.undo()
    got = _run(runner.Runner(), wl, variant)
    assert torch.isfinite(got.latent).all()
    if host.cpu:
        lim = _ops(host).constraints.CUDA_LIMITS["control_merge"]["max_nets"]
        assert kernel_route.launches, "the merge never reached the kernel dispatch"
        assert max(nets for _, nets, _ in kernel_route.launches) == min(n, lim)
        assert _rel(got.latent, want.latent) <= 1e-5
    else:
        assert runner.psnr(want.latent, got.latent) >= 45.0


def test_a_chain_longer_than_one_launch_matches_stock(host, tiny_models, kernel_route):
    """Eight chained applies through the split merge against stock ComfyUI's own chain."""
    wl = _workload(8)
    r = runner.Runner()
    stock = _run(r, wl, _one_loader)
    got = _run(r, wl, _chain(VARIANTS["fused"], _one_loader))
    if host.cpu:
        assert _rel(got.latent, stock.latent) <= 1e-5
    else:  # stock rounds after each scale and add in fp16; the merge once per launch
        assert runner.psnr(stock.latent, got.latent) >= 40.0
