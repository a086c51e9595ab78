# SPDX-License-Identifier: GPL-3.0-or-later
"""The public ops. Each picks its backend through the registry and, on CUDA, calls a
``torch.library`` custom op (``cna::<op>``), so torch.compile and CUDA graphs see one op.

Shapes: ``residuals`` is N nets × K slots (each slot one ControlNet residual, e.g. 13 for
SD1.5), every net's slot k the same shape and dtype; ``strengths`` is a float32 tensor (N,) on
the residuals' device, so changing strength never changes a captured graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _jit, constraints, eager, int8_matmul, registry
from . import geglu_linear as _geglu

_OPS = (
    "control_merge",
    "quantize_int8",
    "dequant_add",
    "dequant_rows",
    "group_norm_silu",
    "int8_linear",
)
for _op in _OPS:
    registry.register("eager", _op)
    registry.register("cuda", _op)


# -- torch.library registrations (CUDA implementations; fakes for tracing) ---------------------
# Registered once per process: the pack can be imported under two names (ComfyUI's loader and
# the test harness), and torch.library refuses a second definition of the same op.


def _registered(name: str) -> bool:
    try:
        getattr(torch.ops.cna, name)
        return True
    except (AttributeError, RuntimeError):
        return False


def _register() -> None:
    @torch.library.custom_op("cna::control_merge", mutates_args=())
    def _control_merge_op(
        residuals: list[torch.Tensor], strengths: torch.Tensor, num_nets: int
    ) -> list[torch.Tensor]:
        return _jit.module().control_merge(residuals, strengths, num_nets)

    @_control_merge_op.register_fake
    def _(residuals, strengths, num_nets):
        k = len(residuals) // num_nets
        return [torch.empty_like(r) for r in residuals[:k]]

    @torch.library.custom_op("cna::control_merge_add_", mutates_args=("hidden",))
    def _control_merge_add_op(
        hidden: list[torch.Tensor], residuals: list[torch.Tensor], strengths: torch.Tensor
    ) -> None:
        _jit.module().control_merge_add_(hidden, residuals, strengths)

    @_control_merge_add_op.register_fake
    def _(hidden, residuals, strengths):
        return None

    @torch.library.custom_op("cna::quantize_int8", mutates_args=())
    def _quantize_int8_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, scale = _jit.module().quantize_int8(x)
        return q, scale

    @_quantize_int8_op.register_fake
    def _(x):
        return (
            torch.empty(x.shape, dtype=torch.int8, device=x.device),
            torch.empty(x.shape[:2], dtype=torch.float32, device=x.device),
        )

    @torch.library.custom_op("cna::dequant_add_", mutates_args=("hidden",))
    def _dequant_add_op(
        hidden: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, strength: torch.Tensor
    ) -> None:
        _jit.module().dequant_add_(hidden, q, scale, strength)

    @_dequant_add_op.register_fake
    def _(hidden, q, scale, strength):
        return None

    @torch.library.custom_op("cna::dequant_rows_", mutates_args=("out",))
    def _dequant_rows_op(out: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
        _jit.module().dequant_rows_(out, q, scale)

    @_dequant_rows_op.register_fake
    def _(out, q, scale):
        return None

    @torch.library.custom_op("cna::dequant_rows_multi_", mutates_args=("out",))
    def _dequant_rows_multi_op(
        out: torch.Tensor, qs: list[torch.Tensor], scales: list[torch.Tensor]
    ) -> None:
        _jit.module().dequant_rows_multi_(out, qs, scales)

    @_dequant_rows_multi_op.register_fake
    def _(out, qs, scales):
        return None

    @torch.library.custom_op("cna::group_norm_silu", mutates_args=())
    def _group_norm_silu_op(
        x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, groups: int, eps: float
    ) -> torch.Tensor:
        return _jit.module().group_norm_silu(x, weight, bias, groups, eps)

    @_group_norm_silu_op.register_fake
    def _(x, weight, bias, groups, eps):
        return torch.empty_like(x)

    @torch.library.custom_op("cna::int8_linear", mutates_args=())
    def _int8_linear_op(
        x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return int8_matmul.linear(x, q, scale, bias)

    @_int8_linear_op.register_fake
    def _(x, q, scale, bias):
        return x.new_empty((*x.shape[:-1], q.shape[0]))


if not _registered("int8_linear"):
    _register()


def _register_geglu() -> None:
    @torch.library.custom_op("cna::geglu_linear", mutates_args=())
    def _geglu_linear_op(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        # Inside compiled code nothing checked this call's tensors before it (the rewrite
        # checked their shapes when it compiled): check here, and take PyTorch's path rather
        # than let the kernel refuse and fail the prompt.
        if _geglu.triton_missing() is None and _geglu.problem(x, w, b) is None:
            return _geglu.geglu_linear(x, w, b)
        return _geglu.reference(x, w, b)

    @_geglu_linear_op.register_fake
    def _(x, w, b):
        return x.new_empty((*x.shape[:-1], w.shape[0] // 2))


if not _registered("geglu_linear"):
    _register_geglu()


# -- public API ---------------------------------------------------------------------------------


def _cna():
    """The registered CUDA ops (one indirection, so tests can stand a checking double in)."""
    return torch.ops.cna


def _check_residuals(residuals: list[list[torch.Tensor]], strengths: torch.Tensor) -> int:
    if not residuals or not residuals[0]:
        raise ValueError(
            "control_merge: residuals must be a non-empty list (nets) of non-empty lists (slots)"
        )
    k = len(residuals[0])
    for i, net in enumerate(residuals):
        if len(net) != k:
            raise ValueError(f"control_merge: net {i} has {len(net)} slots, net 0 has {k}")
        for j, r in enumerate(net):
            ref = residuals[0][j]
            if r.shape != ref.shape or r.device != ref.device:
                raise ValueError(
                    f"control_merge: residual[{i}][{j}] is {tuple(r.shape)} on {r.device}; "
                    f"net 0 has {tuple(ref.shape)} on {ref.device}"
                )
    if strengths.numel() != len(residuals):
        raise ValueError(f"control_merge: {strengths.numel()} strengths for {len(residuals)} nets")
    return k


def _flat(residuals: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [r.contiguous() for net in residuals for r in net]


def _groups(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def _cuda_merge_plan(residuals, strengths, hidden=None) -> tuple[list, list] | str:
    """How the CUDA kernel covers this merge: (net groups, slot groups), every launch within
    the kernel's limits, or the reason it cannot (the caller then runs eager)."""
    lim = constraints.CUDA_LIMITS["control_merge"]
    why = constraints.uniform([r for net in residuals for r in net] + list(hidden or []))
    if why:
        return why
    nets = _groups(len(residuals), lim["max_nets"])
    slots = _groups(len(residuals[0]), lim["max_slots"])
    for ng in nets:
        for sg in slots:
            why = constraints.cuda_launch_problem(
                "control_merge",
                residuals=[net[sg] for net in residuals[ng]],
                outs=None if hidden is None else hidden[sg],
                strengths=strengths[ng],
            )
            if why:
                return why
    return nets, slots


