"""Transfer tiers for the tensors that cross between module groups.

One file per tier; :mod:`~ray_disagg.transport.select` picks a tier for each pair of
workers from where they are (node, process, device). Every tier carries the same message:
a header (metadata, the tensors' names, shapes and dtypes) over the gloo group of the two
groups' link (:mod:`~ray_disagg.transport.links`) and the tensor data over the tier's own
path.

========== ============================ ==============================================
tier       used between                 data path
========== ============================ ==============================================
cuda_ipc   two processes on one GPU     CUDA IPC handle + interprocess event, one
                                        device copy, no host copy
nccl       GPUs of different devices    the link's NCCL communicator (one per worker
                                        and other group)
shm        CPU processes on one node    one copy into a shared-memory buffer the
                                        receiver maps (no socket copy)
gloo       anything else (fallback)     gloo send/recv over TCP (host staging)
========== ============================ ==============================================
"""

from ray_disagg.transport.base import TIERS, TensorSpec, describe
from ray_disagg.transport.select import Location, choose_tier

__all__ = ["TIERS", "Location", "TensorSpec", "choose_tier", "describe"]
