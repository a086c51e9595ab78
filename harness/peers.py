# SPDX-License-Identifier: GPL-3.0-or-later
"""The benchmark's peer: diffusers' ControlNet pipeline on the very weights, seed, prompts, hint
images, sampler and sigmas of the stock ComfyUI workflow, in the same process.

Why: a speed-up over stock ComfyUI says little on its own; the same job in the other common
runtime gives the reference a reader asks for. So the peer has to do the same arithmetic as
stock, not merely something similar, and its output latent is compared with stock's (a latent
PSNR) to show that it does.

How it matches stock
- Models: diffusers' ``UNet2DConditionModel`` / ``ControlNetModel`` / ``AutoencoderKL`` and
  transformers' CLIP text models, built from configs derived here from the pack's specs
  (``random_models.ARCH_UNETS``), with the weights of the generated single-file checkpoints
  converted by diffusers' own single-file conversion functions. Nothing is downloaded: the
  tokenizer files are the ones ComfyUI ships (``comfy/sd1_tokenizer``).
- Text: encoded once when the peer is built (ComfyUI caches its text encodes between prompts),
  by the pipeline's own ``encode_prompt`` with the text encoder in float32 as ComfyUI computes
  CLIP; ComfyUI pads CLIP-L with the end token and SDXL's OpenCLIP with token 0, and so do the
  tokenizers here. SDXL's size conditioning is what ComfyUI gives a plain text encode at
  sampling time: original and target size the image's, no crop (diffusers' default too, passed
  explicitly).
- Sampling: Euler on ComfyUI's sigmas (``normal_sigmas`` computes its "normal" schedule; a
  caller may pass ComfyUI's own), with the UNet and the ControlNets given ComfyUI's timestep for
  each sigma (the nearest of the 1000 training steps, where diffusers would interpolate a
  fractional one), the initial noise drawn as ComfyUI draws it (``torch.randn`` on a CPU
  generator seeded with the seed) and scaled as ComfyUI scales it at full denoise
  (``sqrt(1 + sigma_max^2)``), classifier-free guidance at the workload's cfg, each ControlNet
  at the workload's strength on both conditionings.
- Output: the final latent divided by the VAE's scaling factor, the space of ComfyUI's KSampler
  output, without a decode.

What is left is diffusers' own arithmetic: the order of floating-point operations, and on a GPU
at half precision, that diffusers keeps the latent in the model's dtype between steps where
ComfyUI keeps it in float32.

diffusers is a benchmark-only dependency, never one of the pack's: it is imported lazily and a
missing install is reported with the command that adds it (``PIP_INSTALL``).
"""

from __future__ import annotations

import contextlib
import gc
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..logger import logger
from . import random_models
from .comfy_host import PACK_ROOT
from .workflows import NEGATIVE, POSITIVE, WORKLOADS, Workload, hint_image

DIFFUSERS_VERSION = "0.42.1"
PIP_INSTALL = f"python3 -m pip install --no-deps diffusers=={DIFFUSERS_VERSION}"

# torch.compile's modes; None compiles nothing.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")

# The latent scaling of each family's VAE (ComfyUI's latent formats use the same numbers).
LATENT_SCALE = {"SD15": 0.18215, "SDXL": 0.13025}

# SD1.5 and SDXL share the discrete schedule they were trained on: 1000 steps, betas linear in
# sqrt(beta) from 0.00085 to 0.012 (ComfyUI's "linear", diffusers' "scaled_linear").
TRAIN_STEPS = 1000
BETA_START = 0.00085
BETA_END = 0.012

# CLIP text encoders of the two families (transformers' CLIPTextConfig fields). CLIP-L is
# SD1.5's encoder and SDXL's first; OpenCLIP bigG is SDXL's second, with its projection.
CLIP_L = {
    "vocab_size": 49408,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "projection_dim": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "max_position_embeddings": 77,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
    "bos_token_id": 49406,
    "eos_token_id": 49407,
    "pad_token_id": 49407,
}
CLIP_G = {
    **CLIP_L,
    "hidden_size": 1280,
    "intermediate_size": 5120,
    "projection_dim": 1280,
    "num_hidden_layers": 32,
    "num_attention_heads": 20,
    "hidden_act": "gelu",
    "pad_token_id": 0,
}
# ComfyUI's SD VAE (the one random_models writes): 4 levels of 128·(1, 2, 4, 4), 2 blocks each.
VAE_CHANNELS = (128, 256, 512, 512)


