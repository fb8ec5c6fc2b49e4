"""The device a rank computes on, the backend that follows from it, and the process-wide CUDA settings.

A GPU job (``resources.use_gpu``) gives each rank actor one GPU; a rank that then finds no CUDA fails
with one line (``DeviceError``) instead of falling back to gloo on the CPU: a silent fallback would
train a GPU-sized model on the CPU at a thousandth of the speed, or join NCCL peers on gloo and hang.

Ray hides the other GPUs of the node from an actor (``CUDA_VISIBLE_DEVICES`` = its own), so the
local index is usually 0; with ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` every GPU stays
visible and the index is the one Ray assigned (``cuda_index``). The rank binds it with
``torch.cuda.set_device`` before anything touches CUDA: NCCL's communicators, made lazily at each
group's first collective (``workers.groups``), are then made on that GPU.

What a CUDA rank sets process-wide (``select_device``): TF32 for fp32 matmuls (the tensor cores'
fp32 path, ~10 significant bits kept in the products, fp32 accumulation; what bf16 training already
accepts for its fp32 parts); and, for NCCL, ``NCCL_ENV`` (see there).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

# TORCH_NCCL_ASYNC_ERROR_HANDLING=2 ("CleanUpOnly"): when an NCCL op times out or fails, the
# watchdog aborts the communicators and the op's work raises, and the process lives on. The default
# (3) tears the process down, and 0 leaves a timed-out op blocked for good. An elastic survivor must
# raise, leave the generation and join the next one in the same process, so only 2 fits (the
# driver's kick aborts the communicators at once instead of after the timeout: workers.groups).
# TORCH_NCCL_USE_COMM_NONBLOCKING=1: a communicator being made can be aborted (workers.groups'
# docstring); torch's default is blocking unless device_id is given, which we do not give.
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_USE_COMM_NONBLOCKING": "1"}


class DeviceError(RuntimeError):
    """A rank cannot compute on the device its job asks for (one line, for the driver's report)."""


def backend_for(device: torch.device) -> str:
    """The process-group backend for ``device``: NCCL on CUDA, gloo on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def cuda_index(gpu_ids: Sequence[int | str], visible: str | None) -> int:
    """This rank's CUDA device index among the GPUs the process sees.

    Args:
        gpu_ids: the GPUs Ray assigned to this actor (``ray.get_gpu_ids()``); empty outside Ray,
            where ``LOCAL_RANK`` (torchrun's convention) or 0 is used.
        visible: ``CUDA_VISIBLE_DEVICES`` (None when unset).

    Raises:
        DeviceError: the assigned GPU is not among the visible ones. Guessing GPU 0 would put this
            rank on a GPU Ray gave another rank (two ranks on one device: out of memory, or NCCL
            refusing duplicate GPUs), so the mismatch is reported instead.
    """
    if not gpu_ids:
        return int(os.environ.get("LOCAL_RANK", 0))
    assigned = str(gpu_ids[0])
    if visible is None or not visible.strip():
        return int(assigned)
    listed = [v.strip() for v in visible.split(",")]
    if assigned not in listed:
        raise DeviceError(f"resources.use_gpu: Ray assigned GPU {assigned} but CUDA_VISIBLE_DEVICES={visible!r} "
                          "does not list it: leave CUDA_VISIBLE_DEVICES to Ray on the worker nodes")
    return listed.index(assigned)


def no_cuda_reason() -> str | None:
    """Why this process cannot use CUDA, or None when it can."""
    if torch.version.cuda is None:
        return f"this torch build ({torch.__version__}) has no CUDA support"
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = "unset" if visible is None else repr(visible)
        return f"torch sees no CUDA device (CUDA_VISIBLE_DEVICES {shown}; driver missing or GPU not visible)"
    return None


def select_device(use_gpu: bool, *, gpu_ids: Sequence[int | str] = (), where: str = "this rank") -> torch.device:
    """The rank's device: its GPU in a GPU job (bound as the current device), else the CPU.

    Raises:
        DeviceError: a GPU job but no usable CUDA here: one line naming the cause and the fix.
    """
    if not use_gpu:
        return torch.device("cpu")
    reason = no_cuda_reason()
    if reason is not None:
        raise DeviceError(f"resources.use_gpu: {where} was given a GPU but {reason}: install a CUDA "
                          "build of torch on the worker nodes, or set resources.use_gpu=false")
    index = cuda_index(gpu_ids, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if not 0 <= index < torch.cuda.device_count():
        raise DeviceError(f"resources.use_gpu: {where} was assigned GPU {list(gpu_ids)} but sees "
                          f"{torch.cuda.device_count()} CUDA device(s) (CUDA_VISIBLE_DEVICES="
                          f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}): check the node's GPU setup")
    torch.cuda.set_device(index)
    configure_cuda()
    return torch.device("cuda", index)


def configure_cuda() -> None:
    """Process-wide CUDA settings every rank uses (idempotent)."""
    torch.backends.cuda.matmul.fp32_precision = "tf32"


def release_memory(device: torch.device) -> None:
    """Free what a generation that was just dropped still holds, before the next one is built.

    FSDP2 modules, their hooks and the autograd state form reference cycles, which only the cyclic
    GC frees, and it runs when allocation counts say so, not when the memory is needed: without
    this a model using over half of the GPU would hold two generations at the rebuild and run out
    of memory. ``empty_cache`` then hands the caching allocator's freed blocks back to the driver,
    so the next generation (or another process on the GPU) can use them.
    """
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def apply_nccl_env() -> None:
    """Set ``NCCL_ENV`` before the first NCCL process group reads it (at its construction)."""
    for name, value in NCCL_ENV.items():
        old = os.environ.get(name)
        if old is not None and old != value:
            logger.warning("%s=%s overridden with %s: elastic recovery needs a failed NCCL op to "
                           "raise in a live process", name, old, value)
        os.environ[name] = value
