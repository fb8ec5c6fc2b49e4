"""How the pipeline executor posts one step's point-to-point messages, per backend.

On gloo every message carries its own tag (``message_tag``: kind, source stage, microbatch), so a
receive takes exactly its message whatever order the two ranks post them in: zbv's V has a rank
receive activations and gradients from one neighbour in another order than the neighbour sends
them. NCCL ignores tags and matches a rank pair's messages in posting order; its lockstep batches
post them in the same order on both sides (meshspeak/p2p_rounds.py).

gloo (``batched=False``): sends are posted when their action is reached; receives up to
``lookahead`` actions ahead. Gloo's send is a rendezvous: a send whose receive is not posted yet only
announces itself, and the data moves when the receiver asks for it, which needs the *sender's* gloo
thread to get a core while the sender computes. On a busy CPU host that cost ms per late receive
(bench/pipeline_bubble.py: "recv_of_an_already_sent_tensor_ms"); a receive posted early lets the
sender write the data at once. Batched posting would post a receive no earlier than its own run of
communication actions, i.e. lookahead 0 on gloo, the slower variant measured there, so gloo keeps this.

NCCL (``batched=True``): the messages go out in lockstep batches (``batch_isend_irecv``, as
``torch.distributed.pipelining`` posts them), planned from every rank's list by
``meshspeak.p2p_rounds.nccl_batches``: a rank's k-th batch holds exactly the partners of its
peers' k-th batches, so no NCCL stream can wait on a peer stuck behind it. The plan is posted before
the action it names; a SEND action is then a no-op and a RECV waits for its batch. Why unbatched
NCCL would deadlock, and the model the plan is checked in: that module's docstring.
tests/unit/test_p2p.py records the calls this executor makes on both paths.

``Transport`` is the only code that calls ``torch.distributed``; tests pass a recording one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshspeak.p2p_rounds import Batch
from meshspeak.schedule import Action, Op, message_key

COMM_OPS = (Op.RECV_F, Op.RECV_B, Op.SEND_F, Op.SEND_B)


@dataclass(frozen=True, slots=True)
class Message:
    send: bool
    tensor: torch.Tensor
    peer: int  # world rank


class Transport:
    """torch.distributed point-to-point on one process group."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def isend(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> dist.Work:
        return dist.isend(tensor, dst=peer, group=self.group, tag=tag)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> dist.Work:
        return dist.irecv(tensor, src=peer, group=self.group, tag=tag)

    def batch(self, messages: list[Message]) -> list[dist.Work]:
        ops = [dist.P2POp(dist.isend if m.send else dist.irecv, m.tensor, m.peer, self.group) for m in messages]
        return dist.batch_isend_irecv(ops)


def message_tag(action: Action, num_stages: int) -> int:
    """A tag unique to the message a communication action sends or takes, within one step."""
    kind, src, _, mb = message_key(action)
    return (mb * num_stages + src) * 2 + (kind == "B")


class StepPosting:
    """Posts and completes one step's messages, in list order (one object per step).

    Args:
        peer: world rank of the rank holding a stage.
        new_buffer: an empty tensor of the boundary shape, for a receive.
        outgoing: the tensor an action sends (taken from the stage when the send is posted).
        plan: this rank's lockstep batches (NCCL); None posts one op at a time (gloo).
    """

    def __init__(self, actions: list[Action], transport: Transport, *, peer: Callable[[int], int],
                 new_buffer: Callable[[], torch.Tensor], outgoing: Callable[[Action], torch.Tensor],
                 plan: list[Batch] | None = None, lookahead: int = 0, num_stages: int) -> None:
        self.actions, self.transport, self.lookahead = actions, transport, lookahead
        self.peer, self.new_buffer, self.outgoing = peer, new_buffer, outgoing
        self.num_stages = num_stages
        self.sent: list[dist.Work] = []
        self.plan = deque(plan) if plan is not None else None
        self.batched = plan is not None
        self.received: dict[int, tuple[torch.Tensor, list[dist.Work]]] = {}  # index -> buffer, works
        self.posted_sends: set[int] = set()
        self.to_post = deque(i for i, a in enumerate(actions) if a.op in (Op.RECV_F, Op.RECV_B))
        self.posted: deque[tuple[int, torch.Tensor, dist.Work]] = deque()
        if not self.batched:
            self._top_up(lookahead)

    def _src_dst(self, action: Action) -> int:
        """World rank of the other end of a communication action."""
        if action.op in (Op.SEND_F, Op.RECV_B):
            return self.peer(action.stage + 1)
        return self.peer(action.stage - 1)

    # -- batched (NCCL) ---------------------------------------------------------------------------
    def before(self, index: int) -> None:
        """Post the batches planned before action ``index`` (``len(actions)``: the end); the
        executor calls it before every action."""
        while self.plan and self.plan[0].post_at <= index:
            self._post(self.plan.popleft())

    def _post(self, batch: Batch) -> None:
        messages, recvs = [], []
        for i in batch.members:
            action = self.actions[i]
            send = action.op in (Op.SEND_F, Op.SEND_B)
            tensor = self.outgoing(action) if send else self.new_buffer()
            messages.append(Message(send, tensor, self._src_dst(action)))
            if send:
                self.posted_sends.add(i)
            else:
                recvs.append((i, tensor))
        works = self.transport.batch(messages)
        self.sent += works  # all waited for at the end of the step; receives' also at the receive
        for i, tensor in recvs:
            self.received[i] = (tensor, works)

    # -- unbatched (gloo) -------------------------------------------------------------------------
    def _top_up(self, limit: int) -> None:
        while self.to_post and len(self.posted) < limit:
            i = self.to_post.popleft()
            buf = self.new_buffer()
            action = self.actions[i]
            work = self.transport.irecv(buf, self._src_dst(action), message_tag(action, self.num_stages))
            self.posted.append((i, buf, work))

    # -- what the executor calls --------------------------------------------------------------------
    def send(self, index: int) -> None:
        if self.batched:  # posted by its batch, right after this run of sends (p2p_rounds)
            return
        action = self.actions[index]
        tag = message_tag(action, self.num_stages)
        self.sent.append(self.transport.isend(self.outgoing(action), self._src_dst(action), tag))

    def recv(self, index: int) -> torch.Tensor:
        if self.batched:
            self.before(index)
            buf, works = self.received.pop(index)
            for work in works:
                work.wait()
            return buf
        self._top_up(1)
        expected, buf, work = self.posted.popleft()
        assert expected == index, (expected, index)  # both follow the list order
        work.wait()
        self._top_up(self.lookahead)
        return buf

    def finish(self) -> None:
        if self.batched:
            self.before(len(self.actions))
            sends = {i for i, a in enumerate(self.actions) if a.op in (Op.SEND_F, Op.SEND_B)}
            assert not self.plan and not self.received and self.posted_sends == sends, "plan/list mismatch"
        for work in self.sent:
            work.wait()
        self.sent.clear()
