# SPDX-License-Identifier: GPL-3.0-or-later
"""The kernels' launch limits: recorded as data that matches the CUDA sources, checked before
every launch, and honoured by splitting or by the eager path, never by reaching a kernel.

On the CPU the CUDA ops are replaced by a double (``StrictKernels``) that enforces every
``TORCH_CHECK`` of ``csrc/ops/*.cu`` and then computes the same math, so the dispatch is tested
without a GPU: any call the real kernel would refuse (or overrun) fails the test. With marker
``cuda`` the same properties run against the real kernels.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from comfyui_controlnet_accelerator import kernels
from comfyui_controlnet_accelerator.kernels import _jit, constraints, eager, ops, registry
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

CSRC = Path(_jit.CSRC)
TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
# A running sum rounded once per launch: one rounding per group of nets.
FLOATS = [torch.float32, torch.float16, torch.bfloat16]


def _const(source: str, name: str) -> int:
    m = re.search(rf"constexpr int {name} = (\d+);", (CSRC / source).read_text())
    assert m, f"{name} not found in {source}"
    return int(m.group(1))


def test_limits_match_the_cuda_sources():
    lim = constraints.CUDA_LIMITS
    assert lim["control_merge"]["max_nets"] == _const("ops/control_merge.cu", "kMaxNets")
    assert lim["control_merge"]["max_slots"] == _const("ops/control_merge.cu", "kMaxSlots")
    assert lim["group_norm_silu"]["max_chunks"] == _const("ops/group_norm_silu.cu", "kMaxChunks")


class StrictKernels:
    """Stands in for ``torch.ops.cna`` on the CPU: the CUDA entry points' checks, then the
    math. A call outside the limits raises AssertionError, which no dispatch may trigger."""

    def __init__(self):
        self.launches: list[tuple[str, int, int]] = []

    @staticmethod
    def _limits():
        return constraints.CUDA_LIMITS["control_merge"]

    def _check_merge(self, residuals, strengths, outs, num_nets):
        lim = self._limits()
        slots = len(outs)
        assert 1 <= num_nets <= lim["max_nets"], f"num_nets {num_nets}"
        assert 1 <= slots <= lim["max_slots"], f"slots {slots}"
        assert len(residuals) == num_nets * slots
        assert strengths.dtype == torch.float32 and strengths.is_contiguous()
        assert strengths.numel() >= num_nets
        dtype = outs[0].dtype
        assert dtype in FLOATS
        for k, o in enumerate(outs):
            assert o.dtype == dtype and o.is_contiguous() and o.device == outs[0].device
            for i in range(num_nets):
                r = residuals[i * slots + k]
                assert r.dtype == dtype and r.is_contiguous() and r.shape == o.shape
                assert r.device == o.device
        self.launches.append(("merge", num_nets, slots))

    def control_merge(self, residuals, strengths, num_nets):
        slots = len(residuals) // num_nets
        outs = [torch.empty_like(r) for r in residuals[:slots]]
        self._check_merge(residuals, strengths, outs, num_nets)
        nets = [residuals[i * slots : (i + 1) * slots] for i in range(num_nets)]
        return eager.control_merge(nets, strengths[:num_nets])

    def control_merge_add_(self, hidden, residuals, strengths):
        assert hidden and len(residuals) % len(hidden) == 0
        num_nets = len(residuals) // len(hidden)
        self._check_merge(residuals, strengths, hidden, num_nets)
        slots = len(hidden)
        nets = [residuals[i * slots : (i + 1) * slots] for i in range(num_nets)]
        eager.control_merge_add_(hidden, nets, strengths[:num_nets])

    def quantize_int8(self, x):
        assert x.dim() >= 2 and x.is_contiguous() and x.dtype in FLOATS
        self.launches.append(("quantize", 1, 1))
        return eager.quantize_int8(x)

    def dequant_add_(self, h, q, scale, strength):
        assert h.is_contiguous() and q.is_contiguous() and scale.is_contiguous()
        assert q.dtype == torch.int8 and q.shape == h.shape and h.dim() >= 2
        assert scale.dtype == torch.float32 and scale.numel() == h.shape[0] * h.shape[1]
        assert strength.dtype == torch.float32 and strength.numel() == 1
        assert h.dtype in FLOATS
        self.launches.append(("dequant_add", 1, 1))
        eager.dequant_add_(h, q, scale, strength)

    def dequant_rows_(self, out, q, scale):
        assert q.dtype == torch.int8 and q.is_contiguous() and q.dim() >= 1
        assert scale.dtype == torch.float32 and scale.is_contiguous()
        assert scale.numel() == q.shape[0]
        assert out.is_contiguous() and out.shape == q.shape and out.dtype in FLOATS
        self.launches.append(("dequant_rows", 1, 1))
        eager.dequant_rows(q, scale, out.dtype, out)

    def group_norm_silu(self, x, w, b, groups, eps):
        assert x.is_contiguous() and x.dim() >= 2 and groups > 0 and x.shape[1] % groups == 0
        assert w.numel() == x.shape[1] and b.numel() == x.shape[1]
        assert w.dtype == x.dtype and b.dtype == x.dtype and w.is_contiguous()
        assert b.is_contiguous() and x.dtype in FLOATS
        self.launches.append(("group_norm_silu", 1, 1))
        return eager.group_norm_silu(x, w, b, groups, eps)


@pytest.fixture
def strict(monkeypatch):
    """Every op dispatches to the CUDA path on CPU tensors, reaching ``StrictKernels``."""
    k = StrictKernels()
    monkeypatch.setattr(ops, "_cna", lambda: k)
    monkeypatch.setattr(registry, "select", lambda op, tensors: "cuda")
    return k


def _ref(residuals, strengths):
    return [
        sum(float(strengths[i]) * residuals[i][k].double() for i in range(len(residuals)))
        for k in range(len(residuals[0]))
    ]


def _rel(got, ref):
    den = ref.double().norm().item() or 1.0
    return (got.double() - ref.double()).norm().item() / den


def _within(got, ref, dtype, tol) -> bool:
    """Relative L2 error at most ``tol``, less strict only where the reference is below the
    dtype's normal range (a strength of 1e-16 on fp16 residuals gives 0 in fp16, whatever the
    kernel): the result may then be off by up to the smallest normal number per element."""
    err = (got.double() - ref.double()).norm().item()
    floor = torch.finfo(dtype).smallest_normal * got.numel() ** 0.5
    return err <= tol * ref.double().norm().item() + floor


def _magnitude(residuals, strengths):
    """Σ|strength · residual| per element: what a sum's rounding error scales with. A relative
    error against the result itself is no bound where the terms cancel (a 1×1×1×1 residual
    whose weighted terms sum to 0.001 of their size), however exact the kernel."""
    weights = [abs(float(w)) for w in strengths]
    return [
        sum(w * net[k].double().abs() for w, net in zip(weights, residuals, strict=True))
        for k in range(len(residuals[0]))
    ]


def _within_terms(got, ref, magnitude, dtype, tol) -> bool:
    """The error at most ``tol`` of the terms' magnitude (L2 over elements), with ``_within``'s
    floor below the dtype's normal range."""
    err = (got.double() - ref.double()).norm().item()
    floor = torch.finfo(dtype).smallest_normal * got.numel() ** 0.5
    return err <= tol * magnitude.norm().item() + floor


