# SPDX-License-Identifier: GPL-3.0-or-later
"""The benchmark's kernel-name -> op-kind table, on kernel names seen in H200 profiles."""

from __future__ import annotations

import pytest
from comfyui_controlnet_accelerator.harness.quick import op_kind


@pytest.mark.parametrize(
    "name,kind",
    [
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7", "attention"),
        (
            "void at::native::(anonymous namespace)::RowwiseMomentsCUDAKernel<c10::Half>",
            "groupnorm",
        ),
        ("void cudnn::engines_precompiled::nchwToNhwcKernel<__half, __half, float>", "conv layout"),
        ("void cudnn::engines_precompiled::nhwcToNchwKernel<__half, __half, float>", "conv layout"),
        ("sm90_xmma_fprop_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc_tilesize128x64x64", "conv"),
        ("nvjet_sm90_hsh_168x128_64x5_1x2_h_bz_coopA_bias_TNN", "gemm"),
        ("void at::native::vectorized_layer_norm_kernel<c10::Half, float, false>", "layernorm"),
        ("void cna::gn_apply_kernel<__half, 8, unsigned int>", "groupnorm"),
        ("geglu_kernel", "gemm+geglu"),
        ("triton_poi_fused_gelu_mul_0", "silu/gelu"),
    ],
)
def test_op_kind(name, kind):
    assert op_kind(name) == kind


def test_ssim_is_one_for_identical_images_and_falls_with_noise():
    import torch
    from comfyui_controlnet_accelerator.harness.runner import psnr, ssim

    g = torch.Generator().manual_seed(0)
    img = torch.rand(1, 32, 40, 3, generator=g)
    assert ssim(img, img) == pytest.approx(1.0)
    small = (img + 0.02 * torch.randn(img.shape, generator=g)).clamp(0, 1)
    big = (img + 0.3 * torch.randn(img.shape, generator=g)).clamp(0, 1)
    assert 1.0 > ssim(img, small) > ssim(img, big) > -1.0
    assert psnr(img, small) > psnr(img, big)


