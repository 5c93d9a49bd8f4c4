"""A PyTorch process that forks a child without exec after CUDA is initialised, for hardware checks of
gpu-checkpoint (not part of the tool). The child keeps its parent's descriptors and some of its
/dev/nvidiaN mappings but has no CUDA context (it never touches CUDA).

argv: STATE MIB. The parent behaves as torch_workload.py (x += 1 on the GPU, checked every 50 steps,
"step S ok" into STATE); the child appends "child N" to STATE.child every 100 ms (a log held open), and
writes its PID to STATE.childpid.
"""
import os
import sys
import time

import torch

state = sys.argv[1]
mib = int(sys.argv[2]) if len(sys.argv) > 2 else 256
n = mib * (1 << 20) // 4
base = torch.arange(n, device="cuda", dtype=torch.int32)
x = base.clone()
torch.cuda.synchronize()
child = os.fork()
if child == 0:
    log = os.open(state + ".child", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    i = 0
    while True:
        i += 1
        os.write(log, f"child {i}\n".encode())
        time.sleep(0.1)
with open(state + ".childpid", "w") as f:
    f.write(str(child))
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