class PeerUnavailable(ImportError):
    """The peer cannot run here: diffusers (or what it needs) is not installed."""


@dataclass
class PeerResult:
    """One run of the peer, comparable field by field with ``runner.RunResult``."""

    latent: torch.Tensor  # the final latent in KSampler-output space, float32 on the CPU
    step_ms: list[float]  # between consecutive steps' ends (as runner times them), first left out
    wall_s: float  # the whole pipeline call, host clock
    compile_s: float | None = None  # the first (compiling) run's wall time; None uncompiled
    extra: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# diffusers, imported lazily


@contextlib.contextmanager
def _pack_root_off_path():
    """transformers probes optional packages by name (``kernels`` among them) and imports one it
    finds without metadata; the pack's own ``kernels/`` folder would be found wherever the
    repository root is on ``sys.path`` (``python -m pytest`` from the root puts it there) and
    fail to import as a top-level package. The root leaves ``sys.path`` while diffusers and
    transformers import, as ``benchmark.py`` keeps it off for good."""
    saved = list(sys.path)
    root = PACK_ROOT.resolve()

    def is_root(entry: str) -> bool:
        try:
            return Path(entry or ".").resolve() == root
        except OSError:
            return False

    sys.path[:] = [p for p in sys.path if not is_root(p)]
    try:
        yield
    finally:
        sys.path[:] = saved


def require_diffusers():
    """The ``diffusers`` module, or ``PeerUnavailable`` saying how to install it."""
    try:
        with _pack_root_off_path():
            import diffusers
            import transformers  # noqa: F401  (diffusers' pipelines need it)

            # the submodules used below, imported now while the path is clean
            from diffusers import (  # noqa: F401
                AutoencoderKL,
                ControlNetModel,
                EulerDiscreteScheduler,
                MultiControlNetModel,
                StableDiffusionControlNetPipeline,
                StableDiffusionXLControlNetPipeline,
                UNet2DConditionModel,
            )
            from diffusers.loaders import single_file_utils  # noqa: F401
            from transformers import (  # noqa: F401
                CLIPTextConfig,
                CLIPTextModel,
                CLIPTextModelWithProjection,
                CLIPTokenizer,
            )
    except ImportError as e:
        raise PeerUnavailable(
            f"the diffusers peer needs diffusers {DIFFUSERS_VERSION} (a benchmark-only "
            f"dependency, not the pack's), which does not import here ({e}); install it with: "
            f"{PIP_INSTALL}"
        ) from e
    version = getattr(diffusers, "__version__", "?")
    if version != DIFFUSERS_VERSION:
        logger.info(
            "diffusers %s found; the peer is written against %s", version, DIFFUSERS_VERSION
        )
    return diffusers


def check_compile_mode(mode: str | None) -> str | None:
    """``mode`` if torch.compile knows it (or None: no compile), else a ValueError naming them."""
    if mode is None or mode in COMPILE_MODES:
        return mode
    raise ValueError(
        f"unknown compile mode {mode!r}: use None (no compile) or one of "
        + ", ".join(repr(m) for m in COMPILE_MODES)
    )


# ---------------------------------------------------------------------------------------------
# Configs, derived from the pack's specs


def _levels(arch: str) -> list[dict]:
    """Per resolution level of a UNet spec: channels, blocks, transformer depth down and up."""
    u = random_models.ARCH_UNETS[arch]
    nres = list(u["num_res_blocks"])
    if len(set(nres)) != 1:
        raise NotImplementedError(f"{arch}: diffusers' UNet needs one block count per level")
    n = nres[0]
    depth_down = list(u["transformer_depth"])
    depth_up = list(u["transformer_depth_output"])
    out = []
    for i, mult in enumerate(u["channel_mult"]):
        # both lists run from the first level (ComfyUI's output blocks take theirs from the end)
        down = depth_down[i * n : (i + 1) * n]
        up = depth_up[i * (n + 1) : (i + 1) * (n + 1)]
        if len(set(down)) != 1 or len(set(up)) != 1:
            raise NotImplementedError(f"{arch}: transformer depth varies inside level {i}")
        out.append(
            {
                "channels": u["model_channels"] * mult,
                "blocks": n,
                "depth": down[0],
                "depth_up": up[0],
            }
        )
    return out


