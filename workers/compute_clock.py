"""A rank's own compute time in a step, for straggler scoring: the wall time inside its blocks'
forward passes, with FSDP's waits for its peers left out.

Why wall time inside the blocks: a straggler is a rank that computes slowly — a slow device, a core
taken by a neighbour, or (the test's fault) a sleep — and its peers then wait for it in every
collective. Step wall time is the same on every rank of a lockstep step, and CPU time misses a rank
that is slow without computing more. What makes a block's forward wait for peers is FSDP's
all-gather, which runs in FSDP's forward pre-hook, and its reshard in the post-hook: this clock's
pre-hook is registered after FSDP's (FSDP prepends its own) and its post-hook is prepended, so both
waits fall outside. Tensor-parallel collectives inside a block do count: a slow TP rank makes its TP
group look slow together, and the group is compared with the other replicas.

On a GPU the host only queues a forward's kernels, so host time would score launch speed, not the
device. There each block's forward is timed by two CUDA events recorded on the current stream where
the host stamps would be; FSDP's wait for its all-gather is a wait of that stream, queued in its
pre-hook before our start event, so the GPU reaches the start event only after the wait: the span
is the block's own kernels (and TP collectives inside it). The events are read at ``take`` (once a
step, after the step's last one completed). The CPU path is unchanged (docs/design.md, Stragglers).

The straggler faults (``workers/actor.py`` ``arm_fault`` kinds "sleep" and "slow") act inside the
first block's forward so that they are what a slow rank's compute would be; "sleep" at "microbatch"
sleeps there in every microbatch (a device slower per unit of work).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
from torch import nn


def _burn_cpu(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class ComputeClock:
    def __init__(self, blocks: Iterable[nn.Module], device: torch.device | None = None) -> None:
        self.cuda = device is not None and device.type == "cuda"
        self._spans: list[tuple] = []  # CUDA: (start, end) events of the forwards since the last take
        self.total = 0.0
        self.sleep_s = 0.0  # fault injection for this step: slept inside the next block's forward
        self.busy_s = 0.0  # ... and CPU burnt there
        # ... and slept in *every* forward of this rank's first block: once per microbatch, so a
        # replica's step takes longer in proportion to its microbatches, as on a slower device
        # (elastic.rebalance's fault: bench/rebalance.py). Stays set until changed.
        self.sleep_each_s = 0.0
        self._entered: dict[int, float] = {}
        self._handles = []
        self._first_block: int | None = None
        for block in blocks:
            if self._first_block is None:
                self._first_block = id(block)
            self._handles.append(block.register_forward_pre_hook(self._enter))
            self._handles.append(block.register_forward_hook(self._exit, prepend=True))

    # ``train.compile`` compiles each block in place, hooks included (``nn.Module.compile``). The
    # clock's hooks run eagerly instead, as FSDP2's do: traced, a CUDA event would be made once at
    # trace time and never recorded at run time, and a host clock read would become a constant.
    @torch.compiler.disable
    def _enter(self, module: nn.Module, args) -> None:
        self._entered[id(module)] = self._mark()
        if self.sleep_each_s > 0 and id(module) == self._first_block:
            time.sleep(self.sleep_each_s)
        if self.sleep_s or self.busy_s:
            sleep, busy, self.sleep_s, self.busy_s = self.sleep_s, self.busy_s, 0.0, 0.0
            if sleep > 0:
                time.sleep(sleep)
            if busy > 0:
                _burn_cpu(busy)

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @torch.compiler.disable
    def _exit(self, module: nn.Module, args, output) -> None:
        t0 = self._entered.pop(id(module), None)
        if t0 is None:
            return
        if self.cuda:
            self._spans.append((t0, self._mark()))
        else:
            self.total += time.perf_counter() - t0

    def take(self) -> float:
        """The seconds counted since the last call (one step's); on CUDA waits for the last event."""
        if self._spans:
            self._spans[-1][1].synchronize()
            self.total += sum(start.elapsed_time(end) for start, end in self._spans) / 1e3  # ms
            self._spans.clear()
        out, self.total = self.total, 0.0
        return out

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
