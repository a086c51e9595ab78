# SPDX-License-Identifier: GPL-3.0-or-later
"""Fused ControlNet Apply: a ControlNet object that encodes its hint once per run and merges a
whole chain of ControlNets in one fused pass.

``FusedControlNet`` subclasses ComfyUI's ``comfy.controlnet.ControlNet`` (the sampler only
duck-types control objects; this is the documented extension point) and changes two things:

1. **Hint encoded once per sampling run.** The ControlNet's ``input_hint_block`` depends only
   on the hint image (its layers are convolutions and SiLU; ``emb``/``context`` are ignored), yet
   stock ComfyUI recomputes it at every step. The stock body runs a shallow copy of the network
   (same class, layers and weights; graphs/hint_encoding.py ``with_encoder``) whose encoder is a
   stand-in that returns the encoding cached for this exact hint tensor (same object, address,
   shape, dtype and device). The network itself is never modified. Bit-identical to stock.
2. **One merge for the chain.** Consecutive fused ControlNets of a chain are evaluated as a
   group: each runs its stock ``get_control`` body unscaled (hint preparation, conditioning,
   forward all exactly as ComfyUI does them), then every residual slot of every active net is
   scaled by its strength and summed by ``kernels.control_merge`` in one launch (fp32
   accumulation, one rounding) instead of 13 scale ops per net plus 13 adds per extra net.

Everything else is stock: the range check (start/end percent), hint preprocessing and VAE
encoding, batching, ``cleanup``. Kinds we do not accelerate never become a FusedControlNet (the
node hands them to stock Apply ControlNet).

The CUDA Graph wrapper drives these objects through ``transformer_options`` (a
``step_control.StepControl``): which nets run this step (the host decided it once for the chain)
and whether the call runs inside the graph's function. There the hint is the graph's buffer and
the encoding is the CUDA Graph node's (graphs/hint_encoding.py: computed outside the graph when
that buffer is refreshed), so this cache stays out of the way.

State: ``fused_settings`` (what the Apply node chose; frozen, carried by ``copy``) and ``_run``
(this sampling run's encodings and badge figures; reset by ``pre_run``/``cleanup``).
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from ..errors import NodeInputError
from ..graphs import hint_encoding
from ..kernels import control_merge as fused_merge
from ..logger import logger
from . import status
from .step_control import step_control

try:  # ComfyUI is the host; keep this module importable for tooling without it
    import comfy.controlnet as _cn

    _Base = _cn.ControlNet
except ImportError:  # pragma: no cover - only without ComfyUI
    _cn = None
    _Base = object


def why_not_fusable(control_net) -> str | None:
    """None if ``control_net`` can be accelerated, else the reason it runs the stock path."""
    if _cn is None:
        return "ComfyUI is not available"
    if type(control_net) not in (_cn.ControlNet, FusedControlNet) and not isinstance(
        control_net, FusedControlNet
    ):
        return f"{type(control_net).__name__} (not a standard SD ControlNet)"
    model = getattr(control_net, "control_model", None)
    if model is None or not hasattr(model, "input_hint_block"):
        return "its network has no hint encoder (not an SD/SDXL ControlNet)"
    if getattr(model, "control_add_embedding", None) is not None:
        return "Union ControlNet (ControlNet++/ProMax)"
    if control_net.latent_format is not None:
        return "a VAE-latent ControlNet (SD3/Flux-style)"
    return None


_SOURCE = "_cna_hint_source"  # on a network copy made by _hint_net: the network it copies
_VIEW_OWN = frozenset({"_modules", "_parameters", "_buffers", "input_hint_block", _SOURCE})


def network_of(net):
    """The network ``net`` is a hint-caching copy of (``FusedControlNet._hint_net``), or
    ``net`` itself."""
    ref = getattr(net, "__dict__", {}).get(_SOURCE)
    real = ref() if ref is not None else None
    return real if real is not None else net


class _CachedHintBlock(torch.nn.Module):
    """The hint encoder of the network copy the stock body runs (``FusedControlNet._hint_net``):
    hands back this run's encoding of the same hint tensor; encodes on a miss."""

    def __init__(self, run: FusedRun, block: torch.nn.Module):
        super().__init__()
        self.block = block
        self.__dict__["_fused_run"] = run  # plain state, not a submodule

    def forward(self, hint, emb, context):
        run = self.__dict__["_fused_run"]
        # No version counter here: ComfyUI samples under inference_mode, whose tensors have
        # none. ComfyUI never edits a prepared hint in place (it replaces the tensor), and
        # _hint_src keeps the keyed tensor alive so its id and address cannot be reused.
        key = (id(hint), hint.data_ptr(), tuple(hint.shape), hint.dtype, hint.device)
        if run.hint_key == key and run.hint_enc is not None:
            return run.hint_enc
        enc = self.block(hint, emb, context)
        run.encodes += 1
        run.hint_key, run.hint_enc, run.hint_src = key, enc, hint
        return enc