def unet_config(arch: str) -> dict:
    """diffusers' UNet2DConditionModel config for a ``random_models.ARCH_UNETS`` spec."""
    u = random_models.ARCH_UNETS[arch]
    levels = _levels(arch)
    if u.get("num_head_channels", -1) not in (-1, None) and "num_heads" not in u:
        heads = [lv["channels"] // u["num_head_channels"] for lv in levels]
    else:
        heads = u["num_heads"]
    if u["transformer_depth_middle"] != levels[-1]["depth"] and levels[-1]["depth"] > 0:
        raise NotImplementedError(f"{arch}: middle depth differs from the deepest level's")
    depth = [lv["depth"] or 1 for lv in levels]  # a level without attention ignores it
    if levels[-1]["depth"] == 0:
        depth[-1] = u["transformer_depth_middle"]  # diffusers' middle block takes the last
    cfg = {
        "sample_size": u["image_size"],
        "in_channels": u["in_channels"],
        "out_channels": u["out_channels"],
        "down_block_types": [
            "CrossAttnDownBlock2D" if lv["depth"] else "DownBlock2D" for lv in levels
        ],
        "up_block_types": [
            "CrossAttnUpBlock2D" if lv["depth_up"] else "UpBlock2D" for lv in reversed(levels)
        ],
        "block_out_channels": [lv["channels"] for lv in levels],
        "layers_per_block": levels[0]["blocks"],
        "cross_attention_dim": u["context_dim"],
        "attention_head_dim": heads,
        "use_linear_projection": bool(u["use_linear_in_transformer"]),
        "transformer_layers_per_block": depth,
    }
    up_depth = [lv["depth_up"] or 1 for lv in reversed(levels)]
    if up_depth != depth[::-1]:
        cfg["reverse_transformer_layers_per_block"] = up_depth
    if u.get("adm_in_channels"):  # SDXL: pooled text + size embeddings
        cfg["addition_embed_type"] = "text_time"
        cfg["addition_time_embed_dim"] = 256
        cfg["projection_class_embeddings_input_dim"] = u["adm_in_channels"]
    return cfg


def controlnet_config(arch: str) -> dict:
    """diffusers' ControlNetModel config: the UNet's encoder half, with an RGB hint."""
    u = unet_config(arch)
    keep = (
        "in_channels",
        "down_block_types",
        "block_out_channels",
        "layers_per_block",
        "cross_attention_dim",
        "attention_head_dim",
        "use_linear_projection",
        "transformer_layers_per_block",
        "addition_embed_type",
        "addition_time_embed_dim",
        "projection_class_embeddings_input_dim",
    )
    cfg = {k: u[k] for k in keep if k in u}
    cfg["conditioning_channels"] = 3
    return cfg


def vae_config(family: str) -> dict:
    return {
        "in_channels": 3,
        "out_channels": 3,
        "down_block_types": ["DownEncoderBlock2D"] * len(VAE_CHANNELS),
        "up_block_types": ["UpDecoderBlock2D"] * len(VAE_CHANNELS),
        "block_out_channels": list(VAE_CHANNELS),
        "layers_per_block": 2,
        "latent_channels": 4,
        "sample_size": 512 if family == "SD15" else 1024,
        "scaling_factor": LATENT_SCALE[family],
    }


# ---------------------------------------------------------------------------------------------
# ComfyUI's sampling schedule, computed the way ComfyUI computes it


def _schedule() -> tuple[torch.Tensor, torch.Tensor]:
    """The 1000 training sigmas and their logs, float32, from betas and cumulative alphas in
    float64: ComfyUI's discrete schedule for these models."""
    betas = torch.linspace(BETA_START**0.5, BETA_END**0.5, TRAIN_STEPS, dtype=torch.float64) ** 2
    alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
    sigmas = ((1 - alphas_cumprod) / alphas_cumprod) ** 0.5
    return sigmas.float(), sigmas.log().float()


def discrete_sigmas() -> torch.Tensor:
    """The 1000 training sigmas, float32, lowest first."""
    return _schedule()[0]


def comfy_timesteps(sigmas: torch.Tensor) -> torch.Tensor:
    """ComfyUI's timestep for each sigma: the index of the nearest training sigma in log space
    (diffusers interpolates a fractional one), as float32 for the models' time embedding."""
    log_sigmas = _schedule()[1]
    dists = sigmas.float().log()[None, :] - log_sigmas[:, None]
    return dists.abs().argmin(dim=0).float()


def normal_sigmas(steps: int) -> torch.Tensor:
    """ComfyUI's "normal" schedule for the discrete EPS models: ``steps`` timesteps spaced
    evenly from the last training step to the first, each sigma interpolated in log space
    between the neighbouring training sigmas, and a final 0; float32, ``steps + 1`` values."""
    sig, log_sigmas = _schedule()
    start = comfy_timesteps(sig[-1:]).long()[0]
    end = comfy_timesteps(sig[:1]).long()[0]
    ts = torch.linspace(start, end, steps)
    t = ts.float().clamp(0, TRAIN_STEPS - 1)
    low, high, w = t.floor().long(), t.ceil().long(), t.frac()
    out = ((1 - w) * log_sigmas[low] + w * log_sigmas[high]).exp()
    return torch.cat([out, torch.zeros(1)]).float()


def comfy_sigmas(workload: Workload | str) -> torch.Tensor:
    """The sigmas stock ComfyUI samples the workload with, from ComfyUI's own model sampling
    and scheduler (ComfyUI must be started: ``comfy_host.bootstrap``)."""
    import comfy.model_base
    import comfy.samplers

    wl = _workload(workload)
    mc = random_models._model_config(random_models.SPECS[wl.checkpoint].arch)
    ms = comfy.model_base.model_sampling(mc, comfy.model_base.ModelType.EPS)
    return comfy.samplers.calculate_sigmas(ms, wl.scheduler, wl.steps).float().cpu()


def initial_noise(seed: int, shape: Sequence[int]) -> torch.Tensor:
    """ComfyUI's initial noise for an empty latent: float32 ``torch.randn`` on the CPU from a
    generator seeded with ``seed``."""
    g = torch.Generator(device="cpu").manual_seed(int(seed))
    return torch.randn(tuple(shape), generator=g, dtype=torch.float32, device="cpu")


def max_denoise(first_sigma: float) -> bool:
    """ComfyUI's test for a full denoise: the schedule starts at (or above) the model's largest
    sigma; the noise is then scaled by ``sqrt(1 + sigma^2)``, else by ``sigma``."""
    top = float(discrete_sigmas()[-1])
    return math.isclose(top, first_sigma, rel_tol=1e-05) or first_sigma > top


def _comfy_euler_class(diffusers):
    """EulerDiscreteScheduler with ComfyUI's two rules where diffusers' differ: the timestep of
    a sigma (nearest training step, not interpolated) and the initial noise scale at full
    denoise (``sqrt(1 + sigma^2)`` whatever the timestep spacing)."""

    base = diffusers.EulerDiscreteScheduler

    class ComfyEulerScheduler(base):
        def set_timesteps(self, num_inference_steps=None, device=None, timesteps=None, sigmas=None):
            super().set_timesteps(
                num_inference_steps=num_inference_steps,
                device=device,
                timesteps=timesteps,
                sigmas=sigmas,
            )
            self.timesteps = comfy_timesteps(self.sigmas[:-1]).to(self.timesteps.device)
            self.set_begin_index(0)

        @property
        def init_noise_sigma(self):
            s0 = self.sigmas[0].float()
            if max_denoise(float(s0)):
                return torch.sqrt(1.0 + s0**2.0)
            return s0

    return ComfyEulerScheduler


# ---------------------------------------------------------------------------------------------
# Building the models from the generated files


def _read(path: Path | dict, prefix: str) -> dict[str, torch.Tensor]:
    """The tensors of a single-file checkpoint (a path, or its state dict) whose keys start
    with ``prefix``."""
    if isinstance(path, dict):
        return {k: v for k, v in path.items() if k.startswith(prefix)}
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}