def _groups_of(n, size):
    return -(-n // size)


@pytest.mark.parametrize("nets", [1, 4, 5, 8, 9, 12])
@pytest.mark.parametrize("slots", [13, 32, 33, 70])
def test_control_merge_splits_nets_and_slots_into_launches_the_kernel_takes(strict, nets, slots):
    gen = torch.Generator().manual_seed(nets * 100 + slots)
    shapes = [(2, 1 + k % 5, 3, 2) for k in range(slots)]
    res = [[torch.randn(s, generator=gen).half() for s in shapes] for _ in range(nets)]
    s = torch.rand(nets, generator=gen) + 0.1
    out = kernels.control_merge(res, s)
    lim = constraints.CUDA_LIMITS["control_merge"]
    assert len(strict.launches) == _groups_of(nets, lim["max_nets"]) * _groups_of(
        slots, lim["max_slots"]
    )
    for o, r in zip(out, _ref(res, s), strict=True):
        assert o.dtype == torch.float16
        assert _rel(o, r) <= 2 * TOL[torch.float16]


@pytest.mark.parametrize("nets", [1, 5, 12])
def test_control_merge_add_splits_too(strict, nets):
    gen = torch.Generator().manual_seed(nets)
    shapes = [(1, 4, 2, 2)] * 40
    res = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(nets)]
    hidden = [torch.randn(s, generator=gen) for s in shapes]
    before = [h.clone() for h in hidden]
    s = torch.rand(nets, generator=gen)
    kernels.control_merge_add_(hidden, res, s)
    for h, b, r in zip(hidden, before, _ref(res, s), strict=True):
        assert _rel(h, b.double() + r) <= 1e-6