@dataclasses.dataclass(frozen=True)
class FusedSettings:
    """What the Apply ControlNet (Fused) node chose, fixed when it makes the object."""

    # Run the net on the positive half of the CFG batch only and give the negative half the same
    # residuals (half the ControlNet work; changes the picture slightly). Off by default.
    positive_only: bool = False
    node_id: str | None = None  # the Apply node that made it: its badge


class FusedRun:
    """One sampling run of a FusedControlNet: the hint encoding it keeps, and its badge figures.
    ``reset`` at the run's start and end; ``clone`` gives a fresh one (a copy starts clean).
    The group's merges are counted on the net the sampler calls (the chain's last)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.hint_key: tuple | None = None
        self.hint_enc = None
        self.hint_src = None  # keeps the keyed tensor alive, so its id cannot be reused
        self.encodes = 0  # hint encodings this run
        self.merges = 0  # fused merges of this net's group (one per model evaluation)
        self.positive_only = 0  # of which on the positive half of the CFG batch only
        self.in_graph = False
        self.strengths: tuple | None = None  # (values, device) -> float32 device tensor

    def clone(self) -> FusedRun:
        return FusedRun()


class FusedControlNet(_Base):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fused_settings = FusedSettings()
        self._run = FusedRun()
        self._raw = False  # during one get_control: control_merge hands back the raw output
        self._hint_view = None  # the network's copy with the caching encoder: see _hint_net

    @classmethod
    def from_controlnet(cls, cn, settings: FusedSettings | None = None) -> FusedControlNet:
        c = cls(
            None,
            global_average_pooling=cn.global_average_pooling,
            load_device=cn.load_device,
            manual_cast_dtype=cn.manual_cast_dtype,
        )
        c.control_model = cn.control_model
        c.control_model_wrapped = cn.control_model_wrapped
        cn.copy_to(c)
        if settings is None:
            settings = getattr(cn, "fused_settings", None) or FusedSettings()
        c.fused_settings = settings
        return c

    def copy(self) -> FusedControlNet:
        return FusedControlNet.from_controlnet(self)

    def pre_run(self, model, percent_to_timestep_function):
        if self.cond_hint is not None:
            # The last run on this object never ended: ComfyUI cleans controls up only after
            # sampling completes, so an interrupt (or an error) leaves its prepared hint, the
            # Feature Cache's checked-out stores and the encoding behind, and this run's first
            # step would differ from a fresh run's. Finish that run's cleanup first.
            logger.debug("%s: cleaning up after an interrupted run", NODE)
            self.cleanup()
        self._run.reset()
        super().pre_run(model, percent_to_timestep_function)

    def cleanup(self):
        if self.fused_settings.node_id is not None:
            self._report()
        self._run.reset()
        super().cleanup()

    def _report(self) -> None:
        """This run's figures to the Apply node's badge (nodes/status.py)."""
        try:
            from .. import kernels

            dev = next(self.control_model.parameters()).device
            cuda = next(b for b in kernels.list_backends() if b["name"] == "cuda")
            if dev.type != "cuda":
                kern = f"kernels: PyTorch ({dev.type})"
            elif cuda["available"] and cuda.get("used_by_default"):
                kern = "kernels: CUDA"
            else:
                kern = "kernels: PyTorch (" + status.short(cuda.get("reason") or "off", 40) + ")"
            n, graphed = self._run.encodes, self._run.in_graph
            hint = f"hint encoded {n}× this run"
            if graphed:
                hint = "hint: encoded by the CUDA Graph node"
            nets, prev = 1, self.previous_controlnet
            while isinstance(prev, FusedControlNet):
                nets, prev = nets + 1, prev.previous_controlnet
            lines = [kern, hint, f"{nets} ControlNet(s) merged in 1 fused op"]
            if self.fused_settings.positive_only:
                lines.append("positive half of CFG only")
            data = {
                "kernels": kern,
                "hint_encodes": n,
                "in_graph": graphed,
                "nets_merged": nets,
                "fused_merges": self._run.merges,
                "positive_only": self._run.positive_only,
            }
            status.report(self.fused_settings.node_id, "fused_apply", lines, data)
        except Exception as e:  # a badge must never fail a run
            logger.debug("Apply ControlNet (Fused): no badge: %s", e)

    # -- the stock body, unscaled, with the hint encoding cached ------------------------------

    def control_merge(self, control, control_prev, output_dtype):
        if self._raw:
            return control  # the group merges (and scales) all nets at once
        return super().control_merge(control, control_prev, output_dtype)

    def _fusable(self) -> bool:
        return not self.global_average_pooling and self.strength_type == _cn.StrengthType.CONSTANT

    def _active(self, t, sigma_box: list, ctl) -> bool:
        if ctl is not None and ctl.graph and ctl.active is not None:
            return ctl.active.get(id(self), True)  # decided on the host for the whole chain
        rng = self.timestep_range
        if rng is None:
            return True
        if not sigma_box:
            sigma_box.append(t[0])
        s = sigma_box[0]
        return not (s > rng[0] or s < rng[1])

    def _stock_call(self, x_noisy, t, cond, batched_number, transformer_options, raw: bool):
        """ComfyUI's own get_control for this net alone (no chain, no range check).

        ComfyUI's body reads its chain, range and network from the object and offers no other
        way in, so these are swapped for the call and put back after it."""
        model = self.control_model
        saved = (self.previous_controlnet, self.timestep_range, self._raw)
        self.previous_controlnet, self.timestep_range, self._raw = None, None, raw
        ctl = step_control(transformer_options)
        net = model if ctl is not None and ctl.graph else self._hint_net(model)
        self.control_model = self._wrap_model(net, t, transformer_options)
        try:
            return _cn.ControlNet.get_control(
                self, x_noisy, t, cond, batched_number, transformer_options
            )
        finally:
            self.control_model = model
            self.previous_controlnet, self.timestep_range, self._raw = saved

    def _hint_net(self, model):
        """``model`` with this run's hint-encoding cache as its encoder: a shallow copy made
        once per network and kept while it shares the network's layers (a patch that replaces
        a direct child, or the encoder, makes a new one). ``model`` if it has no encoder
        module to stand in for."""
        block = getattr(model, "_modules", {}).get("input_hint_block")
        if not isinstance(model, torch.nn.Module) or not isinstance(block, torch.nn.Module):
            return model
        view = self._hint_view
        if (
            view is not None
            and network_of(view) is model
            and view._modules["input_hint_block"].block is block
            and hint_encoding.same_layers(view, model)
        ):
            # the network's own plain attributes as they are now (a loader may set some)
            view.__dict__.update((k, v) for k, v in model.__dict__.items() if k not in _VIEW_OWN)
            return view
        view = hint_encoding.with_encoder(model, _CachedHintBlock(self._run, block))
        view.__dict__[_SOURCE] = weakref.ref(model)
        self._hint_view = view
        return view

    def _wrap_model(self, model, t, transformer_options):
        """What ``get_control`` calls as its network (subclasses put a cache in between)."""
        return model

    # -- the group -----------------------------------------------------------------------------

    def get_control(self, x_noisy, t, cond, batched_number, transformer_options):
        group = [self]
        prev = self.previous_controlnet
        while isinstance(prev, FusedControlNet):
            group.insert(0, prev)
            prev = prev.previous_controlnet
        control_prev = None
        if prev is not None:
            control_prev = prev.get_control(x_noisy, t, cond, batched_number, transformer_options)

        ctl = step_control(transformer_options)
        if ctl is not None and ctl.graph:
            for cn in group:
                cn._run.in_graph = True  # for its badge
        sigma_box: list = []
        active = [cn for cn in group if cn._active(t, sigma_box, ctl)]
        if not active:
            return control_prev
        half = _positive_half(active, x_noisy, t, cond, transformer_options)
        if half is not None and all(cn._fusable() for cn in active):
            # ControlNets on the positive chunk only; every chunk then gets its residuals
            xs, ts, cs, n_chunks = half
            raws = [cn._stock_call(xs, ts, cs, 1, transformer_options, raw=True) for cn in active]
            merged = _merge_group(raws, _strengths(active, x_noisy.device))
            self._run.merges += 1
            self._run.positive_only += 1
            return _add_prev(_tile(merged, n_chunks), control_prev)
        if not all(cn._fusable() for cn in active):
            # stock semantics net by net (global average pooling, LINEAR_UP), hint still cached
            out = control_prev
            for cn in active:
                out = cn._merge_stock(
                    cn._stock_call(x_noisy, t, cond, batched_number, transformer_options, raw=True),
                    out,
                )
            return out
        raws = [
            cn._stock_call(x_noisy, t, cond, batched_number, transformer_options, raw=True)
            for cn in active
        ]
        merged = _merge_group(raws, _strengths(active, x_noisy.device))
        self._run.merges += 1
        return _add_prev(merged, control_prev)

    def _merge_stock(self, raw, control_prev):
        return _cn.ControlBase.control_merge(self, raw, control_prev, None)


def _positive_half(active, x_noisy, t, cond, topts):
    """(x, t, cond, number of chunks) of the positive chunk when every active net runs on it
    alone and the batch is one positive chunk plus negative ones of the same size; else None.
    """
    if not all(cn.fused_settings.positive_only for cn in active):
        return None
    order = list((topts or {}).get("cond_or_uncond") or [])
    n = len(order)
    if n < 2 or order.count(0) != 1 or x_noisy.shape[0] % n:
        return None  # no CFG negative in this batch, or several positive chunks (areas)
    size = x_noisy.shape[0] // n
    lo = order.index(0) * size
    total = x_noisy.shape[0]

    def part(v):
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == total:
            return v[lo : lo + size]
        return v

    return part(x_noisy), part(t), {k: part(v) for k, v in cond.items()}, n


def network_batch(active, x_noisy, t, topts):
    """The (x, t) that the networks of a fused group whose ``active`` nets are these see: the
    positive chunk where ``get_control`` runs them on it alone (positive_only), else the whole
    batch. The CUDA Graph glue keys the Feature Cache's host-side decision on it, as the eager
    path does."""
    half = _positive_half(active, x_noisy, t, {}, topts)
    if half is None or not all(cn._fusable() for cn in active):
        return x_noisy, t
    return half[0], half[1]


def _tile(out: dict, n: int) -> dict:
    """Every chunk of the batch gets the positive chunk's residuals."""
    return {k: [None if r is None else torch.cat([r] * n) for r in lst] for k, lst in out.items()}


