# SPDX-License-Identifier: GPL-3.0-or-later
"""The context's key and value projections, once per context (no ComfyUI needed).

A toy network with the UNet's module names (``...attn2.to_k``) runs through ``GraphCache``:
emulated on the CPU, captured into real CUDA graphs (IF nodes) on a GPU. Every result must be
the plain network's bit for bit: the hoisted projection is the same matrix multiply on the
same values, so there is no tolerance to allow.
"""

from __future__ import annotations

import pytest
import torch
from comfyui_controlnet_accelerator.graphs import GraphCache, context_hoist
from comfyui_controlnet_accelerator.graphs import compiled as C

CUDA = torch.cuda.is_available()
BACKENDS = ["emulate", pytest.param("cuda", marks=pytest.mark.cuda)]


class _Attention(torch.nn.Module):
    def __init__(self, dim, ctx_dim, in_place_consumer=False):
        super().__init__()
        self.to_q = torch.nn.Linear(dim, dim, bias=False)
        self.to_k = torch.nn.Linear(ctx_dim, dim, bias=False)
        self.to_v = torch.nn.Linear(ctx_dim, dim, bias=False)
        self.in_place_consumer = in_place_consumer

    def forward(self, x, context):
        q, k, v = self.to_q(x), self.to_k(context), self.to_v(context)
        if self.in_place_consumer:
            k.mul_(0.5)
        a = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        return x + a @ v


class _Block(torch.nn.Module):
    def __init__(self, dim, ctx_dim, **kw):
        super().__init__()
        self.attn1 = _Attention(dim, dim)
        self.attn2 = _Attention(dim, ctx_dim, **kw)

    def forward(self, x, context):
        return self.attn2(self.attn1(x, x), context)


class _Net(torch.nn.Module):
    def __init__(self, dim=32, ctx_dim=24, depth=3, **kw):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block(dim, ctx_dim, **kw) for _ in range(depth))

    def forward(self, x, context):
        for b in self.blocks:
            x = b(x, context)
        return x


def _device(backend):
    if backend == "cuda" and not CUDA:
        pytest.skip("no CUDA device")
    why = context_hoist.available() if backend == "cuda" else None
    if why is not None:
        pytest.skip(why)
    return "cuda" if backend == "cuda" else "cpu"


def _setup(backend, net=None, dtype=torch.float32):
    dev = _device(backend)
    torch.manual_seed(0)
    net = (net or _Net()).to(dev, dtype)
    cache = GraphCache("hoist", backend=backend)
    hoist = context_hoist.ContextProjections(
        context_hoist.cross_attention_weights([net]), lambda: cache.capturing_graph, run_id=0
    )

    def fn(x, ctx):
        with hoist.active(), torch.no_grad():  # ComfyUI samples under inference_mode
            return net(x, ctx)

    def step(x, ctx, run_id=0):
        entry = cache.lookup("k")
        if entry is not None:
            hoist.before_replay(run_id)
        return cache.run("k", fn, [x, ctx])

    return net, hoist, step, dev


def _three_steps_match(net, step):
    """Three steps on one context, each the plain network's result bit for bit."""
    ctx = torch.randn(2, 7, 24)
    for _ in range(3):
        x = torch.randn(2, 16, 32)
        out = step(x, ctx)
        with torch.no_grad():
            assert torch.equal(out, net(x, ctx))


@pytest.fixture
def projections(monkeypatch):
    """How many times each group's projections ran, read on the host after each step."""
    calls = []
    orig = context_hoist._Group.project

    def project(self, x):
        calls.append(id(self))
        return orig(self, x)

    monkeypatch.setattr(context_hoist._Group, "project", project)
    return calls


def test_only_the_cross_attentions_key_and_value_weights_are_taken():
    net = _Net(depth=2)
    net.blocks[1].attn2.to_v = torch.nn.Linear(24, 32, bias=True)  # a bias: left to F.linear
    got = context_hoist.cross_attention_weights([net, None])
    want = [net.blocks[0].attn2.to_k.weight, net.blocks[0].attn2.to_v.weight]
    want.append(net.blocks[1].attn2.to_k.weight)
    assert [id(w) for w in got] == [id(w) for w in want]


