# SPDX-License-Identifier: GPL-3.0-or-later
"""Run API-format workflows in-process through ComfyUI's real executor (``PromptExecutor``).

Serves the host tests and the benchmark: returns the sampler's output latent (and the decoded
image when the workflow decodes), per-step times taken at ComfyUI's own progress hook (CUDA events
on a GPU, so each interval is one step on the GPU's timeline), peak VRAM, and optionally a
torch.profiler summary (GPU-busy time and kernel launches).
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field

import torch


class WorkflowFailed(RuntimeError):
    pass


@dataclass
class RunResult:
    latent: torch.Tensor  # the KSampler's output latent, float32 on the CPU
    image: torch.Tensor | None  # the decoded IMAGE (B, H, W, C) when the workflow decodes
    step_ms: list[float]  # one time per step after the first (see _per_step)
    wall_s: float  # the whole prompt's execution, host clock
    resident_bytes: int | None = None  # allocated when the prompt started (weights kept loaded)
    peak_allocated: int | None = None
    peak_reserved: int | None = None
    gpu_busy_ms: float | None = None  # union of kernel intervals over the whole prompt
    kernels: int | None = None  # kernel launches over the whole prompt
    extra: dict = field(default_factory=dict)


def _per_step(marks: list[tuple], ms_between) -> list[float]:
    """Per-step times from the progress hook's (step value, mark) pairs. ComfyUI 0.3.64 calls
    the hook at every step; newer releases throttle it (the first and last step always, others
    at most every so many milliseconds), so an interval may span several steps: it counts as
    that many steps of its mean length."""
    out: list[float] = []
    for (v0, a), (v1, b) in zip(marks, marks[1:], strict=False):
        n = v1 - v0
        if n > 0:
            out.extend([ms_between(a, b) / n] * n)
    return out


class Runner:
    """One ComfyUI executor with its node cache, so loaders and text encodes run once."""

    def __init__(self, *, device_peak: bool = False):
        """``device_peak``: also poll the device's used memory while sampling (see
        ``DevicePeak``): the only peak that sees memory PyTorch's allocator does not hand out,
        such as ComfyUI 0.33's DynamicVRAM weights. Off for timed runs (a polling thread)."""
        from ..nodes import compat
        from .comfy_host import HeadlessServer

        # the classic cache; ComfyUI 0.33 also takes cache_args (compat builds them)
        self.executor = compat.prompt_executor(HeadlessServer())
        self.cuda = torch.cuda.is_available() and not _comfy_cpu()
        self.device_peak = device_peak

    def run(self, prompt: dict, ids: dict, *, profile: bool = False, on_step=None) -> RunResult:
        """Execute ``prompt``; ``on_step(i)`` is called with the sampler's step i (1-based) each
        time ComfyUI reports progress (every step on 0.3.64; throttled on newer releases)."""
        import asyncio

        import comfy.model_management
        import comfy.utils
        import execution

        ok, err, outputs, node_errors = asyncio.run(
            execution.validate_prompt(str(uuid.uuid4()), prompt, None)
        )
        if not ok:
            raise WorkflowFailed(f"workflow does not validate: {err}; {node_errors}")

        sampler_id = ids["sampler"]
        marks: list = []

        from ..nodes.compiled_step import PROGRESS_TOTAL

        def hook(value, total, preview, node_id=None):
            if node_id is not None and str(node_id) != str(sampler_id):
                return
            if total == PROGRESS_TOTAL:  # a compile's bar on the sampler's node, not a step
                return
            if self.cuda:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                marks.append((value, ev))
            else:
                marks.append((value, time.perf_counter()))
            if on_step is not None:
                on_step(value)
            # As ComfyUI's server hook does (main.py): an interrupt lands at the next step, not
            # only at the next node.
            comfy.model_management.throw_exception_if_processing_interrupted()

        old_hook = comfy.utils.PROGRESS_BAR_HOOK
        comfy.utils.set_progress_bar_global_hook(hook)
        sampling_peaks: list[tuple] = []
        unpatch = (
            _measure_sampling_peak(sampling_peaks, device_peak=self.device_peak)
            if self.cuda
            else (lambda: None)
        )
        resident = peak_a = peak_r = None
        if self.cuda:
            torch.cuda.synchronize()
            resident = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        prof = None
        try:
            t0 = time.perf_counter()
            if profile and self.cuda:
                from torch.profiler import ProfilerActivity
                from torch.profiler import profile as tprofile

                with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
                    self.executor.execute(prompt, str(uuid.uuid4()), {}, outputs)
                    torch.cuda.synchronize()
            else:
                self.executor.execute(prompt, str(uuid.uuid4()), {}, outputs)
                if self.cuda:
                    torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        finally:
            comfy.utils.set_progress_bar_global_hook(old_hook)
            unpatch()
        if not self.executor.success:
            raise WorkflowFailed(_error_text(self.executor.status_messages))
        if self.cuda:
            # the prompt's peak: before sampling (read when sampling began) or since
            pre = [x for x in sampling_peaks if x[0] == "pre"]
            peak_a = max([torch.cuda.max_memory_allocated()] + [x[1] for x in pre])
            peak_r = max([torch.cuda.max_memory_reserved()] + [x[2] for x in pre])
            step_ms = _per_step(marks, lambda a, b: a.elapsed_time(b))
        else:
            step_ms = _per_step(marks, lambda a, b: (b - a) * 1e3)

        latent = self.output_of(ids["sampler"])[0]["samples"].float().cpu()
        image = None
        if "decode" in ids:
            image = self.output_of(ids["decode"])[0].float().cpu()
        res = RunResult(latent, image, step_ms, wall, resident, peak_a, peak_r)
        # how many progress reports the sampler sent: 0 when ComfyUI answered the prompt from its
        # output cache (the same prompt as the run before) and nothing sampled
        res.extra["sampler_reports"] = len(marks)
        if self.cuda:
            # the device's memory in use once the prompt is done: every model still held, those
            # in memory PyTorch's allocator does not see (DynamicVRAM's weights) included
            res.extra["device_used_end"] = _device_used()
        samp = [x for x in sampling_peaks if x[0] == "sampling"]
        if samp:  # loading the run's models and sampling, without the prompt's other nodes
            res.extra["sampling_peak_allocated"] = max(x[1] for x in samp)
            res.extra["sampling_peak_reserved"] = max(x[2] for x in samp)
            dev = [x[3] for x in samp if x[3] is not None]
            if dev:
                res.extra["sampling_peak_device"] = max(dev)
        if prof is not None:
            res.gpu_busy_ms, res.kernels = _kernel_summary(prof)
            res.extra["kernel_ms"] = _kernel_times(prof)
        return res

    def output_of(self, node_id: str) -> list:
        """The cached outputs of a node from the last run (one list entry per output slot)."""
        from ..nodes import compat

        entry = compat.cached_output(self.executor, node_id)
        if entry is None:
            raise WorkflowFailed(f"node {node_id} produced no output")
        outs = getattr(entry, "outputs", entry)
        return [o[0] if isinstance(o, list) and len(o) == 1 else o for o in outs]