def test_loading_the_benchmark_does_not_import_torch():
    """benchmark.py must start ComfyUI's host before torch is imported, or cudaMallocAsync
    (what ComfyUI's main.py selects) is silently replaced by PyTorch's native allocator — this
    happened once, through a variant definition that imported a torch module."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = (
        "import runpy, sys; sys.argv = ['benchmark.py']; "
        f"g = runpy.run_path({str(root / 'benchmark.py')!r}, run_name='not_main'); "
        "import comfyui_controlnet_accelerator.harness.quick as q; "
        "assert q.VARIANTS; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", "importing the benchmark's variants imported torch"


def test_peak_breakdown_finds_the_highest_point_and_what_was_alive_there():
    from comfyui_controlnet_accelerator.harness.mem_breakdown import peak_breakdown

    def ev(action, addr, size, fn="nodes/memory_pool.py", line=1):
        return {
            "action": action,
            "addr": addr,
            "size": size,
            "frames": [
                {"filename": "/x/torch/nn/functional.py", "line": 9, "name": "conv2d"},
                {"filename": f"/pack/{fn}", "line": line, "name": "f"},
            ],
        }

    MiB = 1 << 20
    trace = [
        ev("alloc", 1, 10 * MiB, line=1),
        ev("free_requested", 99, 4 * MiB),  # a block from before the trace (an unload)
        ev("alloc", 2, 20 * MiB, line=2),
        ev("alloc", 3, 5 * MiB, line=2),  # peak here: 10 - 4 + 20 + 5 = 31
        ev("free_requested", 2, 20 * MiB),
        ev("free_completed", 2, 20 * MiB),
        ev("alloc", 4, 15 * MiB, line=3),  # 26: below the peak
    ]
    peak, rows = peak_breakdown({"device_traces": [trace]})
    assert peak_breakdown({"device_traces": [trace]}, start_marker="nothing")[0] == 0
    assert peak == 31
    assert rows[0] == (25.0, 2, "nodes/memory_pool.py:2(f)")
    assert rows[1] == (10.0, 1, "nodes/memory_pool.py:1(f)")
    assert len(rows) == 2  # the 15 MiB block came after the peak


def test_peak_breakdown_after_a_marker_counts_earlier_blocks_but_not_earlier_peaks():
    from comfyui_controlnet_accelerator.harness.mem_breakdown import peak_breakdown

    MiB = 1 << 20

    def ev(action, addr, size, name="f"):
        return {
            "action": action,
            "addr": addr,
            "size": size,
            "frames": [{"filename": "/pack/nodes/x.py", "line": 1, "name": name}],
        }

    trace = [
        ev("alloc", 1, 50 * MiB),  # a peak before sampling (compressing the weights)
        ev("alloc", 2, 30 * MiB),  # weights kept
        ev("free_requested", 1, 50 * MiB),
        ev("alloc", 3, 1 * MiB, name="traced_sample"),
        ev("alloc", 4, 10 * MiB),
    ]
    assert peak_breakdown({"device_traces": [trace]})[0] == 80
    peak, rows = peak_breakdown({"device_traces": [trace]}, start_marker="traced_sample")
    assert peak == 41 and sum(r[0] for r in rows) == 41


def test_per_step_times_split_a_throttled_progress_interval_over_its_steps():
    """Newer ComfyUI reports progress at the first and last step and at most every so often in
    between: an interval over 3 steps counts as 3 steps of a third of it each."""
    from comfyui_controlnet_accelerator.harness.runner import _per_step

    marks = [(1, 0.0), (2, 0.010), (5, 0.040), (5, 0.041), (20, 0.190)]
    got = _per_step(marks, lambda a, b: (b - a) * 1e3)
    assert len(got) == 19  # steps 2..20, the repeated report of step 5 adds none
    assert got[0] == pytest.approx(10.0)
    assert got[1:4] == pytest.approx([10.0] * 3)
    assert got[4:] == pytest.approx([149.0 / 15] * 15)


def test_device_peak_keeps_the_highest_reading_between_start_and_stop():
    import threading

    from comfyui_controlnet_accelerator.harness.runner import DevicePeak

    level = [5]
    reads = []
    seen = threading.Condition()

    def read():
        with seen:
            reads.append(level[0])
            seen.notify_all()
        return level[0]

    poll = DevicePeak(read, interval_s=0.001).start()
    level[0] = 9  # a transient high: polled while it lasts, gone before stop()
    with seen:
        assert seen.wait_for(lambda: 9 in reads, timeout=5)
    level[0] = 3
    assert poll.stop() == 9
    n = len(reads)
    level[0] = 20  # stopped: no more reads
    threading.Event().wait(0.02)
    assert len(reads) == n and poll.peak == 9


def test_device_peak_reads_once_more_at_stop():
    from comfyui_controlnet_accelerator.harness.runner import DevicePeak

    level = [1]
    poll = DevicePeak(lambda: level[0], interval_s=60).start()  # polls once, then waits
    level[0] = 4
    assert poll.stop() == 4


def test_a_variants_environment_holds_for_its_runs_only(monkeypatch):
    from comfyui_controlnet_accelerator.harness import quick

    monkeypatch.setitem(quick.VARIANT_ENV, "v_test", {"CNA_T_SET": "0", "CNA_T_KEPT": "new"})
    monkeypatch.delenv("CNA_T_SET", raising=False)
    monkeypatch.setenv("CNA_T_KEPT", "old")
    import os

    with quick.variant_env("v_test"):
        assert os.environ["CNA_T_SET"] == "0" and os.environ["CNA_T_KEPT"] == "new"
    assert "CNA_T_SET" not in os.environ and os.environ["CNA_T_KEPT"] == "old"
    with pytest.raises(KeyError), quick.variant_env("v_test"):
        raise KeyError("a failing run")
    assert "CNA_T_SET" not in os.environ and os.environ["CNA_T_KEPT"] == "old"
    with quick.variant_env("stock"):  # no settings: nothing changes
        assert "CNA_T_SET" not in os.environ


def test_a_run_records_its_settings_but_no_folders(monkeypatch, tmp_path):
    from comfyui_controlnet_accelerator.harness import quick
    from comfyui_controlnet_accelerator.kernels import registry

    monkeypatch.setattr(registry, "_mode", None)
    monkeypatch.setenv("CNA_KERNELS", "eager")
    monkeypatch.setenv("CNA_POOL_GROUPS", "0")
    monkeypatch.setenv("CNA_MODELS_DIR", str(tmp_path))
    monkeypatch.setenv("NOT_OURS", "1")
    got = quick.run_settings()
    assert got["CNA_KERNELS"] == "eager" and got["CNA_POOL_GROUPS"] == "0"
    assert "CNA_MODELS_DIR" not in got and "NOT_OURS" not in got
    # whether the extension's kernels ran, and why not: switched off here
    assert got["cuda_kernels_by_default"] is False
    assert "CNA_KERNELS=eager" in got["cuda_kernels_note"]
    monkeypatch.delenv("CNA_KERNELS")
    monkeypatch.setattr(registry, "_mode", None)
    assert quick.run_settings()["CNA_KERNELS"] == "auto"  # the default is recorded too
    assert quick.environment()["settings"]["CNA_POOL_GROUPS"] == "0"


def test_every_variant_environment_belongs_to_a_variant():
    from comfyui_controlnet_accelerator.harness import quick

    assert set(quick.VARIANT_ENV) <= set(quick.VARIANTS)


def test_the_benchmark_shows_the_packs_info_lines(monkeypatch):
    import logging

    from comfyui_controlnet_accelerator.harness import quick
    from comfyui_controlnet_accelerator.logger import logger as pack_logger

    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    monkeypatch.setattr(pack_logger, "handlers", [])
    monkeypatch.setattr(pack_logger, "level", logging.NOTSET)
    quick.show_pack_log()
    assert pack_logger.level == logging.INFO and len(pack_logger.handlers) == 1
    quick.show_pack_log()  # idempotent
    assert len(pack_logger.handlers) == 1


class _Outputs:
    """A runner's cached outputs: node id -> list of output slots."""

    def __init__(self, outputs: dict):
        self.outputs = outputs

    def output_of(self, nid):
        from comfyui_controlnet_accelerator.harness.runner import WorkflowFailed

        if nid not in self.outputs:
            raise WorkflowFailed(f"node {nid} produced no output")
        return self.outputs[nid]