def control_merge(
    residuals: list[list[torch.Tensor]], strengths: torch.Tensor
) -> list[torch.Tensor]:
    """out[k] = Σ_i strengths[i] · residuals[i][k] for every slot k, in one launch on CUDA.
    Returns K new tensors (the residuals' dtype), computed in fp32 and rounded once.

    Any number of nets: the kernel merges up to ``CUDA_LIMITS["control_merge"]["max_nets"]``
    in one launch; a longer chain adds the next groups in place, one launch (and one rounding
    of the running sum) per further group. Nets whose residuals differ in dtype (stock ComfyUI
    then adds them with type promotion) are merged in fp32 and returned in the promoted dtype.
    """
    _check_residuals(residuals, strengths)
    backend = registry.select("control_merge", [r for net in residuals for r in net])
    if backend == "cuda":
        plan = _cuda_merge_plan(residuals, strengths)
        if isinstance(plan, str):
            registry.note_fallback("control_merge", plan)
        else:
            nets, slots = plan
            s = strengths.to(device=residuals[0][0].device, dtype=torch.float32).contiguous()
            out: list[torch.Tensor] = []
            for sg in slots:
                first = residuals[nets[0]]
                part = _cna().control_merge(
                    _flat([net[sg] for net in first]), s[nets[0]].contiguous(), len(first)
                )
                for ng in nets[1:]:
                    _cna().control_merge_add_(
                        part, _flat([net[sg] for net in residuals[ng]]), s[ng].contiguous()
                    )
                out.extend(part)
            return out
    return eager.control_merge(residuals, strengths)


