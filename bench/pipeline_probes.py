"""Rank-side probes for bench/pipeline_bubble.py: picklable module-level ``fn(runtime) -> finish``.

``run_mesh(instrument=...)`` calls one on every rank after its ``RankRuntime`` is built; what ``finish()``
returns comes back to the benchmark. ``timing_probe`` records each ``Executor.run`` window (absolute
``perf_counter`` start/end, shared by all local processes) and its process CPU seconds; ``memory_probe``
counts the live bytes autograd saves inside each stage forward and, under the zero-bubble schedules,
the gradients each pending W keeps from its I.
"""

from __future__ import annotations

import time


def timing_probe(runtime):
    """Record each Executor.run's absolute start/end (perf_counter) and process CPU seconds."""
    executor = runtime.executor
    inner = executor.run
    windows: list[tuple[float, float, float]] = []

    def run(actions, data):
        cpu0, t0 = time.process_time(), time.perf_counter()
        out = inner(actions, data)
        windows.append((t0, time.perf_counter(), time.process_time() - cpu0))
        return out

    executor.run = run
    return lambda: windows


def memory_probe(runtime):
    """Count live bytes of autograd-saved activations (distinct storages) during each step."""
    counter = _ActivationCounter(runtime)
    counter.hook_stage_forwards(runtime)
    counter.hook_loss(runtime.executor)
    runtime.executor.after_action = counter.after_action  # the executor's hook (workers/pipeline.py)
    counter.hook_step(runtime.executor)
    return lambda: counter.per_step


class _Saved:
    """One tensor autograd saved, detached; its storage's count drops when autograd lets it go."""

    __slots__ = ("tensor", "key", "counter", "__weakref__")

    def __init__(self, tensor, key, counter: _ActivationCounter):
        self.tensor, self.key, self.counter = tensor, key, counter

    def __del__(self):
        count, nbytes = self.counter.refs[self.key]
        if count == 1:
            del self.counter.refs[self.key]
            self.counter.live -= nbytes
        else:
            self.counter.refs[self.key] = (count - 1, nbytes)


class _ActivationCounter:
    """The probe's state: saved-activation bytes live now and at the step's peak, the first
    microbatch's F, and (zero-bubble) the gradients kept from each I to its W."""

    def __init__(self, runtime) -> None:
        self.excluded = set()
        for stage in runtime.stages.values():
            for t in [*stage.module.parameters(), *stage.module.buffers()]:
                self.excluded.add(t.untyped_storage().data_ptr())
        # live/peak: saved activations; kept/peak_total: zero-bubble's kept gradients, and both together.
        self.live = self.peak = 0
        self.refs: dict[int, tuple[int, int]] = {}  # storage -> (saved tensors on it, its bytes)
        self.first_f: int | None = None
        self.first_start = self.forwards = self.kept = self.peak_total = 0
        self.kept_by_pass: dict[tuple[int, int], int] = {}  # (stage, microbatch) -> bytes its W will free
        self.per_step: list[dict] = []

    def pack(self, tensor):
        key = tensor.untyped_storage().data_ptr()
        if key in self.excluded or key == 0:
            return tensor
        count, nbytes = self.refs.get(key, (0, tensor.untyped_storage().nbytes()))
        if count == 0:
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            self.peak_total = max(self.peak_total, self.live + self.kept)
        self.refs[key] = (count + 1, nbytes)
        # Detached: a saved output of a node would otherwise reference that node (through its
        # grad_fn) from what the node saves, a cycle Python cannot collect. A backward with
        # retain_graph=False breaks it by releasing what it ran through; a zero-bubble I
        # (retain_graph=True) and its W leave nodes on the input path unreleased, and those would
        # stay alive for good and be counted (workers/split_backward.py).
        return _Saved(tensor.detach(), key, self)

    @staticmethod
    def unpack(packed):
        return packed.tensor if isinstance(packed, _Saved) else packed

    def hook_stage_forwards(self, runtime) -> None:
        """Count what each stage's forward saves; the first microbatch's F of a step is noted."""
        import torch

        for stage in runtime.stages.values():
            module, forward = stage.module, stage.module.forward

            def hooked(x, _forward=forward):
                before = self.live
                with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                    out = _forward(x)
                self.forwards += 1
                if self.forwards == 1:
                    self.first_start, self.first_f = before, self.live - before
                return out

            module.forward = hooked

    def hook_loss(self, executor) -> None:
        """The last stage's loss is computed by the executor outside the stage module: count it too."""
        import torch

        loss_fn = executor.loss_fn

        def hooked_loss(logits, targets):
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                loss = loss_fn(logits, targets)
            if self.forwards == 1:  # the first microbatch's F includes its loss
                self.first_f = self.live - self.first_start
            return loss

        executor.loss_fn = hooked_loss

    def after_action(self, stage, action) -> None:
        """Zero-bubble: from its I to its W a microbatch also holds the gradients the W starts from
        (WeightPass.kept_bytes, workers/split_backward.py), which 1F1B's backward frees at once: counted
        after each I (its pending W's), dropped after that W."""
        from meshspeak.schedule import Op

        key = (stage.index, action.microbatch)
        if action.op == Op.BACKWARD_INPUT:
            self.kept_by_pass[key] = stage.weight_passes[action.microbatch].kept_bytes
            self.kept += self.kept_by_pass[key]
            self.peak_total = max(self.peak_total, self.live + self.kept)
        elif action.op == Op.BACKWARD_WEIGHT:
            self.kept -= self.kept_by_pass.pop(key)

    def hook_step(self, executor) -> None:
        """Each step starts its peaks from what is live and records one row when it ends."""
        inner = executor.run

        def run(actions, data):
            self.peak, self.first_f, self.forwards = self.live, None, 0
            self.peak_total = self.live + self.kept
            out = inner(actions, data)
            self.per_step.append({"peak_bytes": self.peak, "one_microbatch_bytes": self.first_f,
                                  "live_after_step": self.live, "peak_with_kept_gradients_bytes": self.peak_total,
                                  "kept_after_step": self.kept})  # fmt: skip
            return out

        executor.run = run