@pytest.mark.parametrize("backend", ["native", "cudaMallocAsync"])
def test_the_hoist_is_refused_under_cuda_malloc_async(backend, monkeypatch):
    """IF nodes recordable, a GPU present: the hoist is offered under PyTorch's native
    allocator only, and the refusal says how to get it."""
    from comfyui_controlnet_accelerator.kernels import graph_if

    monkeypatch.setattr(graph_if, "available", lambda: None)
    monkeypatch.setattr(torch.cuda.memory, "get_allocator_backend", lambda: backend)
    why = context_hoist.available()
    if backend == "native":
        assert why is None
    else:
        assert "cudaMallocAsync" in why and "--disable-cuda-malloc" in why


def _two_contexts_match(net, step, dev, close=torch.equal):
    """Eight steps: one context four times, another three times, the first again; each step
    ``close`` to the plain network's result (bit for bit by default)."""
    g = torch.Generator(device=dev).manual_seed(1)
    ctx_a = torch.randn(2, 7, 24, device=dev, generator=g)
    ctx_b = torch.randn(2, 7, 24, device=dev, generator=g)
    for i, ctx in enumerate([ctx_a] * 4 + [ctx_b] * 3 + [ctx_a]):
        x = torch.randn(2, 16, 32, device=dev, generator=g)
        out = step(x, ctx)
        with torch.no_grad():
            want = net(x, ctx)
        assert close(out, want), i


@pytest.mark.parametrize("backend", BACKENDS)
def test_projections_run_once_per_context_and_match_the_plain_network(backend, projections):
    net, hoist, step, dev = _setup(backend)
    _two_contexts_match(net, step, dev)
    assert len(hoist.groups) == 1 and len(hoist.groups[0].weights) == 6
    if backend == "emulate":  # the host sees each decision: the changes only, after the capture
        assert len(projections) == 1 + 1 + 1, projections
        assert hoist.hoisted == 6 and hoist.computed == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_weight_changed_in_place_or_a_new_run_recomputes(backend, projections):
    net, hoist, step, dev = _setup(backend)
    g = torch.Generator(device=dev).manual_seed(2)
    ctx = torch.randn(2, 7, 24, device=dev, generator=g)
    x = torch.randn(2, 16, 32, device=dev, generator=g)
    for _ in range(3):
        step(x, ctx)
    with torch.no_grad():
        net.blocks[1].attn2.to_v.weight.mul_(1.5)  # same memory, new values (a LoRA)
        want = net(x, ctx)
    assert torch.equal(step(x, ctx), want)
    n = len(projections)
    hoist.groups[0].prev.fill_(0)  # whatever the GPU holds, a new run must project again
    with torch.no_grad():
        net.blocks[0].attn2.to_k.weight.copy_(net.blocks[0].attn2.to_k.weight)
    assert torch.equal(step(x, ctx, run_id=1), want)
    if backend == "emulate":
        assert len(projections) == n + 1


def test_a_sign_change_of_zero_counts_as_a_change(projections):
    net, hoist, step, dev = _setup("emulate")
    ctx = torch.zeros(1, 4, 24)
    x = torch.randn(1, 8, 32)
    step(x, ctx)
    step(x, ctx)
    n = len(projections)
    step(x, -ctx)  # equal as numbers, other bits: projected again
    assert len(projections) == n + 1


def test_a_projection_written_in_place_downstream_is_left_as_it_is():
    net, hoist, step, dev = _setup("emulate", _Net(in_place_consumer=True))
    _three_steps_match(net, step)
    assert [len(g.weights) for g in hoist.groups] == [3]  # the values only
    assert hoist.hoisted == 3 and hoist.computed == 3