def control_merge_add_(
    hidden: list[torch.Tensor], residuals: list[list[torch.Tensor]], strengths: torch.Tensor
) -> None:
    """hidden[k] += Σ_i strengths[i] · residuals[i][k], in place, every slot in one launch
    (any number of nets: see ``control_merge``)."""
    k = _check_residuals(residuals, strengths)
    if len(hidden) != k:
        raise ValueError(f"control_merge_add_: {len(hidden)} hidden tensors for {k} slots")
    for j, h in enumerate(hidden):
        if h.shape != residuals[0][j].shape or h.device != residuals[0][j].device:
            raise ValueError(f"control_merge_add_: hidden[{j}] does not match residual slot {j}")
    backend = registry.select("control_merge", [*hidden, *(r for net in residuals for r in net)])
    if backend == "cuda":
        plan = _cuda_merge_plan(residuals, strengths, hidden)
        if isinstance(plan, str):
            registry.note_fallback("control_merge", plan)
        else:
            nets, slots = plan
            s = strengths.to(device=hidden[0].device, dtype=torch.float32).contiguous()
            for sg in slots:
                for ng in nets:
                    _cna().control_merge_add_(
                        hidden[sg], _flat([net[sg] for net in residuals[ng]]), s[ng].contiguous()
                    )
            return
    eager.control_merge_add_(hidden, residuals, strengths)


def _cuda_ok(op: str, **args) -> bool:
    why = constraints.cuda_launch_problem(op, **args)
    if why is None:
        return True
    registry.note_fallback(op, why)
    return False


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, C, *spatial) -> (q int8 same shape, scale float32 (B, C)); x ≈ q · scale."""
    if x.dim() < 2:
        raise ValueError(f"quantize_int8: x must be (B, C, ...), got {tuple(x.shape)}")
    if registry.select("quantize_int8", [x]) == "cuda" and _cuda_ok("quantize_int8", x=x):
        return _cna().quantize_int8(x.contiguous())
    return eager.quantize_int8(x)


def dequant_add_(
    hidden: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, strength: torch.Tensor
) -> None:
    """hidden += strength · q · scale[b, c] in place (strength: float32 scalar tensor)."""
    if q.shape != hidden.shape or q.dtype != torch.int8:
        raise ValueError("dequant_add_: q must be int8 with hidden's shape")
    if scale.shape != hidden.shape[:2]:
        raise ValueError(f"dequant_add_: scale must be (B, C) = {tuple(hidden.shape[:2])}")
    if strength.numel() != 1:
        raise ValueError("dequant_add_: strength must be one value")
    backend = registry.select("dequant_add", [hidden, q, scale])
    if backend == "cuda" and _cuda_ok(
        "dequant_add", hidden=hidden, q=q, scale=scale, strength=strength
    ):
        s = strength.to(device=hidden.device, dtype=torch.float32).reshape(1)
        _cna().dequant_add_(hidden, q.contiguous(), scale.float().contiguous(), s)
        return
    eager.dequant_add_(hidden, q, scale, strength)


def dequant_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q (R, ...) int8, scale (R, 1, ...) or (R,) float32 -> q · scale[r] in ``dtype``: the
    Memory Pool's INT8 weights expanded for one layer call."""
    if q.dtype != torch.int8 or q.dim() < 1 or scale.numel() != q.shape[0]:
        raise ValueError("dequant_rows: q must be int8 and scale hold one value per row")
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    backend = registry.select("dequant_rows", [out, q, scale])
    if backend == "cuda" and _cuda_ok("dequant_rows", q=q, scale=scale, out=out):
        _cna().dequant_rows_(out, q, scale.contiguous())
        return out
    return eager.dequant_rows(q, scale, dtype, out)


