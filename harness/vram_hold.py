# SPDX-License-Identifier: GPL-3.0-or-later
"""``--free-vram GIB``: run the benchmark with only that much of the GPU's memory free, as on a
smaller card, by a helper process that holds the rest for the run.

The helper starts before ComfyUI does, so ComfyUI (and DynamicVRAM, on 0.33) sees the memory
already taken from its first look. It allocates through its own CUDA context, so this process's
allocator statistics (the table's peaks) do not count it; the driver's used memory (the
benchmark's ``device_used_end_mib``) does, and ``Hold.held_mib`` says how much to take off. The
GPU's total memory still reads as the card's own: ComfyUI sizes what it loads by the free
memory, but its rules by share of the whole card (and the pack's own, such as the classic
copies' share under DynamicVRAM) see the big card.

Run as a script, this file is the helper: ``python vram_hold.py WANT_FREE_BYTES DEVICE``.
"""

from __future__ import annotations

import subprocess
import sys

MiB = 1024**2
GiB = 1024**3
# The benchmark's own CUDA context, made after the helper's allocation, takes memory too; the
# helper leaves this much more free so that the run's free memory lands close to the target
# (the real figure is read back and shown).
CONTEXT_MIB = 512


def ballast_bytes(free: int, want_free: int, context: int = CONTEXT_MIB * MiB) -> int:
    """What the helper allocates so that ``want_free`` bytes of ``free`` stay free once the
    benchmark's own CUDA context is made."""
    if want_free <= 0:
        raise ValueError(f"--free-vram must be positive (got {want_free / GiB:g} GiB)")
    if want_free + context >= free:
        raise ValueError(
            f"--free-vram {want_free / GiB:g} GiB: only {free / GiB:.1f} GiB of the GPU is free"
        )
    return free - want_free - context


def _child(argv: list[str]) -> int:
    """The helper: allocate, say ``ready HELD_BYTES``, hold until its input closes. ``argv``:
    the bytes to leave free, the device, and (tests) the free bytes to assume."""
    import torch

    want, device = int(argv[0]), torch.device(argv[1])
    free = int(argv[2]) if len(argv) > 2 else torch.cuda.mem_get_info(device)[0]
    try:
        n = ballast_bytes(free, want)
    except ValueError as e:
        print(f"error {e}", flush=True)
        return 2
    held = torch.empty(n, dtype=torch.uint8, device=device)
    if held.is_cuda:
        torch.cuda.synchronize(device)
    print(f"ready {n}", flush=True)
    sys.stdin.read()
    return 0


class Hold:
    """Hold all but ``free_gib`` of ``device``'s free memory in a helper process while the
    context is open."""

    def __init__(self, free_gib: float, device: str = "cuda:0", assume_free: int | None = None):
        self.want = int(free_gib * GiB)
        self.device = device
        self.assume_free = assume_free
        self.held_mib = 0
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> Hold:
        argv = [sys.executable, __file__, str(self.want), self.device]
        if self.assume_free is not None:
            argv.append(str(self.assume_free))
        self._proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        line = self._proc.stdout.readline().strip()
        if not line.startswith("ready "):
            self.__exit__(None, None, None)
            if line.startswith("error "):
                raise ValueError(line[len("error ") :])
            raise RuntimeError(
                f"the helper holding GPU memory did not start ({line or 'no reply'})"
            )
        self.held_mib = int(line.split()[1]) // MiB
        return self

    def __exit__(self, *exc) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()
            proc.wait(timeout=30)
        except Exception:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
