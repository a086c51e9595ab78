# SPDX-License-Identifier: GPL-3.0-or-later
"""The example workflows shipped in ``example_workflows/`` (ComfyUI shows them as templates),
built as API prompts and written in UI format. Regenerate with ``python tools/make_examples.py``;
a host test converts each file back and runs it on the tiny models."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..memory.feature_cache import CacheConfig
from ..nodes.memory_pool import PoolOptions
from . import ui_workflow

SD15_CKPT = "v1-5-pruned-emaonly-fp16.safetensors"
SD15_CANNY = "control_v11p_sd15_canny_fp16.safetensors"
SDXL_CKPT = "sd_xl_base_1.0.safetensors"
SDXL_CANNY = "controlnet-canny-sdxl-1.0.safetensors"
SDXL_DEPTH = "controlnet-depth-sdxl-1.0.safetensors"
POS = "a lighthouse on a cliff at sunset, dramatic sky, highly detailed photograph"
NEG = "blurry, low quality, watermark"


def _builder():
    """(prompt, titles, add): ``add(class_type, title=None, **inputs)`` appends a node and
    returns its id."""
    p: dict = {}
    titles: dict = {}

    def add(ct, title=None, **inputs):
        nid = str(len(p) + 1)
        p[nid] = {"class_type": ct, "inputs": inputs}
        if title:
            titles[nid] = title
        return nid

    return p, titles, add


def _checkpoint_and_prompts(add, ckpt: str) -> tuple[str, str, str]:
    ck = add("CheckpointLoaderSimple", ckpt_name=ckpt)
    pos = add("CLIPTextEncode", "Positive prompt", text=POS, clip=[ck, 1])
    neg = add("CLIPTextEncode", "Negative prompt", text=NEG, clip=[ck, 1])
    return ck, pos, neg


def _graph(
    ckpt: str,
    nets: list[str],
    size: int,
    ksampler_graph: bool,
    feature_cache: bool = False,
    memory_pool: bool = False,
    pool: dict | None = None,
    pool_title: str = "ControlNet Memory Pool (weights 'as loaded' = exact result)",
) -> tuple[dict, dict]:
    p, titles, add = _builder()
    ck, pos, neg = _checkpoint_and_prompts(add, ckpt)
    cp, cn_ = [pos, 0], [neg, 0]
    model = [ck, 0]
    for i, net in enumerate(nets):
        loader = [add("ControlNetLoader", control_net_name=net), 0]
        if memory_pool:
            node = add(
                "CNA_ControlNetMemoryPool",
                pool_title,
                model=model,
                control_net=loader,
                **{**dataclasses.asdict(PoolOptions()), "offload_idle_models": True} | (pool or {}),
            )
            model, loader = [node, 0], [node, 1]
        if feature_cache:
            loader = [
                add(
                    "CNA_ControlNetFeatureCache",
                    "ControlNet Feature Cache (mode off = exact result)",
                    control_net=loader,
                    **dataclasses.asdict(CacheConfig()),  # the node's defaults
                ),
                0,
            ]
        img = add("LoadImage", f"Control image {i + 1} (edge map / depth map)", image="example.png")
        ap = add(
            "CNA_ControlNetApplyFused",
            positive=cp,
            negative=cn_,
            control_net=loader,
            image=[img, 0],
            strength=0.9 if i == 0 else 0.6,
            start_percent=0.0,
            end_percent=1.0 if i == 0 else 0.8,
        )
        cp, cn_ = [ap, 0], [ap, 1]
    lat = add("EmptyLatentImage", width=size, height=size, batch_size=1)
    common = dict(
        seed=42,
        steps=25,
        cfg=7.0,
        sampler_name="dpmpp_2m",
        scheduler="karras",
        positive=cp,
        negative=cn_,
        latent_image=[lat, 0],
        denoise=1.0,
    )
    if ksampler_graph:
        ks = add(
            "CNA_KSamplerCUDAGraph", model=model, enabled=True, max_graphs=8, verify=False, **common
        )
    else:
        g = add("CNA_CUDAGraph", model=model, enabled=True, max_graphs=8, verify=False)
        ks = add("KSampler", model=[g, 0], **common)
    dec = add("VAEDecode", samples=[ks, 0], vae=[ck, 2])
    add("SaveImage", images=[dec, 0], filename_prefix="controlnet_accelerated")
    return p, titles


def _side_by_side(ckpt: str, net: str, size: int) -> tuple[dict, dict]:
    """One prompt, one seed, two branches: stock *Apply ControlNet* + *KSampler (CUDA Graph)*
    with graphs off (it samples exactly as KSampler; its badge times the run), and the
    accelerated branch (*Apply ControlNet (Fused)* + graphs on). Both badges show ms/step."""
    p, titles, add = _builder()
    ck, pos, neg = _checkpoint_and_prompts(add, ckpt)
    loader = add("ControlNetLoader", control_net_name=net)
    img = add("LoadImage", "Control image (edge map)", image="example.png")
    lat = add("EmptyLatentImage", width=size, height=size, batch_size=1)
    apply = dict(
        positive=[pos, 0],
        negative=[neg, 0],
        control_net=[loader, 0],
        image=[img, 0],
        strength=0.9,
        start_percent=0.0,
        end_percent=1.0,
    )
    stock_ap = add("ControlNetApplyAdvanced", "Stock: Apply ControlNet", **apply)
    fast_ap = add("CNA_ControlNetApplyFused", "Accelerated: Apply ControlNet (Fused)", **apply)
    common = dict(seed=42, steps=25, cfg=7.0, sampler_name="dpmpp_2m", scheduler="karras")
    common.update(latent_image=[lat, 0], denoise=1.0, max_graphs=8, verify=False)
    for title, ap, on, prefix in (
        ("Stock: KSampler (graphs off, timing only)", stock_ap, False, "stock"),
        ("Accelerated: KSampler (CUDA Graph)", fast_ap, True, "accelerated"),
    ):
        ks = add(
            "CNA_KSamplerCUDAGraph",
            title,
            model=[ck, 0],
            positive=[ap, 0],
            negative=[ap, 1],
            enabled=on,
            **common,
        )
        dec = add("VAEDecode", samples=[ks, 0], vae=[ck, 2])
        add("SaveImage", images=[dec, 0], filename_prefix=f"controlnet_{prefix}")
    return p, titles


EXAMPLES = {
    "controlnet_sd15_cuda_graph": lambda: _graph(SD15_CKPT, [SD15_CANNY], 512, False),
    "controlnet_sdxl_two_nets_ksampler_cuda_graph": lambda: _graph(
        SDXL_CKPT, [SDXL_CANNY, SDXL_DEPTH], 1024, True
    ),
    "controlnet_sdxl_feature_cache_cuda_graph": lambda: _graph(
        SDXL_CKPT, [SDXL_CANNY], 1024, False, feature_cache=True
    ),
    # stock and accelerated side by side, same seed, both timed
    "controlnet_sd15_stock_vs_accelerated": lambda: _side_by_side(SD15_CKPT, SD15_CANNY, 512),
    # short of VRAM: UNet INT8, both ControlNets streamed from system RAM (39% of stock's peak
    # VRAM at SD1.5 with two nets on the H200; slower: the nets' weights cross PCIe every step)
    "controlnet_sdxl_two_nets_low_vram": lambda: _graph(
        SDXL_CKPT,
        [SDXL_CANNY, SDXL_DEPTH],
        1024,
        False,
        memory_pool=True,
        pool={"controlnet_weights": "stream"},
        pool_title="ControlNet Memory Pool (ControlNet streamed from RAM: least VRAM, slower)",
    ),
    # all four techniques on one ControlNet
    "controlnet_sd15_all_techniques": lambda: _graph(
        SD15_CKPT, [SD15_CANNY], 512, False, feature_cache=True, memory_pool=True
    ),
}


def write_examples(folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for name, build in EXAMPLES.items():
        prompt, titles = build()
        ui = ui_workflow.api_to_ui(prompt, titles)
        path = folder / f"{name}.json"
        path.write_text(json.dumps(ui, indent=1) + "\n")
        out.append(path)
    return out
