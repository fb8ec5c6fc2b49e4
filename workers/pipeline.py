"""Execute one rank's pipeline action list (made by the driver) over the stages this rank holds.

The list is executed literally, in order. Sends are posted asynchronously and waited for at the end
of the step; receives block. The driver's schedule is proven deadlock-free under exactly that model
(meshspeak/schedule.py's simulator). What crosses a stage boundary is the local tensor each
(dp, tp) rank holds (a sequence shard under sequence parallelism), sent to the rank with the same
dp/tp coordinates in the neighbouring pipeline position. How the messages are posted (gloo: one op at
a time, receives a few actions ahead; NCCL: lockstep batches planned from every rank's list, since
NCCL's sends are not asynchronous in the simulator's sense) is ``workers.p2p``'s business. Two
neighbouring stages on this rank (zbv's V) hand over in memory: the later stage's F takes the
earlier one's output (detached, as a received tensor would be) and the earlier one's backward takes
the later one's input gradient. The zero-bubble I and W actions are ``workers.split_backward``'s.

Per-action timings (bubble, straggler scores) are host ``perf_counter`` stamps on the CPU. On CUDA
the host only enqueues kernels, so host stamps would time launches; there they are CUDA events on
the compute stream, read once at the end of the step (which synchronises once anyway, for the loss).
The loss share is accumulated on the compute device: the last stage's loss is a CUDA tensor on GPU.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from meshmodels.gpt_model import lm_loss_sum
from meshspeak.messages import ActionTiming
from meshspeak.p2p_rounds import Batch
from meshspeak.schedule import COMPUTE_OPS, Action, Op, stage_to_rank
from workers.p2p import StepPosting, Transport
from workers.parallelize import loss_context, uses_fsdp
from workers.split_backward import WeightPass, backward_input, hold_gradients, reduce_gradients


@dataclass
class Stage:
    """A pipeline stage held by this rank, with the per-microbatch tensors alive during a step."""

    index: int
    module: nn.Module
    is_first: bool
    is_last: bool
    last_backward_mb: int = -1
    last_weight_mb: int = -1  # zero-bubble: the microbatch whose W ends the stage's step
    # ZeRO-0 under torch DDP (workers.compression.wrap_ddp): the wrapper that forwards run through;
    # ``module`` stays the bare stage (names, checkpoints, eval and the optimizer use it).
    ddp: nn.Module | None = None
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    grad_outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    grad_inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    weight_passes: dict[int, WeightPass] = field(default_factory=dict)  # I done, W pending

    def clear(self) -> None:
        self.inputs.clear()
        self.outputs.clear()
        self.grad_outputs.clear()
        self.grad_inputs.clear()
        self.weight_passes.clear()


@dataclass
class StepData:
    """This replica's microbatches and how to weight their loss."""

    inputs: list[torch.Tensor]
    targets: list[torch.Tensor]
    # Multiplies each summed microbatch loss: dp / global_tokens. FSDP averages gradients over dp,
    # so the dp factor turns that mean back into a sum and the result is the global-token mean.
    grad_scale: float
    report_scale: float  # 1 / global_tokens: this replica's share of the global-mean loss


