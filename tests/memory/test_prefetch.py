# SPDX-License-Identifier: GPL-3.0-or-later
"""Weights prepared one layer ahead (memory/prefetch.py), as the Memory Pool's streamed layers
use them: same results as copying each weight when its layer runs, the order learned per pass,
wrong guesses and pass ends handled. The CPU cases run the lanes synchronously (same
bookkeeping); the CUDA cases copy from pinned memory on the side stream, in eager mode and
inside a CUDA graph capture."""

from __future__ import annotations

import pytest
import torch
from comfyui_controlnet_accelerator.memory import prefetch
from comfyui_controlnet_accelerator.memory import weight_compress as wc


class Net(torch.nn.Module):
    """Five layers, four streamed; ``skip`` leaves out the middle one (a ControlNet off at this
    step)."""

    def __init__(self, device, dtype):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        layers = []
        for i in range(5):
            lin = torch.nn.Linear(96, 96)
            with torch.no_grad():
                lin.weight.copy_(torch.randn(96, 96, generator=g) / 10)
                lin.bias.copy_(torch.randn(96, generator=g) / 10)
            lin = lin.to(device, dtype)
            layers.append(wc.compress(lin, mode="stream") if i != 1 else lin)
        self.layers = torch.nn.ModuleList(layers)  # layer 1 stays as it is: not a lane layer

    def forward(self, x, skip=False):
        for i, layer in enumerate(self.layers):
            if skip and i == 2:
                continue
            x = torch.tanh(layer(x))
        return x


def _run(net, x, skip=False):
    with prefetch.counting() as counts:
        y = net(x, skip)
        prefetch.end_pass()
    return y, counts


def test_cpu_lanes_learn_the_order_and_give_the_same_result():
    net = Net("cpu", torch.float32)
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(0))
    with prefetch.enabled(False):
        ref = net(x)
        ref_skip = net(x, skip=True)
    with prefetch.lanes_on_cpu():
        y, s = _run(net, x)  # first pass: learns, prepares nothing
        assert torch.equal(y, ref)
        assert s == {"prepared": 0, "used": 0, "wasted": 0, "direct": 4}
        y, s = _run(net, x)  # the first layer expands itself, the three after it were ready
        assert torch.equal(y, ref)
        assert s == {"prepared": 3, "used": 3, "wasted": 0, "direct": 1}
        y, s = _run(net, x, skip=True)  # layer 2 was prepared but not called: wasted
        assert torch.equal(y, ref_skip)
        assert s["wasted"] == 1 and s["used"] == 1 and s["direct"] == 2
        y, s = _run(net, x, skip=True)  # learned the new order
        assert torch.equal(y, ref_skip)
        assert s == {"prepared": 2, "used": 2, "wasted": 0, "direct": 1}


def test_nothing_is_prepared_across_the_end_of_a_pass():
    net = Net("cpu", torch.float32)
    x = torch.randn(2, 96)
    with prefetch.lanes_on_cpu():
        _run(net, x)
        net(x)
        net(x)  # no end_pass between: the last layer learned that the first follows it ...
        lane = next(iter(prefetch._LANES.values()))
        assert lane.pending is not None and lane.pending.layer() is net.layers[0]
        with prefetch.counting() as counts:
            prefetch.end_pass()  # ... which is joined and dropped here, and forgotten
        assert counts["wasted"] == 1
        assert lane.pending is None and lane.prev is None
        y, s = _run(net, x)
        assert s == {"prepared": 3, "used": 3, "wasted": 0, "direct": 1}
        assert lane.pending is None
        assert torch.equal(y, Net("cpu", torch.float32)(x))


def test_a_weight_that_needs_a_cast_is_not_prepared_ahead():
    net = Net("cpu", torch.float32)
    streamed = [m for m in net.layers if isinstance(m, wc._StreamedWeight)]
    assert streamed[0].empty_weight(torch.bfloat16, "cpu") is None
    x = torch.randn(2, 96, dtype=torch.bfloat16)
    with prefetch.lanes_on_cpu():
        for _ in range(3):  # fp32 weights in RAM, bf16 input: copied and cast where used
            with prefetch.counting() as s:
                y = x
                for m in streamed:
                    y = m(y)
                prefetch.end_pass()
            assert s["prepared"] == 0 and s["direct"] == 4
    ref = x
    for m in streamed:
        ref = torch.nn.functional.linear(ref, m.host_weight.bfloat16(), m.bias.bfloat16())
    assert y.dtype == torch.bfloat16 and torch.equal(y, ref)


def test_prefetch_off_expands_each_weight_where_it_is_used():
    net = Net("cpu", torch.float32)
    x = torch.randn(2, 96)
    with prefetch.lanes_on_cpu(), prefetch.enabled(False):
        _run(net, x)
        y, s = _run(net, x)
        assert s == {"prepared": 0, "used": 0, "wasted": 0, "direct": 0}  # no lane at all
        assert not prefetch._LANES
        assert torch.equal(y, Net("cpu", torch.float32)(x))


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _gpu_net_and_refs():
    """(net, x, result, result with the middle layer skipped), each weight copied where used;
    lanes forgotten afterwards."""
    net = Net("cuda", torch.float16)
    x = torch.randn(64, 96, device="cuda", dtype=torch.float16)
    with prefetch.enabled(False):
        ref, ref_skip = net(x), net(x, skip=True)
    prefetch.reset()
    return net, x, ref, ref_skip


@cuda
@pytest.mark.cuda
def test_side_stream_results_equal_direct_expansion_on_the_gpu():
    net, x, ref, ref_skip = _gpu_net_and_refs()
    for skip, want in ((False, ref), (False, ref), (True, ref_skip), (False, ref)):
        y, s = _run(net, x, skip)
        torch.cuda.synchronize()
        assert torch.equal(y, want)
    assert s["used"] >= 2  # the last pass ran on a learned order
    prefetch.reset()


@cuda
@pytest.mark.cuda
def test_prepared_weights_inside_a_cuda_graph_replay_to_the_eager_result():
    net, x, ref, _ = _gpu_net_and_refs()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on the capture stream: the lane learns there
        net(x)
        prefetch.end_pass()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with prefetch.counting() as counts, torch.cuda.graph(g, stream=side):
        out = net(x)
        prefetch.end_pass()  # every forked stream joined before the capture ends
    assert counts["used"] == 3  # the graph holds the side-stream copies
    for _ in range(3):
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref)
    prefetch.reset()
