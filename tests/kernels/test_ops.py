# SPDX-License-Identifier: GPL-3.0-or-later
"""Kernel ops against independent fp32 references written here (not the eager module).

Tier 1 (always, CPU): the eager backend vs the references. Tier 2 (``cuda``): the CUDA backend
vs the same references with fresh random inputs each check, odd sizes, outputs poisoned first.
Tolerances per dtype (relative L2 error against the fp32 reference): the result is rounded once
to the output dtype, so the error is that dtype's rounding: fp32 1e-6, bf16 8e-3, fp16 1e-3.
"""

from __future__ import annotations

import pytest
import torch
from comfyui_controlnet_accelerator import kernels
from comfyui_controlnet_accelerator.harness.kernel_bench import SD15_SLOTS
from comfyui_controlnet_accelerator.kernels import _jit, registry

TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (B, C, H, W) residual slots: SD1.5 at 512² (SD15_SLOTS) and odd sizes that defeat vectors.
ODD_SLOTS = [(1, 3, 5, 7), (2, 5, 3, 3), (1, 1, 1, 1), (3, 7, 11, 13)]


def _ref_merge(residuals, strengths):
    return [
        sum(float(strengths[i]) * residuals[i][k].double() for i in range(len(residuals)))
        for k in range(len(residuals[0]))
    ]


def _ref_quant(x):
    b, c = x.shape[:2]
    xf = x.double().reshape(b, c, -1)
    amax = xf.abs().amax(-1)
    scale = amax / 127
    q = torch.where(
        amax[..., None] > 0,
        torch.round(xf / scale.clamp_min(1e-300)[..., None]),
        torch.zeros_like(xf),
    ).clamp(-127, 127)
    return q.reshape(x.shape), scale


def _rel(got, ref):
    ref = ref.double()
    den = ref.norm().item() or 1.0
    return (got.double() - ref).norm().item() / den


def _assert_close(got, ref, dtype, what):
    err = _rel(got, ref)
    if not err <= TOL[dtype]:
        diff = (got.double() - ref.double()).abs().flatten()
        idx = diff.topk(min(5, diff.numel())).indices
        pairs = [(int(i), float(got.flatten()[i]), float(ref.flatten()[i])) for i in idx]
        pytest.fail(
            f"{what}: rel err {err:.3g} > {TOL[dtype]:g}; worst (index, got, expected): {pairs}"
        )


def _residuals(nets, shapes, dtype, device, gen):
    return [
        [torch.randn(s, generator=gen, device=device).to(dtype) for s in shapes]
        for _ in range(nets)
    ]


def _cuda_ready():
    if not torch.cuda.is_available():
        return False
    return _jit.ensure_loaded() is not None


def _devices():
    return ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _setup(device):
    if device == "cuda" and not _cuda_ready():
        pytest.skip("CUDA extension not loaded: " + str(kernels.list_backends()))
    return kernels.use_backend("cuda" if device == "cuda" else "eager")


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nets", [1, 2, 3])
@pytest.mark.parametrize("shapes", [SD15_SLOTS, ODD_SLOTS], ids=["sd15", "odd"])
def test_control_merge(device, dtype, nets, shapes):
    with _setup(device):
        gen = torch.Generator(device=device).manual_seed(nets * 7 + len(shapes))
        for _ in range(2):  # fresh inputs each check
            res = _residuals(nets, shapes, dtype, device, gen)
            s = torch.rand(nets, generator=gen, device=device) * 2
            out = kernels.control_merge(res, s)
            for k, (o, r) in enumerate(zip(out, _ref_merge(res, s.cpu()), strict=True)):
                assert o.dtype == dtype and o.shape == res[0][k].shape
                _assert_close(o, r, dtype, f"slot {k}")


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nets", [1, 2])
def test_control_merge_add_in_place(device, dtype, nets):
    with _setup(device):
        gen = torch.Generator(device=device).manual_seed(3)
        shapes = SD15_SLOTS[:4] + ODD_SLOTS[:2]
        res = _residuals(nets, shapes, dtype, device, gen)
        hidden = [torch.randn(s, generator=gen, device=device).to(dtype) for s in shapes]
        before = [h.clone() for h in hidden]
        s = torch.tensor([0.7, 1.3][:nets], device=device)
        kernels.control_merge_add_(hidden, res, s)
        for k, (h, b, r) in enumerate(zip(hidden, before, _ref_merge(res, s.cpu()), strict=True)):
            _assert_close(h, b.double() + r, dtype, f"slot {k}")


