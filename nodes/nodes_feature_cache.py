# SPDX-License-Identifier: GPL-3.0-or-later
"""ControlNet Feature Cache: the node. Logic in ``feature_cache.py`` and
``memory/feature_cache.py``."""

from __future__ import annotations

from comfy_api.latest import io

from ..errors import NodeInputError
from ..memory.feature_cache import MODES, STORAGES, CacheConfig
from .feature_cache import apply_cache
from .kernel_build import build_kernels
from .status import node_id_of
from .validate import check_choices, widget_errors

CATEGORY = "ControlNet Accelerator/loaders"
NODE = "ControlNet Feature Cache"
_D = CacheConfig()  # the defaults live in one place
# min, max of each number input: the widgets' limits, and the check of linked values in execute
RANGES = {
    "threshold": (0.0, 2.0),
    "every_n": (1, 10),
    "max_reuse": (0, 10),
    "reuse_start": (0.0, 1.0),
    "reuse_end": (0.0, 1.0),
}


class ControlNetFeatureCache(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CNA_ControlNetFeatureCache",
            display_name="ControlNet Feature Cache",
            category=CATEGORY,
            description=(
                "Reuses this ControlNet's features across sampling steps instead of running it "
                "every step (stored INT8, about half the memory of fp16). Place it between Load "
                "ControlNet Model and Apply ControlNet (stock or Fused). Faster, at a small, "
                "bounded change to the picture: 'off' gives exactly the uncached result."
            ),
            inputs=[
                io.ControlNet.Input("control_net", tooltip="The ControlNet to cache."),
                io.Combo.Input(
                    "mode",
                    options=list(MODES),
                    default=_D.mode,
                    tooltip="adaptive: reuse while the estimated change stays under "
                    "'threshold'; every_n: run the ControlNet every n-th step; off: no cache "
                    "(the stock result exactly).",
                ),
                io.Float.Input(
                    "threshold",
                    default=_D.threshold,
                    min=RANGES["threshold"][0],
                    max=RANGES["threshold"][1],
                    step=0.01,
                    tooltip="adaptive: the change in the ControlNet's input (relative) it "
                    "tolerates before running again. Lower = closer to uncached, slower; 0 "
                    "never reuses.",
                ),
                io.Int.Input(
                    "every_n",
                    default=_D.every_n,
                    min=RANGES["every_n"][0],
                    max=RANGES["every_n"][1],
                    tooltip="every_n: run the ControlNet on every n-th step, reuse between. 1 "
                    "never reuses; smaller values stay closer to the uncached image (2-3), "
                    "larger ones are faster.",
                ),
                io.Int.Input(
                    "max_reuse",
                    default=_D.max_reuse,
                    min=RANGES["max_reuse"][0],
                    max=RANGES["max_reuse"][1],
                    tooltip="At most this many reused steps in a row (every_n - 1 lets every_n "
                    "work fully). 0 turns the cache off.",
                ),
                io.Combo.Input(
                    "storage",
                    options=list(STORAGES),
                    default=_D.storage,
                    tooltip="int8: per-channel quantized (half the memory of fp16, tiny "
                    "rounding); fp16: exact copies.",
                ),
                io.Float.Input(
                    "reuse_start",
                    default=_D.reuse_start,
                    min=RANGES["reuse_start"][0],
                    max=RANGES["reuse_start"][1],
                    step=0.01,
                    tooltip="Reuse allowed from this fraction of the run (the first step is "
                    "always computed).",
                ),
                io.Float.Input(
                    "reuse_end",
                    default=_D.reuse_end,
                    min=RANGES["reuse_end"][0],
                    max=RANGES["reuse_end"][1],
                    step=0.01,
                    tooltip="Reuse allowed up to this fraction of the run (the last step is "
                    "always computed).",
                ),
            ],
            outputs=[io.ControlNet.Output("control_net_out", display_name="control_net")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, mode=None, storage=None, reuse_start=0.0, reuse_end=1.0):
        # Inputs named here skip ComfyUI's own checks, so both ranges are checked here, and the
        # combos on every ComfyUI version (0.3.x does not check V3 combos) with the message
        # ``execute`` raises for linked values. Linked values arrive as None.
        bad = widget_errors(NODE, _combo_inputs(mode, storage))
        if bad:
            return bad
        for name, v in (("reuse_start", reuse_start), ("reuse_end", reuse_end)):
            if v is None:  # linked: checked in execute
                continue
            if not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                return f"ControlNet Feature Cache: {name} is {v!r}; use a fraction from 0 to 1."
        if reuse_start is not None and reuse_end is not None and reuse_start > reuse_end:
            return (
                f"ControlNet Feature Cache: reuse_start ({reuse_start}) is after reuse_end "
                f"({reuse_end}); set reuse_start <= reuse_end."
            )
        return True

    @classmethod
    def execute(
        cls,
        control_net,
        mode=_D.mode,
        threshold=_D.threshold,
        every_n=_D.every_n,
        max_reuse=_D.max_reuse,
        storage=_D.storage,
        reuse_start=_D.reuse_start,
        reuse_end=_D.reuse_end,
    ) -> io.NodeOutput:
        values = dict(
            mode=mode,
            threshold=threshold,
            every_n=every_n,
            max_reuse=max_reuse,
            storage=storage,
            reuse_start=reuse_start,
            reuse_end=reuse_end,
        )
        check_inputs(**values)
        cfg = CacheConfig(**values)
        if cfg.mode != "off" and cfg.storage == "int8":
            # a first build of the kernels shows as this node's progress, not in a step
            build_kernels(node_id_of(cls))
        return io.NodeOutput(apply_cache(control_net, cfg, node_id=node_id_of(cls)))


def check_inputs(**values) -> None:
    """Values that reach ``execute`` through links skip ComfyUI's widget checks (and
    ``validate_inputs`` sees only widget values): refuse them here with the input's name."""
    check_choices(NODE, _combo_inputs(values["mode"], values["storage"]))
    for name, (lo, hi) in RANGES.items():
        v = values[name]
        whole = isinstance(lo, int)  # an INT input
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not lo <= v <= hi:
            problem = f"is {v!r}, outside {lo}–{hi}"
        elif whole and v != int(v):
            problem = f"is {v!r}, not a whole number"
        else:
            continue
        raise NodeInputError(NODE, name, problem, f"Use a value from {lo} to {hi}.")
    if values["reuse_start"] > values["reuse_end"]:
        raise NodeInputError(
            NODE,
            "reuse_start",
            f"({values['reuse_start']}) is after reuse_end ({values['reuse_end']})",
            "Set reuse_start to at most reuse_end.",
        )


def _combo_inputs(mode, storage) -> dict:
    return {"mode": (mode, MODES), "storage": (storage, STORAGES)}


NODES = [ControlNetFeatureCache]