def test_a_weight_applied_to_two_inputs_is_left_as_it_is():
    class TwoContexts(_Net):
        def forward(self, x, context):
            x = super().forward(x, context)
            return x + self.blocks[0].attn2.to_k(context * 2).mean()

    net, hoist, step, dev = _setup("emulate", TwoContexts())
    _three_steps_match(net, step)
    assert [len(g.weights) for g in hoist.groups] == [5]
    assert hoist.hoisted == 5 and hoist.computed == 2


def test_an_input_larger_than_a_text_context_is_left_as_it_is(monkeypatch):
    monkeypatch.setattr(context_hoist, "MAX_CONTEXT_ELEMENTS", 100)
    net, hoist, step, dev = _setup("emulate")
    ctx = torch.randn(2, 7, 24)
    x = torch.randn(2, 16, 32)
    for _ in range(2):
        out = step(x, ctx)
    with torch.no_grad():
        assert torch.equal(out, net(x, ctx))
    assert hoist.groups == [] and hoist.hoisted == 0


@pytest.mark.cuda
def test_fp16_projections_in_a_cuda_graph_are_bit_identical():
    if not CUDA:
        pytest.skip("no CUDA device")
    if context_hoist.available() is not None:
        pytest.skip(context_hoist.available())
    net, hoist, step, dev = _setup("cuda", _Net(dim=640, ctx_dim=2048, depth=2), torch.float16)
    g = torch.Generator(device=dev).manual_seed(3)
    ctxs = [torch.randn(2, 77, 2048, device=dev, generator=g, dtype=torch.float16) for _ in "ab"]
    for ctx in (ctxs[0], ctxs[0], ctxs[1], ctxs[1], ctxs[0]):
        x = torch.randn(2, 256, 640, device=dev, generator=g, dtype=torch.float16)
        out = step(x, ctx)
        with torch.no_grad():
            want = net(x, ctx)
        assert torch.equal(out, want)


# -- compiled mode: the projections lifted out of the compiled graph ------------------------------


def _compiled_setup(backend, tmp_path, net=None, dtype=torch.float32, lift=True):
    """The toy network compiled (``aot_eager`` on the CPU: dynamo traces, the backend hook
    rewrites, nothing is generated; inductor on a GPU) and run inside ``GraphCache``."""
    dev = _device(backend)
    torch.manual_seed(0)
    net = (net or _Net()).to(dev, dtype).requires_grad_(False)
    cache = GraphCache("hoist-compiled", backend=backend)
    owner = context_hoist.CompiledProjections(lambda: cache.capturing_graph)
    opts = C.CompileOptions(
        backend="inductor" if backend == "cuda" else "aot_eager", cache_dir=str(tmp_path)
    )
    cm = C.CompiledModule(net, "net", opts, lift=owner.lift if lift else None)

    def fn(x, ctx):
        with owner.active(), torch.no_grad():
            return cm(x, ctx)

    def step(x, ctx, run_id=0):
        owner.before_replay(run_id)  # the node: before each replay, and before a capture
        return cache.run("k", fn, [x, ctx], compile_first=True)

    step.cache = cache  # a capture that failed would run eager, with the same values
    return net, owner, cm, step, dev


def _captured_once(step) -> None:
    assert step.cache.captures == 1 and not step.cache.failed, step.cache.failed


@pytest.fixture
def lifted_projections(monkeypatch):
    """How many times each lifted group's projections ran, read on the host after each step."""
    calls = []
    orig = context_hoist._Lifted.project

    def project(self, x, weights):
        calls.append(id(self))
        return orig(self, x, weights)

    monkeypatch.setattr(context_hoist._Lifted, "project", project)
    return calls


def _lifted_counts(owner) -> list[int]:
    return [len(g.buffers) for g in owner.groups()]


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_projections_are_lifted_out_and_run_once_per_context(
    backend, tmp_path, lifted_projections
):
    net, owner, cm, step, dev = _compiled_setup(backend, tmp_path)
    # emulated, the traced graph runs the same ops (bit for bit); inductor's fused code (fp32
    # here) is within float rounding
    close = torch.equal if backend == "emulate" else lambda a, b: torch.allclose(a, b, 1e-4, 1e-4)
    _two_contexts_match(net, step, dev, close)
    assert cm.compiles == 1 and not cm.failed, cm.failed
    _captured_once(step)
    assert _lifted_counts(owner) == [6]  # the 3 blocks' key and value projections, one context
    assert owner.hoisted == 6 and owner.computed == 0
    if backend == "emulate":  # the first call, then one per change of context
        assert len(lifted_projections) == 1 + 1 + 1, lifted_projections