def test_control_merge_zero_strength_leaves_hidden_exact():
    h = [torch.randn(2, 4, 3, 3).half()]
    before = h[0].clone()
    with kernels.use_backend("eager"):
        kernels.control_merge_add_(h, [[torch.randn(2, 4, 3, 3).half()]], torch.zeros(1))
    assert torch.equal(h[0], before)


def test_control_merge_rejects_mismatched_inputs_with_clear_errors():
    a = [torch.zeros(1, 2, 3, 3)]
    b = [torch.zeros(1, 2, 4, 4)]
    with pytest.raises(ValueError, match=r"residual\[1\]\[0\]"):
        kernels.control_merge([a, b], torch.ones(2))
    with pytest.raises(ValueError, match="strengths"):
        kernels.control_merge([a], torch.ones(2))


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape", [(2, 320, 64, 64), (2, 1280, 8, 8), (1, 3, 5, 7), (3, 1, 1, 1)], ids=str
)
def test_quantize_int8_matches_reference_and_bounds_error(device, dtype, shape):
    with _setup(device):
        gen = torch.Generator(device=device).manual_seed(sum(shape))
        x = (torch.randn(shape, generator=gen, device=device) * 3).to(dtype)
        x[0, 0] = 0  # an all-zero plane: scale 0, q 0
        q, scale = kernels.quantize_int8(x)
        rq, rscale = _ref_quant(x)
        assert q.dtype == torch.int8 and scale.dtype == torch.float32
        assert scale.shape == shape[:2]
        torch.testing.assert_close(scale.double(), rscale, rtol=1e-6, atol=0)
        # round-half-even ties and fp32 x/scale can move a value by one step at most
        assert (q.double() - rq).abs().max().item() <= 1
        assert (q.double() != rq).double().mean().item() < 1e-3
        deq = q.double() * scale.double()[..., None, None].reshape(
            *shape[:2], *([1] * (len(shape) - 2))
        )
        bound = scale.double().reshape(*shape[:2], *([1] * (len(shape) - 2))) * 0.5 + 1e-12
        err = (deq - x.double()).abs()
        assert (err <= bound * 1.01 + x.double().abs() * TOL[dtype]).all()
        assert torch.all(q[0, 0] == 0) and scale[0, 0] == 0


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dequant_add_matches_reference(device, dtype):
    with _setup(device):
        gen = torch.Generator(device=device).manual_seed(11)
        shape = (2, 640, 32, 32)
        x = torch.randn(shape, generator=gen, device=device).to(dtype)
        q, scale = kernels.quantize_int8(x)
        h = torch.randn(shape, generator=gen, device=device).to(dtype)
        h0 = h.clone()
        s = torch.tensor(0.75, device=device)
        kernels.dequant_add_(h, q, scale, s)
        ref = h0.double() + 0.75 * q.double() * scale.double()[..., None, None]
        _assert_close(h, ref, dtype, "dequant_add_")


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape",
    # SD conv and linear weights (vector path), conv_in's K = 36 and odd sizes (scalar path)
    [(1280, 1280, 3, 3), (640, 2048), (320, 4, 3, 3), (7, 5, 3), (1, 1)],
    ids=str,
)
def test_dequant_rows_matches_reference(device, dtype, shape):
    with _setup(device):
        gen = torch.Generator(device=device).manual_seed(13)
        q = torch.randint(-127, 128, shape, generator=gen, device=device, dtype=torch.int8)
        scale = torch.rand((shape[0],) + (1,) * (len(shape) - 1), generator=gen, device=device)
        out = kernels.dequant_rows(q, scale, dtype)
        assert out.dtype == dtype and out.shape == q.shape and out.device.type == device
        ref = q.double() * scale.double()
        _assert_close(out, ref, dtype, "dequant_rows")
        # a (R,) scale means the same
        _assert_close(kernels.dequant_rows(q, scale.flatten(), dtype), ref, dtype, "flat scale")


