# SPDX-License-Identifier: GPL-3.0-or-later
"""Where a compile's time goes, from torch's own timers (``python benchmark.py
--compile-phases``).

Torch times each phase of every compile in the process (dynamo's tracing and guards, AOTAutograd,
inductor's lowering, scheduling and code generation, waiting for the Triton compile workers,
reading compiled code from the disk cache, benchmarking kernel configurations at the first run)
and counts what its caches answered. ``snapshot`` reads both; the difference of two snapshots
taken around a variant's first run is what that run's compiles cost, phase by phase. The figures
are the sum over the run's compiles (the UNet and each ControlNet), and phases nest (the
backend's time contains inductor's), so they are read side by side, not added up.
"""

from __future__ import annotations

# The phases reported, outermost first, with what each one is; others are kept in the JSON.
PHASES = (
    ("_compile.compile_inner", "whole compile (dynamo and everything it calls)"),
    ("bytecode_tracing", "dynamo tracing the Python"),
    ("build_guards", "dynamo building the guards"),
    ("create_aot_dispatcher_function", "AOTAutograd and inductor (or their caches)"),
    ("GraphLowering.run", "inductor lowering the graph"),
    ("Scheduler.__init__", "inductor's scheduler (fusion decisions)"),
    ("Scheduler.codegen", "inductor generating kernels"),
    ("async_compile.wait", "waiting for the kernel compile workers"),
    ("PyCodeCache.load_by_key_path", "loading the compiled module"),
    ("CachingAutotuner.benchmark_all_configs", "first run: timing kernel configurations"),
)
# Cache counters reported: (torch's counter group, name).
COUNTERS = (
    ("inductor", "fxgraph_cache_hit"),
    ("inductor", "fxgraph_cache_miss"),
    ("aot_autograd", "autograd_cache_hit"),
    ("aot_autograd", "autograd_cache_miss"),
    ("aot_autograd", "autograd_cache_bypass"),
    ("inductor", "async_compile_cache_miss"),
    ("inductor", "async_compile_cache_hit"),
)


def snapshot() -> dict:
    """Torch's compile-phase totals (seconds per phase, summed over every compile so far in this
    process) and its counters, as ``{"times": {...}, "counters": {"group.name": n}}``. Empty
    where this torch keeps neither."""
    times: dict[str, float] = {}
    counts: dict[str, int] = {}
    try:
        from torch._dynamo import utils as dutils
    except Exception:  # a torch without dynamo: nothing to read
        return {"times": times, "counters": counts}
    for name, values in dict(getattr(dutils, "compilation_time_metrics", {})).items():
        try:
            times[name] = float(sum(values))
        except TypeError:  # not a list of durations
            continue
    for group, counter in dict(getattr(dutils, "counters", {})).items():
        for name, n in dict(counter).items():
            if isinstance(n, int | float):
                counts[f"{group}.{name}"] = n
    return {"times": times, "counters": counts}


def delta(before: dict, after: dict) -> dict:
    """What happened between two snapshots: the phases and counters that grew, by how much."""
    out: dict = {"times": {}, "counters": {}}
    for kind in ("times", "counters"):
        old = before.get(kind, {})
        for name, value in after.get(kind, {}).items():
            grew = value - old.get(name, 0)
            if grew > 0:
                out[kind][name] = round(grew, 4) if kind == "times" else grew
    return out


def text(per_variant: dict[str, dict]) -> str:
    """A Markdown table of the reported phases and counters, one column per variant that
    compiled (``per_variant``: name -> ``delta``); empty when none did."""
    names = [v for v, d in per_variant.items() if d.get("times")]
    if not names:
        return ""
    lines = [
        "Compile phases of the first runs (torch's timers, seconds summed over the run's "
        "compiles; phases nest, so they are not to be added):",
        "",
        "| phase | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for key, what in PHASES:
        cells = [per_variant[v]["times"].get(key) for v in names]
        if any(c is not None for c in cells):
            shown = [f"{c:.1f}" if c is not None else "—" for c in cells]
            lines.append(f"| {what} (`{key}`) | " + " | ".join(shown) + " |")
    for group, key in COUNTERS:
        cells = [per_variant[v]["counters"].get(f"{group}.{key}") for v in names]
        if any(c is not None for c in cells):
            shown = [str(int(c)) if c is not None else "0" for c in cells]
            lines.append(f"| {key} | " + " | ".join(shown) + " |")
    return "\n".join(lines)