def test_inputs_the_kernel_cannot_take_run_eager_with_one_log_line(strict, caplog):
    registry._fallbacks_logged.clear()
    a = [torch.ones(1, 2, 2, 2, dtype=torch.float16)]
    b = [torch.ones(1, 2, 2, 2, dtype=torch.float32)]  # a second net loaded in another dtype
    with caplog.at_level("INFO", logger="ControlNetAccelerator"):
        for _ in range(3):
            out = kernels.control_merge([a, b], torch.tensor([1.0, 2.0]))
    assert strict.launches == []
    assert out[0].dtype == torch.float32 and torch.equal(out[0], torch.full((1, 2, 2, 2), 3.0))
    lines = [r.message for r in caplog.records if "runs on PyTorch" in r.message]
    assert len(lines) == 1 and "mixed dtypes" in lines[0]
    # group_norm_silu with fp32 affine parameters on fp16 x: eager, not the kernel's TORCH_CHECK
    x = torch.randn(1, 32, 4, 4).half()
    y = kernels.group_norm_silu(x, torch.ones(32), torch.zeros(32), 32)
    assert strict.launches == [] and y.shape == x.shape
    # a non-contiguous hidden for dequant_add_: eager, and the result is still right
    h = torch.zeros(2, 4, 3, 3).transpose(2, 3)
    q = torch.ones(2, 4, 3, 3, dtype=torch.int8)
    kernels.dequant_add_(h, q, torch.full((2, 4), 0.5), torch.tensor(2.0))
    assert strict.launches == [] and torch.equal(h, torch.ones(2, 4, 3, 3))


# -- fuzz: random counts, shapes, dtypes and strides a workflow can produce --------------------

_SHAPE = st.tuples(
    st.integers(1, 3), st.integers(1, 12), st.integers(1, 9), st.integers(1, 9)
)  # (B, C, H, W): CFG batches, odd channel counts, small latents


@st.composite
def _merge_case(draw):
    nets = draw(st.integers(1, 12))
    slots = draw(st.integers(1, 40))
    shapes = [draw(_SHAPE) for _ in range(min(slots, 4))]
    shapes = [shapes[k % len(shapes)] for k in range(slots)]
    dtype = draw(st.sampled_from(FLOATS))
    transposed = draw(st.booleans())  # residuals as views (a sliced or permuted output)
    strengths = draw(st.lists(st.floats(0, 10, width=32), min_size=nets, max_size=nets))
    return nets, shapes, dtype, transposed, strengths


def _make(shape, dtype, transposed, gen, device):
    t = torch.randn(shape, generator=gen, device=device).to(dtype)
    return t.transpose(2, 3).contiguous().transpose(2, 3) if transposed else t