# An SDXL transformer block's ten INT8 weights, a ResBlock's convolutions, and 19 small ones
# (more than one launch takes); (320, 4, 3, 3) has K = 36, off the vector path.
MULTI_SHAPES = {
    "sdxl_block": [(1280, 1280)] * 4
    + [(1280, 1280), (1280, 2048), (1280, 2048), (1280, 1280)]
    + [(10240, 1280), (1280, 5120)],
    "resblock": [(640, 320, 3, 3), (640, 640, 3, 3), (640, 1280), (640, 320, 1, 1)],
    "many": [(16 * (i % 5 + 1), 32 * (i % 3 + 1)) for i in range(19)],
    "mixed": [(64, 64), (320, 4, 3, 3), (48, 16)],
}


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(MULTI_SHAPES))
def test_dequant_rows_multi_matches_reference(device, dtype, case):
    with _setup(device):
        gen = torch.Generator(device=device).manual_seed(17)
        shapes = MULTI_SHAPES[case]
        qs = [
            torch.randint(-127, 128, sh, generator=gen, device=device, dtype=torch.int8)
            for sh in shapes
        ]
        ss = [torch.rand(sh[0], generator=gen, device=device) + 1e-3 for sh in shapes]
        outs = kernels.dequant_rows_multi(qs, ss, dtype)
        base = outs[0].data_ptr()
        off = 0
        for k, (o, q, sc) in enumerate(zip(outs, qs, ss, strict=True)):
            assert o.dtype == dtype and o.shape == q.shape and o.device.type == device
            assert o.data_ptr() == base + off * o.element_size()  # one allocation, in order
            off += q.numel()
            ref = q.double() * sc.double().reshape((-1,) + (1,) * (q.dim() - 1))
            _assert_close(o, ref, dtype, f"weight {k} {tuple(q.shape)}")
            # bit for bit what expanding the weight alone gives
            assert torch.equal(o, kernels.dequant_rows(q, sc, dtype)), k


@pytest.mark.cuda
def test_dequant_rows_multi_in_a_cuda_graph_and_after_poisoning():
    with _setup("cuda"):
        gen = torch.Generator(device="cuda").manual_seed(19)
        shapes = MULTI_SHAPES["sdxl_block"] + MULTI_SHAPES["many"]
        qs = [
            torch.randint(-127, 128, sh, generator=gen, device="cuda", dtype=torch.int8)
            for sh in shapes
        ]
        ss = [torch.rand(sh[0], generator=gen, device="cuda") for sh in shapes]
        want = [kernels.dequant_rows(q, sc, torch.float16) for q, sc in zip(qs, ss, strict=True)]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            kernels.dequant_rows_multi(qs, ss, torch.float16)  # warm up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs = kernels.dequant_rows_multi(qs, ss, torch.float16)
        for o in outs:
            o.fill_(float("nan"))  # poison: the replay must write every element
        g.replay()
        torch.cuda.synchronize()
        for k, (o, w) in enumerate(zip(outs, want, strict=True)):
            assert torch.equal(o, w), k
        # new scales are read at the next replay (the graph holds addresses, not values)
        for sc in ss:
            sc.mul_(2)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(outs[3], kernels.dequant_rows(qs[3], ss[3], torch.float16))


