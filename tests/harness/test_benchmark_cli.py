# SPDX-License-Identifier: GPL-3.0-or-later
"""benchmark.py's command line and the quick table's notes, without ComfyUI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from comfyui_controlnet_accelerator.harness import quick

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def help_text() -> str:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmark.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def _options(parser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings if s.startswith("--")}


def test_help_lists_every_mode_and_every_option_of_each(help_text):
    from comfyui_controlnet_accelerator.harness import kernel_bench, mem_breakdown

    for flag in ("--kernels", "--soak", "--mem-breakdown"):
        assert f"python benchmark.py {flag} [options]" in help_text
        assert f"usage: benchmark.py {flag} " in help_text
    expected = _options(quick.build_parser())
    expected |= _options(kernel_bench.build_parser())
    expected |= _options(mem_breakdown.build_parser())
    # the soak run's options, read from its parser's source, so a new one must show up too
    soak_src = (ROOT / "harness" / "soak.py").read_text()
    expected |= {
        line.split('"')[1]
        for line in soak_src.splitlines()
        if 'ap.add_argument("--' in line or line.strip().startswith('"--')
    }
    missing = sorted(o for o in expected if o not in help_text)
    assert not missing, missing
    assert {"--gpus", "--tiny", "--reps", "--workload", "--rounds"} <= expected


def test_a_mode_help_names_the_mode():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmark.py"), "--mem-breakdown", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: benchmark.py --mem-breakdown")
    assert "--workloads" not in out.stdout  # the quick benchmark's options are not its own


def test_two_modes_at_once_are_refused():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmark.py"), "--kernels", "--soak"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2 and "choose one mode" in out.stderr


def test_the_quick_parser_refuses_a_mode_flag_it_cannot_run():
    with pytest.raises(SystemExit):
        quick.main(["--soak", "--workloads", "T0"])


def _row(first: float, walls: list[float], **extra) -> quick.Row:
    import statistics

    med = statistics.median(walls)
    return quick.Row(
        workload="T1",
        variant="cuda_graph",
        ms_step_median=1.0,
        ms_step_mean=1.0,
        ms_step_min=1.0,
        ms_step_max=1.0,
        run_medians_ms=[1.0],
        wall_s_median=med,
        first_run_s=first,
        first_run_overhead_s=first - med,
        psnr_vs_stock_db=None,
        extra={"warm_wall_spread_s": max(walls) - min(walls), **extra},
    )


@pytest.mark.parametrize(
    "first, walls, shown",
    [
        (1.00, [1.10, 1.20, 1.15], "≈ 0"),  # faster than the warm runs: noise, not a gain
        (1.17, [1.10, 1.20, 1.15], "≈ 0"),  # slower, but within the warm runs' spread
        (3.15, [1.10, 1.20, 1.15], "2.00"),  # a real overhead (a JIT build, a capture)
    ],
)
def test_first_run_overhead_is_never_shown_negative(first, walls, shown):
    r = _row(first, walls)
    assert quick.overhead_text(r) == shown
    assert not quick.overhead_text(r).startswith("-")


def test_eager_note_gives_the_reason_and_skips_the_expected_eager_steps():
    first_step = "first step of a run: the ControlNet prepares its hint"
    cpu = "no CUDA device for this model (input on cpu): graphs need a GPU"
    assert quick.eager_note([first_step, cpu]) == cpu
    assert quick.eager_note([first_step]) == "no graph was replayed"
    long = "x" * 200
    note = quick.eager_note([long, cpu])
    assert len(note) < 100 and note.endswith("(+1 more)")


def test_table_says_which_graph_variant_ran_eager_and_why():
    eager = _row(1.0, [1.1, 1.2], ran_eager="no CUDA device for this model")
    stock = _row(1.0, [1.1, 1.2])
    stock.variant = "stock"
    text = quick.table([stock, eager], {"T1": "tiny"})
    lines = text.splitlines()
    assert "| cuda_graph (ran eager: no CUDA device for this model) |" in lines[3]
    assert "ran eager" not in lines[2]
    passed = _row(1.0, [1.1, 1.2], passed_through="DynamicVRAM manages this model")
    line = quick.table([stock, passed], {"T1": "tiny"}).splitlines()[3]
    assert "| cuda_graph (model passed through: DynamicVRAM manages this model) |" in line
    assert "ran eager" not in line


def test_graph_variants_are_recognised():
    assert quick.uses_graphs("cuda_graph") and quick.uses_graphs("stack_all")
    assert not quick.uses_graphs("fused") and not quick.uses_graphs("pool_int8")


def test_table_shows_host_time_per_step_for_graph_variants_only():
    graph = _row(1.0, [1.1, 1.2])
    graph.host_ms_step = 0.4321
    graph.launch_ms_step = 9.876
    graph.host_ms_replay = 0.2468
    stock = _row(1.0, [1.1, 1.2])
    stock.variant = "stock"
    lines = quick.table([stock, graph], {"T1": "tiny"}).splitlines()
    cols = [c.strip() for c in lines[0].strip("|").split("|")]
    at = cols.index("host ms/step")
    assert lines[1].count("---") == len(cols)
    assert [c.strip() for c in lines[2].strip("|").split("|")][at] == "—"
    assert [c.strip() for c in lines[3].strip("|").split("|")][at] == "0.432"
    at = cols.index("host ms/replay")
    assert [c.strip() for c in lines[2].strip("|").split("|")][at] == "—"
    assert [c.strip() for c in lines[3].strip("|").split("|")][at] == "0.247"
    at = cols.index("launch wait ms/step")
    assert [c.strip() for c in lines[2].strip("|").split("|")][at] == "—"
    assert [c.strip() for c in lines[3].strip("|").split("|")][at] == "9.88"


def test_compiled_graph_variants_exist_but_are_not_run_by_default():
    for v in ("graph_compiled", "fused+graph_compiled"):
        assert v in quick.VARIANTS and v not in quick.DEFAULT_VARIANTS
        assert quick.uses_graphs(v)
    from comfyui_controlnet_accelerator.harness.workflows import WORKLOADS, build_prompt

    p, _ = build_prompt(WORKLOADS["T1"], 0, ["h.png"], quick.VARIANTS["fused+graph_compiled"])
    graph = [n for n in p.values() if n["class_type"] == "CNA_CUDAGraph"]
    assert len(graph) == 1 and graph[0]["inputs"]["compile"] == "inductor"
    assert graph[0]["inputs"]["max_graphs"] == 24
    assert any(n["class_type"] == "CNA_ControlNetApplyFused" for n in p.values())


def test_the_output_says_what_ran_and_that_a_cpu_run_is_no_speed_measurement():
    info = {"T2": "sd15-tiny 64², 2 CN, 4 steps"}
    cpu = quick.what_ran(True, info, ["stock", "fused"], quick.CPU_ROUNDS, defaults=True)
    assert cpu.startswith("Ran on the CPU: T2 (sd15-tiny 64², 2 CN, 4 steps); variants stock")
    assert f"{quick.CPU_ROUNDS} warm round(s)" in cpu and "not a speed measurement" in cpu
    assert "--workloads T0,T1,T2" in cpu  # how to run more than the CPU defaults
    asked = quick.what_ran(True, info, ["stock"], 3, defaults=False)
    assert "3 warm round(s)" in asked and "CPU defaults" not in asked
    gpu = quick.what_ran(False, info, ["stock"], quick.GPU_ROUNDS, defaults=True)
    assert gpu.startswith("Ran on the GPU") and "speed measurement" not in gpu
    # the GPU defaults are the reference workloads and rounds of docs/benchmarks.md
    assert quick.GPU_WORKLOADS == ["W0", "W1", "W2", "W3", "W4", "W5"] and quick.GPU_ROUNDS == 3
    assert quick.CPU_WORKLOADS and all(w.startswith("T") for w in quick.CPU_WORKLOADS)
