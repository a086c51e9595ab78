# SPDX-License-Identifier: GPL-3.0-or-later
"""The feed-forward projection with its GEGLU in the GEMM's epilogue: the Triton kernel against
an fp64 reference, the ``cna::geglu_linear`` op, and the graph rewrite that puts it into
compiled code.

Tier 1 (CPU): the kernel's own code in Triton's interpreter (fp32, small tiles, shapes that
leave partial tiles in every direction), the op's PyTorch path, and the rewrite (forced on,
since the kernel does not serve the CPU) with its compiled result against eager. Tier 2
(``cuda``): the kernel at SD1.5 and SDXL shapes in fp16 and bf16, in a CUDA graph, and inside
inductor's code.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from comfyui_controlnet_accelerator.graphs.compiled import CompiledModule, CompileOptions
from comfyui_controlnet_accelerator.kernels import geglu_linear as gl
from comfyui_controlnet_accelerator.kernels import ops
from comfyui_controlnet_accelerator.kernels.fx_rewrites import GEGLU_ENV, GegluRewrite


def _rel(got, ref):
    ref = ref.double()
    return (got.double() - ref).norm().item() / (ref.norm().item() or 1.0)


def _inputs(m, n2, k, dtype, device, seed=0, bias=True):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, generator=g, device=device).to(dtype)
    w = (torch.randn(n2, k, generator=g, device=device) * k**-0.5).to(dtype)
    b = (torch.randn(n2, generator=g, device=device) * 0.1).to(dtype) if bias else None
    return x, w, b


def _ref64(x, w, b):
    return gl.reference(x.double(), w.double(), None if b is None else b.double())


def _reload_kernel():
    name = gl.__name__.rsplit(".", 1)[0] + "._geglu_triton"
    if name in sys.modules:
        importlib.reload(sys.modules[name])
    gl._kernel.cache_clear()
    gl._kernel_tma.cache_clear()


@pytest.fixture
def interpreted(monkeypatch):
    """The kernel's code run by Triton's interpreter on the CPU (Triton decides when the kernel
    is defined, so its module is loaded again around each test)."""
    if gl.triton_missing() is not None:
        pytest.skip(gl.triton_missing())
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _reload_kernel()
    yield
    monkeypatch.delenv("TRITON_INTERPRET")
    _reload_kernel()


@pytest.mark.parametrize(
    ("m", "n2", "k", "bias", "tile"),
    [
        (37, 96, 48, True, (16, 16, 16, 1, 1, 2)),  # partial tiles in tokens and outputs
        (64, 128, 64, False, (32, 32, 32, 1, 1, 8)),  # even everywhere, no bias
        (5, 64, 40, True, (16, 32, 16, 1, 1, 1)),  # depth not a multiple of the tile's
        (50, 160, 32, True, (16, 16, 32, 1, 1, 3)),  # groups of 3 token tiles, 5 output tiles
    ],
)
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_the_kernel_matches_the_reference_in_the_interpreter(
    interpreted, monkeypatch, m, n2, k, bias, tile, tma
):
    x, w, b = _inputs(m, n2, k, torch.float32, "cpu", bias=bias)
    assert gl._tma_ok(x, w, n2 // 2) == (k % 4 == 0 and n2 // 2 % 4 == 0)
    with monkeypatch.context() as mp:
        if tma:  # the descriptor kernel runs, not the other one
            mp.setattr(gl, "_kernel", lambda: pytest.fail("the pointer kernel ran"))
        got = gl.geglu_linear(x, w, b, gl.Config(*tile, tma=tma))
    assert got.shape == (m, n2 // 2)
    assert _rel(got, _ref64(x, w, b)) < 1e-5


def test_the_kernel_takes_any_leading_shape_and_a_strided_input(interpreted):
    x, w, b = _inputs(2 * 7 * 3, 64, 32, torch.float32, "cpu")
    x3 = x.reshape(2, 21, 32)
    wide = torch.cat([x3, x3], dim=-1)[..., :32]  # rows not contiguous with each other
    got = gl.geglu_linear(wide, w, b, gl.Config(16, 16, 16, 1, 1))
    assert got.shape == (2, 21, 32)
    assert _rel(got, _ref64(x3, w, b)) < 1e-5


def test_a_descriptor_tile_the_operands_cannot_take_runs_on_pointers(interpreted, monkeypatch):
    x, w, b = _inputs(21, 64, 32, torch.float32, "cpu")
    xs = torch.zeros(21, 33)[:, :32]  # rows 132 bytes apart: not a descriptor's 16-byte step
    xs.copy_(x)
    assert not gl._tma_ok(xs, w, 32)
    real, seen = gl._kernel, {}

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.update(kw)
                return real()[grid](*args, **kw)

            return launch

    with monkeypatch.context() as mp:
        mp.setattr(gl, "_kernel", Spy)
        mp.setattr(gl, "_kernel_tma", lambda: pytest.fail("the descriptor kernel ran"))
        got = gl.geglu_linear(xs, w, b, gl.Config(16, 16, 16, 1, 5, 2, True))
    assert seen["num_stages"] == 3  # the pointer kernel's stages hold more: capped
    assert _rel(got, _ref64(x, w, b)) < 1e-5


def test_the_op_runs_pytorchs_path_off_the_gpu_and_checks_the_weight():
    x, w, b = _inputs(10, 64, 32, torch.float32, "cpu")
    x = x.reshape(2, 5, 32)
    assert torch.equal(ops.geglu_linear(x, w, b), gl.reference(x, w, b))
    assert torch.equal(ops.geglu_linear(x, w, None), gl.reference(x, w, None))
    with pytest.raises(ValueError, match="geglu_linear"):
        ops.geglu_linear(x, w[:63], b[:63])
    with pytest.raises(ValueError, match="geglu_linear"):
        ops.geglu_linear(x, w[:, :16], b)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fx, fw = mode.from_tensor(x), mode.from_tensor(w)
        assert torch.ops.cna.geglu_linear(fx, fw, None).shape == (2, 5, 32)


def test_the_kernel_says_what_it_cannot_take():
    x, w, b = _inputs(8, 64, 32, torch.float16, "cpu")
    assert "cpu" in gl.problem(x, w, b)
    assert "dtype" in gl.problem(x.float(), w, b)
    assert "even" in gl.problem(x, w[:63], b[:63])
    assert "multiple of 16" in gl.problem(x[:, :24], w[:, :24], b)
    assert "bias" in gl.problem(x, w, b[:10])


def test_the_tile_follows_the_measured_rule():
    # 128 × 128 by descriptors where that leaves at least 512 tiles, else 128 × 64 by
    # pointers; 64 × 64 for few tokens
    big = gl.Config(128, 128, 64, 8, 4, 8, True)
    assert gl.default_config(8192, 1280, 320) == big  # SD1.5 512², first level
    assert gl.default_config(2048, 5120, 1280) == big  # SDXL 1024², second level
    assert gl.default_config(2048, 2560, 640) == (128, 64, 64, 8, 3, 8, False)  # SD1.5, 2nd
    assert gl.default_config(512, 5120, 1280)[:2] == (128, 64)  # SD1.5 512², third level
    assert gl.default_config(32, 5120, 1280)[:2] == (64, 64)


class FeedForward(nn.Module):
    """ComfyUI's FeedForward with GEGLU (comfy/ldm/modules/attention.py), three of them: one
    as ComfyUI writes it, one with the tanh GELU and one whose projection is also used
    elsewhere (neither is this GEGLU: both are left alone)."""

    def __init__(self, dim=32, inner=48):
        super().__init__()
        self.proj = nn.ModuleList(nn.Linear(dim, inner * 2) for _ in range(3))
        self.out = nn.ModuleList(nn.Linear(inner, dim) for _ in range(3))

    def forward(self, x):
        v, gate = self.proj[0](x).chunk(2, dim=-1)
        h = self.out[0](v * F.gelu(gate))
        v, gate = self.proj[1](h).chunk(2, dim=-1)
        h = self.out[1](v * F.gelu(gate, approximate="tanh"))
        p = self.proj[2](h)
        v, gate = p.chunk(2, dim=-1)
        return self.out[2](v * F.gelu(gate)) + p.sum()


def _graph_of(m, x, rewrite=None):
    got = []

    def backend(gm, example_inputs):
        if rewrite is not None:
            got.append(rewrite.rewrite(gm))
        got.insert(0, gm)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(m, backend=backend)(x)
    return got, out


def _calls(gm):
    return [n for n in gm.graph.nodes if n.target is torch.ops.cna.geglu_linear.default]


def test_the_rewrite_takes_comfyuis_geglu_and_nothing_else():
    torch.manual_seed(0)
    m = FeedForward().eval().requires_grad_(False)
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        (gm, done), got = _graph_of(m, x, GegluRewrite(force=True))
        ref = m(x)
    assert done == 1 and len(_calls(gm)) == 1
    assert len([n for n in gm.graph.nodes if n.op == "call_method" and n.target == "chunk"]) == 2
    assert torch.equal(got, ref)  # on the CPU the op is PyTorch's own path


def test_the_rewrite_takes_the_token_counts_where_the_kernel_measured_faster():
    from comfyui_controlnet_accelerator.kernels.fx_rewrites import geglu_pays

    # the UNet's first level at batch 2 (SD1.5 512², SDXL 1024², SD1.5 1024²), not the deeper
    assert geglu_pays(8192) and geglu_pays(32768)
    assert not geglu_pays(2048) and not geglu_pays(512) and not geglu_pays(8191)


def test_the_rewrite_is_off_where_the_kernel_does_not_serve(monkeypatch):
    """Not forced: on the CPU the graph is left to inductor; under grad mode with trainable
    weights, too. It is opt-in (``CNA_COMPILE_GEGLU=1``)."""
    torch.manual_seed(0)
    m = FeedForward().eval()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        (gm,), _ = _graph_of(m, x)
        assert GegluRewrite().rewrite(gm) == 0 and GegluRewrite()(gm) is None
    (gm,), _ = _graph_of(m, x)
    assert GegluRewrite(force=True).rewrite(gm) == 0  # weights that train: left alone
    from comfyui_controlnet_accelerator.kernels import fx_rewrites

    monkeypatch.delenv(GEGLU_ENV, raising=False)
    assert not fx_rewrites.geglu_enabled()
    monkeypatch.setenv(GEGLU_ENV, "1")
    assert fx_rewrites.geglu_enabled()
    with torch.no_grad():
        (gm,), _ = _graph_of(m.requires_grad_(False), x)
        assert GegluRewrite().rewrite(gm) == 0  # switched on, but the CPU has no kernel


def _devices():
    return ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.mark.parametrize("device", _devices())
def test_compiled_with_the_rewrite_matches_eager(device, monkeypatch):
    """Through the pack's compiled module: on the GPU inductor's code calls the kernel (fp16,
    the rewrite as compiled mode runs it); on the CPU AOTAutograd traces the op through its
    fake and runs its PyTorch path (fp32, forced, ``aot_eager``)."""
    if device == "cuda" and not _gpu_ready():
        pytest.skip("no CUDA GPU of compute capability 8.0+ with Triton")
    dtype = torch.float16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    m = FeedForward(320, 1280).to(device=device, dtype=dtype).eval().requires_grad_(False)
    x = torch.randn(2, 4096, 320, device=device, dtype=dtype)  # 8,192 tokens: where it pays
    rewrite = GegluRewrite(force=device != "cuda")
    if device == "cuda":  # opt-in: as compiled mode runs it under CNA_COMPILE_GEGLU=1
        monkeypatch.setenv(GEGLU_ENV, "1")
    with torch.no_grad():
        seen = []
        opts = CompileOptions(
            graph_passes=(lambda gm: seen.append(rewrite.rewrite(gm)),),
            backend="inductor" if device == "cuda" else "aot_eager",
        )
        cm = CompiledModule(m, "FeedForward", opts)
        got = cm(x)
        assert cm.stats()["compiled_signatures"] == 1, cm.stats()
        assert seen == [1], seen
        ref = m(x)
    assert _rel(got, ref) <= (1e-6 if dtype == torch.float32 else 2e-3)


# ---- on the GPU ------------------------------------------------------------------------------

# (tokens, 2 × inner, model width): SD1.5 at 512² (three levels), SDXL at 1024² (two), batch 2,
# and odd sizes: one token, a token count no tile divides, outputs no tile divides, a depth of 48.
GPU_SHAPES = [
    (8192, 2560, 320),
    (2048, 5120, 640),
    (512, 10240, 1280),
    (8192, 5120, 640),
    (2048, 10240, 1280),
    (1, 640, 320),
    (77, 2560, 320),
    (300, 200, 48),
]


def _gpu_ready():
    return (
        torch.cuda.is_available()
        and gl.triton_missing() is None
        and torch.cuda.get_device_capability() >= (8, 0)
    )


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("m", "n2", "k"), GPU_SHAPES)
def test_on_the_gpu_the_kernel_is_as_close_to_fp64_as_the_plain_path(m, n2, k, dtype):
    if not _gpu_ready():
        pytest.skip("no Triton or a GPU older than compute capability 8.0")
    x, w, b = _inputs(m, n2, k, dtype, "cuda", seed=m + k)
    assert gl.problem(x, w, b) is None
    ref = _ref64(x, w, b)
    got = ops.geglu_linear(x, w, b)
    plain = gl.reference(x, w, b)
    # the kernel rounds once, the plain path twice (the projection, then the product)
    assert _rel(got, ref) <= max(1.25 * _rel(plain, ref), 1e-4), (_rel(got, ref), _rel(plain, ref))
    assert (
        _rel(ops.geglu_linear(x, w, None), _ref64(x, w, None))
        <= 1.25 * _rel(gl.reference(x, w, None), _ref64(x, w, None)) + 1e-4
    )


@pytest.mark.cuda
def test_on_the_gpu_it_replays_in_a_cuda_graph_with_new_inputs():
    if not _gpu_ready():
        pytest.skip("no Triton or a GPU older than compute capability 8.0")
    x, w, b = _inputs(2048, 5120, 640, torch.float16, "cuda")
    ops.geglu_linear(x, w, b)  # compiled by Triton before the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ops.geglu_linear(x, w, b)
    x2, _, _ = _inputs(2048, 5120, 640, torch.float16, "cuda", seed=9)
    x.copy_(x2)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ops.geglu_linear(x2, w, b))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("m", "n2", "k"), GPU_SHAPES)
def test_on_the_gpu_the_descriptor_kernel_is_as_close_to_fp64_as_the_plain_path(m, n2, k, dtype):
    if not _gpu_ready() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("no Triton or a GPU older than compute capability 9.0")
    x, w, b = _inputs(m, n2, k, dtype, "cuda", seed=m + k)
    cfg = gl.Config(128, 128, 64, 8, 3, 8, True)
    ref = _ref64(x, w, b)
    got = gl.geglu_linear(x, w, b, cfg)
    assert _rel(got, ref) <= max(1.25 * _rel(gl.reference(x, w, b), ref), 1e-4)
    # a row stride the descriptors cannot take: the pointer kernel runs the same tile
    xs = torch.zeros(m, k + 1, dtype=dtype, device="cuda")[:, :k]
    xs.copy_(x)
    assert not gl._tma_ok(xs, w, n2 // 2)
    assert _rel(gl.geglu_linear(xs, w, b, cfg), ref) <= max(
        1.25 * _rel(gl.reference(x, w, b), ref), 1e-4
    )


@pytest.mark.cuda
def test_on_the_gpu_the_descriptor_kernel_replays_in_a_cuda_graph_with_new_inputs():
    if not _gpu_ready() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("no Triton or a GPU older than compute capability 9.0")
    cfg = gl.Config(128, 128, 64, 8, 3, 8, True)
    x, w, b = _inputs(2048, 5120, 640, torch.float16, "cuda")
    gl.geglu_linear(x, w, b, cfg)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = gl.geglu_linear(x, w, b, cfg)
    x2, _, _ = _inputs(2048, 5120, 640, torch.float16, "cuda", seed=9)
    x.copy_(x2)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, gl.geglu_linear(x2, w, b, cfg))