def dequant_rows_multi(
    qs: list[torch.Tensor], scales: list[torch.Tensor], dtype: torch.dtype
) -> list[torch.Tensor]:
    """``[dequant_rows(q, s, dtype) for q, s in zip(qs, scales)]``, the results laid out one
    after the other in one allocation (each a contiguous view of it): the Memory Pool expands a
    block's INT8 layers at once. On CUDA one launch for them all where every weight fits the
    kernel's vector path (``constraints``); otherwise one expansion per weight, into its view."""
    if len(qs) != len(scales):
        raise ValueError("dequant_rows_multi: one scale per weight")
    if not qs:
        return []
    dev = qs[0].device
    for q, s in zip(qs, scales, strict=True):
        if q.dtype != torch.int8 or q.dim() < 1 or s.numel() != q.shape[0]:
            raise ValueError(
                "dequant_rows_multi: each q must be int8 and its scale hold one value per row"
            )
        if q.device != dev:
            raise ValueError("dequant_rows_multi: every weight must be on one device")
    out = torch.empty(sum(q.numel() for q in qs), dtype=dtype, device=dev)
    views, off = [], 0
    for q in qs:
        views.append(out[off : off + q.numel()].view(q.shape))
        off += q.numel()
    backend = registry.select("dequant_rows", [out, *qs, *scales])
    if backend == "cuda":
        flat = [s.reshape(-1).contiguous() for s in scales]
        if _cuda_ok("dequant_rows_multi", qs=qs, scales=flat, out=out):
            _cna().dequant_rows_multi_(out, list(qs), flat)
            return views
        for v, q, s in zip(views, qs, flat, strict=True):
            if _cuda_ok("dequant_rows", q=q, scale=s, out=v):
                _cna().dequant_rows_(v, q, s)
            else:
                eager.dequant_rows(q, s, dtype, v)
        return views
    for v, q, s in zip(views, qs, scales, strict=True):
        eager.dequant_rows(q, s, dtype, v)
    return views


def group_norm_silu(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, groups: int = 32, eps: float = 1e-5
) -> torch.Tensor:
    """SiLU(GroupNorm(x)) for x (B, C, *spatial); weight, bias (C,) in x's dtype."""
    if x.dim() < 2 or x.shape[1] % groups:
        raise ValueError(f"group_norm_silu: x {tuple(x.shape)} needs C divisible by {groups}")
    if registry.select("group_norm_silu", [x, weight, bias]) == "cuda" and _cuda_ok(
        "group_norm_silu", x=x, weight=weight, bias=bias, groups=groups
    ):
        return _cna().group_norm_silu(
            x.contiguous(), weight.contiguous(), bias.contiguous(), groups, float(eps)
        )
    return eager.group_norm_silu(x, weight, bias, groups, eps)


def int8_linear_expands(device=None) -> bool:
    """Whether ``int8_linear`` on ``device`` expands the weight first (the default, and every
    device but CUDA) rather than multiplying with the INT8 weight: the Triton kernel is chosen
    only under ``CNA_KERNELS=cuda``."""
    if device is None or torch.device(device).type != "cuda":
        return True
    return registry.mode() != "cuda"


def int8_linear(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, q · scale, bias)`` for x (..., K), q int8 (N, K), scale float32 with one
    value per row: the Memory Pool's INT8 Linear. With the CUDA backend chosen for it (only
    under ``CNA_KERNELS=cuda``: see ``registry.VALIDATED_TRITON``) one matrix multiply that
    reads the INT8 weight directly (``int8_matmul``); otherwise the weight is expanded to x's
    dtype first (``dequant_rows``) and multiplied by PyTorch."""
    if q.dtype != torch.int8 or q.dim() != 2 or scale.numel() != q.shape[0]:
        raise ValueError("int8_linear: q must be 2-D int8 and scale hold one value per row")
    tensors = [x, q, scale] + ([bias] if bias is not None else [])
    if registry.select("int8_linear", tensors) == "cuda" and _cuda_ok(
        "int8_linear", x=x, q=q, scale=scale, bias=bias
    ):
        return _cna().int8_linear(x, q, scale.reshape(-1).contiguous(), bias)
    return F.linear(x, dequant_rows(q, scale, x.dtype), bias)


def geglu_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``value · gelu(gate)`` where ``value, gate = F.linear(x, w, b).chunk(2, -1)``: a
    feed-forward projection with its GEGLU. On CUDA (Triton, compute capability 8.0+) one
    matrix multiply that applies the GEGLU before storing (``geglu_linear``); elsewhere, or
    outside the kernel's limits, PyTorch's path."""
    if w.dim() != 2 or w.shape[0] % 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(
            f"geglu_linear: weight {tuple(w.shape)} must be (2N, K) for input (..., {x.shape[-1]})"
        )
    return torch.ops.cna.geglu_linear(x, w, b)