def test_compiled_projections_follow_a_weight_changed_in_place_and_a_new_run(
    tmp_path, lifted_projections
):
    net, owner, cm, step, dev = _compiled_setup("emulate", tmp_path)
    ctx = torch.randn(2, 7, 24)
    x = torch.randn(2, 16, 32)
    for _ in range(3):
        step(x, ctx)
    n = len(lifted_projections)
    with torch.no_grad():
        net.blocks[1].attn2.to_v.weight.mul_(1.5)  # same memory, new values (a LoRA)
        want = net(x, ctx)
    assert torch.equal(step(x, ctx), want)
    assert len(lifted_projections) == n + 1
    owner.groups()[0].prev.fill_(0)  # whatever the buffers hold, a new run projects again
    step(x, ctx)
    assert torch.equal(step(x, ctx, run_id=1), want)
    assert len(lifted_projections) == n + 3


def test_compiled_projections_written_in_place_or_shared_stay_in_the_graph(tmp_path):
    """A key written in place downstream, and a weight applied to a second input, stay the
    compiled graph's own; the rest is lifted and the result is unchanged."""

    class TwoContexts(_Net):
        def forward(self, x, context):
            x = super().forward(x, context)
            return x + self.blocks[0].attn2.to_v(context * 2).mean()

    for net, lifted in ((_Net(in_place_consumer=True), [3]), (TwoContexts(), [5])):
        net, owner, cm, step, dev = _compiled_setup("emulate", tmp_path, net)
        _three_steps_match(net, step)
        assert _lifted_counts(owner) == lifted and not cm.failed


def test_compiled_projections_left_in_place_with_dynamic_shapes_or_without_the_hook(tmp_path):
    net, owner, cm, step, dev = _compiled_setup("emulate", tmp_path, lift=False)
    _three_steps_match(net, step)
    assert owner.groups() == [] and cm.compiles == 1
    net, owner, cm, step, dev = _compiled_setup("emulate", tmp_path)
    cm.options = C.CompileOptions(backend="aot_eager", dynamic="dynamic")
    _three_steps_match(net, step)
    assert owner.groups() == [] and cm.compiles == 1


@pytest.mark.cuda
def test_fp16_compiled_projections_in_a_cuda_graph_match_the_compiled_code_without_them(
    tmp_path,
):
    """Inductor's code with the projections lifted out, captured with the IF node, against the
    same network compiled with them inside, captured plainly: the same matrix multiplies on the
    same values, so bit for bit."""
    if not CUDA:
        pytest.skip("no CUDA device")
    if context_hoist.available() is not None:
        pytest.skip(context_hoist.available())
    big = dict(dim=640, ctx_dim=2048, depth=2)
    net, owner, cm, step, dev = _compiled_setup("cuda", tmp_path, _Net(**big), torch.float16)
    _, _, cm0, plain, _ = _compiled_setup("cuda", tmp_path, net, torch.float16, lift=False)
    g = torch.Generator(device=dev).manual_seed(3)
    ctxs = [torch.randn(2, 77, 2048, device=dev, generator=g, dtype=torch.float16) for _ in "ab"]
    for i, ctx in enumerate((ctxs[0], ctxs[0], ctxs[1], ctxs[1], ctxs[0])):
        x = torch.randn(2, 256, 640, device=dev, generator=g, dtype=torch.float16)
        assert torch.equal(step(x, ctx, run_id=0), plain(x, ctx)), i
    assert _lifted_counts(owner) == [4] and owner.hoisted == 4
    assert not cm.failed and not cm0.failed
    _captured_once(step)
    _captured_once(plain)