def test_a_reused_graph_node_is_labelled_passed_through_only_if_it_handed_its_input_on():
    """Under DynamicVRAM the CUDA Graph node hands the model on unchanged; when ComfyUI reuses
    its output for a later variant, no badge comes, and the benchmark reads the reuse from the
    cached outputs instead: the node's output is its input model."""
    from comfyui_controlnet_accelerator.harness.quick import _graph_node_passed_model_on

    model, wrapped = object(), object()
    prompt = {"4": {"inputs": {}}, "9": {"inputs": {"model": ["4", 0]}}}
    ids = {"CNA_CUDAGraph": "9"}
    assert _graph_node_passed_model_on(_Outputs({"4": [model], "9": [model]}), prompt, ids)
    assert not _graph_node_passed_model_on(_Outputs({"4": [model], "9": [wrapped]}), prompt, ids)
    assert not _graph_node_passed_model_on(_Outputs({"4": [model]}), prompt, ids)  # never ran
    assert not _graph_node_passed_model_on(_Outputs({"9": [model]}), prompt, {})  # no such node


def test_compile_phases_count_what_a_compile_did_between_two_snapshots():
    import torch
    from comfyui_controlnet_accelerator.harness import compile_phases as cp

    def f(x):
        return torch.sin(x) * 2 + 1

    x = torch.randn(8)
    before = cp.snapshot()
    torch.compile(f, backend="eager")(x)  # dynamo traces; nothing is generated
    after = cp.snapshot()
    got = cp.delta(before, after)
    assert got["times"]["bytecode_tracing"] > 0, got
    assert got["times"]["_compile.compile_inner"] >= got["times"]["bytecode_tracing"]
    assert got["counters"].get("stats.unique_graphs", 0) >= 1, got
    assert cp.delta(after, cp.snapshot()) == {"times": {}, "counters": {}}  # nothing since


