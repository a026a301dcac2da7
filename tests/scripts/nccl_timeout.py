"""A torchrun-style script without torch or a GPU that ends as a script's rank ends on a GPU node when its
collective times out under NCCL: rank 1 exits 0 at once (an early exit decided there), rank 0 says a second later
what NCCL's watchdog says of the collective it waited in, then the C++ runtime's words and frames, and aborts
(SIGABRT), as torch's watchdog takes the process down (tests/script/test_script_early_exit.py)."""

import os
import sys
import time

rank = int(os.environ["RANK"])
if rank == 1:
    sys.exit(0)
time.sleep(1.0)
work = "WorkNCCL(SeqNum=12, OpType=ALLREDUCE, NumelIn=9, NumelOut=9, Timeout(ms)=600000) ran for 600021 milliseconds"
say = [
    f"[rank0]:[E1129 21:40:00.000000001 ProcessGroupNCCL.cpp:616] [Rank 0] Watchdog caught collective operation "
    f"timeout: {work} before timing out.",
    "[rank0]:[E1129 21:40:00.000000002 ProcessGroupNCCL.cpp:1785] [PG ID 0 PG GUID 0(default_pg) Rank 0] Exception "
    "(either an error or timeout) detected by watchdog at work: 12, last enqueued NCCL work: 12, last completed NCCL "
    "work: 11.",
    "terminate called after throwing an instance of 'c10::DistBackendError'",
    "  what():  [PG ID 0 PG GUID 0(default_pg) Rank 0] Process group watchdog thread terminated with exception: "
    f"[Rank 0] Watchdog caught collective operation timeout: {work} before timing out.",
    "Exception raised from checkTimeout at /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:632 (most "
    "recent call first):",
    *(f"frame #{i}: <unknown function> + 0x{i:x}0 (0x7f00000{i:03x} in /usr/lib/libtorch_cuda.so)" for i in range(25)),
]
sys.stderr.write("\n".join(say) + "\n")
sys.stderr.flush()
os.abort()
