"""workers/compute_clock.py: a block's forward counts, a wait in a hook placed before it (FSDP's
all-gather, whose pre-forward hook FSDP prepends) or after it (FSDP's reshard) does not; the
straggler faults land inside the counted time. A fake clock: no wall-clock assertion."""

from __future__ import annotations

import torch
from torch import nn

import workers.compute_clock as cc


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    def thread_time(self) -> float:  # burning CPU moves both clocks
        self.now += 0.25
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


class Block(nn.Module):
    def __init__(self, clock: FakeTime, work_s: float) -> None:
        super().__init__()
        self.clock, self.work_s = clock, work_s
        self.lin = nn.Linear(2, 2)

    def forward(self, x):
        self.clock.sleep(self.work_s)  # the block's own compute
        return self.lin(x)


def test_forward_counts_and_the_hooks_around_it_do_not(monkeypatch):
    fake = FakeTime()
    monkeypatch.setattr(cc, "time", fake)
    blocks = [Block(fake, 0.25), Block(fake, 0.5)]
    for b in blocks:  # registered first, as FSDP's are: a prepended pre-hook and a post-hook
        b.register_forward_pre_hook(lambda m, a: fake.sleep(3.0), prepend=True)
        b.register_forward_hook(lambda m, a, o: fake.sleep(7.0))
    clock = cc.ComputeClock(blocks)
    x = torch.zeros(1, 2)
    for b in blocks:
        x = b(x)
    assert clock.take() == 0.75 and clock.take() == 0.0

    clock.sleep_s = 2.0  # the "sleep" fault: inside the first block's forward of the step, once
    for b in blocks:
        x = b(x)
    assert clock.take() == 2.75
    clock.busy_s = 1.0  # the "slow" fault burns CPU there (1 s, plus the fake's first 0.25 s read)
    blocks[0](x)
    assert clock.take() == 1.5
    clock.remove()
    blocks[0](x)
    assert clock.take() == 0.0


class FakeEvent:
    """torch.cuda.Event as the clock uses it: recorded on the stream, read once at take()."""

    now = 0.0  # the GPU's time, advanced by the fake kernels below
    synced = 0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.t = None

    def record(self) -> None:
        self.t = FakeEvent.now

    def elapsed_time(self, end: "FakeEvent") -> float:  # milliseconds, as CUDA's
        return (end.t - self.t) * 1e3

    def synchronize(self) -> None:
        FakeEvent.synced += 1


def test_on_cuda_the_blocks_are_timed_by_events_on_the_stream_not_by_the_host(monkeypatch):
    """On a GPU the host only launches: a block whose kernels take 0.5 s of device time but 1 ms of
    host time scores 0.5 s. FSDP's all-gather wait (a stream wait in its pre-hook) lands before the
    start event, so it does not count. The events are read once, at take()."""
    fake_host = FakeTime()
    monkeypatch.setattr(cc, "time", fake_host)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)

    class GpuBlock(nn.Module):
        def forward(self, x):
            FakeEvent.now += 0.5  # the kernels' device time
            fake_host.sleep(0.001)  # the host's launch time
            return x

    blocks = [GpuBlock(), GpuBlock()]
    for b in blocks:
        b.register_forward_pre_hook(lambda m, a: setattr(FakeEvent, "now", FakeEvent.now + 3.0), prepend=True)
    clock = cc.ComputeClock(blocks, device=torch.device("cuda", 0))
    x = torch.zeros(1)
    for b in blocks:
        x = b(x)
    assert FakeEvent.synced == 0
    assert clock.take() == 1.0 and FakeEvent.synced == 1
    assert clock.take() == 0.0
    cpu = cc.ComputeClock(blocks[:1], device=torch.device("cpu"))  # the CPU path: host time, as before
    blocks[0](x)
    assert abs(cpu.take() - 0.001) < 1e-12


def test_the_hooks_run_eagerly_around_a_compiled_block(monkeypatch):
    """``train.compile`` compiles each block in place (``nn.Module.compile``), hooks included. The
    clock's hooks must stay out of the graph: traced, a CUDA event is made once at trace time and
    never recorded at run time (the GPU machine's compiled run failed at its first step with "Both
    events must be recorded"), and a host clock read would be a constant. Here every clock read
    happens eagerly, and each call of the compiled block counts its own time."""
    fake = FakeTime()
    compiling_reads = []

    class Spy:
        def perf_counter(self) -> float:
            compiling_reads.append(torch.compiler.is_compiling())
            return fake.perf_counter()

    monkeypatch.setattr(cc, "time", Spy())
    torch._dynamo.reset()
    block = Block(fake, 0.25)
    block.clock = type("Eager", (), {"sleep": staticmethod(torch.compiler.disable(fake.sleep))})()
    clock = cc.ComputeClock([block])
    block.compile(backend="eager")
    x = torch.zeros(1, 2)
    for _ in range(3):
        block(x)
        fake.sleep(1.0)  # between calls: not the block's time
    assert clock.take() == 0.75
    assert compiling_reads and not any(compiling_reads)
    torch._dynamo.reset()