class StepClock:
    """Marks in one step: host perf_counter on the CPU, CUDA events on the current stream on GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> int:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())
        return len(self.marks) - 1

    def seconds(self) -> list[float]:
        """Every mark's time after the first one (waits for the last CUDA event)."""
        if not self.cuda:
            return [t - self.marks[0] for t in self.marks]
        self.marks[-1].synchronize()
        return [self.marks[0].elapsed_time(event) / 1e3 for event in self.marks]


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
        nccl_plan: Callable[[list[Action]], list[Batch]] | None = None,
        transport: Transport | None = None,
        placement: str = "loop",
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
        # The family's loss_sum(logits, targets): summed token loss (the built-in GPT's by default).
        self.loss_fn = loss_fn if loss_fn is not None else lm_loss_sum
        # NCCL: this rank's lockstep batches for an action list (workers.p2p); None on gloo.
        self.nccl_plan = nccl_plan
        self.transport = transport if transport is not None else Transport(pp_group)
        self.placement = placement  # how stages sit on pp ranks (meshspeak.schedule.placement_of)
        # What the last stage multiplies its loss by before backward (dynamic loss scaling, fp16).
        self.loss_scale = 1.0
        # Called with (stage, action) after each action, outside its timing, when set: what a benchmark
        # counts there (bench/pipeline_probes.py: the gradients a zero-bubble I keeps until its W).
        self.after_action: Callable[[Stage, Action], None] | None = None
        # time.monotonic() when the rank last progressed in a step (``mark_progress``), which the driver
        # asks for (RankRuntime.stalled_s) before it counts a slow step as a hang.
        self.progressed_at = time.monotonic()

    def mark_progress(self) -> None:
        """The rank progressed: an action done here, or a phase of the step outside the actions (the
        runtime's: the step begun, tied gradients synced, the update decided or waited for)."""
        self.progressed_at = time.monotonic()

    def _peer(self, stage: int) -> int:
        return self.peer_of_pp_index(stage_to_rank(stage, self.pp, self.placement))

    def _new_buffer(self) -> torch.Tensor:
        return torch.empty(self.boundary_shape, dtype=self.boundary_dtype, device=self.device)

    def _outgoing(self, action: Action) -> torch.Tensor:
        stage = self.stages[action.stage]
        if action.op == Op.SEND_F:
            return stage.outputs[action.microbatch].detach().to(self.boundary_dtype).contiguous()
        return stage.grad_inputs.pop(action.microbatch).to(self.boundary_dtype).contiguous()

    def run(self, actions: list[Action], data: StepData) -> tuple[float, list[ActionTiming], float]:
        """Run the step's actions; returns (reported loss share, timings, compute seconds)."""
        self._prepare_stages(actions)
        plan = self.nccl_plan(actions) if self.nccl_plan is not None else None
        posting = StepPosting(actions, self.transport, peer=self._peer, new_buffer=self._new_buffer,
                              outgoing=self._outgoing, plan=plan, lookahead=self.recv_lookahead,
                              num_stages=self.num_stages)
        loss_share = torch.zeros((), dtype=torch.float64, device=self.device)
        clock = StepClock(self.device)
        clock.mark()
        spans: list[tuple[int, int]] = []
        for index, action in enumerate(actions):
            posting.before(index)
            t0 = clock.mark()
            share = self._run_action(index, action, posting, data)
            if share is not None:
                loss_share += share
            spans.append((t0, clock.mark()))
            self.mark_progress()
            if self.after_action is not None:
                self.after_action(self.stages[action.stage], action)
        posting.finish()
        for stage in self.stages.values():
            stage.clear()
        at = clock.seconds()
        timings = [ActionTiming(str(a), at[t0], at[t1]) for a, (t0, t1) in zip(actions, spans)]
        compute = sum(at[t1] - at[t0] for a, (t0, t1) in zip(actions, spans) if a.op in COMPUTE_OPS)
        return float(loss_share), timings, compute

    def _prepare_stages(self, actions: list[Action]) -> None:
        """Empty each stage and note its last B and last W of the step (where gradients are reduced)."""
        for stage in self.stages.values():
            stage.clear()
            backwards = [a.microbatch for a in actions if a.stage == stage.index and a.op == Op.BACKWARD]
            stage.last_backward_mb = backwards[-1] if backwards else -1
            weights = [a.microbatch for a in actions if a.stage == stage.index and a.op == Op.BACKWARD_WEIGHT]
            stage.last_weight_mb = weights[-1] if weights else -1

    def _run_action(self, index: int, action: Action, posting: StepPosting, data: StepData) -> torch.Tensor | None:
        """Run one action of the list; a forward on the last stage answers its share of the reported loss."""
        stage = self.stages[action.stage]
        mb = action.microbatch
        op = action.op
        if op == Op.RECV_F:
            stage.inputs[mb] = posting.recv(index).requires_grad_()
        elif op == Op.FORWARD:
            return self._forward(stage, action, data)
        elif op == Op.RECV_B:
            stage.grad_outputs[mb] = posting.recv(index)
        elif op == Op.BACKWARD:
            self._backward(stage, mb)
        elif op == Op.BACKWARD_INPUT:
            self._backward_input(stage, mb)
        elif op == Op.BACKWARD_WEIGHT:
            stage.weight_passes.pop(mb).run()
            if mb == stage.last_weight_mb and uses_fsdp(stage.module):
                reduce_gradients(stage.module)
        elif op in (Op.SEND_F, Op.SEND_B):
            posting.send(index)
        else:  # pragma: no cover - the schedule only makes the ops above
            raise ValueError(f"unknown action {action}")
        return None

    def _forward(self, stage: Stage, action: Action, data: StepData) -> torch.Tensor | None:
        """F of one microbatch; on the last stage the loss (scaled for backward) is its output, and its
        detached share of the reported loss is returned."""
        mb = action.microbatch
        if stage.is_first:
            x = data.inputs[mb]
        elif mb in stage.inputs:
            x = stage.inputs[mb]
        else:  # the previous stage is on this rank: hand over in memory
            prev = self.stages[action.stage - 1].outputs[mb]
            x = stage.inputs[mb] = prev.detach().to(self.boundary_dtype).requires_grad_()
        if stage.ddp is not None:
            # All-reduce on the step's last backward only (DDP's no_sync, as FSDP's
            # set_requires_gradient_sync in _backward); DDP reads the flag in forward.
            stage.ddp.require_backward_grad_sync = mb == stage.last_backward_mb
            out = stage.ddp(x)
        else:
            out = stage.module(x)
        share = None
        if stage.is_last:
            with loss_context(out):  # TP: vocab-sharded logits (workers.parallelize)
                loss_sum = self.loss_fn(out, data.targets[mb])
            value = loss_sum.detach()
            if isinstance(value, DTensor):  # replicated over tp
                value = value.to_local()
            share = value.double() * data.report_scale
            out = loss_sum * (data.grad_scale * self.loss_scale)
        stage.outputs[mb] = out
        return share

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
            with loss_context(out):
                out.backward()
        else:
            torch.autograd.backward(out, self._grad_output(stage, mb))
        if not stage.is_first:
            stage.grad_inputs[mb] = stage.inputs.pop(mb).grad
        else:
            stage.inputs.pop(mb, None)

    def _grad_output(self, stage: Stage, mb: int) -> torch.Tensor:
        """The gradient of the stage's output: received, or the next stage's on this rank."""
        if mb in stage.grad_outputs:
            return stage.grad_outputs.pop(mb)
        return self.stages[stage.index + 1].grad_inputs.pop(mb)

    def _backward_input(self, stage: Stage, mb: int) -> None:
        """Zero-bubble I: the input gradient now, the weights' gradient kept for the W."""
        if uses_fsdp(stage.module):
            hold_gradients(stage.module)
        out = stage.outputs.pop(mb)
        grad = None if stage.is_last else self._grad_output(stage, mb)
        # TP's vocab-sharded loss runs its backward under loss_parallel, as _backward does; the
        # context is chosen here so that the pending W does not keep `out` (and its graph) alive.
        context = loss_parallel if isinstance(out, DTensor) else contextlib.nullcontext
        grad_input, stage.weight_passes[mb] = backward_input(
            out, grad, None if stage.is_first else stage.inputs.pop(mb), context=context)
        if grad_input is not None:
            stage.grad_inputs[mb] = grad_input
