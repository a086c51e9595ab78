# SPDX-License-Identifier: GPL-3.0-or-later
"""Soak run: hundreds of queued prompts through real ComfyUI servers, one per GPU, at once.

    python benchmark.py --soak --gpus 0,1 --prompts 200 --out DIR     (the H200 run)
    python benchmark.py --soak --gpus cpu --tiny --prompts 8           (a smoke run on a CPU)

Each server is ``main.py`` from a throwaway base directory with this pack under
``custom_nodes`` and random-weight models; ``--cuda-device N`` puts it on GPU N, so two
servers on two GPUs also check that the pack works on a non-default GPU and that two processes
can build the kernel extension at the same time (the build cache starts empty on a fresh
machine).

The prompts vary resolution, batch, sampler, steps, the number of ControlNets (0–2), their
strength and schedule, and which of our nodes are on (every benchmark variant of
``harness/quick.py``: graphs, fused apply, Feature Cache, Memory Pool, all stacked). The first
prompt is the heaviest configuration. All the rest are queued at once.

Checked, per server:
- every prompt succeeds and its images are finite and not constant;
- every ``--check-every``-th prompt that uses only exact modes is also run as stock ComfyUI
  with the same seed, and the two images must agree (PSNR ≥ 40 dB on a GPU in fp16, where
  graph replay and stock differ in rounding only; ≥ 60 dB on a CPU in fp32);
- reserved VRAM (ComfyUI's ``/system_stats`` ``torch_vram_total``) after the first prompt,
  after the first ``--warm`` prompts, and at the end; read again after ComfyUI's ``/free`` has
  unloaded every model, the end's must be within 5% (+64 MiB) of the warm one's. With models
  loaded the figure depends on which ones the last prompt left resident (the first H200 soak's
  went 2176 → 2368 MiB on one GPU and 3840 → 3264 on the other; under ComfyUI 0.33's
  DynamicVRAM 64 → 2304 MiB with nothing leaking), so the end within 5% of the first prompt's
  figure is the verdict only where ``/free`` could not be read (``reserved_problems``);
- the server log has no traceback and no IMPORT FAILED; the pack's fallback lines are counted;
- on a GPU, nvidia-smi shows the server's process on the GPU it was given.
A JSON report goes to ``--out``; the exit code is nonzero when any check fails.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import browser, workflows
from .quick import VARIANTS

# Variants whose result equals stock ComfyUI's (the property test's list).
EXACT = ["cuda_graph", "fused", "fused+graph", "fused+graph_serial", "pool_offload", "exact_stack"]
LOSSY = [
    "fused_positive_only+graph",
    "cache_every2+graph",
    "cache_every3+graph",
    "cache_adaptive0.2+graph",
    "cache_every2",
    "pool_int8",
    "pool_int8_offload",
    "pool_cn_int8",
    "pool_int8_offload+graph",
    "stack_all",
    "stack_all_cc",
]
NEEDS_NET = {"fused", "fused+graph", "fused+graph_serial", "fused_positive_only+graph"} | {
    v for v in LOSSY if v.startswith("cache") or v.startswith("stack")
}
MIB = 2**20


@dataclass
class Job:
    index: int
    variant: str  # a harness.quick variant ("stock" for the comparison runs)
    workload: workflows.Workload
    seed: int
    check_of: int | None = None  # for a stock comparison run: the index it checks


@dataclass
class ServerReport:
    where: str
    prompts: int = 0  # queued
    not_run: int = 0  # still queued, or interrupted while running, when the budget ran out
    failed: list = field(default_factory=list)
    bad_images: list = field(default_factory=list)
    checks: list = field(default_factory=list)  # (index, variant, psnr dB)
    reserved_mib: dict = field(default_factory=dict)
    seconds: float = 0.0
    log_tracebacks: int = 0
    log_import_failed: int = 0
    log_fallback_lines: int = 0
    gpu_of_process: str | None = None
    gpu_memory_used_mib: str | None = None  # nvidia-smi, every GPU, with the server still up
    pack_log_lines: list = field(default_factory=list)  # the pack's log lines (digits as #), counts
    problems: list = field(default_factory=list)


def plan(n: int, tiny: bool, check_every: int, seed: int) -> list[Job]:
    """n prompts (plus the stock runs that check some of them), reproducible from ``seed``."""
    rnd = random.Random(seed)
    ck, nets = ("sd15-tiny", ("sd15-tiny-cn-a", "sd15-tiny-cn-b"))
    if not tiny:
        ck, nets = "sd15", ("sd15-cn-a", "sd15-cn-b")
    sizes = [(64, 64), (96, 64), (64, 96)] if tiny else [(256, 256), (384, 384), (512, 384)]
    jobs: list[Job] = []
    for i in range(n):
        if i == 0:  # the heaviest first: largest size, both nets, batch 2, every node on
            size, k, batch, variant = max(sizes, key=lambda s: s[0] * s[1]), 2, 2, "exact_stack"
        else:
            size, k, batch = rnd.choice(sizes), rnd.choice([0, 1, 1, 2]), rnd.choice([1, 1, 2])
            pool = EXACT + LOSSY
            if k == 0:
                pool = [v for v in pool if v not in NEEDS_NET]
            variant = rnd.choice(pool)
        wl = workflows.Workload(
            f"soak{i}",
            ck,
            tuple(nets[:k]),
            size[0],
            size[1],
            steps=rnd.randint(4, 6) if tiny else rnd.randint(5, 8),
            sampler=rnd.choice(["euler", "dpmpp_2m"]),
            strength=rnd.choice([1.0, 0.8, 0.5]),
            start_percent=rnd.choice([0.0, 0.0, 0.1]),
            end_percent=rnd.choice([1.0, 1.0, 0.8]),
            batch_size=batch,
            decode=True,
        )
        s = 10_000 + i
        jobs.append(Job(i, variant, wl, s))
        if variant in EXACT and i % check_every == 0:
            jobs.append(Job(i, "stock", wl, s, check_of=i))
    return jobs


def _post(url: str, payload: dict) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        body = r.read().decode()
    return json.loads(body) if body.strip() else {}


def _images(base: Path, entry: dict):
    import numpy as np
    from PIL import Image

    out = []
    for node_out in entry.get("outputs", {}).values():
        for im in node_out.get("images", []):
            path = base / im.get("type", "output") / im.get("subfolder", "") / im["filename"]
            out.append(np.asarray(Image.open(path), dtype=np.float64) / 255.0)
    return out


def _psnr(a, b) -> float:
    import numpy as np

    mse = float(np.mean((a - b) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


def _reserved(server: browser.ComfyServer) -> float | None:
    dev = server.get("/system_stats").get("devices", [{}])[0]
    if "cuda" not in str(dev.get("type", "")) and "cuda" not in str(dev.get("name", "")):
        return None
    return dev.get("torch_vram_total", 0) / MIB


def _reserved_after_free(server: browser.ComfyServer) -> float | None:
    """Reserved VRAM once ComfyUI has unloaded every model and dropped its output cache (its
    own ``/free``, what the UI's "Unload models" button sends): what stays is what nobody
    should hold, so this figure, unlike the one with models loaded, does not depend on which
    models the last prompt happened to leave resident. The worker frees after waking from its
    queue; the figure is read once it stops changing."""
    _post(server.url + "/free", {"unload_models": True, "free_memory": True})
    last = None
    for _ in range(20):
        time.sleep(1.0)
        now = _reserved(server)
        if now is None or now == last:
            return now
        last = now
    return last


def reserved_problems(r: dict) -> list[str]:
    """The reserved-VRAM verdict from the figures ``run_server`` read (MiB; None: unread).

    With every model unloaded (``/free``), the end's figure must stay within 5% + 64 MiB of the
    warm one's: that is the leak check, and when both were read it is the only one. With models
    loaded, the figure says which models the last prompt left resident more than whether memory
    leaks (ComfyUI 0.33's DynamicVRAM keeps its weights outside PyTorch's allocator, so a first
    prompt there can leave 64 MiB and a later one a loaded Memory Pool's 2304 MiB); it is the
    verdict (end within 5% of the first prompt's) only where ``/free`` could not be read."""
    w, e = r.get("after_warm_prompts_freed"), r.get("after_last_prompt_freed")
    if w is not None and e is not None:
        if e > 1.05 * w + 64:
            return [
                f"reserved VRAM with models unloaded grew {w:.0f} → {e:.0f} MiB after the warm "
                "prompts (a leak)"
            ]
        return []
    first, end = r.get("after_first_prompt"), r.get("after_last_prompt")
    if first and end and end > 1.05 * first:
        return [
            f"reserved VRAM grew {first:.0f} → {end:.0f} MiB over the run (models as they were; "
            "ComfyUI's /free could not be read)"
        ]
    return []


def _gpu_of(pid: int) -> str | None:
    """The index of the GPU on which nvidia-smi sees process ``pid``."""
    try:
        q = ["nvidia-smi", "--format=csv,noheader"]
        gpus = subprocess.run(
            q + ["--query-gpu=index,uuid"], capture_output=True, text=True, timeout=30
        ).stdout
        apps = subprocess.run(
            q + ["--query-compute-apps=pid,gpu_uuid"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    index = {u.strip(): i.strip() for i, u in (ln.split(",") for ln in gpus.splitlines() if ln)}
    for ln in apps.splitlines():
        p, u = (x.strip() for x in ln.split(","))
        if p == str(pid):
            return index.get(u, u)
    return None


def run_server(
    where: str, comfy_root: Path, base: Path, jobs: list[Job], warm: int, budget: float
) -> ServerReport:
    rep = ServerReport(where)
    cpu = where == "cpu"
    args = [] if cpu else ["--cuda-device", where]
    hints = workflows.write_hint_images(base / "input", workflows.WORKLOADS["T2"])
    t0 = time.time()
    with browser.ComfyServer(comfy_root, base, cpu=cpu, args=args) as srv:
        ids: dict[str, Job] = {}

        def queue(job: Job) -> str:
            wl = job.workload
            names = workflows.write_hint_images(base / "input", wl) if wl.controlnets else hints
            p, _ = workflows.build_prompt(wl, job.seed, names, VARIANTS[job.variant])
            pid = _post(srv.url + "/prompt", {"prompt": p, "client_id": "cna-soak"})["prompt_id"]
            ids[pid] = job
            return pid

        deadline = t0 + budget

        def wait(pids: set[str]) -> dict:
            """History entries of ``pids`` once the queue is empty, or of those done by the
            deadline (the rest is cleared from the queue and reported)."""
            while time.time() < deadline:
                q = srv.get("/queue")
                if not q.get("queue_running") and not q.get("queue_pending"):
                    break
                time.sleep(1.0)
            else:
                _post(srv.url + "/queue", {"clear": True})
                _post(srv.url + "/interrupt", {})
                time.sleep(3.0)
                msg = f"budget of {budget:.0f} s ran out with prompts queued"
                if msg not in rep.problems:
                    rep.problems.append(msg)
            hist = srv.get("/history?max_items=100000")
            return {k: hist.get(k) for k in pids}

        results: dict = {}
        try:
            results.update(wait({queue(jobs[0])}))
            rep.reserved_mib["after_first_prompt"] = _reserved(srv)
            if not cpu and srv.proc is not None:
                rep.gpu_of_process = _gpu_of(srv.proc.pid)
            results.update(wait({queue(j) for j in jobs[1:warm]}))
            rep.reserved_mib["after_warm_prompts"] = _reserved(srv)
            rep.reserved_mib["after_warm_prompts_freed"] = _reserved_after_free(srv)
            results.update(wait({queue(j) for j in jobs[warm:]}))
            rep.reserved_mib["after_last_prompt"] = _reserved(srv)
            rep.reserved_mib["after_last_prompt_freed"] = _reserved_after_free(srv)
        except OSError as e:  # the server stopped answering: say how it ended, and when
            time.sleep(2.0)
            code = srv.proc.poll() if srv.proc is not None else None
            how = {None: "still running", -9: "killed (SIGKILL: the kernel's OOM killer?)"}
            raise RuntimeError(
                f"server stopped answering after {time.time() - t0:.0f} s, "
                f"{sum(v is not None for v in results.values())} prompts done: {e}; process "
                f"exit code {code} ({how.get(code, 'exited')})"
            ) from e
        if not cpu:
            try:
                rep.gpu_memory_used_mib = subprocess.run(
                    ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader"],
                    capture_output=True,
                    text=True,
                    timeout=30,
                ).stdout.strip()
            except (OSError, subprocess.TimeoutExpired):
                pass
        log = srv.log_path.read_text(errors="replace")
    rep.seconds = time.time() - t0
    rep.prompts = len(ids)
    # ComfyUI's own start-up may log import failures of its optional extras (no torchaudio,
    # say): only this pack's import and what happens once the server is up count.
    served = log.split("To see the GUI go to", 1)[-1]
    rep.log_tracebacks = served.count("Traceback (most recent call last)")
    rep.log_import_failed = sum(
        "IMPORT FAILED" in ln and browser.PACK_FOLDER in ln for ln in log.splitlines()
    )
    rep.log_fallback_lines = len(re.findall(r"eager|fell back|falls back", served))
    keys = ("graph", "kernel", "eager", "Accelerator", "Memory Pool", "Feature Cache", "CNA")
    seen: dict[str, int] = {}
    for ln in served.splitlines():
        if any(k in ln for k in keys):
            key = re.sub(r"\d+(\.\d+)?", "#", ln.strip())[:200]
            seen[key] = seen.get(key, 0) + 1
    rep.pack_log_lines = sorted(seen.items(), key=lambda kv: -kv[1])[:40]

    images: dict[tuple[int, str], list] = {}
    for pid, job in ids.items():
        entry = results.get(pid)
        status = (entry or {}).get("status", {})
        stopped = rep.problems and "budget" in rep.problems[-1]
        interrupted = "execution_interrupted" in json.dumps(status.get("messages", []))
        if stopped and (entry is None or interrupted):  # queued, or running, at the deadline
            rep.not_run += 1
            continue
        if not entry or status.get("status_str") != "success":
            msgs = json.dumps(status.get("messages", []))[-800:]
            rep.failed.append({"index": job.index, "variant": job.variant, "why": msgs})
            continue
        imgs = _images(base, entry)
        ok = imgs and all(
            (x == x).all() and float(x.std()) > 1e-4 for x in imgs
        )  # finite (PNG) and not constant
        if not ok:
            rep.bad_images.append({"index": job.index, "variant": job.variant})
        images[(job.index, "stock" if job.check_of is not None else job.variant)] = imgs
    floor = 60.0 if cpu else 40.0
    for (i, v), imgs in images.items():
        if v == "stock" or (i, "stock") not in images:
            continue
        ref = images[(i, "stock")]
        db = min(_psnr(a, b) for a, b in zip(ref, imgs, strict=True))
        rep.checks.append((i, v, db))
        if db < floor:
            rep.problems.append(f"prompt {i} ({v}) differs from stock: {db:.1f} dB < {floor}")
    if rep.failed:
        rep.problems.append(f"{len(rep.failed)} prompts failed")
    if rep.bad_images:
        rep.problems.append(f"{len(rep.bad_images)} prompts gave constant or broken images")
    if rep.log_tracebacks or rep.log_import_failed:
        rep.problems.append(
            f"server log: {rep.log_tracebacks} tracebacks, {rep.log_import_failed} IMPORT FAILED"
        )
    rep.problems += reserved_problems(rep.reserved_mib)
    if not cpu and rep.gpu_of_process not in (None, where):
        rep.problems.append(f"server for GPU {where} ran on GPU {rep.gpu_of_process}")
    return rep


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default="0", help="comma list of GPU indices, or 'cpu'")
    ap.add_argument("--prompts", type=int, default=200, help="prompts per server")
    ap.add_argument("--check-every", type=int, default=10)
    ap.add_argument("--warm", type=int, default=20, help="prompts before the warm VRAM figure")
    ap.add_argument("--tiny", action="store_true", help="tiny models (CPU smoke runs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--budget", type=float, default=3600.0, help="seconds per server; then it stops, reported"
    )
    ap.add_argument("--models-dir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path("bench-results"))
    a = ap.parse_args(argv)

    from . import comfy_host, random_models

    models_dir = a.models_dir or comfy_host.default_models_dir()
    comfy_host.bootstrap(cpu=True, models_dir=models_dir, load_pack=False)
    names = ["sd15-tiny", "sd15-tiny-cn-a", "sd15-tiny-cn-b"]
    if not a.tiny:
        names = ["sd15", "sd15-cn-a", "sd15-cn-b"]
    paths = random_models.ensure_models(names, models_dir, log=print)
    models = {
        f"{'checkpoints' if random_models.SPECS[n].kind == 'checkpoint' else 'controlnet'}/"
        f"{random_models.SPECS[n].filename}": p
        for n, p in paths.items()
    }
    root = comfy_host.find_comfyui()
    pack = Path(__file__).resolve().parents[1]
    wheres = a.gpus.split(",")
    reports: dict[str, ServerReport] = {}
    errors: dict[str, str] = {}
    tmp = Path(tempfile.mkdtemp(prefix="cna-soak-"))
    hint = tmp / "hint.png"
    workflows.write_hint_images(tmp, workflows.WORKLOADS["T1"])
    next(tmp.glob("cna_hint_*.png")).rename(hint)

    def one(where: str, k: int) -> None:
        base = browser.prepare_base(tmp / f"base-{where}", pack, models, hint)
        jobs = plan(a.prompts, a.tiny, a.check_every, a.seed + 1000 * k)
        try:
            reports[where] = run_server(where, root, base, jobs, a.warm, a.budget)
        except Exception as e:  # a dead server: reported with its log's end, and the run fails
            log = base / "server.log"
            tail = log.read_text(errors="replace").splitlines()[-150:] if log.exists() else []
            errors[where] = f"{type(e).__name__}: {e}"[-2000:] + "\nserver log:\n" + "\n".join(tail)
        finally:  # the whole server log beside the report
            a.out.mkdir(parents=True, exist_ok=True)
            if (base / "server.log").exists():
                shutil.copy(base / "server.log", a.out / f"soak-server-{where}.log")

    threads = [threading.Thread(target=one, args=(w, k)) for k, w in enumerate(wheres)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    a.out.mkdir(parents=True, exist_ok=True)
    payload = {
        "settings": vars(a) | {"out": str(a.out), "models_dir": str(models_dir)},
        "servers": {w: asdict(r) for w, r in reports.items()},
        "errors": errors,
    }
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (a.out / f"soak-{stamp}.json").write_text(json.dumps(payload, indent=1, default=str))
    bad = bool(errors)
    for w, r in sorted(reports.items()):
        worst = min((db for *_, db in r.checks), default=None)
        print(
            f"server {w}: {r.prompts} prompts queued, {r.prompts - r.not_run} ran in "
            f"{r.seconds:.0f} s, {len(r.failed)} failed, "
            f"{len(r.checks)} stock checks (worst {worst} dB), reserved MiB "
            + ", ".join(f"{k} {v:.0f}" for k, v in r.reserved_mib.items() if v is not None)
            + f", GPU of process {r.gpu_of_process}, fallback log lines {r.log_fallback_lines}"
        )
        for p in r.problems:
            print(f"  PROBLEM: {p}")
        bad |= bool(r.problems)
    for w, e in errors.items():
        print(f"server {w} ERROR: {e}")
    print(f"written: {a.out / f'soak-{stamp}.json'}")
    return 1 if bad else 0