def _name(path: Path | dict) -> str:
    return path.name if isinstance(path, Path) else "a state dict"


def _load(model: torch.nn.Module, sd: dict, what: str, ignore: tuple[str, ...] = ()):
    """Load converted weights into a model built on the meta device, taking the tensors as they
    are (the file's dtype: the caller casts). Every parameter must come from the file: a random
    or missing tensor would make the comparison with stock meaningless. Shapes are checked by
    ``load_state_dict``, also for tensors on the meta device (``layout_check``)."""
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    unexpected = [k for k in unexpected if not k.endswith(ignore)]
    if missing or unexpected:
        raise RuntimeError(
            f"{what}: the converted weights do not fit diffusers' model: "
            f"missing {missing[:5]} ({len(missing)}), unexpected {unexpected[:5]} "
            f"({len(unexpected)})"
        )
    emb = getattr(getattr(model, "text_model", model), "embeddings", None)
    ids = getattr(emb, "position_ids", None)
    if ids is not None and ids.is_meta and not emb.position_embedding.weight.is_meta:
        # CLIP's position ids are a non-persistent buffer: no file holds them
        n = emb.position_embedding.weight.shape[0]
        emb.register_buffer(
            "position_ids", torch.arange(n).expand((1, -1)).clone(), persistent=False
        )
    real = not any(t.is_meta for t in sd.values())
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if real and meta:
        raise RuntimeError(f"{what}: tensors left without a value: {meta[:5]}")
    model.requires_grad_(False)
    return model.eval()