@pytest.mark.cuda
def test_dequant_rows_multi_entry_point_refuses_what_it_cannot_do():
    with _setup("cuda"):
        ext = _jit.module()
        q = torch.zeros(4, 16, dtype=torch.int8, device="cuda")
        sc = torch.ones(4, device="cuda")
        out = torch.empty(64, dtype=torch.float16, device="cuda")
        ext.dequant_rows_multi_(out, [q], [sc])
        with pytest.raises(RuntimeError, match="out must hold every weight"):
            ext.dequant_rows_multi_(torch.empty(65, dtype=torch.float16, device="cuda"), [q], [sc])
        with pytest.raises(RuntimeError, match="multiple of 16"):
            ext.dequant_rows_multi_(
                torch.empty(36, dtype=torch.float16, device="cuda"),
                [torch.zeros(4, 9, dtype=torch.int8, device="cuda")],
                [sc],
            )
        with pytest.raises(RuntimeError, match="one per row"):
            ext.dequant_rows_multi_(out, [q], [torch.ones(3, device="cuda")])


def test_dequant_rows_rejects_a_scale_per_element():
    q = torch.zeros(4, 8, dtype=torch.int8)
    with pytest.raises(ValueError, match="one value per row"):
        kernels.dequant_rows(q, torch.ones(4, 8), torch.float32)


def _ref_gn_silu(x, w, b, groups, eps=1e-5):
    shape = x.shape
    g = x.double().reshape(shape[0], groups, -1)
    xn = (
        (g - g.mean(-1, keepdim=True)) / torch.sqrt(g.var(-1, unbiased=False, keepdim=True) + eps)
    ).reshape(shape)
    bshape = (1, shape[1], *([1] * (len(shape) - 2)))
    y = xn * w.double().reshape(bshape) + b.double().reshape(bshape)
    return y * torch.sigmoid(y)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape",
    [(2, 320, 64, 64), (2, 1280, 8, 8), (2, 640, 128, 128), (1, 64, 9, 7), (3, 32, 1, 1)],
    ids=str,
)
def test_group_norm_silu_matches_reference(device, dtype, shape):
    """Reduction rule: our error may be at most twice that of PyTorch's own GroupNorm + SiLU in
    the same dtype (and within the dtype's rounding tolerance)."""
    with _setup(device):
        gen = torch.Generator(device=device).manual_seed(sum(shape))
        x = (torch.randn(shape, generator=gen, device=device) * 2 + 0.5).to(dtype)
        w = (torch.rand(shape[1], generator=gen, device=device) + 0.5).to(dtype)
        b = torch.randn(shape[1], generator=gen, device=device).to(dtype)
        ref = _ref_gn_silu(x, w, b, 32)
        got = kernels.group_norm_silu(x, w, b, 32, 1e-5)
        assert got.dtype == dtype and got.shape == x.shape
        torch_err = _rel(
            torch.nn.functional.silu(torch.nn.functional.group_norm(x, 32, w, b, 1e-5)), ref
        )
        err = _rel(got, ref)
        # On the CPU the eager op IS PyTorch's GroupNorm + SiLU, so the rule above would compare
        # it with itself: there it must meet a fixed bound against the fp64 math, the dtype's
        # rounding, or 3e-5 for fp32: PyTorch's fp32 variance leaves ~1e-5 on groups of one
        # element, which 1/sqrt(eps) amplifies.
        bound = max(2 * torch_err, TOL[dtype]) if device == "cuda" else max(TOL[dtype], 3e-5)
        assert err <= bound, (err, torch_err)


def test_group_norm_silu_eager_matches_manual_reference():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 64, 9, 7, generator=gen)
    w = torch.rand(64, generator=gen) + 0.5
    b = torch.randn(64, generator=gen)
    g = x.double().reshape(2, 32, -1)
    xn = (
        (g - g.mean(-1, keepdim=True)) / torch.sqrt(g.var(-1, unbiased=False, keepdim=True) + 1e-5)
    ).reshape(x.shape)
    y = xn * w.double()[:, None, None] + b.double()[:, None, None]
    ref = y * torch.sigmoid(y)
    got = kernels.group_norm_silu(x, w, b, 32, 1e-5)
    assert _rel(got, ref) < 1e-6


