# SPDX-License-Identifier: GPL-3.0-or-later
"""Nodes of the CUDA Graph Sampler: a MODEL patch for any sampler, and a KSampler with it built in.

The logic is in ``cuda_graph.py``; these classes only declare inputs and call it.
"""

from __future__ import annotations

from comfy_api.latest import io

from ..errors import NodeInputError
from . import compat, compiled_step
from .cuda_graph import GraphOptions, apply_cuda_graph
from .fused_apply import context_width, family
from .kernel_build import build_for_if_nodes
from .status import node_id_of
from .validate import check_choices, sampler_choices, widget_errors

CATEGORY = "ControlNet Accelerator/sampling"

_ENABLE_TIP = (
    "Capture the UNet + ControlNet step in CUDA graphs and replay it every step. "
    "Off: the model is returned unchanged."
)
_MAX_TIP = (
    "How many captured graphs (one per image size, batch, ControlNet set) to keep per "
    "model; the least recently used is dropped first. Each holds the step's activation "
    "memory."
)
_VERIFY_TIP = (
    "Compare the first replay of every new graph with the eager result and run eager "
    "for that signature if they differ. Costs one extra step per capture. Off by "
    "default."
)


_CL_TIP = (
    "Hold the convolution weights in channels-last layout while sampling (saves cuDNN's "
    "layout conversions; put back after the run). Measured on an H200: 16% faster for SD1.5 "
    "at 512², 3% slower for SDXL at 1024²; results differ from stock by conv rounding only. "
    "Off by default."
)
_CC_TIP = (
    "Run the ControlNets on a second CUDA stream inside the graph, beside the UNet's input "
    "blocks (their outputs are first needed at the middle block), with or without compile. "
    "Same results; measured 3-11% faster per step on an H200, for about 2% more peak VRAM "
    "with the eager kernels and none compiled. On by default."
)
_COMPILE_TIP = (
    "Compile the UNet and ControlNets with PyTorch's inductor and capture the compiled code in "
    "the graphs (needs Triton on a GPU). The first run at a new image size or batch compiles "
    "first (1–2 minutes for SD1.5 + 1 ControlNet on an H200; the progress bar shows it); later "
    "runs and ComfyUI restarts read the compile cache on disk. Changing strength, prompt, seed or "
    "start/end never compiles again. Results differ from stock by fp16 rounding only. "
    "max-autotune benchmarks about 20 kernels per GEMM and convolution shape: its first "
    "compile took over 15 minutes for SD1.5 at 512² on an H200. Needs ComfyUI started "
    "with --disable-cuda-malloc (otherwise it stays off and says why). Off: exact stock "
    "kernels. A model from TorchCompileModel is compiled this way even when off."
)
COMPILE_CHOICES = list(compiled_step.CHOICES)

MAX_GRAPHS = (1, 64)


def _options(
    node: str,
    enabled: bool,
    max_graphs: int,
    verify: bool,
    channels_last: bool,
    concurrent: bool,
    compile: str = "off",
) -> GraphOptions:
    lo, hi = MAX_GRAPHS
    ok = isinstance(max_graphs, int) and not isinstance(max_graphs, bool)
    if not ok or not lo <= max_graphs <= hi:  # a linked value skips ComfyUI's widget check
        raise NodeInputError(
            node, "max_graphs", f"is {max_graphs!r}, outside {lo}–{hi}", f"Use {lo} to {hi}."
        )
    check_choices(node, {"compile": (compile, COMPILE_CHOICES)})
    return GraphOptions(
        enabled=enabled,
        max_graphs=max_graphs,
        verify=verify,
        channels_last=channels_last,
        concurrent_controlnet=concurrent,
        compile=compiled_step.options_for(compile),
    )