def _on_meta(factory):
    with torch.device("meta"):
        return factory()


def _tokenizer_dir() -> Path:
    """ComfyUI's CLIP tokenizer files (vocab and merges of CLIP-L, also OpenCLIP's)."""
    comfy = sys.modules.get("comfy")
    if comfy is not None and getattr(comfy, "__file__", None):
        root = Path(comfy.__file__).resolve().parent
    else:
        from .comfy_host import find_comfyui

        root = find_comfyui() / "comfy"
    path = root / "sd1_tokenizer"
    if not (path / "vocab.json").is_file():
        raise FileNotFoundError(f"ComfyUI's CLIP tokenizer files are not at {path}")
    return path


def _tokenizer(pad_token: str):
    from transformers import CLIPTokenizer

    return CLIPTokenizer.from_pretrained(
        str(_tokenizer_dir()), local_files_only=True, model_max_length=77, pad_token=pad_token
    )


def _build_unet(diffusers, arch: str, ckpt: Path | dict):
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    cfg = unet_config(arch)
    sd = convert_ldm_unet_checkpoint(_read(ckpt, "model.diffusion_model."), cfg)
    model = _on_meta(lambda: diffusers.UNet2DConditionModel(**cfg))
    return _load(model, sd, f"UNet of {_name(ckpt)}")


def controlnet_weights(ldm: dict, cfg: dict) -> dict:
    """A ControlNet file's tensors (``control_model.*``) in diffusers' names."""
    from diffusers.loaders.single_file_utils import (
        DIFFUSERS_TO_LDM_MAPPING,
        convert_controlnet_checkpoint,
    )

    sd = convert_controlnet_checkpoint(ldm, cfg)
    if cfg.get("addition_embed_type") == "text_time":
        # SDXL's pooled-text + size embedding: diffusers' table maps it for ControlNets too,
        # but convert_controlnet_checkpoint (0.42.1) leaves it out
        for new, old in DIFFUSERS_TO_LDM_MAPPING["controlnet"]["addition_embed_type"].items():
            sd[new] = ldm["control_model." + old]
    return sd


def _build_controlnet(diffusers, arch: str, path: Path | dict):
    cfg = controlnet_config(arch)
    sd = controlnet_weights(_read(path, "control_model."), cfg)
    model = _on_meta(lambda: diffusers.ControlNetModel(**cfg))
    return _load(model, sd, f"ControlNet {_name(path)}")


def _build_vae(diffusers, family: str, ckpt: Path | dict):
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    cfg = vae_config(family)
    sd = convert_ldm_vae_checkpoint(_read(ckpt, "first_stage_model."), cfg)
    model = _on_meta(lambda: diffusers.AutoencoderKL(**cfg))
    return _load(model, sd, f"VAE of {_name(ckpt)}")


def _strip_wrapper(model, sd: dict) -> dict:
    """transformers flattened CLIPTextModel (no ``text_model.`` level) in 5.6; the conversion
    writes that level: drop it where the model has none."""
    if hasattr(model, "text_model"):
        return sd
    return {k.removeprefix("text_model."): v for k, v in sd.items()}


def _build_clip_l(ckpt: Path | dict, prefix: str):
    from diffusers.loaders.single_file_utils import convert_ldm_clip_checkpoint
    from transformers import CLIPTextConfig, CLIPTextModel

    model = _on_meta(lambda: CLIPTextModel(CLIPTextConfig(**CLIP_L)))
    sd = convert_ldm_clip_checkpoint(_read(ckpt, prefix), remove_prefix=prefix)
    return _load(
        model,
        _strip_wrapper(model, sd),
        f"CLIP-L of {_name(ckpt)}",
        ignore=("text_projection.weight", "logit_scale", "position_ids"),
    )


