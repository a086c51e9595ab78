# SPDX-License-Identifier: GPL-3.0-or-later
"""ControlNet Memory Pool: the node. Logic in ``memory_pool.py`` and
``memory/weight_compress.py``."""

from __future__ import annotations

from comfy_api.latest import io

from .kernel_build import build_kernels
from .memory_pool import WEIGHT_MODES, PoolOptions, apply_memory_pool
from .status import node_id_of
from .validate import check_choices, widget_errors

CATEGORY = "ControlNet Accelerator/loaders"
NODE = "ControlNet Memory Pool"
_D = PoolOptions()


class ControlNetMemoryPool(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CNA_ControlNetMemoryPool",
            display_name="ControlNet Memory Pool",
            category=CATEGORY,
            description=(
                "Lowers the VRAM that sampling with ControlNets needs: keeps the model's and "
                "the ControlNet's large layers as INT8 on the GPU (half the bytes of fp16, "
                "expanded layer by layer as they run) and can unload models sampling does not "
                "use. Your loaded checkpoint is not changed: other nodes still get fp16. For "
                "two ControlNets, chain a second Memory Pool for the second net."
            ),
            inputs=[
                io.Model.Input("model", tooltip="The diffusion model (from the checkpoint)."),
                io.ControlNet.Input(
                    "control_net", optional=True, tooltip="A ControlNet to store compressed."
                ),
                io.Combo.Input(
                    "unet_weights",
                    options=list(WEIGHT_MODES),
                    default=_D.unet_weights,
                    tooltip="int8: the diffusion model's large layers stored INT8 with a scale "
                    "per output channel (about half its VRAM; a slight change to the picture). "
                    "'as loaded' leaves them exactly as they are. stream: kept as loaded in "
                    "pinned system RAM, not VRAM, and copied in layer by layer, one ahead, as "
                    "they run (exact result; much slower: the whole model crosses PCIe every "
                    "step).",
                ),
                io.Combo.Input(
                    "controlnet_weights",
                    options=list(WEIGHT_MODES),
                    default=_D.controlnet_weights,
                    tooltip="int8: the ControlNet's large layers stored INT8 (about half its "
                    "VRAM). 'as loaded' leaves them exactly as they are. stream: kept in pinned "
                    "system RAM and copied in layer by layer as they run (no VRAM for its "
                    "weights, exact result, slower: see the node's documentation).",
                ),
                io.Boolean.Input(
                    "offload_idle_models",
                    default=_D.offload_idle_models,
                    tooltip="Before sampling, unload from the GPU the models sampling does not "
                    "use (text encoder, VAE); ComfyUI reloads them when needed. Off keeps "
                    "ComfyUI's behaviour.",
                ),
            ],
            outputs=[
                io.Model.Output("model_out", display_name="model"),
                io.ControlNet.Output("control_net_out", display_name="control_net"),
            ],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, unet_weights=None, controlnet_weights=None):
        # Named here, both combos are checked by the node on every ComfyUI version (0.3.x does
        # not check V3 combos), with the message ``execute`` raises for linked values.
        return widget_errors(NODE, _weight_inputs(unet_weights, controlnet_weights)) or True

    @classmethod
    def execute(
        cls,
        model,
        control_net=None,
        unet_weights=_D.unet_weights,
        controlnet_weights=_D.controlnet_weights,
        offload_idle_models=_D.offload_idle_models,
    ) -> io.NodeOutput:
        check_choices(NODE, _weight_inputs(unet_weights, controlnet_weights))
        opts = PoolOptions(unet_weights, controlnet_weights, bool(offload_idle_models))
        if "int8" in (unet_weights, controlnet_weights):
            # a first build of the kernels shows as this node's progress, not in a step
            build_kernels(node_id_of(cls))
        m, cn = apply_memory_pool(model, control_net, opts, node_id=node_id_of(cls))
        return io.NodeOutput(m, cn)


def _weight_inputs(unet_weights, controlnet_weights) -> dict:
    return {
        "unet_weights": (unet_weights, WEIGHT_MODES),
        "controlnet_weights": (controlnet_weights, WEIGHT_MODES),
    }


NODES = [ControlNetMemoryPool]
