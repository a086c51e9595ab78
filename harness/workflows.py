# SPDX-License-Identifier: GPL-3.0-or-later
"""API-format ComfyUI workflows for the tests and the benchmark, and their synthetic hint images.

The stock ControlNet workflow is: checkpoint -> two text encodes -> ControlNet loader(s) ->
Apply ControlNet (chained for several nets) -> KSampler -> (VAE decode -> preview | save latent).
Variants of a technique are the same graph plus our nodes, built by ``Workload.prompt(extra=...)``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

POSITIVE = "a photograph of a lighthouse on a cliff at sunset, highly detailed"
NEGATIVE = "blurry, low quality"


@dataclass(frozen=True)
class Workload:
    """One reference workload (docs/benchmarks.md, Workloads): model, size, ControlNets, sampler."""

    id: str
    checkpoint: str  # a harness.random_models spec name
    controlnets: tuple[str, ...]
    width: int
    height: int
    steps: int = 20
    cfg: float = 7.5
    sampler: str = "euler"
    scheduler: str = "normal"
    strength: float = 1.0
    start_percent: float = 0.0
    end_percent: float = 1.0
    batch_size: int = 1
    decode: bool = False

    def models(self) -> list[str]:
        return [self.checkpoint, *self.controlnets]

    def with_(self, **kw) -> Workload:
        return replace(self, **kw)


WORKLOADS: dict[str, Workload] = {
    w.id: w
    for w in (
        Workload("W0", "sd15", (), 512, 512),
        Workload("W1", "sd15", ("sd15-cn-a",), 512, 512),
        Workload("W2", "sd15", ("sd15-cn-a", "sd15-cn-b"), 512, 512),
        Workload("W3", "sd15", ("sd15-cn-a",), 1024, 1024),
        Workload("W4", "sdxl", ("sdxl-cn-a",), 1024, 1024),
        Workload("W5", "sdxl", ("sdxl-cn-a", "sdxl-cn-b"), 1024, 1024),
        # CPU sizes: the tiny SD1.5-layout models at 64x64 pixels (8x8 latent).
        Workload("T0", "sd15-tiny", (), 64, 64, steps=4),
        Workload("T1", "sd15-tiny", ("sd15-tiny-cn-a",), 64, 64, steps=4),
        Workload("T2", "sd15-tiny", ("sd15-tiny-cn-a", "sd15-tiny-cn-b"), 64, 64, steps=4),
    )
}


def hint_image(width: int, height: int, kind: int = 0) -> np.ndarray:
    """A deterministic synthetic hint, uint8 HxWx3: edge map (kind 0) or depth ramp (kind 1)."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    if kind == 0:
        img = np.zeros((height, width), np.float32)
        cx, cy = width * 0.5, height * 0.55
        for r in (0.12, 0.25, 0.38):
            d = np.abs(np.hypot(x - cx, y - cy) - r * min(width, height))
            img = np.maximum(img, (d < max(1.0, width / 256)).astype(np.float32))
        img = np.maximum(
            img, (np.abs(y - height * 0.8) < max(1.0, height / 256)).astype(np.float32)
        )
        img = np.maximum(
            img, (np.abs(x - 0.2 * width - 0.3 * y) < max(1.0, width / 256)).astype(np.float32)
        )
    else:
        img = 0.6 * (y / max(1, height - 1)) + 0.4 * (0.5 + 0.5 * np.sin(x / max(1, width) * 6.28))
    return (np.clip(img, 0, 1) * 255).astype(np.uint8)[..., None].repeat(3, axis=2)


def write_hint_images(input_dir: Path, wl: Workload) -> list[str]:
    """Write the workload's hint PNGs into ComfyUI's input folder; returns their file names."""
    from PIL import Image

    names = []
    for i in range(max(1, len(wl.controlnets))):
        name = f"cna_hint_{wl.width}x{wl.height}_{i % 2}.png"
        path = Path(input_dir) / name
        if not path.exists():
            Image.fromarray(hint_image(wl.width, wl.height, i % 2)).save(path)
        names.append(name)
    return names


def filename_of(spec_name: str) -> str:
    from .random_models import SPECS

    return SPECS[spec_name].filename


def build_prompt(wl: Workload, seed: int, hint_files: list[str], extra=None) -> tuple[dict, dict]:
    """The API-format prompt for a workload and its node ids. ``extra(prompt, ids)`` may add and
    rewire nodes.

    Node ids are stable across variants so ComfyUI's cache reuses the loaders and text encodes.
    ``ids`` names the nodes: ckpt, pos, neg, cn_<i>, hint_<i>, apply_<i>, latent, sampler, out.
    """
    p: dict[str, dict] = {}
    ids: dict[str, str] = {}

    def add(key: str, class_type: str, **inputs) -> str:
        nid = str(len(p) + 1)
        p[nid] = {"class_type": class_type, "inputs": inputs}
        ids[key] = nid
        return nid

    ckpt = add("ckpt", "CheckpointLoaderSimple", ckpt_name=filename_of(wl.checkpoint))
    pos = add("pos", "CLIPTextEncode", text=POSITIVE, clip=[ckpt, 1])
    neg = add("neg", "CLIPTextEncode", text=NEGATIVE, clip=[ckpt, 1])
    cond_p, cond_n = [pos, 0], [neg, 0]
    for i, cn in enumerate(wl.controlnets):
        loader = add(f"cn_{i}", "ControlNetLoader", control_net_name=filename_of(cn))
        hint = add(f"hint_{i}", "LoadImage", image=hint_files[i % len(hint_files)])
        apply = add(
            f"apply_{i}",
            "ControlNetApplyAdvanced",
            positive=cond_p,
            negative=cond_n,
            control_net=[loader, 0],
            image=[hint, 0],
            strength=wl.strength,
            start_percent=wl.start_percent,
            end_percent=wl.end_percent,
        )
        cond_p, cond_n = [apply, 0], [apply, 1]
    latent = add(
        "latent", "EmptyLatentImage", width=wl.width, height=wl.height, batch_size=wl.batch_size
    )
    sampler = add(
        "sampler",
        "KSampler",
        model=[ckpt, 0],
        seed=seed,
        steps=wl.steps,
        cfg=wl.cfg,
        sampler_name=wl.sampler,
        scheduler=wl.scheduler,
        positive=cond_p,
        negative=cond_n,
        latent_image=[latent, 0],
        denoise=1.0,
    )
    if wl.decode:
        dec = add("decode", "VAEDecode", samples=[sampler, 0], vae=[ckpt, 2])
        add("out", "PreviewImage", images=[dec, 0])
    else:
        add("out", "SaveLatent", samples=[sampler, 0], filename_prefix="cna_bench/latent")
    if extra is not None:
        extra(p, ids)
    return p, ids
