"""A PyTorch workload for hardware checks of gpu-checkpoint (not part of the tool).

Keeps two tensors in device memory: `base` (fixed) and `x` (x += 1 every step). Every 50 steps it checks on the
GPU that x - base == step everywhere and writes "step S ok" (or "MISMATCH") to the state file given as argv[1].
argv[2]: MiB per tensor (default 512); argv[3] `random`: `base` holds random int32 (incompressible, as model
weights are) instead of 0, 1, 2, ... fork_workload.py imports `tensors` and `count` from here.
"""
import os
import sys
import time

import torch


def tensors(mib, random=False):
    """`base` (MIB MiB of device memory: 0, 1, 2, ... as int32, or random int32) and `x`, a copy of it."""
    n = mib * (1 << 20) // 4
    if random:
        base = torch.randint(-(2**31), 2**31 - 1, (n,), device="cuda", dtype=torch.int32)
    else:
        base = torch.arange(n, device="cuda", dtype=torch.int32)
    return base, base.clone()


def count(state, base, x):
    """x += 1 for ever; every 50 steps the check, written to STATE (replaced whole)."""
    step = 0
    while True:
        x += 1
        step += 1
        if step % 50 == 0:
            ok = bool(((x - base) == step).all().item())
            with open(state + ".tmp", "w") as f:
                f.write(f"{'step' if ok else 'MISMATCH step'} {step} {'ok' if ok else ''} time {int(time.time())}\n")
            os.replace(state + ".tmp", state)
        time.sleep(0.002)


if __name__ == "__main__":
    base, x = tensors(
        int(sys.argv[2]) if len(sys.argv) > 2 else 512,
        random=len(sys.argv) > 3 and sys.argv[3] == "random",
    )
    count(sys.argv[1], base, x)
