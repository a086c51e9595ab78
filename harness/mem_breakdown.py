# SPDX-License-Identifier: GPL-3.0-or-later
"""Where the peak VRAM of one sampling run goes: runs a benchmark workload once per variant from
a cold start with PyTorch's allocator history on from the start of sampling, finds the moment
of peak allocated memory and groups the blocks allocated since sampling began and alive then by
the code that allocated them.

    python benchmark.py --mem-breakdown --workload W2 --variants stock,pool_int8_offload+graph

GPU only; uses PyTorch's native allocator (allocation history is a feature of that allocator;
the bytes a model allocates are the same under cudaMallocAsync). Writes DIR/mem-<wl>-<v>.txt
and prints the tables. A development tool: the benchmark proper is ``benchmark.py``.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

MiB = 1024 * 1024
SKIP = ("torch/", "/torch", "<frozen", "contextlib", "threading", "asyncio", "execution.py")


def _site(frames) -> str:
    """The most telling frames: the first two outside torch, with the pack's or ComfyUI's
    file:line (and function)."""
    picked = []
    for f in frames:
        fn = f.get("filename", "")
        if any(s in fn for s in SKIP):
            continue
        short = "/".join(fn.split("/")[-2:])
        picked.append(f"{short}:{f.get('line')}({f.get('name')})")
        if len(picked) == 2:
            break
    return " < ".join(picked) or "(no python frame)"


def peak_breakdown(
    snapshot: dict, device: int = 0, top: int = 25, start_marker: str | None = None
) -> tuple[float, list]:
    """(peak MiB, [(MiB, count, site)]): the highest net allocation over the trace, and the
    blocks allocated during the trace and alive at that point, by allocation site. With
    ``start_marker``, only points after the first allocation made in a function of that name
    count (everything before still counts as alive)."""
    trace = snapshot["device_traces"][device]
    live: dict[int, tuple[int, str]] = {}
    # net bytes since the trace began: frees of blocks allocated before it count too (a model
    # unloaded during sampling), their allocation site is unknown
    cur = best = 0
    best_live: dict = {}
    started = start_marker is None
    for ev in trace:
        a = ev["action"]
        if not started and any(f.get("name") == start_marker for f in ev.get("frames", [])):
            started = True
        if a == "alloc":
            live[ev["addr"]] = (ev["size"], _site(ev.get("frames", [])))
            cur += ev["size"]
            if started and cur > best:
                best = cur
                best_live = dict(live)
        elif a == "free_requested":
            live.pop(ev["addr"], None)
            cur -= ev["size"]
    groups: dict[str, list] = collections.defaultdict(lambda: [0, 0])
    for size, site in best_live.values():
        groups[site][0] += size
        groups[site][1] += 1
    rows = sorted(((v[0] / MiB, v[1], k) for k, v in groups.items()), reverse=True)
    return best / MiB, rows[:top]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="benchmark.py --mem-breakdown",
        description="Where the peak VRAM of one sampling run goes, grouped by the code that "
        "allocated it, per variant, from a cold start (GPU only).",
    )
    ap.add_argument("--workload", default="W2", help="one benchmark workload (default W2)")
    ap.add_argument(
        "--variants",
        default="stock,pool_int8_offload+graph",
        help="comma list of benchmark variants (default stock,pool_int8_offload+graph)",
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=Path("bench-results"),
        help="folder for mem-<workload>-<variant>.txt (default bench-results)",
    )
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    from . import comfy_host

    host = comfy_host.bootstrap(models_dir=comfy_host.default_models_dir(), cuda_malloc=False)
    assert not host.cpu, "GPU only"
    import folder_paths
    import torch

    from . import quick, random_models, runner, workflows

    wl = workflows.WORKLOADS[a.workload].with_(decode=False)
    random_models.ensure_models(wl.models(), comfy_host.default_models_dir())
    hints = workflows.write_hint_images(folder_paths.get_input_directory(), wl)
    a.out.mkdir(parents=True, exist_ok=True)
    import comfy.samplers

    cls = comfy.samplers.CFGGuider
    orig = cls.sample
    base: list = []

    def traced_sample(self, *args, **kwargs):
        # marks where sampling begins in the trace (the run's models load inside it)
        torch.cuda.synchronize()
        base.append(torch.cuda.memory_allocated())
        torch.empty(1, device="cuda")
        return orig(self, *args, **kwargs)

    for v in a.variants.split(","):
        quick._cold_reset()
        p, ids = workflows.build_prompt(wl, 5000, hints, quick.VARIANTS[v])
        # the first run records nothing (kernel builds, cuDNN plans); the second is cold again
        runner.Runner().run(p, ids)
        quick._cold_reset()
        base.clear()
        torch.cuda.memory._record_memory_history(max_entries=1000000, stacks="python")
        cls.sample = traced_sample
        try:
            res = runner.Runner().run(p, ids)
        finally:
            cls.sample = orig
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        peak, rows = peak_breakdown(snap, torch.cuda.current_device(), start_marker="traced_sample")
        b = base[0] / MiB if base else 0.0
        lines = [
            f"{a.workload} {v}: prompt peak allocated {res.peak_allocated / MiB:.0f} MiB, "
            f"sampling peak {res.extra.get('sampling_peak_allocated', 0) / MiB:.0f} MiB "
            f"({b:.0f} MiB allocated when sampling began); traced from a cold start: "
            f"{peak:.0f} MiB at the sampling peak, of which:",
        ]
        lines += [f"  {mib:9.1f} MiB {n:5d}x  {site}" for mib, n, site in rows]
        text = "\n".join(lines)
        print(text, flush=True)
        (a.out / f"mem-{a.workload}-{v.replace('+', '_')}.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
