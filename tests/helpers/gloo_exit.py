"""How the test scripts that run gloo ranks end their processes."""

import os
import sys

import torch.distributed as dist


def finish() -> None:
    """Destroy the process group, then leave without the interpreter's shutdown.

    At shutdown gloo's worker threads may still hold tensors that Python refers to. Releasing one
    then takes the GIL of a dying interpreter, and the process aborts with "terminate called
    without an active exception" (SIGABRT; pytorch/pytorch#190489, #179291). CI saw it twice, in
    rank processes whose checks had all passed. Call this after everything the script reports
    has been written; an exception before it still ends the process with its traceback.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
