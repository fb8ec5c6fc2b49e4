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
    import torch

    excluded = set()
    for stage in runtime.stages.values():
        for t in [*stage.module.parameters(), *stage.module.buffers()]:
            excluded.add(t.untyped_storage().data_ptr())
    # live/peak: saved activations; kept/peak_total: zero-bubble's kept gradients, and both together.
    state = {"live": 0, "peak": 0, "refs": {}, "first_f": None, "first_start": 0, "forwards": 0, "kept": 0,
             "peak_total": 0}
    per_step: list[dict] = []

    class Saved:
        __slots__ = ("tensor", "key", "__weakref__")

        def __init__(self, tensor, key):
            self.tensor, self.key = tensor, key

        def __del__(self):
            count, nbytes = state["refs"][self.key]
            if count == 1:
                del state["refs"][self.key]
                state["live"] -= nbytes
            else:
                state["refs"][self.key] = (count - 1, nbytes)

    def pack(tensor):
        key = tensor.untyped_storage().data_ptr()
        if key in excluded or key == 0:
            return tensor
        count, nbytes = state["refs"].get(key, (0, tensor.untyped_storage().nbytes()))
        if count == 0:
            state["live"] += nbytes
            state["peak"] = max(state["peak"], state["live"])
            state["peak_total"] = max(state["peak_total"], state["live"] + state["kept"])
        state["refs"][key] = (count + 1, nbytes)
        # Detached: a saved output of a node would otherwise reference that node (through its
        # grad_fn) from what the node saves, a cycle Python cannot collect. A backward with
        # retain_graph=False breaks it by releasing what it ran through; a zero-bubble I
        # (retain_graph=True) and its W leave nodes on the input path unreleased, and those would
        # stay alive for good and be counted (workers/split_backward.py).
        return Saved(tensor.detach(), key)

    def unpack(packed):
        return packed.tensor if isinstance(packed, Saved) else packed

    for stage in runtime.stages.values():
        module, forward = stage.module, stage.module.forward

        def hooked(x, _forward=forward):
            before = state["live"]
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                out = _forward(x)
            state["forwards"] += 1
            if state["forwards"] == 1:
                state["first_start"], state["first_f"] = before, state["live"] - before
            return out

        module.forward = hooked

    # The last stage's loss is computed by the executor outside the stage module: count it too.
    loss_fn = runtime.executor.loss_fn

    def hooked_loss(logits, targets):
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            loss = loss_fn(logits, targets)
        if state["forwards"] == 1:  # the first microbatch's F includes its loss
            state["first_f"] = state["live"] - state["first_start"]
        return loss

    runtime.executor.loss_fn = hooked_loss

    executor = runtime.executor
    # Zero-bubble: from its I to its W a microbatch also holds the gradients the W starts from
    # (WeightPass.kept_bytes, workers/split_backward.py), which 1F1B's backward frees at once.
    backward_input = executor._backward_input

    def counted_backward_input(stage, mb):
        backward_input(stage, mb)
        weights = stage.weight_passes[mb]
        kept, run_weights = weights.kept_bytes, weights.run
        state["kept"] += kept
        state["peak_total"] = max(state["peak_total"], state["live"] + state["kept"])

        def run():
            run_weights()
            state["kept"] -= kept

        weights.run = run

    executor._backward_input = counted_backward_input
    inner = executor.run

    def run(actions, data):
        state["peak"], state["first_f"], state["forwards"] = state["live"], None, 0
        state["peak_total"] = state["live"] + state["kept"]
        out = inner(actions, data)
        per_step.append({"peak_bytes": state["peak"], "one_microbatch_bytes": state["first_f"],
                         "live_after_step": state["live"], "peak_with_kept_gradients_bytes": state["peak_total"],
                         "kept_after_step": state["kept"]})  # fmt: skip
        return out

    executor.run = run
    return lambda: per_step