def _build_clip_g(ckpt: Path | dict, prefix: str):
    from diffusers.loaders.single_file_utils import convert_open_clip_checkpoint
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    model = _on_meta(lambda: CLIPTextModelWithProjection(CLIPTextConfig(**CLIP_G)))
    sd = convert_open_clip_checkpoint(model, _read(ckpt, prefix), prefix=prefix)
    return _load(
        model,
        _strip_wrapper(model, sd),
        f"OpenCLIP-G of {_name(ckpt)}",
        ignore=("logit_scale", "position_ids"),
    )


# The checkpoint prefixes of each family's text encoders (ComfyUI's saved layout).
CLIP_PREFIXES = {
    "SD15": {"clip_l": "cond_stage_model.transformer."},
    "SDXL": {
        "clip_l": "conditioner.embedders.0.transformer.",
        "clip_g": "conditioner.embedders.1.model.",
    },
}


def _build_models(diffusers, arch: str, ckpt, controlnets: list, vae: bool) -> dict:
    """Every network of the peer from a checkpoint and ControlNet files (paths or dicts)."""
    family = random_models.ARCH_FAMILY[arch]
    out = {
        "unet": _build_unet(diffusers, arch, ckpt),
        "controlnets": [_build_controlnet(diffusers, arch, c) for c in controlnets],
        "vae": _build_vae(diffusers, family, ckpt) if vae else None,
    }
    prefixes = CLIP_PREFIXES[family]
    out["text_encoder"] = _build_clip_l(ckpt, prefixes["clip_l"])
    if "clip_g" in prefixes:
        out["text_encoder_2"] = _build_clip_g(ckpt, prefixes["clip_g"])
    return out


def layout_check(arch: str) -> dict[str, int]:
    """Build the peer's networks for an architecture from the shapes of the files the pack
    writes (``random_models.build_state_dict(meta=True)``: nothing drawn, nothing allocated),
    so that a config or conversion that does not fit is found without a GPU or the memory of
    the real weights. Returns each network's parameter count."""
    diffusers = require_diffusers()
    names = [s.name for s in random_models.SPECS.values() if s.arch == arch]
    ckpt = next(n for n in names if random_models.SPECS[n].kind == "checkpoint")
    cn = next(n for n in names if random_models.SPECS[n].kind == "controlnet")
    models = _build_models(
        diffusers,
        arch,
        random_models.build_state_dict(random_models.SPECS[ckpt], meta=True),
        [random_models.build_state_dict(random_models.SPECS[cn], meta=True)],
        vae=True,
    )
    models["controlnet"] = models.pop("controlnets")[0]
    return {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()}


# ---------------------------------------------------------------------------------------------
# The peer


def _workload(workload: Workload | str) -> Workload:
    return WORKLOADS[workload] if isinstance(workload, str) else workload


