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

from torch_workload import count, tensors

state = sys.argv[1]
base, x = tensors(int(sys.argv[2]) if len(sys.argv) > 2 else 256)
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
count(state, base, x)
