"""Bring a job up on Ray and run it: connect (or start an embedded local Ray), check the cluster can hold
the mesh, start the store host and the RankActors, hand them to the Controller, and tear down.
"""

from __future__ import annotations

import logging
import os
import threading

import ray

from orchestrator.config import JobConfig
from orchestrator.controller import Controller, RunSummary
from orchestrator.errors import ClusterConnectError, UserInputError, WorkerGroupStartupError
from orchestrator.metrics import MetricsLog
from orchestrator.worker_group import ActorResources, WorkerGroup
from workers.data import validate_source

logger = logging.getLogger(__name__)

LOCAL_MIN_CPUS = 8  # logical CPU slots of the embedded Ray: enough for a dp=2 x tp=2 laptop job


def connect(cfg: JobConfig, *, connect_timeout_s: float = 30.0) -> bool:
    """Join RAY_ADDRESS's cluster, or start a local one. Returns True for an embedded local Ray."""
    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS")
    if address:
        # ray.init retries for a long time on an unreachable address: bound it ourselves.
        error: list[BaseException] = []

        def attempt() -> None:
            try:
                ray.init(address=address, log_to_driver=True)
            except BaseException as exc:  # reported below as one line
                error.append(exc)

        thread = threading.Thread(target=attempt, daemon=True)
        thread.start()
        thread.join(connect_timeout_s)
        if thread.is_alive() or error:
            why = f"{type(error[0]).__name__}: {str(error[0]).splitlines()[0]}" if error else f"no answer in {connect_timeout_s:g}s"
            raise ClusterConnectError(
                f"RAY_ADDRESS={address}: cannot reach a Ray cluster ({why}); start one with "
                "`ray start --head`, fix RAY_ADDRESS, or unset it to use an embedded local Ray "
                "(with token auth on, also set RAY_AUTH_MODE=token)"
            )
        return False
    world = cfg.mesh.world
    needed = world * cfg.resources.cpus_per_worker
    cpus = max(os.cpu_count() or 1, LOCAL_MIN_CPUS)
    if needed > cpus:
        raise WorkerGroupStartupError(
            f"mesh.dp*pp*tp={world} workers x resources.cpus_per_worker="
            f"{cfg.resources.cpus_per_worker:g} need {needed:g} CPU slots but the local Ray has {cpus}: "
            "lower mesh.dp/pp/tp or resources.cpus_per_worker, or set RAY_ADDRESS to a larger cluster"
        )
    # address="local": never attach to a `ray start` cluster on this machine by accident.
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=True)
    return True


def resolve_gpu(cfg: JobConfig) -> bool:
    setting = cfg.resources.use_gpu
    if setting == "auto":
        return ray.cluster_resources().get("GPU", 0) > 0
    return bool(setting)


def run_job(cfg: JobConfig, *, progress: bool = True) -> RunSummary:
    source = validate_source(cfg.data.path, cfg.model.seq_len, cfg.model.vocab_size, cfg.train.global_batch_size)
    started_local = connect(cfg)
    metrics = None
    group = None
    try:
        use_gpu = resolve_gpu(cfg)
        if not started_local and not cfg.checkpoint.dir and len(ray.nodes()) > 1:
            logger.warning("checkpoint.dir is unset on a multi-node cluster: elastic recovery restarts "
                           "from step 1; set it to shared storage (e.g. s3://bucket/run)")
        from workers.store import StoreHost

        store = StoreHost.options(
            scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                ray.get_runtime_context().get_node_id(), soft=True
            )
        ).remote()
        store_address = ray.get(store.address.remote(), timeout=60)
        group = WorkerGroup(
            ActorResources(cpus=cfg.resources.cpus_per_worker, gpus=1 if use_gpu else 0),
            placement_timeout_s=cfg.resources.placement_timeout_s,
        )
        group.add(cfg.mesh.world)
        metrics = MetricsLog(cfg.metrics, progress_total=cfg.train.steps if progress else None)
        controller = Controller(
            cfg, group, metrics=metrics, store_address=store_address, use_gpu=use_gpu,
            data_path=source.name,
        )
        return controller.run()
    except UserInputError:
        raise
    finally:
        if metrics is not None:
            metrics.close()
        if group is not None:
            group.shutdown()
        if started_local:
            ray.shutdown()