def _graph_inputs() -> list:
    return [
        io.Boolean.Input("enabled", default=True, tooltip=_ENABLE_TIP),
        io.Int.Input(
            "max_graphs",
            default=8,
            min=MAX_GRAPHS[0],
            max=MAX_GRAPHS[1],
            step=1,
            tooltip=_MAX_TIP,
        ),
        io.Boolean.Input("verify", default=False, tooltip=_VERIFY_TIP),
        io.Boolean.Input("channels_last", default=False, optional=True, tooltip=_CL_TIP),
        io.Boolean.Input("concurrent_controlnet", default=True, optional=True, tooltip=_CC_TIP),
        io.Combo.Input(
            "compile", options=COMPILE_CHOICES, default="off", optional=True, tooltip=_COMPILE_TIP
        ),
    ]


class CUDAGraphModel(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CNA_CUDAGraph",
            display_name="CUDA Graph",
            category=CATEGORY,
            description=(
                "Makes every sampler run this model's steps as CUDA graphs: the UNet and all "
                "ControlNets of a step are captured once per image size and replayed, removing "
                "thousands of kernel launches per step. Results match stock ComfyUI. Anything "
                "that cannot be captured (lowvram, per-step patches, CPU) runs as usual, with the "
                "reason in the log. Works with KSampler, KSamplerAdvanced and "
                "SamplerCustomAdvanced."
            ),
            inputs=[
                io.Model.Input("model", tooltip="The model to run with CUDA graphs."),
                *_graph_inputs(),
            ],
            outputs=[io.Model.Output(tooltip="The same model, sampling through CUDA graphs.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, compile=None):
        return widget_errors("CUDA Graph", {"compile": (compile, COMPILE_CHOICES)}) or True

    @classmethod
    def execute(
        cls,
        model,
        enabled=True,
        max_graphs=8,
        verify=False,
        channels_last=False,
        concurrent_controlnet=True,
        compile="off",
    ) -> io.NodeOutput:
        if not enabled:
            return io.NodeOutput(model)
        opts = _options(
            "CUDA Graph", enabled, max_graphs, verify, channels_last, concurrent_controlnet, compile
        )
        out = apply_cuda_graph(model, opts, node_id=node_id_of(cls))
        if _hoists(out, compile):
            build_for_if_nodes(node_id_of(cls))
        return io.NodeOutput(out)


def _hoists(model, compile: str) -> bool:
    """Whether the node's graphs (``model``: the node's output) will run the context projections
    once per context, so the IF nodes' extension is built now: not for a model DynamicVRAM
    manages (the node handed it back as it came)."""
    return compiled_step.context_hoist_on(compiled=compile != "off") and not compat.is_dynamic(
        model
    )


class KSamplerCUDAGraph(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        import comfy.samplers

        return io.Schema(
            node_id="CNA_KSamplerCUDAGraph",
            display_name="KSampler (CUDA Graph)",
            category=CATEGORY,
            description=(
                "KSampler that runs each step (UNet + ControlNets) as a replayed CUDA graph. Same "
                "inputs and same result as KSampler; falls back to normal sampling, with the "
                "reason in the log, whenever a step cannot be captured."
            ),
            inputs=[
                io.Model.Input("model", tooltip="The model used for denoising the input latent."),
                io.Int.Input(
                    "seed",
                    default=0,
                    min=0,
                    max=0xFFFFFFFFFFFFFFFF,
                    control_after_generate=True,
                    tooltip="The random seed used for creating the noise.",
                ),
                io.Int.Input(
                    "steps",
                    default=20,
                    min=1,
                    max=10000,
                    tooltip="The number of steps used in the denoising process.",
                ),
                io.Float.Input(
                    "cfg",
                    default=8.0,
                    min=0.0,
                    max=100.0,
                    step=0.1,
                    round=0.01,
                    tooltip="Classifier-free guidance scale.",
                ),
                io.Combo.Input(
                    "sampler_name",
                    options=comfy.samplers.KSampler.SAMPLERS,
                    tooltip="The sampling algorithm.",
                ),
                io.Combo.Input(
                    "scheduler",
                    options=comfy.samplers.KSampler.SCHEDULERS,
                    tooltip="The noise schedule.",
                ),
                io.Conditioning.Input("positive", tooltip="What to include in the image."),
                io.Conditioning.Input("negative", tooltip="What to exclude from the image."),
                io.Latent.Input("latent_image", tooltip="The latent image to denoise."),
                io.Float.Input(
                    "denoise",
                    default=1.0,
                    min=0.0,
                    max=1.0,
                    step=0.01,
                    tooltip="The amount of denoising applied; 1.0 for txt2img.",
                ),
                *_graph_inputs(),
            ],
            outputs=[io.Latent.Output(tooltip="The denoised latent.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, sampler_name=None, scheduler=None, compile=None):
        # Named here, the combos are checked by the node on every ComfyUI version (0.3.x does
        # not check V3 combos), with the message ``execute`` raises for linked values.
        choices = {
            **_sampler_inputs(sampler_name, scheduler),
            "compile": (compile, COMPILE_CHOICES),
        }
        return widget_errors(KSAMPLER, choices) or True

    @classmethod
    def execute(
        cls,
        model,
        seed,
        steps,
        cfg,
        sampler_name,
        scheduler,
        positive,
        negative,
        latent_image,
        denoise=1.0,
        enabled=True,
        max_graphs=8,
        verify=False,
        channels_last=False,
        concurrent_controlnet=True,
        compile="off",
    ):
        check_choices(KSAMPLER, _sampler_inputs(sampler_name, scheduler))
        import nodes

        node_id = node_id_of(cls)
        check_control_family(KSAMPLER, model, positive=positive, negative=negative)
        if enabled or node_id is not None:
            # disabled, it samples exactly as KSampler does and only times the run for its
            # badge (a stock baseline beside an accelerated branch in one workflow)
            opts = _options(
                KSAMPLER,
                enabled,
                max_graphs,
                verify,
                channels_last,
                concurrent_controlnet,
                compile,
            )
            model = apply_cuda_graph(model, opts, node_id=node_id, node_name=KSAMPLER)
            if enabled and _hoists(model, compile):
                build_for_if_nodes(node_id)
        (latent,) = nodes.common_ksampler(
            model,
            seed,
            steps,
            cfg,
            sampler_name,
            scheduler,
            positive,
            negative,
            latent_image,
            denoise=denoise,
        )
        return io.NodeOutput(latent)


KSAMPLER = "KSampler (CUDA Graph)"


def _sampler_inputs(sampler_name, scheduler) -> dict:
    samplers, schedulers = sampler_choices()
    return {"sampler_name": (sampler_name, samplers), "scheduler": (scheduler, schedulers)}


def check_control_family(node: str, model, **conds) -> None:
    """Every ControlNet applied to the conditioning must fit the model's text width (an SDXL
    ControlNet on an SD1.5 model would otherwise fail deep inside the first step)."""
    want = context_width(getattr(getattr(model, "model", None), "diffusion_model", None))
    if want is None:
        return
    seen: set[int] = set()
    for name, cond in conds.items():
        for entry in cond or []:
            c = entry[1].get("control") if len(entry) > 1 and isinstance(entry[1], dict) else None
            while c is not None and id(c) not in seen:
                seen.add(id(c))
                got = context_width(getattr(c, "control_model", None))
                if got is not None and got != want:
                    raise NodeInputError(
                        node,
                        name,
                        f"carries a {family(got)} ControlNet (text conditioning {got} wide) but "
                        f"'model' is a {family(want)} model ({want} wide)",
                        "Load a ControlNet made for your checkpoint's model family in the "
                        "Apply ControlNet node.",
                    )
                c = getattr(c, "previous_controlnet", None)


NODES = [CUDAGraphModel, KSamplerCUDAGraph]