class DevicePeak:
    """The most device memory in use while it runs: ``read()`` (default: the CUDA driver's
    used = total - free, the whole process's use, context included) polled on a thread every
    ``interval_s``, from ``start()`` to ``stop()``, which reads once more and returns the peak
    in bytes. A peak between two reads can be missed; the interval is far shorter than a step."""

    def __init__(self, read=None, interval_s: float = 0.002):
        self.read = read or _device_used
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.read())
            self._stop.wait(self.interval_s)

    def start(self) -> DevicePeak:
        self.peak = self.read()
        self._stop.clear()
        self._thread = threading.Thread(target=self._poll, name="cna-device-peak", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> int:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.peak = max(self.peak, self.read())
        return self.peak


def _device_used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def _measure_sampling_peak(out: list, device_peak: bool = False):
    """Record peak VRAM from the start of ComfyUI's ``CFGGuider.sample`` (outside every
    OUTER_SAMPLE wrapper: the pack's nodes reset the peak counter there for their own badges;
    then the run's models load, then it samples) to its end: ("pre", alloc, reserved, None) =
    the prompt's peak so far, ("sampling", alloc, reserved, device) = the peak of this sampling
    call, ``device`` the device's used memory (``DevicePeak``) where ``device_peak`` asks for
    it, else None. Measurement only: the harness wraps the method for one prompt and puts it
    back (returns the undo)."""
    import comfy.samplers

    cls = comfy.samplers.CFGGuider
    orig = cls.sample

    def sample(self, *args, **kwargs):
        torch.cuda.synchronize()
        out.append(
            ("pre", torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved(), None)
        )
        torch.cuda.reset_peak_memory_stats()
        poll = DevicePeak().start() if device_peak else None
        try:
            return orig(self, *args, **kwargs)
        finally:
            torch.cuda.synchronize()
            dev = poll.stop() if poll is not None else None
            out.append(
                (
                    "sampling",
                    torch.cuda.max_memory_allocated(),
                    torch.cuda.max_memory_reserved(),
                    dev,
                )
            )

    cls.sample = sample

    def undo():
        cls.sample = orig

    return undo


def _comfy_cpu() -> bool:
    from comfy.cli_args import args

    return bool(args.cpu)


def _error_text(messages) -> str:
    for event, data in messages:
        if event == "execution_error":
            tb = "".join(data.get("traceback", []))
            return (
                f"node {data.get('node_id')} ({data.get('node_type')}) failed: "
                f"{data.get('exception_type')}: {data.get('exception_message')}\n{tb}"
            )
        if event == "execution_interrupted":
            return f"interrupted at node {data.get('node_id')}"
    return "workflow failed without an error message"


def _kernel_summary(prof) -> tuple[float, int]:
    """GPU-busy ms (union of device intervals) and the number of kernel launches."""
    from torch.autograd import DeviceType

    spans = []
    kernels = 0
    for e in prof.events():
        if e.device_type != DeviceType.CUDA:
            continue
        spans.append((e.time_range.start, e.time_range.end))
        name = e.name.lower()
        if not (name.startswith("memcpy") or name.startswith("memset")):
            kernels += 1
    spans.sort()
    busy = 0.0
    cur_s = cur_e = None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    return busy / 1e3, kernels


def _kernel_times(prof) -> dict[str, float]:
    """Total device ms per kernel name over the profiled run."""
    from torch.autograd import DeviceType

    out: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            out[e.name] = out.get(e.name, 0.0) + (e.time_range.end - e.time_range.start) / 1e3
    return out


def psnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    """10·log10(range(ref)² / MSE) in dB; inf when identical."""
    ref = ref.double()
    mse = torch.mean((ref - x.double()) ** 2).item()
    if mse == 0:
        return float("inf")
    rng = (ref.max() - ref.min()).item()
    return 10.0 * torch.log10(torch.tensor(rng * rng / mse)).item()


def ssim(ref: torch.Tensor, x: torch.Tensor) -> float:
    """Mean SSIM (Wang et al. 2004: 11×11 Gaussian window, σ 1.5, K1 0.01, K2 0.03) of two
    IMAGE batches (B, H, W, C) in [0, 1], over every channel; 1.0 when identical."""
    import torch.nn.functional as F

    a = ref.double().movedim(-1, 1)
    b = x.double().movedim(-1, 1)
    c = a.shape[1]
    g = torch.exp(-((torch.arange(11, dtype=torch.float64) - 5) ** 2) / (2 * 1.5**2))
    g = g / g.sum()
    w = (g[:, None] * g[None, :]).expand(c, 1, 11, 11).contiguous()

    def blur(t):
        return F.conv2d(t, w, groups=c)

    mu_a, mu_b = blur(a), blur(b)
    var_a = blur(a * a) - mu_a**2
    var_b = blur(b * b) - mu_b**2
    cov = blur(a * b) - mu_a * mu_b
    c1, c2 = 0.01**2, 0.03**2
    s = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / (
        (mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2)
    )
    return float(s.mean())
