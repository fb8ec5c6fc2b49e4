"""Copying a rank's state into reusable CPU buffers for a background checkpoint write (worker side; torch).

``Stager`` wraps DCP's ``StateDictStager``, which keeps one CPU buffer per source storage and copies
into it again on the next save (pinned when on GPU, so the device-to-host copies run at full speed).
It is what DCP's public ``DefaultStager`` runs in its synchronous mode, used directly because some
torch releases' ``DefaultStager`` closes it after every stage (torch 2.11, seen on a GPU machine):
every save then pins fresh buffers, and the second save of a state holding DTensors fails with
``KeyError: <class 'type'>`` (close() clears the copier table that a DTensor spec's reconstruction
needs). Owning the ``StateDictStager`` keeps both the reuse and the table until our ``close``.
What it adds:

* On CUDA the copies run on a stream of their own, after an event the training thread records on
  its compute stream at the step boundary (``mark``): they see the parameters as the finished step
  left them and overlap the next step's kernels. DCP's ``DefaultStager`` itself either copies on the
  current stream (our writer thread's: the device's default stream, serialised with training) or,
  with non-blocking copies, ends with ``torch.accelerator.synchronize()``, a device-wide wait for
  every kernel training has queued meanwhile. Here each copy is a blocking copy on the side stream,
  which waits for that stream only.
* An owner's lifecycle: ``close()`` releases the buffers (unpins them); the writer closes a stager
  it replaces once the save still reading it has ended (``checkpoints.writer``), so abandoned saves
  do not pile up pinned buffers.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
# Private module, the same class in torch 2.11-2.13: DefaultStager's own staging (see the docstring).
from torch.distributed.checkpoint._state_dict_stager import StateDictStager

_made = itertools.count(1)
_closed = itertools.count(1)
stats = {"made": 0, "closed": 0}  # process-wide counts, for the leak test


class Stager:
    def __init__(self, pin_memory: bool) -> None:
        # Staging is synchronous wherever it runs (the caller, or the writer's thread for background
        # staging), so the stager needs no executor of its own.
        self.inner = StateDictStager(pin_memory=pin_memory, share_memory=False)
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        self.closed = False
        stats["made"] = next(_made)

    def mark(self) -> Any:
        """On the training thread at the step boundary: what the copies must wait for (CUDA)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def stage(self, state: dict[str, Any], ready: Any = None) -> dict[str, Any]:
        """A copy of ``state`` with every tensor in this stager's CPU buffers (on any thread)."""
        if self.stream is None:
            return self.inner.stage(state, non_blocking=False)
        with torch.cuda.stream(self.stream):
            if ready is not None:
                self.stream.wait_event(ready)
            return self.inner.stage(state, non_blocking=False)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.inner.close()
            stats["closed"] = next(_closed)