def _strengths(nets: list[FusedControlNet], device) -> torch.Tensor:
    """The nets' strengths as one float32 device tensor, without a host->device copy per step.

    Floats (eager sampling): cached on the outermost net per value tuple. Tensors (the CUDA
    Graph glue feeds device scalars): stacked on the device, which a graph can capture.
    """
    vals = [cn.strength for cn in nets]
    if any(isinstance(v, torch.Tensor) for v in vals):
        return torch.stack(
            [
                v.to(device=device, dtype=torch.float32).reshape(())
                if isinstance(v, torch.Tensor)
                else torch.full((), float(v), device=device)
                for v in vals
            ]
        )
    run = nets[-1]._run
    key = (tuple(float(v) for v in vals), device)
    if run.strengths is None or run.strengths[0] != key:
        run.strengths = (
            key,
            torch.tensor([float(v) for v in vals], dtype=torch.float32, device=device),
        )
    return run.strengths[1]


def _merge_group(raws: list[dict], strengths: torch.Tensor) -> dict:
    """Scale and sum the nets' residual dicts slot by slot in one fused op."""
    keys = [k for k in ("input", "middle", "output") if any(r.get(k) for r in raws)]
    layout = [(k, i) for k in keys for i in range(max(len(r.get(k, [])) for r in raws))]
    present = [all(_slot(r, k, i) is not None for r in raws) for k, i in layout]
    if not all(present):  # a net without some slot: fall back to the stock sum for safety
        return _stock_sum(raws, strengths)
    residuals = [[_slot(r, k, i) for k, i in layout] for r in raws]
    merged = fused_merge(residuals, strengths)
    out: dict = {"input": [], "middle": [], "output": []}
    for (k, _), m in zip(layout, merged, strict=True):
        out[k].append(m)
    return out


