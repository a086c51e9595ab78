# SPDX-License-Identifier: GPL-3.0-or-later
"""What the pack's nodes reported about one prompt's run: their badges (``nodes/status.py``).

Each node reports the figures of its sampling run under its node id (``status.LAST``). ``run``
forgets a prompt's node ids before running it, so what it hands back belongs to that run and
not to an earlier prompt that used the same ids. The benchmark and the host tests read a run's
counters here (graph replays, Feature Cache reuse, hint encodings) instead of process-wide
totals, so a model that goes away during a test takes nothing from another run's figures.
"""

from __future__ import annotations

from collections.abc import Iterable

GRAPH_KEYS = ("captures", "replays", "eager")


def _status():
    from .comfy_host import pack_module

    return pack_module().nodes.status


def clear(node_ids: Iterable) -> None:
    """Forget the badges of these nodes (before a run that reuses their ids)."""
    last = _status().LAST
    for nid in node_ids:
        last.pop(str(nid), None)


def collect(node_ids: Iterable) -> dict[str, dict]:
    """Node id → the badge payload (kind, lines, data) each of these nodes reported."""
    last = _status().LAST
    return {str(n): last[str(n)] for n in node_ids if str(n) in last}


def run(runner, prompt: dict, ids: dict, **kwargs):
    """``runner.run(prompt, ids)`` with the run's badges in ``result.extra["badges"]``."""
    clear(prompt)
    res = runner.run(prompt, ids, **kwargs)
    res.extra["badges"] = collect(prompt)
    return res


def data(res, kind: str) -> list[dict]:
    """The figures of every node of this kind (``cuda_graph``, ``fused_apply``,
    ``feature_cache``, ...) that reported in the run."""
    return [b["data"] for b in res.extra.get("badges", {}).values() if b["kind"] == kind]


def summed(results, kind: str, keys: Iterable[str], sub: str | None = None) -> dict[str, float]:
    """``keys`` of the badges of ``kind`` added up over one run or several (``sub``: a nested
    dict of the data, e.g. the Feature Cache's ``calls``)."""
    if not isinstance(results, list | tuple):
        results = [results]
    out = dict.fromkeys(keys, 0)
    for res in results:
        for d in data(res, kind):
            d = d.get(sub, {}) if sub else d
            for k in out:
                out[k] += d.get(k, 0) or 0
    return out


def graph_counts(results) -> dict[str, float]:
    """Model calls replayed, captured and run eager by the CUDA Graph nodes in these runs."""
    return summed(results, "cuda_graph", GRAPH_KEYS)


def model_graph_counts(runner, ids: dict) -> dict[str, int]:
    """The graph counters of the workflow's model (the checkpoint's, as the runner holds it):
    its captures, replays, eager calls, failed captures and released graphs so far; zeros
    before its first graph. Alive as long as the runner keeps the checkpoint's output."""
    from .comfy_host import pack_module
    from .runner import WorkflowFailed

    gs = pack_module().nodes.graph_state
    try:
        patcher = runner.output_of(ids["ckpt"])[0]
    except WorkflowFailed:
        return dict.fromkeys(gs.COUNTERS, 0)
    st = gs.existing_state(getattr(patcher, "model", None))
    return dict(st.stats) if st is not None else dict.fromkeys(gs.COUNTERS, 0)
