"""A stage's backward split in two, for the zero-bubble schedules: I (input gradient) now, W later.

``backward_input`` computes only the gradient of the stage's input (what the previous stage waits
for) and returns a ``WeightPass`` that, run later, computes the weights' gradients from where the
two paths meet, without redoing the input path. How, as ``torch.distributed.pipelining``'s private
``stage_backward_input`` / ``stage_backward_weight`` (torch/distributed/pipelining/_backward.py):
the autograd nodes where a weight's path joins the input's path ("intermediates",
``get_param_groups``) get pre-hooks that keep the gradients flowing into them during
``autograd.grad(..., inputs=[stage input], retain_graph=True)``; the W pass then starts
``autograd.grad`` at those nodes (``GradientEdge``) with the kept gradients and ends at the weights.
Torch's two functions are not called as they are because they find the weights through
``module.parameters()`` *before* the backward runs: under FSDP2 ZeRO-3 the modules then hold their
sharded parameters, not the unsharded ones the graph used, and the weights would get no gradient.
Here the weights are the graph's own leaves (its ``AccumulateGrad`` nodes), whatever the module
holds at the time: unsharded FSDP2 parameters, TP DTensors or plain tensors alike; torch's
graph-walking helpers are reused.

The first stage's input is token ids (no gradient): its I does nothing and its W is the whole
backward, as torch's schedules do.

FSDP2: every I and W runs with gradient sync and resharding off (nothing reduced, parameters kept
gathered between microbatches); after the stage's last W of the step ``reduce_gradients`` runs
FSDP2's post-backward by hand on every parameter group (the W pass starts below the hooks that
would run it) and then its end-of-backward callback, which waits for the reduce-scatters: what
torch's ``PipelineStage.perform_reduce_grad`` does. Activation checkpointing and torch.compile are
refused with these schedules by the config (orchestrator/config/validate.py says why).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, Node
from torch.distributed.pipelining._backward import construct_reverse_graph, get_param_groups
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

_ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"


class WeightPass:
    """The W of one (stage, microbatch): call ``run()`` once. ``kept_bytes``: the intermediate
    gradients it holds from its I until it runs (memory a 1F1B backward frees at once; the saved
    activations it holds besides are the forward's, counted by whoever counts those)."""

    def __init__(self, run: Callable[[], None], kept_bytes: int = 0) -> None:
        self._run = run
        self.kept_bytes = kept_bytes

    def run(self) -> None:
        run, self._run = self._run, None
        if run is None:
            raise RuntimeError("a weight pass runs once")
        run()


def _leaf_nodes(roots: list[Node]) -> list[Node]:
    """The AccumulateGrad nodes (leaf tensors: parameters and the stage input) under ``roots``."""
    seen: set[Node] = set()
    stack, leaves = list(roots), []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node.name() == _ACCUMULATE_GRAD:
            leaves.append(node)
        stack.extend(fn for fn, _ in node.next_functions)
    return leaves


def _accumulate_node(leaf: torch.Tensor) -> Node:
    # A leaf's AccumulateGrad is made lazily; a view reaches it (torch's _get_grad_fn_or_grad_acc).
    return leaf.view_as(leaf).grad_fn.next_functions[0][0]


def backward_input(output: torch.Tensor, grad_output: torch.Tensor | None, inp: torch.Tensor | None,
                   context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                   ) -> tuple[torch.Tensor | None, WeightPass]:
    """(the gradient of ``inp``, the pending W). ``grad_output`` None: ``output`` is the loss.
    ``inp`` None: the first stage (no input gradient; the W does the whole backward). ``context``:
    what the backward runs under (``loss_parallel`` for a TP loss)."""
    if inp is None:
        def whole() -> None:
            with context():
                torch.autograd.backward(output, grad_output)
        return None, WeightPass(whole)

    roots = [output.grad_fn]
    input_node = _accumulate_node(inp)
    weights = [n for n in _leaf_nodes(roots) if n is not input_node]
    groups = get_param_groups([input_node], weights, construct_reverse_graph(roots))
    handles = []
    for group in groups:
        group["intermediates"] = list(group["intermediates"])
        group["grads"] = [None] * len(group["intermediates"])
        for i, node in enumerate(group["intermediates"]):
            def keep(grad_outputs, group=group, i=i):
                group["grads"][i] = grad_outputs
            handles.append(node.register_prehook(keep))
    try:
        with context():
            (grad_input,) = torch.autograd.grad(
                output, [inp], None if grad_output is None else [grad_output], retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()
    return grad_input, WeightPass(lambda: _weights(groups, context), _kept_bytes(groups))


def _kept_bytes(groups: list[dict]) -> int:
    """Bytes of the distinct storages behind the kept gradients. A tensor subclass that wraps others
    (a TP DTensor, the async-collective result a TP backward can hand over) has no storage of its own:
    its inner tensors' are counted."""
    storages = {}
    for group in groups:
        for kept in group["grads"]:
            for grad in kept or ():
                if grad is not None:
                    for storage in _plain_storages(grad):
                        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _plain_storages(t: torch.Tensor):
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()  # DTensor's also name its DeviceMesh
        for inner in (getattr(t, name) for name in names):
            if isinstance(inner, torch.Tensor):
                yield from _plain_storages(inner)
    else:
        yield t.untyped_storage()


def _weights(groups: list[dict], context) -> None:
    """Each group's weight gradients from its kept intermediate gradients, added to ``.grad``."""
    for group in groups:
        edges, grads = [], []
        for node, kept in zip(group["intermediates"], group["grads"]):
            for i, grad in enumerate(kept or ()):
                if grad is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(grad)
        handles = []
        if len(group["intermediates"]) > 1:
            # An intermediate below another one would get the upper one's gradient a second time:
            # pin every intermediate to the gradient it got in the I pass (as torch does).
            for node, kept in zip(group["intermediates"], group["grads"]):
                handles.append(node.register_prehook(lambda grad_outputs, kept=kept: kept))
        try:
            if not edges:
                continue
            params = list(group["params"])
            with context():
                dweights = torch.autograd.grad(edges, [GradientEdge(p, 0) for p in params], grads)
            for node, dw in zip(params, dweights):
                leaf = node.variable
                leaf.grad = dw if leaf.grad is None else leaf.grad + dw
        finally:
            for handle in handles:
                handle.remove()
            group.clear()  # frees the kept gradients and the graph they point into


def hold_gradients(module: nn.Module) -> None:
    """FSDP2: no reduction and no resharding during a step's split backwards (see the docstring)."""
    module.set_is_last_backward(False)
    module.set_requires_gradient_sync(False)
    module.set_reshard_after_backward(False)


def reduce_gradients(module: nn.Module) -> None:
    """FSDP2: reduce the step's accumulated gradients and reshard, after the stage's last W.

    FSDP2's post-backward runs by hand on every parameter group, last module first (autograd's
    order), then its end-of-backward callback (it waits for the reductions and hands the sharded
    gradients over). Reaches into FSDP2's state as ``PipelineStage.perform_reduce_grad`` does: no
    public call runs the post-backward outside an autograd backward.
    """
    from torch.distributed.fsdp import fully_shard

    module.set_is_last_backward(True)
    module.set_requires_gradient_sync(True)
    module.set_reshard_after_backward(True)
    state = fully_shard.state(module)
    for sub in reversed(state._state_ctx.all_states):
        for group in reversed(sub._fsdp_param_groups):
            group.post_backward()
    state._root_post_backward_final_callback()
