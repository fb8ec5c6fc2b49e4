"""Execute one rank's pipeline action list (made by the driver) over the stages this rank holds.

The list is executed literally, in order. Sends are posted asynchronously and waited for at the end
of the step; receives block. The driver's schedule is proven deadlock-free under exactly that model
(orchestrator/schedule.py's simulator). What crosses a stage boundary is the local tensor each
(dp, tp) rank holds (a sequence shard under sequence parallelism), sent to the rank with the same
dp/tp coordinates in the neighbouring pipeline position. Point-to-point messages between two ranks
match in posting order (one tag), which the schedule guarantees: per rank pair, receives come in
the order of the sends (a unit test checks every schedule).

On gloo, a few receives are posted ahead of the action that needs them (``recv_lookahead``). Gloo's
send is a rendezvous: a send whose receive is not posted yet only announces itself, and the data
moves when the receiver asks for it, which needs the *sender's* gloo thread to get a core while the
sender computes. On a busy CPU host that cost ms per late receive (bench/pipeline_bubble.py:
"recv_of_an_already_sent_tensor_ms"). A receive posted early lets the sender write the data at
once. NCCL is left at zero: its send and receive to one peer share a stream, so an early receive
would hold back a send the peer is waiting for.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from orchestrator.messages import ActionTiming
from orchestrator.schedule import Action, Op, message_key
from workers.parallelize import uses_fsdp


@dataclass
class Stage:
    """A pipeline stage held by this rank, with the per-microbatch tensors alive during a step."""

    index: int
    module: nn.Module
    is_first: bool
    is_last: bool
    last_backward_mb: int = -1
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    grad_outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    grad_inputs: dict[int, torch.Tensor] = field(default_factory=dict)

    def clear(self) -> None:
        self.inputs.clear()
        self.outputs.clear()
        self.grad_outputs.clear()
        self.grad_inputs.clear()


@dataclass
class StepData:
    """This replica's microbatches and how to weight their loss."""

    inputs: list[torch.Tensor]
    targets: list[torch.Tensor]
    # Multiplies each summed microbatch loss: dp / global_tokens. FSDP averages gradients over dp,
    # so the dp factor turns that mean back into a sum and the result is the global-token mean.
    grad_scale: float
    report_scale: float  # 1 / global_tokens: this replica's share of the global-mean loss


class Executor:
    def __init__(
        self,
        stages: dict[int, Stage],
        *,
        num_stages: int,
        pp: int,
        peer_of_pp_index,
        boundary_shape: tuple[int, ...],
        boundary_dtype: torch.dtype,
        device: torch.device,
        pp_group: dist.ProcessGroup | None,
        recv_lookahead: int = 0,
        loss_fn=None,
    ) -> None:
        self.stages = stages
        self.num_stages = num_stages
        self.pp = pp
        self.peer_of_pp_index = peer_of_pp_index
        self.boundary_shape = boundary_shape
        self.boundary_dtype = boundary_dtype
        self.device = device
        self.pp_group = pp_group
        self.recv_lookahead = recv_lookahead
        self.loss_fn = loss_fn  # the family's loss_sum(logits, targets): summed token loss

    def _peer(self, stage: int) -> int:
        return self.peer_of_pp_index(stage % self.pp)

    def _post_recv(self, action: Action) -> tuple[Action, torch.Tensor, dist.Work]:
        _, src_stage, _, _ = message_key(action)
        buf = torch.empty(self.boundary_shape, dtype=self.boundary_dtype, device=self.device)
        return action, buf, dist.irecv(buf, src=self._peer(src_stage), group=self.pp_group)

    def run(self, actions: list[Action], data: StepData) -> tuple[float, list[ActionTiming], float]:
        """Run the step's actions; returns (reported loss share, timings, compute seconds)."""
        for stage in self.stages.values():
            stage.clear()
            backwards = [a.microbatch for a in actions if a.stage == stage.index and a.op == Op.BACKWARD]
            stage.last_backward_mb = backwards[-1] if backwards else -1
        pending: list[dist.Work] = []
        to_post = deque(a for a in actions if a.op in (Op.RECV_F, Op.RECV_B))
        posted: deque[tuple[Action, torch.Tensor, dist.Work]] = deque()

        # Receives of this step in list order; up to recv_lookahead are posted before they are needed.
        def top_up(limit: int) -> None:
            while to_post and len(posted) < limit:
                posted.append(self._post_recv(to_post.popleft()))

        def recv(action: Action) -> torch.Tensor:
            top_up(1)
            expected, buf, work = posted.popleft()
            assert expected == action, (expected, action)  # both follow the list order
            work.wait()
            top_up(self.recv_lookahead)
            return buf

        top_up(self.recv_lookahead)

        timings: list[ActionTiming] = []
        loss_share = torch.zeros((), dtype=torch.float64)
        compute = 0.0
        t_step = time.perf_counter()
        for action in actions:
            t0 = time.perf_counter()
            stage = self.stages[action.stage]
            mb = action.microbatch
            op = action.op
            if op == Op.RECV_F:
                stage.inputs[mb] = recv(action).requires_grad_()
            elif op == Op.FORWARD:
                x = data.inputs[mb] if stage.is_first else stage.inputs[mb]
                out = stage.module(x)
                if stage.is_last:
                    loss_sum = self.loss_fn(out, data.targets[mb])
                    loss_share += loss_sum.detach().double() * data.report_scale
                    out = loss_sum * data.grad_scale
                stage.outputs[mb] = out
            elif op == Op.SEND_F:
                out = stage.outputs[mb].detach().to(self.boundary_dtype).contiguous()
                pending.append(dist.isend(out, dst=self._peer(action.stage + 1), group=self.pp_group))
            elif op == Op.RECV_B:
                stage.grad_outputs[mb] = recv(action)
            elif op == Op.BACKWARD:
                self._backward(stage, mb)
            elif op == Op.SEND_B:
                grad = stage.grad_inputs.pop(mb).to(self.boundary_dtype).contiguous()
                pending.append(dist.isend(grad, dst=self._peer(action.stage - 1), group=self.pp_group))
            else:  # pragma: no cover - the schedule only makes the ops above
                raise ValueError(f"unknown action {action}")
            t1 = time.perf_counter()
            if op in (Op.FORWARD, Op.BACKWARD):
                compute += t1 - t0
            timings.append(ActionTiming(str(action), t0 - t_step, t1 - t_step))
        for work in pending:
            work.wait()
        for stage in self.stages.values():
            stage.clear()
        return float(loss_share), timings, compute

    def _backward(self, stage: Stage, mb: int) -> None:
        if uses_fsdp(stage.module):
            # Reduce-scatter gradients once per step, on this stage's last microbatch only, and keep
            # the gathered parameters between microbatches instead of re-gathering them for every
            # backward (torch.distributed.pipelining's PipelineStage does the same around its
            # backward). Parameters are still sharded at rest: after the step's last backward.
            last = mb == stage.last_backward_mb
            stage.module.set_requires_gradient_sync(last)
            stage.module.set_reshard_after_backward(last)
        out = stage.outputs.pop(mb)
        if stage.is_last:
            out.backward()
        else:
            torch.autograd.backward(out, stage.grad_outputs.pop(mb))
        if not stage.is_first:
            stage.grad_inputs[mb] = stage.inputs.pop(mb).grad
        else:
            stage.inputs.pop(mb, None)
