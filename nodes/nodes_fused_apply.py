# SPDX-License-Identifier: GPL-3.0-or-later
"""Apply ControlNet (Fused): the node. Logic in ``fused_apply.py``."""

from __future__ import annotations

from comfy_api.latest import io

from .fused_apply import apply_fused
from .kernel_build import build_kernels
from .status import node_id_of

CATEGORY = "ControlNet Accelerator/conditioning"


class ControlNetApplyFused(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CNA_ControlNetApplyFused",
            display_name="Apply ControlNet (Fused)",
            category=CATEGORY,
            description=(
                "Drop-in for Apply ControlNet, same inputs and outputs. The hint image is encoded "
                "once per run instead of every step, and chained Fused applies are merged in one "
                "fused pass. Same result as stock (merge rounding aside). ControlNet kinds it "
                "does not accelerate (T2I-Adapter, Control-LoRA, Union, SD3/Flux) run the stock "
                "path."
            ),
            inputs=[
                io.Conditioning.Input("positive", tooltip="Conditioning to apply the control to."),
                io.Conditioning.Input("negative", tooltip="Negative conditioning, controlled too."),
                io.ControlNet.Input("control_net", tooltip="The ControlNet to apply."),
                io.Image.Input("image", tooltip="The hint image (edge map, depth, pose, ...)."),
                io.Float.Input(
                    "strength",
                    default=1.0,
                    min=0.0,
                    max=10.0,
                    step=0.01,
                    tooltip="How strongly the control steers; 0 turns it off (the "
                    "conditioning is returned untouched).",
                ),
                io.Float.Input(
                    "start_percent",
                    default=0.0,
                    min=0.0,
                    max=1.0,
                    step=0.001,
                    tooltip="Fraction of sampling at which the control starts.",
                ),
                io.Float.Input(
                    "end_percent",
                    default=1.0,
                    min=0.0,
                    max=1.0,
                    step=0.001,
                    tooltip="Fraction of sampling at which the control stops.",
                ),
                io.Vae.Input(
                    "vae",
                    optional=True,
                    tooltip="Only for ControlNets that need one (SD3/Flux-style).",
                ),
                io.Boolean.Input(
                    "positive_only",
                    default=False,
                    optional=True,
                    tooltip="Run the ControlNet on the positive prompt's half of the CFG batch "
                    "only and give the negative half the same features: about half the "
                    "ControlNet's work, a slightly different picture. Off (default): exactly "
                    "the stock result.",
                ),
            ],
            outputs=[
                io.Conditioning.Output("positive_out", display_name="positive"),
                io.Conditioning.Output("negative_out", display_name="negative"),
            ],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(
        cls,
        positive,
        negative,
        control_net,
        image,
        strength=1.0,
        start_percent=0.0,
        end_percent=1.0,
        vae=None,
        positive_only=False,
    ) -> io.NodeOutput:
        # a first build of the kernels shows as this node's progress, not in a step
        build_kernels(node_id_of(cls))
        pos, neg = apply_fused(
            positive,
            negative,
            control_net,
            image,
            strength,
            start_percent,
            end_percent,
            vae=vae,
            positive_only=positive_only,
            node_id=node_id_of(cls),
        )
        return io.NodeOutput(pos, neg)


NODES = [ControlNetApplyFused]
