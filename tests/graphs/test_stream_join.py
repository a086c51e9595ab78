# SPDX-License-Identifier: GPL-3.0-or-later
"""The traced stream join (graphs/stream_join.py) and the residual dict that uses it
(nodes/graph_deferral.py ``_JoinOnUse`` with ``traced_join``), no ComfyUI needed.

The stand-in network reads its residuals the way ComfyUI's UNet does (``apply_control``: pop
from the dict's lists, add in place): three input blocks, a middle block, three output blocks.
Inductor really compiles it, on the CPU, with one compile thread and plain C++ as in
test_compiled.py. The wait is a recorder here; on a GPU it is a stream's wait for an event.
"""

from __future__ import annotations

import pytest
import torch
from comfyui_controlnet_accelerator.graphs import compiled as C
from comfyui_controlnet_accelerator.graphs import stream_join
from comfyui_controlnet_accelerator.nodes import graph_deferral as gd
from torch import nn
from torch._inductor.utils import run_and_get_code


def apply_control(h, control, name):
    """ComfyUI's (openaimodel.apply_control), without its warning for a shape mismatch."""
    if control is not None and name in control and len(control[name]) > 0:
        ctrl = control[name].pop()
        if ctrl is not None:
            h += ctrl
    return h


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inb = nn.ModuleList([nn.Conv2d(4, 4, 3, padding=1) for _ in range(3)])
        self.mid = nn.Conv2d(4, 4, 3, padding=1)
        self.outb = nn.ModuleList([nn.Conv2d(8, 4, 3, padding=1) for _ in range(3)])

    def forward(self, x, control):
        hs, h = [], x
        for b in self.inb:
            h = apply_control(torch.relu(b(h)), control, "input")
            hs.append(h)
        h = apply_control(torch.relu(self.mid(h)), control, "middle")
        for b in self.outb:
            skip = apply_control(hs.pop(), control, "output")
            h = torch.relu(b(torch.cat([h, skip], 1)))
        return h


def _residuals(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 4, 8, 8, generator=g) for _ in range(4)]


def _plain(rs):
    return {"input": [], "middle": [rs[0]], "output": list(rs[1:])}


def test_the_op_makes_the_wait_of_the_call_in_progress_and_refuses_outside_one():
    like = torch.randn(3, dtype=torch.float16)
    with pytest.raises(stream_join.JoinOutsideCall):
        stream_join.gate(like)
    waits = []
    with stream_join.waiting(lambda: waits.append("outer")):
        with stream_join.waiting(lambda: waits.append("inner")):
            one = stream_join.gate(like)
        stream_join.gate(like)
    assert waits == ["inner", "outer"]
    assert one.shape == () and one.dtype == torch.float16 and one.item() == 1.0
    with pytest.raises(stream_join.JoinOutsideCall):  # the block's end took the wait away
        stream_join.gate(like)


def test_join_on_use_gates_every_residual_once_in_place():
    r = [torch.randn(2) for _ in range(4)]
    lists = {"input": [], "middle": [r[0]], "output": [r[1], None], "t": (r[2],), "x": r[3]}
    waits = []

    def wait(d):
        waits.append(d)
        return torch.tensor(2.0)  # not one, so that the product shows where it was applied

    out_list = lists["output"]
    d = gd._JoinOnUse(lists, event=None, wait=wait)
    assert d["input"] == [] and not waits  # empty: nothing to wait for
    assert d["middle"][0].equal(r[0] * 2) and waits == [d]
    assert d["output"] is out_list and d["output"][0].equal(r[1] * 2) and out_list[1] is None
    assert d["t"][0].equal(r[2] * 2) and d["x"].equal(r[3] * 2)
    list(d.items())
    assert waits == [d]  # once per dict


def test_holds_tells_a_graph_with_the_op_from_one_without():
    def with_op(x):
        return x * stream_join.gate(x)

    assert stream_join.holds(torch.fx.symbolic_trace(with_op))
    assert not stream_join.holds(torch.fx.symbolic_trace(lambda x: x * 2))


def test_a_dict_with_no_tensor_hands_out_its_entries_without_the_op():
    d = gd._JoinOnUse({"input": [], "middle": [None], "output": [None, None]}, None, gd.traced_join)
    assert d["middle"] == [None] and d["output"] == [None, None]  # no wait set: no op ran


def test_compiled_net_is_one_graph_and_waits_once_after_the_middle_block(monkeypatch, tmp_path):
    """Compiled as the pack compiles (``CompiledModule``, which compiles a graph that holds the
    op in the traced program's order)."""
    import torch._dynamo
    import torch._inductor.config as ic
    from torch._dynamo.utils import counters

    monkeypatch.setattr(ic, "compile_threads", 1)
    monkeypatch.setattr(ic.cpp, "vec_isa_ok", False)
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    net = Net().eval()
    x = torch.randn(2, 4, 8, 8)
    import torch._inductor.compile_fx as cfx

    configs = []
    real = cfx.compile_fx

    def compile_fx(gm, example_inputs, config_patches=None, **kw):
        configs.append(dict(config_patches or {}))
        return real(gm, example_inputs, config_patches=config_patches, **kw)

    monkeypatch.setattr(cfx, "compile_fx", compile_fx)
    compiled = C.CompiledModule(net, "UNet", C.CompileOptions(cache_dir=str(tmp_path)))
    waits: list[int] = []
    with torch.no_grad():
        for call in range(2):  # a new dict of the same shapes: the same compiled code
            rs = _residuals(call)
            want = net(x, _plain(rs))
            d = gd._JoinOnUse(_plain(rs), event=None, wait=gd.traced_join)
            with stream_join.waiting(lambda call=call: waits.append(call)):
                if call == 0:
                    got, code = run_and_get_code(compiled, x, d)
                else:
                    got = compiled(x, d)
            torch.testing.assert_close(got, want)
            assert d["output"] == [] and d["middle"] == []  # popped, as from the plain dict
    assert waits == [0, 1]
    assert compiled.compiles == 1 and not compiled.failed and compiled.eager_calls == 0
    assert configs and all(configs[0].get(k) == v for k, v in stream_join.ORDER_OPTIONS), configs
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    # in the generated code, the op comes after the middle block's convolution (the 4th) and
    # before the first output block's (the 5th): the ControlNets overlap the blocks before it
    body = code[0][code[0].index("def call(") :]
    lines = body.splitlines()
    convs = [i for i, line in enumerate(lines) if "= extern_kernels.convolution(" in line]
    at = [i for i, line in enumerate(lines) if f"= torch.ops.{stream_join._NAMESPACE}.gate" in line]
    assert len(convs) == 7 and len(at) == 1, (convs, at)
    assert convs[3] < at[0] < convs[4], (convs, at)
