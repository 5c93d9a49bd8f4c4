"""An NVML-only process for hardware checks of gpu-checkpoint (not part of the tool), shaped like a
monitoring agent: NVML initialised, the first GPU's memory polled every 100 ms, and libcuda loaded and
initialised (cuInit, as pynvml images do through their CUDA imports) without any context.

Appends one line a poll to the log given as argv[1], held open (O_APPEND): `poll N ok USED` or
`poll N error CODE` (NVML's return code), so that what NVML does in a restored process shows.
"""
import ctypes
import os
import sys
import time

log = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
nvml = ctypes.CDLL("libnvidia-ml.so.1")
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
assert nvml.nvmlInit_v2() == 0


class Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


n = 0
while True:
    n += 1
    dev = ctypes.c_void_p()
    mem = Memory()
    rc = nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(dev))
    if rc == 0:
        rc = nvml.nvmlDeviceGetMemoryInfo(dev, ctypes.byref(mem))
    line = f"poll {n} ok {mem.used}\n" if rc == 0 else f"poll {n} error {rc}\n"
    os.write(log, line.encode())
    time.sleep(0.1)