def _check_merge_case(case, device):
    nets, shapes, dtype, transposed, strengths = case
    gen = torch.Generator(device=device).manual_seed(len(shapes) * 13 + nets)
    res = [[_make(s, dtype, transposed, gen, device) for s in shapes] for _ in range(nets)]
    s = torch.tensor(strengths, device=device)
    out = kernels.control_merge(res, s)
    tol = 3 * TOL[dtype]  # one rounding per launch over the nets: at most three groups here
    cpu_res = [[r.cpu() for r in net] for net in res]
    ref, mag = _ref(cpu_res, s.cpu()), _magnitude(cpu_res, s.cpu())
    for k, (o, r, m) in enumerate(zip(out, ref, mag, strict=True)):
        assert o.shape == shapes[k] and o.dtype == dtype and o.device.type == device
        assert _within_terms(o.cpu(), r, m, dtype, tol), (k, _rel(o.cpu(), r))
    hidden = [_make(sh, dtype, transposed, gen, device) for sh in shapes]
    before = [h.cpu().double() for h in hidden]
    kernels.control_merge_add_(hidden, res, s)
    for h, b, r, m in zip(hidden, before, ref, mag, strict=True):
        assert _within_terms(h.cpu(), b + r, m + b.abs(), dtype, tol), _rel(h.cpu(), b + r)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=_merge_case())
def test_fuzz_merge_dispatch_never_reaches_a_kernel_outside_its_limits(strict, case):
    _check_merge_case(case, "cpu")


@st.composite
def _quant_case(draw):
    shape = draw(_SHAPE)
    dtype = draw(st.sampled_from(FLOATS))
    return shape, dtype, draw(st.booleans())


def _check_quant_case(case, device):
    shape, dtype, transposed = case
    gen = torch.Generator(device=device).manual_seed(sum(shape))
    x = _make(shape, dtype, transposed, gen, device)
    q, scale = kernels.quantize_int8(x)
    assert q.shape == x.shape and scale.shape == shape[:2]
    deq = q.cpu().double() * scale.cpu().double().reshape(*shape[:2], 1, 1)
    xd = x.cpu().double()
    bound = scale.cpu().double().reshape(*shape[:2], 1, 1) * 0.51 + xd.abs() * TOL[dtype]
    assert ((deq - xd).abs() <= bound + 1e-12).all()
    h = _make(shape, dtype, transposed, gen, device)
    h0 = h.cpu().double()
    kernels.dequant_add_(h, q, scale, torch.tensor(0.5, device=device))
    assert _rel(h.cpu(), h0 + 0.5 * deq) <= 2 * TOL[dtype]
    w = torch.randint(-127, 128, (shape[1], shape[0] * 3), generator=gen, device=device).to(
        torch.int8
    )
    ws = torch.rand(shape[1], generator=gen, device=device)
    got = kernels.dequant_rows(w, ws, dtype)
    assert _rel(got.cpu(), w.cpu().double() * ws.cpu().double()[:, None]) <= TOL[dtype]


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=_quant_case())
def test_fuzz_quant_dispatch_never_reaches_a_kernel_outside_its_limits(strict, case):
    _check_quant_case(case, "cpu")


@st.composite
def _gn_case(draw):
    b, c, h, w = draw(_SHAPE)
    groups = draw(st.sampled_from([1, 2, 4, 8, 32]))
    c = groups * max(1, c // groups)
    h = max(h, 2)  # GroupNorm needs more than one value per group
    x_dtype = draw(st.sampled_from(FLOATS))
    p_dtype = draw(st.sampled_from([x_dtype, torch.float32]))
    return (b, c, h, w), groups, x_dtype, p_dtype, draw(st.booleans())


def _check_gn_case(case, device):
    shape, groups, x_dtype, p_dtype, transposed = case
    gen = torch.Generator(device=device).manual_seed(sum(shape) + groups)
    x = _make(shape, x_dtype, transposed, gen, device)
    w = (torch.rand(shape[1], generator=gen, device=device) + 0.5).to(p_dtype)
    b = torch.randn(shape[1], generator=gen, device=device).to(p_dtype)
    got = kernels.group_norm_silu(x, w, b, groups)
    xc, wc, bc = x.cpu().double(), w.cpu().double(), b.cpu().double()
    ref = torch.nn.functional.silu(torch.nn.functional.group_norm(xc, groups, wc, bc, 1e-5))
    # the reduction rule of test_ops: at most twice PyTorch's own error doing the same math in
    # x's dtype (its affine parameters cast to it, as the CUDA GroupNorm requires)
    low = torch.nn.functional.silu(
        torch.nn.functional.group_norm(x, groups, w.to(x_dtype), b.to(x_dtype), 1e-5)
    )
    torch_err = _rel(low.cpu(), ref)
    err = _rel(got.cpu(), ref)
    assert got.shape == x.shape
    assert err <= max(2 * torch_err, TOL[x_dtype]) + 1e-6, (err, torch_err, case)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=_gn_case())