def _slot(raw: dict, key: str, i: int):
    lst = raw.get(key, [])
    return lst[i] if i < len(lst) else None


def _stock_sum(raws, strengths):
    out: dict = {"input": [], "middle": [], "output": []}
    for n, raw in enumerate(raws):
        for key, lst in raw.items():
            for i, x in enumerate(lst):
                if x is None:
                    continue
                x = x * strengths[n].to(x.dtype)
                o = out.setdefault(key, [])
                if i >= len(o):
                    o.append(x)
                elif o[i] is None:
                    o[i] = x
                else:
                    o[i] = o[i] + x
    return out


def _add_prev(out: dict, control_prev: dict | None) -> dict:
    """Stock ControlBase.control_merge's handling of the previous (non-fused) chain."""
    if control_prev is None:
        return out
    for key in ("input", "middle", "output"):
        o = out.setdefault(key, [])
        for i, prev_val in enumerate(control_prev.get(key, [])):
            if i >= len(o):
                o.append(prev_val)
            elif prev_val is not None:
                o[i] = prev_val if o[i] is None else prev_val + o[i]
    return out


_logged: set[str] = set()
NODE = "Apply ControlNet (Fused)"
_FAMILY = {768: "SD1.5", 1024: "SD2.x", 2048: "SDXL", 1280: "SDXL refiner"}