def test_forced_build_failure_falls_back_to_eager_with_a_warning(monkeypatch, caplog):
    """Any build failure: one warning naming the reason, the cuda backend marked unavailable,
    and the ops still answer (eagerly)."""
    _jit.reset_for_tests()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def broken(*a, **k):
        raise RuntimeError("nvcc exploded: error in control_merge.cu")

    monkeypatch.setattr(_jit, "build", broken)
    try:
        with caplog.at_level("WARNING", logger="ControlNetAccelerator"):
            assert _jit.ensure_loaded() is None
            assert _jit.ensure_loaded() is None  # tried once only
        warned = [r.message for r in caplog.records if "unavailable" in r.message]
        assert len(warned) == 1 and "nvcc exploded" in warned[0]
        rep = {b["name"]: b for b in kernels.list_backends()}
        assert rep["cuda"]["available"] is False and "nvcc exploded" in rep["cuda"]["reason"]
        r = [[torch.ones(1, 2, 2, 2)]]
        assert registry.select("control_merge", r[0]) == "eager"
        out = kernels.control_merge(r, torch.tensor([2.0]))
        assert torch.equal(out[0], torch.full((1, 2, 2, 2), 2.0))
    finally:
        _jit.reset_for_tests()


def test_force_eager_switch(monkeypatch):
    _jit.reset_for_tests()
    monkeypatch.setenv("CNA_FORCE_EAGER", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    try:
        assert _jit.ensure_loaded() is None
        rep = {b["name"]: b for b in kernels.list_backends()}
        assert "CNA_FORCE_EAGER" in rep["cuda"]["reason"]
    finally:
        _jit.reset_for_tests()


def test_forcing_an_unusable_backend_lists_every_reason():
    with kernels.use_backend("cuda"), pytest.raises(kernels.NoCapableBackend, match="cuda: "):
        kernels.group_norm_silu(torch.zeros(1, 32, 2, 2), torch.ones(32), torch.zeros(32))


def test_cache_key_changes_with_sources_and_arch(tmp_path, monkeypatch):
    a = _jit.build_params("9.0")
    b = _jit.build_params("8.9")
    assert a != b and a["sources"] == b["sources"]
    assert set(a) >= {"sources", "torch", "cuda", "arch", "python", "nvcc_flags"}
    # the same sources elsewhere hash the same; one changed byte in one kernel changes the key
    import shutil

    csrc = tmp_path / "csrc"
    shutil.copytree(_jit.CSRC, csrc)
    monkeypatch.setattr(_jit, "CSRC", csrc)
    monkeypatch.setattr(_jit, "_sources_hash", None)
    assert _jit.build_params("9.0") == a
    cu = csrc / "ops" / "control_merge.cu"
    cu.write_text(cu.read_text() + "\n// changed\n")
    monkeypatch.setattr(_jit, "_sources_hash", None)
    c = _jit.build_params("9.0")
    assert c["sources"] != a["sources"] and {k: v for k, v in c.items() if k != "sources"} == {
        k: v for k, v in a.items() if k != "sources"
    }


def test_changed_kernel_sources_are_not_used_by_default(monkeypatch):
    """The automatic choice holds only for the sources that passed their GPU tests."""
    registry.refresh_mode()
    monkeypatch.delenv("CNA_KERNELS", raising=False)
    try:
        monkeypatch.setattr(_jit, "_sources_hash", registry.VALIDATED_SOURCES)
        assert registry._cuda_by_default("control_merge")
        monkeypatch.setattr(_jit, "_sources_hash", "0" * 16)
        assert not registry._cuda_by_default("control_merge")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(_jit, "cuda_home", lambda: "/opt/cuda")
        rep = {b["name"]: b for b in kernels.list_backends()}["cuda"]
        assert rep["available"] and not rep["used_by_default"]
        assert "validated" in rep["note"] and "CNA_KERNELS=cuda" in rep["note"]
        monkeypatch.setenv("CNA_KERNELS", "cuda")
        registry.refresh_mode()
        assert registry._cuda_by_default("control_merge")
    finally:
        monkeypatch.delenv("CNA_KERNELS", raising=False)
        registry.refresh_mode()


class _CudaTensorStandIn:
    """What ``registry.select`` reads of a CUDA tensor, for a machine without a GPU."""

    is_cuda = True
    device = torch.device("cuda")
    dtype = torch.float16


def test_unvalidated_sources_say_once_that_the_ops_run_on_pytorch(monkeypatch, caplog):
    """Changed kernel sources turn the CUDA ops off by default; the first op on a CUDA tensor
    says so in the log, once, with the switch that turns them on."""
    registry.refresh_mode()
    monkeypatch.delenv("CNA_KERNELS", raising=False)
    monkeypatch.setattr(_jit, "_sources_hash", "0" * 16)
    monkeypatch.setattr(registry, "_unvalidated_logged", False)
    t = _CudaTensorStandIn()
    try:
        with caplog.at_level("WARNING", logger="ControlNetAccelerator"):
            registry.select("control_merge", [torch.ones(2)])  # a CPU tensor: nothing to say
            assert not [r for r in caplog.records if "validated" in r.message]
            assert registry.select("control_merge", [t]) == "eager"
            assert registry.select("dequant_rows", [t, t, t]) == "eager"
        warned = [r.message for r in caplog.records if "validated" in r.message]
        assert len(warned) == 1 and "CNA_KERNELS=cuda" in warned[0]
        monkeypatch.setattr(registry, "_unvalidated_logged", False)
        monkeypatch.setattr(_jit, "_sources_hash", registry.VALIDATED_SOURCES)
        monkeypatch.setenv("CNA_KERNELS", "eager")  # a user's choice: nothing to say either
        registry.refresh_mode()
        caplog.clear()
        with caplog.at_level("WARNING", logger="ControlNetAccelerator"):
            assert registry.select("control_merge", [t]) == "eager"
        assert not [r for r in caplog.records if "validated" in r.message]
    finally:
        monkeypatch.delenv("CNA_KERNELS", raising=False)
        registry.refresh_mode()


def test_shipped_kernel_sources_are_the_validated_ones(monkeypatch):
    """The pack ships the kernel sources its GPU tests last passed on; otherwise the automatic
    choice quietly runs every op on PyTorch's path for every user."""
    monkeypatch.setattr(_jit, "_sources_hash", None)  # hash the files on disk now
    assert _jit.sources_hash() == registry.VALIDATED_SOURCES, (
        "the CUDA kernel sources changed since their GPU tests last passed: run "
        "`CNA_KERNELS=cuda python -m pytest -m cuda tests/kernels` on a GPU, then set "
        f"kernels/registry.py's VALIDATED_SOURCES to {_jit.sources_hash()!r}"
    )


@pytest.mark.parametrize(
    "setup, reason",
    [
        ({"gpu": False}, "no CUDA GPU visible"),
        ({"nvcc": False}, "no CUDA compiler"),
        ({"env": ("CNA_KERNELS", "eager")}, "switched off (CNA_KERNELS=eager)"),
        ({"env": ("CNA_FORCE_EAGER", "1")}, "switched off (CNA_FORCE_EAGER=1)"),
    ],
    ids=["no-gpu", "no-compiler", "kernels-eager", "force-eager"],
)
def test_list_backends_says_why_cuda_is_not_used_on_this_machine(monkeypatch, setup, reason):
    _jit.reset_for_tests()
    monkeypatch.delenv("CNA_KERNELS", raising=False)
    monkeypatch.delenv("CNA_FORCE_EAGER", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: setup.get("gpu", True))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(_jit, "cuda_home", lambda: "/opt/cuda" if setup.get("nvcc", True) else None)
    if "env" in setup:
        monkeypatch.setenv(*setup["env"])
    registry.refresh_mode()
    try:
        rep = {b["name"]: b for b in kernels.list_backends()}["cuda"]
        assert rep["available"] is False and rep["used_by_default"] is False
        assert reason in rep["reason"]
    finally:
        monkeypatch.delenv("CNA_KERNELS", raising=False)
        registry.refresh_mode()
        _jit.reset_for_tests()