def _dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    return getattr(torch, str(dtype).removeprefix("torch."))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class DiffusersPeer:
    """A built pipeline for one workload; ``run(seed)`` samples it as stock ComfyUI would."""

    def __init__(
        self, wl: Workload, pipe, family: str, device, dtype, compile_mode, embeds, progress=None
    ):
        self.workload = wl
        self.progress = progress
        self.pipe = pipe
        self.family = family
        self.device = torch.device(device)
        self.dtype = dtype
        self.compile_mode = compile_mode
        self.compile_s: float | None = None
        self._embeds = embeds
        self._hints = [
            _pil(hint_image(wl.width, wl.height, i % 2)) for i in range(len(wl.controlnets))
        ]
        self._runs = 0

    def latent_shape(self) -> tuple[int, ...]:
        return (self.workload.batch_size, 4, self.workload.height // 8, self.workload.width // 8)

    def run(self, seed: int, sigmas: Sequence[float] | torch.Tensor | None = None) -> PeerResult:
        """Sample the workload from ``seed``. ``sigmas``: the schedule with its final 0
        (``comfy_sigmas``), else ComfyUI's "normal" schedule computed here. The first run of
        a compiled peer compiles; its wall time is ``compile_s``."""
        if self.pipe is None:
            raise RuntimeError("the peer is closed")
        wl = self.workload
        if wl.sampler != "euler":
            raise NotImplementedError(f"the peer samples with euler only, not {wl.sampler!r}")
        if sigmas is None:
            if wl.scheduler != "normal":
                raise NotImplementedError(
                    f"scheduler {wl.scheduler!r}: pass ComfyUI's sigmas (comfy_sigmas)"
                )
            sigmas = normal_sigmas(wl.steps)
        sig = [float(s) for s in (sigmas.tolist() if torch.is_tensor(sigmas) else sigmas)]
        noise = initial_noise(seed, self.latent_shape()).to(self.device, self.dtype)
        # the pipeline scales the latents it is given by init_noise_sigma (ComfyUI's scale)

        graphs = self.compile_mode in _CUDAGRAPH_MODES and self.device.type == "cuda"
        cuda = self.device.type == "cuda"
        marks: list = []

        def on_step(pipe, i, t, kwargs):
            # timed as harness.runner times ComfyUI's steps: a CUDA event at each step's end on
            # a GPU (no synchronize, so the host may run ahead as it does in use), the host
            # clock on the CPU
            if cuda:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                marks.append(ev)
            else:
                marks.append(time.perf_counter())
            if graphs:  # the next step's graphs may overwrite this step's outputs
                torch.compiler.cudagraph_mark_step_begin()
            return {}

        first_compile = self.compile_mode is not None and self._runs == 0
        if first_compile and self.progress is not None:
            self.progress(f"peer {wl.id}: compiling ({self.compile_mode}) in the first run")
        n = len(wl.controlnets)
        kwargs = {}
        if self.family == "SDXL":
            kwargs = {
                "pooled_prompt_embeds": self._embeds["pooled"],
                "negative_pooled_prompt_embeds": self._embeds["negative_pooled"],
                # ComfyUI's sampler sets width/height (and so the target size) to the
                # latent's size times 8 where the conditioning names none
                "original_size": (wl.height, wl.width),
                "target_size": (wl.height, wl.width),
                "crops_coords_top_left": (0, 0),
            }
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        _synchronize(self.device)
        t0 = time.perf_counter()
        out = self.pipe(
            prompt_embeds=self._embeds["positive"],
            negative_prompt_embeds=self._embeds["negative"],
            image=self._hints if n > 1 else self._hints[0],
            height=wl.height,
            width=wl.width,
            sigmas=sig,
            guidance_scale=wl.cfg,
            latents=noise,
            output_type="latent",
            controlnet_conditioning_scale=[wl.strength] * n if n > 1 else wl.strength,
            control_guidance_start=[wl.start_percent] * n if n > 1 else wl.start_percent,
            control_guidance_end=[wl.end_percent] * n if n > 1 else wl.end_percent,
            callback_on_step_end=on_step,
            return_dict=False,
            **kwargs,
        )
        _synchronize(self.device)
        wall = time.perf_counter() - t0
        self._runs += 1
        if first_compile:
            self.compile_s = wall
        scale = LATENT_SCALE[self.family]
        latent = (out[0].float() / scale).cpu()
        pairs = zip(marks, marks[1:], strict=False)
        step_ms = [a.elapsed_time(b) if cuda else (b - a) * 1e3 for a, b in pairs]
        return PeerResult(latent, step_ms, wall, self.compile_s)

    def close(self) -> None:
        """Drop the pipeline and its models and hand the freed device memory back."""
        self.pipe = None
        self._embeds = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _pil(arr):
    from PIL import Image

    return Image.fromarray(arr)


def build_peer(
    workload: Workload | str,
    models_dir: Path | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    compile_mode: str | None = None,
    progress: Callable[[str], None] | None = None,
    *,
    vae: bool = False,
) -> DiffusersPeer:
    """diffusers' ControlNet pipeline for ``workload`` on its generated models.

    device: default CUDA where available, else the CPU. dtype: default float16 on CUDA and
    float32 on the CPU (ComfyUI's choice for these models). compile_mode: None, or a
    torch.compile mode for the UNet and the ControlNets (not the text encoders); the first
    ``run`` compiles. vae: also build the VAE (the peer never decodes; off by default so the
    peer holds what stock holds while it samples). progress(msg) is told what is being done.
    """
    compile_mode = check_compile_mode(compile_mode)
    wl = _workload(workload)
    diffusers = require_diffusers()
    say = progress or (lambda msg: None)
    spec = random_models.SPECS[wl.checkpoint]
    family = random_models.ARCH_FAMILY[spec.arch]
    if not wl.controlnets:
        raise NotImplementedError(f"{wl.id}: the peer is a ControlNet pipeline; it needs one")
    if wl.batch_size != 1:
        raise NotImplementedError(f"{wl.id}: the peer runs batch 1 only")
    if (wl.start_percent, wl.end_percent) != (0.0, 1.0):
        # diffusers switches a ControlNet by the fraction of steps done, ComfyUI by sigma
        raise NotImplementedError(
            f"{wl.id}: the peer applies ControlNets over the whole schedule (start 0, end 1) "
            "only; diffusers and ComfyUI turn a partial range into different steps"
        )
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = _dtype(dtype or (torch.float16 if device.type == "cuda" else torch.float32))

    paths = random_models.ensure_models(wl.models(), models_dir)
    ckpt = paths[wl.checkpoint]
    t0 = time.perf_counter()
    say(f"peer {wl.id}: building diffusers' pipeline from {ckpt.name}")
    models = _build_models(diffusers, spec.arch, ckpt, [paths[c] for c in wl.controlnets], vae=vae)
    nets = models["controlnets"]
    scheduler = _comfy_euler_class(diffusers)(
        num_train_timesteps=TRAIN_STEPS,
        beta_start=BETA_START,
        beta_end=BETA_END,
        beta_schedule="scaled_linear",
        prediction_type="epsilon",
    )
    common = {
        "vae": models["vae"],
        "text_encoder": models["text_encoder"],
        "tokenizer": _tokenizer("<|endoftext|>"),  # ComfyUI pads CLIP-L with its end token
        "unet": models["unet"],
        "controlnet": diffusers.MultiControlNetModel(nets) if len(nets) > 1 else nets[0],
        "scheduler": scheduler,
    }
    if family == "SD15":
        pipe = diffusers.StableDiffusionControlNetPipeline(
            **common, safety_checker=None, feature_extractor=None, requires_safety_checker=False
        )
    elif family == "SDXL":
        pipe = diffusers.StableDiffusionXLControlNetPipeline(
            **common,
            text_encoder_2=models["text_encoder_2"],
            tokenizer_2=_tokenizer("!"),  # and OpenCLIP with token 0
            add_watermarker=False,
        )
    else:
        raise NotImplementedError(f"no peer for the {family} family")
    pipe.set_progress_bar_config(disable=True)

    # The prompts, encoded once in float32 on the target device (ComfyUI computes CLIP in
    # float32 and caches the encode), then every model in the run's dtype.
    encoders = [m for m in (pipe.text_encoder, getattr(pipe, "text_encoder_2", None)) if m]
    for m in encoders:
        m.to(device=device, dtype=torch.float32)
    embeds = _encode(pipe, family, device)
    embeds = {k: v.to(dtype) for k, v in embeds.items()}
    for m in pipe.components.values():
        if isinstance(m, torch.nn.Module):
            # nn.Module's own ``to``: diffusers' warns of float32-only modules where there are
            # none (an empty list) when a dtype is given
            torch.nn.Module.to(m, device=device, dtype=dtype)
    say(f"peer {wl.id}: built in {time.perf_counter() - t0:.1f} s ({device}, {dtype})")

    if compile_mode is not None:
        say(f"peer {wl.id}: torch.compile (mode {compile_mode}) of the UNet and ControlNets")
        pipe.unet.compile(mode=compile_mode, fullgraph=False)
        for net in nets:
            net.compile(mode=compile_mode, fullgraph=False)
    return DiffusersPeer(wl, pipe, family, device, dtype, compile_mode, embeds, progress)


@torch.no_grad()
def _encode(pipe, family: str, device) -> dict[str, torch.Tensor]:
    if family == "SDXL":
        pos, neg, pooled, neg_pooled = pipe.encode_prompt(
            prompt=POSITIVE,
            device=device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=True,
            negative_prompt=NEGATIVE,
        )
        return {"positive": pos, "negative": neg, "pooled": pooled, "negative_pooled": neg_pooled}
    pos, neg = pipe.encode_prompt(
        POSITIVE,
        device,
        1,
        True,
        negative_prompt=NEGATIVE,
    )
    return {"positive": pos, "negative": neg}
