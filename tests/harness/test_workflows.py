# SPDX-License-Identifier: GPL-3.0-or-later
"""The workflow builder and hint images, without ComfyUI."""

from __future__ import annotations

import numpy as np
from comfyui_controlnet_accelerator.harness import workflows as wf


def test_hint_images_are_deterministic_and_not_blank():
    a = wf.hint_image(96, 64, 0)
    assert a.shape == (64, 96, 3) and a.dtype == np.uint8
    assert np.array_equal(a, wf.hint_image(96, 64, 0))
    assert 0.01 < (a > 127).mean() < 0.5  # an edge map: some edges, mostly background
    b = wf.hint_image(96, 64, 1)
    assert not np.array_equal(a, b)


def test_prompt_chains_controlnets_into_the_sampler():
    wl = wf.WORKLOADS["W2"]
    p, ids = wf.build_prompt(wl, 7, ["h0.png", "h1.png"])
    s = p[ids["sampler"]]["inputs"]
    assert s["positive"] == [ids["apply_1"], 0] and s["negative"] == [ids["apply_1"], 1]
    a1 = p[ids["apply_1"]]["inputs"]
    assert a1["positive"] == [ids["apply_0"], 0] and a1["negative"] == [ids["apply_0"], 1]
    assert (
        p[ids["cn_0"]]["inputs"]["control_net_name"] != p[ids["cn_1"]]["inputs"]["control_net_name"]
    )
    assert s["seed"] == 7 and s["steps"] == 20 and s["cfg"] == 7.5
    assert p[ids["out"]]["class_type"] == "SaveLatent"


def test_zero_controlnets_feed_text_conds_directly():
    p, ids = wf.build_prompt(wf.WORKLOADS["W0"], 1, ["h.png"])
    s = p[ids["sampler"]]["inputs"]
    assert s["positive"] == [ids["pos"], 0] and s["negative"] == [ids["neg"], 0]
    assert not any(v["class_type"].startswith("ControlNet") for v in p.values())


def test_node_ids_are_stable_across_seeds():
    wl = wf.WORKLOADS["W1"]
    p1, ids1 = wf.build_prompt(wl, 1, ["h.png"])
    p2, ids2 = wf.build_prompt(wl, 2, ["h.png"])
    assert ids1 == ids2
    assert p1[ids1["ckpt"]] == p2[ids2["ckpt"]]