def context_width(module) -> int | None:
    """The text-conditioning width a UNet's or ControlNet's cross-attention expects, if any."""
    if not isinstance(module, torch.nn.Module):
        return None
    for name, mod in module.named_modules():
        if name.endswith("attn2.to_k") and hasattr(mod, "in_features"):
            return int(mod.in_features)
    return None


def family(width: int) -> str:
    """The model family of a text-conditioning width, for error messages."""
    return _FAMILY.get(width, f"{width}-wide")


def _context_width(control_net) -> int | None:
    return context_width(getattr(control_net, "control_model", None))


def _hint_channels(control_net) -> int | None:
    block = getattr(getattr(control_net, "control_model", None), "input_hint_block", None)
    try:
        return int(block[0].in_channels)
    except (TypeError, AttributeError, IndexError):
        return None


def validate_inputs(
    positive, negative, control_net, image, strength, start_percent, end_percent
) -> None:
    """Refuse inputs that stock ComfyUI would only trip over mid-sampling, or not at all."""
    if not isinstance(strength, (int, float)) or not (0.0 <= float(strength) <= 10.0):
        raise NodeInputError(
            NODE,
            "strength",
            f"is {strength!r}, outside 0–10",
            "Use a value between 0 (off) and 10.",
        )
    for name, v in (("start_percent", start_percent), ("end_percent", end_percent)):
        if not isinstance(v, (int, float)) or not (0.0 <= float(v) <= 1.0):
            raise NodeInputError(
                NODE,
                name,
                f"is {v!r}, outside 0–1",
                "Use a fraction of the sampling run between 0 and 1.",
            )
    if not isinstance(image, torch.Tensor) or image.dim() != 4:
        shape = tuple(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__
        raise NodeInputError(
            NODE,
            "image",
            f"must be an IMAGE batch (B, H, W, C), got {shape}",
            "Connect a Load Image node or a ControlNet preprocessor's output.",
        )
    if image.numel() == 0 or image.shape[1] < 8 or image.shape[2] < 8:
        raise NodeInputError(
            NODE,
            "image",
            f"is empty or tiny {tuple(image.shape)}",
            "Connect a real control image (at least 8×8 pixels).",
        )
    want = _hint_channels(control_net)
    if want is not None and image.shape[-1] != want:
        raise NodeInputError(
            NODE,
            "image",
            f"has {image.shape[-1]} channels but this ControlNet expects {want}",
            "Pass an RGB image (a mask or RGBA image needs converting first).",
        )
    if not torch.isfinite(image).all():
        raise NodeInputError(
            NODE,
            "image",
            "contains NaN or infinite values",
            "Check the node that produced the control image.",
        )
    want_ctx = _context_width(control_net)
    if want_ctx is None:
        return
    for cname, cond in (("positive", positive), ("negative", negative)):
        for t in cond:
            emb = t[1].get("cross_attn_controlnet", t[0]) if isinstance(t[1], dict) else t[0]
            if isinstance(emb, torch.Tensor) and emb.dim() >= 2 and emb.shape[-1] != want_ctx:
                got = emb.shape[-1]
                raise NodeInputError(
                    NODE,
                    "control_net",
                    f"is a {family(want_ctx)} ControlNet (text conditioning {want_ctx} wide) "
                    f"but '{cname}' comes from a {family(got)} model ({got} wide)",
                    "Load a ControlNet made for your checkpoint's model family.",
                )


def apply_fused(
    positive,
    negative,
    control_net,
    image,
    strength,
    start_percent,
    end_percent,
    vae=None,
    positive_only=False,
    node_id=None,
):
    """What the node does: stock Apply ControlNet's wiring with FusedControlNet objects."""
    if strength == 0:
        return positive, negative
    validate_inputs(positive, negative, control_net, image, strength, start_percent, end_percent)
    why = why_not_fusable(control_net)
    if why is not None:
        if why not in _logged:
            _logged.add(why)
            logger.info("Apply ControlNet (Fused): %s runs the stock path", why)
        import nodes

        return nodes.ControlNetApplyAdvanced().apply_controlnet(
            positive, negative, control_net, image, strength, start_percent, end_percent, vae=vae
        )
    hint = image.movedim(-1, 1)
    settings = FusedSettings(positive_only=bool(positive_only), node_id=node_id)
    cnets: dict = {}
    out = []
    for conditioning in (positive, negative):
        c = []
        for t in conditioning:
            d = t[1].copy()
            prev = d.get("control", None)
            if prev in cnets:
                c_net = cnets[prev]
            else:
                # a FusedControlNet subclass (the Feature Cache's) keeps its class and settings
                if isinstance(control_net, FusedControlNet):
                    base = control_net.copy()
                    base.fused_settings = settings
                else:
                    base = FusedControlNet.from_controlnet(control_net, settings)
                c_net = base.set_cond_hint(hint, strength, (start_percent, end_percent), vae=vae)
                c_net.set_previous_controlnet(prev)
                cnets[prev] = c_net
            d["control"] = c_net
            d["control_apply_to_uncond"] = False
            c.append([t[0], d])
        out.append(c)
    return out[0], out[1]
