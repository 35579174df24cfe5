"""Out of memory in one line: torch's and the host's messages parsed, the line written."""

import pytest

from megatron_ext.runtime import oom
from megatron_ext.runtime.faults import CUDA_OOM_MESSAGE, HOST_OOM_MESSAGE

GIB = 1 << 30
MIB = 1 << 20
MEMINFO = "MemTotal:       24682064 kB\nMemFree:  100 kB\nMemAvailable:   1153434 kB\n"


def test_current_cuda_message():
    s = oom.device_shortage(CUDA_OOM_MESSAGE)
    assert (s.device, s.asked, s.free) == ("cuda:0", 2 * GIB, int(1.10 * GIB))
    assert s.total == int(139.81 * GIB)


def test_pre_2_1_cuda_message():
    message = ("CUDA out of memory. Tried to allocate 36.00 MiB (GPU 3; 7.93 GiB total capacity; "
               "130.35 MiB already allocated; 47.06 MiB free; 188.00 MiB reserved in total by "
               "PyTorch)")
    s = oom.device_shortage(message)
    assert (s.device, s.asked, s.total, s.free) == ("cuda:3", 36 * MIB, int(7.93 * GIB),
                                                    int(47.06 * MIB))


def test_message_without_numbers():
    s = oom.device_shortage("CUDA error: out of memory", default_device="cuda:5")
    assert (s.device, s.asked, s.free, s.total) == ("cuda:5", None, None, None)
    assert oom.oom_line(s, "starting up", "") == "out of memory on cuda:5 while starting up"


@pytest.mark.parametrize("message,asked", [
    (HOST_OOM_MESSAGE, 3 * GIB),
    ("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you "
     "tried to allocate 123456789 bytes. Error code 12 (Cannot allocate memory)", 123456789),
    ("libtorch_cpu.so: failed to map segment from shared object", None),
])
def test_host_messages(message, asked):
    s = oom.host_shortage(message, MEMINFO)
    assert (s.device, s.asked) == ("host", asked)
    assert (s.free, s.total) == (1153434 * 1024, 24682064 * 1024)


def test_classify():
    import torch

    assert oom.classify(torch.OutOfMemoryError(CUDA_OOM_MESSAGE)) == "device"
    assert oom.classify(RuntimeError("CUDA out of memory. Tried to allocate 1 GiB")) == "device"
    assert oom.classify(MemoryError(HOST_OOM_MESSAGE)) == "host"
    assert oom.classify(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried "
                                     "to allocate 5 bytes")) == "host"
    assert oom.classify(ImportError("x.so: failed to map segment from shared object")) == "host"
    assert oom.classify(RuntimeError("shape mismatch")) is None
    assert oom.classify(ValueError("Cannot allocate memory")) is None


def test_a_thread_that_cannot_start_is_host_memory_only_under_ulimit_v():
    # gloo's process-group threads under ulimit -v: no room to map a stack (EAGAIN).
    eagain = RuntimeError("Resource temporarily unavailable")
    assert oom.classify(eagain, limited=True) == "host"
    assert oom.classify(eagain, limited=False) is None
    assert oom.classify(ValueError("Resource temporarily unavailable"), limited=True) is None


def test_the_line():
    line = oom.oom_line(oom.device_shortage(CUDA_OOM_MESSAGE), "taking the optimizer step",
                        "try --offload-optimizer")
    assert line == ("out of memory on cuda:0 while taking the optimizer step (asked 2.00 GiB, "
                    "1.10 GiB free of 139.81 GiB): try --offload-optimizer")
    host = oom.host_shortage(HOST_OOM_MESSAGE, MEMINFO)
    host.limit = 700 * MIB
    assert oom.oom_line(host, "loading data", "try fewer --num-workers") == (
        "out of memory on the host while loading data (asked 3.00 GiB, 1.10 GiB available of "
        "23.54 GiB, ulimit -v 700.00 MiB): try fewer --num-workers")