def test_compile_phases_table_has_a_column_per_variant_that_compiled():
    from comfyui_controlnet_accelerator.harness import compile_phases as cp
    from comfyui_controlnet_accelerator.harness.quick import Row, phases_text

    a = {
        "times": {"_compile.compile_inner": 61.2, "Scheduler.codegen": 19.3},
        "counters": {"inductor.fxgraph_cache_miss": 2},
    }
    b = {"times": {"_compile.compile_inner": 12.0}, "counters": {"inductor.fxgraph_cache_hit": 2}}
    text = cp.text({"graph_compiled": a, "restart": b, "stock": {"times": {}, "counters": {}}})
    lines = text.splitlines()
    assert lines[2] == "| phase | graph_compiled | restart |"
    assert "| inductor generating kernels (`Scheduler.codegen`) | 19.3 | — |" in lines
    assert "| fxgraph_cache_hit | 0 | 2 |" in lines and "| fxgraph_cache_miss | 2 | 0 |" in lines
    assert not any("dynamo tracing" in ln for ln in lines)  # a phase nobody timed: no row
    assert cp.text({"stock": {"times": {}, "counters": {}}}) == ""

    def row(wid, v, phases=None):
        r = Row(wid, v, 1.0, 1.0, 1.0, 1.0, [1.0], 1.0, 1.0, 0.0, None)
        if phases is not None:
            r.extra["compile_phases"] = phases
        return r

    out = phases_text([row("W1", "stock"), row("W1", "graph_compiled", a), row("W0", "stock")])
    assert "W1: Compile phases" in out and "W0: no compile in any first run" in out


def _graph_sizes(seen):
    """A dynamo backend that records, per graph it gets, whether any input size is symbolic."""
    import torch

    def backend(gm, example_inputs):
        seen.append(
            any(
                isinstance(d, torch.SymInt)
                for t in example_inputs
                if isinstance(t, torch.Tensor)
                for d in t.shape
            )
            or any(isinstance(t, torch.SymInt) for t in example_inputs)
        )
        return gm.forward

    return backend


def test_the_kernel_benchmark_compiles_every_shape_static_as_compiled_mode_does():
    import torch
    import torch._dynamo
    from comfyui_controlnet_accelerator.harness.kernel_bench import _inductor

    def geglu(x):
        v, g = x.chunk(2, -1)
        return v * torch.nn.functional.gelu(g)

    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.reset()
    try:
        # torch's default: the second shape recompiles with symbolic sizes
        default: list[bool] = []
        f = torch.compile(geglu, backend=_graph_sizes(default))
        for n in (8, 16, 24):
            f(torch.randn(n, 32))
        assert default[0] is False and True in default[1:]
        torch._dynamo.reset()
        # the benchmark's baselines: one static graph per shape, past dynamo's 8 per function
        static: list[bool] = []
        f = _inductor(geglu, backend=_graph_sizes(static))
        shapes = [8 * (i + 1) for i in range(12)]
        for n in shapes:
            x = torch.randn(n, 32)
            torch.testing.assert_close(f(x), geglu(x))
        assert static == [False] * len(shapes)
    finally:
        torch._dynamo.config.recompile_limit = limit
        torch._dynamo.reset()