def test_fuzz_group_norm_dispatch_never_reaches_a_kernel_outside_its_limits(strict, case):
    _check_gn_case(case, "cpu")


# -- the same on the GPU, against the real kernels ---------------------------------------------


def _real_cuda():
    if not torch.cuda.is_available() or _jit.ensure_loaded() is None:
        pytest.skip("CUDA extension not loaded: " + str(kernels.list_backends()))
    return kernels.use_backend("cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("nets", list(range(1, 13)))
def test_cuda_control_merge_any_number_of_nets(nets):
    with _real_cuda():
        from comfyui_controlnet_accelerator.harness.kernel_bench import SD15_SLOTS

        gen = torch.Generator(device="cuda").manual_seed(nets)
        res = [
            [torch.randn(s, generator=gen, device="cuda").half() for s in SD15_SLOTS]
            for _ in range(nets)
        ]
        s = torch.rand(nets, generator=gen, device="cuda") / nets
        out = kernels.control_merge(res, s)
        with kernels.use_backend("eager"):
            want = kernels.control_merge(res, s)
        for o, w in zip(out, want, strict=True):
            assert _rel(o, w) <= TOL[torch.float16]


@pytest.mark.cuda
@settings(max_examples=150, deadline=None)
@given(case=_merge_case())
def test_cuda_fuzz_merge(case):
    with _real_cuda():
        _check_merge_case(case, "cuda")
    torch.cuda.synchronize()


@pytest.mark.cuda
@settings(max_examples=100, deadline=None)
@given(case=_quant_case())
def test_cuda_fuzz_quant(case):
    with _real_cuda():
        _check_quant_case(case, "cuda")
    torch.cuda.synchronize()


@pytest.mark.cuda
@settings(max_examples=100, deadline=None)
@given(case=_gn_case())
def test_cuda_fuzz_group_norm(case):
    with _real_cuda():
        _check_gn_case(case, "cuda")
    torch.cuda.synchronize()


_RAW_CALL = """
import importlib.util, sys
import torch
spec = importlib.util.spec_from_file_location(
    "cna_raw", {init!r}, submodule_search_locations=[{root!r}])
m = importlib.util.module_from_spec(spec); sys.modules["cna_raw"] = m; spec.loader.exec_module(m)
from cna_raw.kernels import _jit
mod = _jit.ensure_loaded()
case = sys.argv[1]
try:
    if case == "group_norm_groups":
        x = torch.randn(1, 30, 4, 4, device="cuda")
        w, b = torch.ones(30, device="cuda"), torch.zeros(30, device="cuda")
        mod.group_norm_silu(x, w, b, 32, 1e-5)
    else:
        res = [torch.randn(2, 8, device="cuda") for _ in range(5)]
        mod.control_merge(res, torch.ones(5, device="cuda"), 5)
    print("RETURNED")
except RuntimeError as e:
    print("RAISED", str(e).splitlines()[0])
"""


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["group_norm_groups", "merge_too_many_nets"])
def test_a_failed_check_in_the_cuda_code_raises_instead_of_crashing(case):
    """The extension's own checks (behind the Python ones) must raise, not end the process."""
    import subprocess
    import sys

    if not torch.cuda.is_available() or _jit.ensure_loaded() is None:
        pytest.skip("CUDA extension not loaded: " + str(kernels.list_backends()))
    root = Path(_jit.__file__).resolve().parents[1]
    code = _RAW_CALL.format(init=str(root / "__init__.py"), root=str(root))
    p = subprocess.run(
        [sys.executable, "-c", code, case], capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, f"process ended with {p.returncode}: {p.stderr[-2000:]}"
    assert "RAISED" in p.stdout, p.stdout
