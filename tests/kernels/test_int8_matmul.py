# SPDX-License-Identifier: GPL-3.0-or-later
"""``int8_linear``: the Memory Pool's INT8 Linear as one matrix multiply reading the INT8
weight (a Triton kernel), against an fp64 reference ``x @ (q · scale)ᵀ + bias``.

Tolerance: the kernel accumulates in fp32 and rounds once to the output dtype, so its error
against the fp64 reference is that rounding (relative L2 1e-3 for fp16, 8e-3 for bf16), and no
larger than the expansion path's (which also rounds the weight to fp16 first) by more than a
small margin. On the CPU the kernel itself runs in Triton's interpreter (fp16 only: the
interpreter has no bf16 arithmetic), in a child process, since the interpreter is chosen when
the kernel is defined.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from comfyui_controlnet_accelerator import kernels
from comfyui_controlnet_accelerator.kernels import _jit, int8_matmul, registry
from comfyui_controlnet_accelerator.memory import weight_compress as wc

TOL = {torch.float16: 1e-3, torch.bfloat16: 8e-3}
# (tokens M, outputs N, inputs K): SD1.5 / SDXL attention and GEGLU at 512²–1024² with CFG,
# cross-attention's context (77 tokens, twice), and odd sizes that leave partial tiles.
SHAPES = [
    (8192, 320, 320),
    (2048, 10240, 1280),
    (2048, 1280, 5120),
    (154, 640, 2048),
    (154, 1280, 768),
    (1, 1280, 320),
    (37, 99, 48),
    (300, 130, 208),
]


def _ref(x, q, scale, bias):
    y = x.double() @ (q.double() * scale.double().reshape(-1, 1)).T
    return y if bias is None else y + bias.double()


def _rel(got, ref):
    return ((got.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _inputs(m, n, k, dtype, device, seed, bias=True):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, generator=g, device=device).to(dtype)
    q = torch.randint(-127, 128, (n, k), generator=g, device=device, dtype=torch.int8)
    scale = torch.rand(n, generator=g, device=device) * 0.02 + 1e-4
    b = torch.randn(n, generator=g, device=device).to(dtype) if bias else None
    return x, q, scale, b


# -- CPU ------------------------------------------------------------------------------------------


def test_the_cpu_path_is_the_expansion_then_linear():
    x, q, scale, b = _inputs(5, 24, 32, torch.float32, "cpu", 1)
    got = kernels.int8_linear(x.reshape(1, 5, 32), q, scale, b)
    want = F.linear(x, kernels.dequant_rows(q, scale, x.dtype), b)
    assert got.shape == (1, 5, 24)
    assert torch.equal(got.reshape(5, 24), want)


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda a: {**a, "x": a["x"].float()}, "dtype"),
        (lambda a: {**a, "x": a["x"][:, :40], "q": a["q"][:, :40].contiguous()}, "multiple of 16"),
        (lambda a: {**a, "q": a["q"][:, :32].contiguous()}, "features"),
        (lambda a: {**a, "scale": a["scale"][:-1]}, "one float32 value per output"),
        (lambda a: {**a, "bias": a["bias"].float()}, "bias"),
        (lambda a: a, "tensors on cpu"),
    ],
    ids=["fp32", "k", "mismatch", "scale", "bias", "cpu"],
)
def test_problem_names_what_the_kernel_cannot_take(change, reason):
    x, q, scale, b = _inputs(4, 8, 48, torch.float16, "cpu", 2)
    a = change({"x": x, "q": q, "scale": scale, "bias": b})
    why = int8_matmul.problem(a["x"], a["q"], a["scale"], a["bias"])
    assert why is not None and reason in why


def test_default_tiles_cover_every_token_count():
    seen = set()
    for m in (1, 32, 33, 64, 65, 256, 257, 10**6):
        cfg = int8_matmul.default_config(m, 1280, 1280)
        assert cfg.bk % 16 == 0 and cfg.bn >= 64 and cfg.warps in (4, 8)
        seen.add(cfg)
    assert len(seen) == 4  # a tile per token-count class
    # bfloat16's square tile keeps 4 warps (see default_config), float16's has 8
    assert int8_matmul.default_config(2048, 10240, 1280, torch.bfloat16).warps == 4
    assert int8_matmul.default_config(2048, 10240, 1280, torch.float16).warps == 8


def test_a_changed_kernel_source_is_not_used_by_default(monkeypatch):
    registry.refresh_mode()
    monkeypatch.delenv("CNA_KERNELS", raising=False)
    try:
        h = registry.triton_source_hash("int8_linear")
        monkeypatch.setattr(registry, "VALIDATED_TRITON", {"int8_linear": h})
        assert registry._cuda_by_default("int8_linear")
        monkeypatch.setattr(registry, "VALIDATED_TRITON", {"int8_linear": "0" * 16})
        assert not registry._cuda_by_default("int8_linear")
        monkeypatch.setenv("CNA_KERNELS", "cuda")
        registry.refresh_mode()
        assert registry._cuda_by_default("int8_linear")
    finally:
        monkeypatch.delenv("CNA_KERNELS", raising=False)
        registry.refresh_mode()


_INTERPRETED = textwrap.dedent(
    """
    import importlib.util, json, sys, torch
    spec = importlib.util.spec_from_file_location("int8_matmul_under_test", sys.argv[1])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cases = json.loads(sys.argv[2])
    out = []
    for m, n, k, bias, cfg, lead in cases:
        g = torch.Generator().manual_seed(m * 131 + n)
        x = torch.randn(m, k, generator=g).half()
        q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        s = torch.rand(n, generator=g) * 0.02 + 1e-4
        b = torch.randn(n, generator=g).half() if bias else None
        xin = x.reshape(*lead, m // (lead[0] if lead else 1), k) if lead else x
        y = mod.linear(xin, q, s, b, mod.Config(*cfg) if cfg else None)
        ref = x.double() @ (q.double() * s.double()[:, None]).T
        if b is not None:
            ref = ref + b.double()
        exp = torch.nn.functional.linear(x.float(), (q.float() * s[:, None]).half().float(),
                                         None if b is None else b.float()).half()
        assert tuple(y.shape) == (*xin.shape[:-1], n), (y.shape, xin.shape)
        y = y.reshape(m, n)
        rel = ((y.double() - ref).norm() / ref.norm()).item()
        rel_exp = ((exp.double() - ref).norm() / ref.norm()).item()
        out.append([rel, rel_exp])
    print(json.dumps(out))
    """
)


# A kernel whose loop bound comes from an argument, the way the INT8 kernel's does. Triton 3.6's
# interpreter turns that bound into an int with ``int()`` of a one-element array, which NumPy
# 2.5 refuses ("only 0-dimensional arrays can be converted to Python scalars"); later Triton
# squeezes the array first. Run only when the INT8 kernel failed in the interpreter, to tell
# that interpreter apart from a fault of the kernel.
_LOOP_BOUND_PROBE = textwrap.dedent(
    """
    import torch, triton, triton.language as tl

    @triton.jit
    def count(out_ptr, n, B: tl.constexpr):
        for i in range(0, tl.cdiv(n, B)):
            tl.store(out_ptr + i, i)

    out = torch.zeros(4, dtype=torch.int32)
    count[(1,)](out, 8, B=2)
    assert out.tolist() == [0, 1, 2, 3], out
    """
)


def _interpreter_takes_loop_bounds(env: dict) -> tuple[bool, str]:
    """Whether the probe ran in the interpreter, and the end of its error output."""
    res = subprocess.run(
        [sys.executable, "-c", _LOOP_BOUND_PROBE], capture_output=True, text=True, env=env,
        timeout=300,
    )  # fmt: skip
    return res.returncode == 0, res.stderr[-500:]


def test_the_kernel_in_the_interpreter_matches_the_reference(tmp_path):
    pytest.importorskip("triton", reason="Triton is not installed")
    src = Path(int8_matmul.__file__)
    # the module imports its limits relatively; the child loads it as a lone file
    code = src.read_text().replace("from .constraints import CUDA_LIMITS", "CUDA_LIMITS = {}")
    lone = tmp_path / "int8_matmul.py"
    lone.write_text(code)
    cases = [
        # m, n, k, bias, explicit tile (small, so the interpreter stays quick), leading dims
        [50, 96, 80, True, [64, 32, 32, 4, 2], []],  # K not a multiple of BK: masked depth
        [130, 64, 64, False, [32, 64, 32, 4, 2], [2]],  # partial token tile, 3-D input
        [7, 33, 48, True, [16, 16, 16, 1, 1], []],  # partial tiles everywhere
        [64, 48, 32, True, [16, 16, 16, 1, 1, 2], []],  # grouped order over several tiles
        [3, 40, 32, True, None, []],  # the default tile for few tokens
    ]
    import json

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run(
        [sys.executable, "-c", _INTERPRETED, str(lone), json.dumps(cases)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    if res.returncode != 0:
        ok, why = _interpreter_takes_loop_bounds(env)
        if not ok and "0-dimensional arrays" in why:
            import numpy
            import triton

            pytest.skip(
                f"Triton {triton.__version__}'s interpreter cannot run a loop whose bound comes "
                f"from an argument under NumPy {numpy.__version__} (a one-element array to int): "
                f"{why.strip().splitlines()[-1] if why.strip() else 'no message'}"
            )
    assert res.returncode == 0, res.stderr[-3000:]
    errs = json.loads(res.stdout.strip().splitlines()[-1])
    for case, (rel, rel_exp) in zip(cases, errs, strict=True):
        assert rel <= TOL[torch.float16], (case, rel)
        assert rel <= rel_exp * 1.5 + 1e-4, (case, rel, rel_exp)


# -- CUDA -----------------------------------------------------------------------------------------


def _cuda_ready():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    if int8_matmul.triton_missing():
        pytest.skip(int8_matmul.triton_missing())
    _jit.ensure_loaded()  # dequant_rows, for the expansion path compared against


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_cuda_kernel_matches_the_reference(dtype, shape):
    _cuda_ready()
    m, n, k = shape
    for seed, bias in ((3, True), (4, False)):  # fresh inputs each check
        x, q, scale, b = _inputs(m, n, k, dtype, "cuda", seed + m + n, bias)
        with kernels.use_backend("cuda"):
            y = kernels.int8_linear(x, q, scale, b)
        assert y.dtype == dtype and y.shape == (m, n)
        ref = _ref(x, q, scale, b)
        with kernels.use_backend("eager"):
            expanded = kernels.int8_linear(x, q, scale, b)
        rel, rel_exp = _rel(y, ref), _rel(expanded, ref)
        assert rel <= TOL[dtype], (shape, rel)
        assert rel <= rel_exp * 1.5 + 1e-4, (shape, rel, rel_exp)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_cuda_kernel_gives_the_same_finite_result_call_after_call(dtype):
    """The large tile, called again and again on one input: every output finite and equal to
    the first (8-warp bfloat16 code now and then wrote wrong values: default_config)."""
    _cuda_ready()
    x, q, scale, b = _inputs(2048, 10240, 1280, dtype, "cuda", 12292, False)
    with kernels.use_backend("cuda"):
        first = kernels.int8_linear(x, q, scale, b)
        assert torch.isfinite(first).all()
        assert _rel(first, _ref(x, q, scale, b)) <= TOL[dtype]
        for _ in range(12):
            assert torch.equal(kernels.int8_linear(x, q, scale, b), first)


@pytest.mark.cuda
def test_cuda_kernel_replays_in_a_cuda_graph_and_under_compile():
    _cuda_ready()
    x, q, scale, b = _inputs(154, 640, 768, torch.float16, "cuda", 9)
    with kernels.use_backend("cuda"):
        want = kernels.int8_linear(x, q, scale, b)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            kernels.int8_linear(x, q, scale, b)  # warm-up: compiles outside the capture
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = kernels.int8_linear(x, q, scale, b)
        x.copy_(torch.randn_like(x))
        want2 = kernels.int8_linear(x, q, scale, b)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want2) and not torch.equal(want, want2)
        compiled = torch.compile(lambda t: kernels.int8_linear(t, q, scale, b), fullgraph=True)
        assert torch.equal(compiled(x), want2)


@pytest.mark.cuda
def test_int8_linear_layer_uses_the_kernel_and_stays_close_to_the_original():
    _cuda_ready()
    torch.manual_seed(5)
    lin = torch.nn.Linear(1280, 5120).cuda().half()
    layer = wc.compress(lin, mode="int8")
    x = torch.randn(2, 1024, 1280, device="cuda", dtype=torch.float16)
    with kernels.use_backend("cuda"):
        got = layer(x)
    with kernels.use_backend("eager"):
        expanded = layer(x)
    ref = lin(x)
    # INT8 weights: the layer's own quantization error, the same on both paths
    assert _rel(got, ref.double()) < 1e-2
    assert _rel(got, expanded.double()) < 2e-3
