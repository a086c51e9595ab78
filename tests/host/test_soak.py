# SPDX-License-Identifier: GPL-3.0-or-later
"""The soak harness (``harness/soak.py``) on the CPU with the tiny models: a real ComfyUI
server, prompts queued over HTTP, exact-mode prompts compared with stock ones. The H200 run
(``python benchmark.py --soak --gpus 0,1``) is the real soak; this proves the harness works and
that its stock comparison catches a result that is not stock's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from comfyui_controlnet_accelerator.harness import browser, soak

pytestmark = [pytest.mark.host, pytest.mark.slow]


WHY_NOT = browser.missing_server_packages()


def _run(tmp_path: Path, models_dir: Path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "out"
    rc = soak.main(
        ["--gpus", "cpu", "--tiny", "--warm", "3", "--out", str(out)]
        + ["--models-dir", str(models_dir), *extra]
    )
    (report,) = out.glob("soak-*.json")
    return rc, json.loads(report.read_text())


def test_plan_varies_what_the_issue_asks_and_checks_exact_modes():
    jobs = soak.plan(200, tiny=False, check_every=10, seed=0)
    runs = [j for j in jobs if j.check_of is None]
    assert len(runs) == 200
    assert runs[0].variant == "exact_stack" and len(runs[0].workload.controlnets) == 2
    assert {len(j.workload.controlnets) for j in runs} == {0, 1, 2}
    assert len({(j.workload.width, j.workload.height) for j in runs}) >= 3
    assert len({j.variant for j in runs}) >= 12 and {1, 2} <= {j.workload.batch_size for j in runs}
    checks = [j for j in jobs if j.check_of is not None]
    assert checks and all(j.variant == "stock" for j in checks)
    assert all(runs[j.check_of].variant in soak.EXACT for j in checks)
    # a ControlNet-only node never lands on a prompt without a ControlNet (same prompt as stock)
    assert not [j for j in runs if not j.workload.controlnets and j.variant in soak.NEEDS_NET]


def test_reserved_vram_verdict_reads_the_unloaded_figures_first():
    # ComfyUI 0.33 with DynamicVRAM on: weights outside PyTorch's allocator, then a Memory Pool
    # left loaded; with every model unloaded nothing stayed. Not a leak.
    dyn = {
        "after_first_prompt": 64.0,
        "after_warm_prompts": 1632.0,
        "after_warm_prompts_freed": 64.0,
        "after_last_prompt": 2304.0,
        "after_last_prompt_freed": 64.0,
    }
    assert soak.reserved_problems(dyn) == []
    # what stays after unloading grows: a leak, whatever the loaded figures say
    leak = dict(dyn, after_last_prompt=64.0, after_last_prompt_freed=512.0)
    (said,) = soak.reserved_problems(leak)
    assert "64 → 512" in said and "leak" in said
    assert soak.reserved_problems(dict(dyn, after_last_prompt_freed=64.0 * 1.05 + 64)) == []
    # /free unread: the loaded figures are all there is
    unread = dict(dyn, after_warm_prompts_freed=None, after_last_prompt_freed=None)
    (said,) = soak.reserved_problems(unread)
    assert "64 → 2304" in said and "/free" in said
    assert soak.reserved_problems(dict(unread, after_last_prompt=66.0)) == []
    assert soak.reserved_problems({}) == []


@pytest.mark.skipif(WHY_NOT is not None, reason=f"soak: {WHY_NOT}")
def test_soak_through_a_real_server(host, tiny_models, models_dir, tmp_path):
    rc, rep = _run(tmp_path, models_dir, "--prompts", "6", "--check-every", "2")
    (srv,) = rep["servers"].values()
    assert rc == 0, srv["problems"] or rep["errors"]
    assert srv["prompts"] >= 7 and not srv["failed"] and not srv["bad_images"]
    assert srv["checks"] and all(db >= 60.0 for *_, db in srv["checks"])


@pytest.mark.skipif(WHY_NOT is not None, reason=f"soak: {WHY_NOT}")
def test_soak_flags_a_result_that_differs_from_stock(
    host, tiny_models, models_dir, tmp_path, monkeypatch
):
    # Claim a lossy mode (INT8 weights) is exact: its stock comparison must fail the run.
    monkeypatch.setattr(soak, "EXACT", ["pool_int8"])
    monkeypatch.setattr(soak, "LOSSY", [])
    rc, rep = _run(tmp_path, models_dir, "--prompts", "3", "--check-every", "1")
    (srv,) = rep["servers"].values()
    assert rc == 1
    assert any("differs from stock" in p for p in srv["problems"]), srv["problems"]
