"""RankActor: the thin Ray shell around one rank. Knows nothing of placement, policy or other actors.

Calls run in a small thread pool (``max_concurrency``), so while one thread is inside a training step
— possibly blocked in a collective whose peer died — the driver can still poll the actor and tell it
to shut this generation's gloo sockets down (``kick``). Every error inside a step is latched into the
returned ``StepResult``; the driver decides what happens next.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback

import ray
import torch

from orchestrator.messages import GenerationSpec, RankInfo, RuntimeSpec, StepResult, WorkerStatus
from orchestrator.schedule import Action

logger = logging.getLogger(__name__)


class RankActor:
    def __init__(self, actor_id: int) -> None:
        # Ranks share few cores; one intra-op thread each avoids oversubscription (cpu-gloo-facts).
        torch.set_num_threads(1)
        logging.basicConfig(
            level=logging.INFO, format=f"%(asctime)s [actor={actor_id}] %(name)s: %(message)s"
        )
        self.actor_id = actor_id
        self.runtime = None
        self.generation = -1
        self.world_rank = -1
        self.step = 0
        self.busy = False
        self.error: str | None = None
        self.gloo_listeners: tuple[tuple[str, int], ...] = ()
        self._lock = threading.Lock()
        self._fault: tuple[int, str, float] | None = None

    def ping(self) -> tuple[int, str]:
        return os.getpid(), ray.util.get_node_ip_address()

    def join_generation(self, gen: GenerationSpec, spec: RuntimeSpec) -> RankInfo:
        """Leave the current generation (if any) and join ``gen`` as ``gen.world_rank``."""
        from workers.groups import build_process_groups
        from workers.runtime import RankRuntime

        with self._lock:
            t0 = time.perf_counter()
            self._leave()
            use_gpu = spec.use_gpu and torch.cuda.is_available()
            device = torch.device("cuda", 0) if use_gpu else torch.device("cpu")
            groups = build_process_groups(
                store_addr=gen.store_addr,
                store_port=gen.store_port,
                store_prefix=gen.store_prefix,
                generation=gen.generation,
                shape=gen.shape,
                world_rank=gen.world_rank,
                timeout_s=spec.collective_timeout_s,
                device=device,
            )
            try:
                self.runtime = RankRuntime(spec, groups)
            except BaseException:
                groups.destroy()
                raise
            self.generation, self.world_rank, self.error = gen.generation, gen.world_rank, None
            ip = ray.util.get_node_ip_address()
            self.gloo_listeners = tuple((ip, port) for port in groups.gloo_ports)
            return RankInfo(
                world_rank=gen.world_rank,
                pid=os.getpid(),
                node_ip=ip,
                gloo_listeners=self.gloo_listeners,
                setup_s=time.perf_counter() - t0,
                num_params_local=sum(p.numel() for p in self.runtime.params),
            )

    def train_step(self, step: int, actions: list[Action]) -> StepResult:
        self.busy, self.step = True, step
        self._maybe_fire_fault(step)
        try:
            if self.runtime is None:
                raise RuntimeError("train_step before join_generation")
            return self.runtime.train_step(step, actions)
        except Exception as exc:  # latched: the driver decides (rebuild, retry or stop)
            self.error = f"{type(exc).__name__}: {exc}"
            logger.warning("step %d failed: %s\n%s", step, self.error, traceback.format_exc(limit=4))
            return StepResult(step=step, world_rank=self.world_rank, ok=False, error=self.error)
        finally:
            self.busy = False

    def full_state(self) -> dict:
        return self.runtime.full_state()

    def save_checkpoint(self, path: str, step: int) -> dict:
        return {"stall_s": self.runtime.save_checkpoint(path, step)}

    def wait_checkpoint(self) -> dict:
        return self.runtime.wait_checkpoint()

    def load_checkpoint(self, path: str) -> int:
        with self._lock:
            return self.runtime.load_checkpoint(path)

    def arm_fault(self, step: int, kind: str, delay_s: float = 0.3) -> None:
        """Test hook: at ``step``, ``delay_s`` into it, SIGKILL ("kill") or SIGSTOP ("hang") this process."""
        self._fault = (step, kind, delay_s)

    def leave_generation(self) -> None:
        with self._lock:
            self._leave()

    def _leave(self) -> None:
        if self.runtime is not None:
            self.runtime.destroy()
            self.runtime = None
        self.generation, self.world_rank = -1, -1

    def kick(self, peers: list[tuple[str, int]]) -> int:
        """Make a collective blocked on a dead peer fail now (runs on a second actor thread)."""
        from workers.sockets import shutdown_gloo_sockets

        local = {port for _, port in self.gloo_listeners}
        return shutdown_gloo_sockets(local, set(map(tuple, peers)))

    def _maybe_fire_fault(self, step: int) -> None:
        if self._fault is None or self._fault[0] != step:
            return
        _, kind, delay = self._fault
        self._fault = None
        sig = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP}[kind]
        threading.Timer(delay, os.kill, (os.getpid(), sig)).start()

    def status(self) -> WorkerStatus:
        return WorkerStatus(
            world_rank=self.world_rank,
            pid=os.getpid(),
            generation=self.generation,
            busy=self.busy,
            step=self.step,
            error=self.error,
        )
