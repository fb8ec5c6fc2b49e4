"""The data-parallel strategy of a generation, decided once (pure; no torch, no Ray).

The driver's plan (``orchestrator/plan/mesh_plan.py``) turns ``mesh.zero``, ``mesh.dp_replicate``,
``mesh.cpu_offload``, ``train.dtype``, ``train.grad_reduce`` and ``train.grad_compression`` and the
generation's (dp, pp, tp) into one ``DataParallelPlan``, ships it to every rank in the generation's
``RuntimeSpec`` and shows it in ``elastimesh plan``; the ranks only apply it
(``workers/runtime.py``, ``workers/parallelize.py``, ``workers/compression.py``) and never re-derive
any part of it. TorchTitan splits the same way: ``ParallelDims`` decides, ``parallelize_*`` applies.

Which wrapper a stage gets (docs/design.md, Data-parallel strategies):

* ``"ddp"``: torch's ``DistributedDataParallel`` — ZeRO-0 where it computes exactly what HSDP
  (replicate = dp, shard = 1) does (``ddp_applies``);
* ``"fsdp"``: FSDP2 ``fully_shard`` over the dp mesh (1-D, or (replicate, shard) for HSDP and ZeRO-0),
  or over the one-rank shard mesh when PowerSGD does the all-reduce across replicas;
* ``"none"``: one fp32/fp64 rank, nothing to reduce (``fsdp_applies`` is false).

Which reduction carries the gradients over dp (``compression``, docs/design.md, Gradient compression):

* ``"none"``: the wrapper's own (DDP's bucketed all-reduce, FSDP2's reduce-scatter / HSDP all-reduce);
* ``"powersgd"``: ZeRO-0 only; FSDP2 over the one-rank shard mesh, PowerSGD on its all-reduce hook;
* ``"int8"`` / ``"int4"``: blockwise-quantized (qgZ): a DDP comm hook (ZeRO-0 on plain dp), FSDP2's
  all-reduce hook over the one-rank shard mesh (ZeRO-0 with TP/PP/bf16), or FSDP2's custom
  reduce-scatter over dp (ZeRO-1..3);
* ``"onebit_adam"``: ZeRO-0 only (``train.optimizer``): the plain mean during 1-bit Adam's warm-up,
  then no gradient reduction at all (the optimizer sends 1-bit momentum); seams as int8's at ZeRO-0.

A compression that a generation cannot use (dp = 1; PowerSGD or 1-bit Adam above ZeRO-0, which the
config rules refuse) plans as ``"none"``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DataParallelPlan:
    """How one generation's ranks hold and reduce their parameters over dp (see the module docstring)."""

    zero: int  # mesh.zero, as configured (1 runs as 2: workers/parallelize.py says why)
    wrapper: str  # "ddp" | "fsdp" | "none"
    reshard_after_forward: bool  # FSDP2: ZeRO-3 gathers again in backward; 0-2 keep the gathered params
    replicate: int  # HSDP replica groups R of the dp axis (dp for ZeRO-0); the ranks build (R, dp / R)
    fsdp_over: str  # "dp": the dp mesh; "shard": the one-rank shard mesh (PowerSGD reduces across replicas)
    reduce_dtype: str  # the gradient reduction's dtype (train.grad_reduce; fp64 reduces in fp64)
    cpu_offload: bool  # FSDP2 CPUOffloadPolicy (mesh.cpu_offload)
    compression: str  # "none" | "powersgd" | "int8" | "int4" | "onebit_adam": the dp reduction (module doc)
    count_dp_bytes: bool  # dp > 1: step records carry the bytes a rank sent over dp (compressed or not)


def plan_data_parallel(*, zero: int, dp: int, pp: int, tp: int, dtype: str, grad_reduce: str,
                       cpu_offload: bool, compression: str, cfg_dp: int, cfg_replicate: int,
                       optimizer: str = "adamw", rebalance: bool = False) -> DataParallelPlan:
    """The one data-parallel decision for a generation of ``(dp, pp, tp)`` ranks.

    ``cfg_dp`` / ``cfg_replicate`` are ``mesh.dp`` / ``mesh.dp_replicate`` as configured: HSDP keeps the
    shard-group size they fix across elastic resizes (``replicate_degree``). ``compression`` and
    ``optimizer`` are ``train.grad_compression`` and ``train.optimizer`` (``reduction``).

    ``rebalance`` (``elastic.rebalance``: replicas run different numbers of microbatches,
    meshspeak/rebalance.py): ZeRO-3 keeps each unit gathered from its first forward to the step's
    last backward, as ZeRO-2 does. Resharding after every forward would all-gather again in each
    microbatch's backward and next forward, a number of all-gathers over the shard group that
    depends on the replica's count: ranks with different counts would pair different collectives
    (tests/distributed/test_rebalance.py shows the hang). Gathered through the step every rank
    all-gathers and reduce-scatters each unit once per step whatever its count; between steps the
    parameters are sharded as before. ``elastimesh plan`` estimates the memory so.
    """
    reduction = dp_reduction(zero, dp, compression, optimizer)
    ddp = ddp_applies(zero, dp, pp, tp, dtype, grad_reduce, cpu_offload, compression)
    wrapper = "ddp" if ddp else ("fsdp" if fsdp_applies(dp, dtype, cpu_offload) else "none")
    # ZeRO-0 whose all-reduce is ours and not DDP's (a comm hook there): FSDP2 over the one-rank shard
    # mesh communicates nothing over dp itself; its all-reduce hook hands us each unit's gradients.
    own_all_reduce = zero == 0 and reduction != "none" and wrapper == "fsdp"
    return DataParallelPlan(
        zero=zero, wrapper=wrapper, reshard_after_forward=zero == 3 and not rebalance,
        replicate=replicate_degree(zero, dp, cfg_dp, cfg_replicate),
        fsdp_over="shard" if own_all_reduce else "dp",
        reduce_dtype="float64" if dtype == "float64" else grad_reduce,
        cpu_offload=cpu_offload, compression=reduction,
        count_dp_bytes=dp > 1 and wrapper != "none",
    )


def dp_reduction(zero: int, dp: int, compression: str, optimizer: str = "adamw") -> str:
    """Which reduction carries a generation's gradients over dp (the module docstring's list)."""
    if dp <= 1:
        return "none"
    if optimizer == "onebit_adam":
        return "onebit_adam" if zero == 0 else "none"
    if compression == "powersgd":
        return "powersgd" if zero == 0 else "none"
    return compression if compression in ("int8", "int4") else "none"


def fsdp_applies(dp: int, dtype: str, cpu_offload: bool = False) -> bool:
    """Whether a stage is sharded with FSDP2 (ZeRO) at all: the rule the ranks and the plan share.

    With one dp rank in fp32 there is nothing for FSDP to do: skipping it keeps the single-rank path
    as fast as plain PyTorch (bench/step_overhead.py); the same holds for fp64, whose parameters are
    fp64 themselves (no mixed precision). bf16/fp16 always go through FSDP2's
    MixedPrecisionPolicy (fp32 master weights, 16-bit compute, fp32 gradient reduction), and
    ``mesh.cpu_offload`` through its CPUOffloadPolicy, even at dp=1 (an elastic shrink to one
    replica must not silently move the model back onto the GPU).
    """
    return dp > 1 or dtype not in ("float32", "float64") or cpu_offload


def ddp_applies(zero: int, dp: int, pp: int, tp: int, dtype: str, grad_reduce: str = "float32",
                cpu_offload: bool = False, grad_compression: str = "none") -> bool:
    """Whether ZeRO-0 runs through torch's ``DistributedDataParallel`` instead of FSDP2's HSDP:
    the rule the ranks and the plan share (docs/design.md, Data-parallel strategies).

    Only where DDP computes exactly what HSDP(replicate=dp, shard=1) does: plain (non-TP) parameters,
    one stage per rank, fp32 compute reduced in fp32 (or fp64), no offload and no PowerSGD (which
    runs on FSDP2's all-reduce hook; int8/int4 and 1-bit Adam's warm-up run as DDP comm hooks).
    There FSDP2 still all-gathers and reduce-scatters over its one-rank shard axis every step besides
    the dp all-reduce, and pays its per-unit Python hooks; DDP's bucketed all-reduce overlapped with
    backward does not (bench/ray_train_compare.py).
    """
    precision_ok = dtype == "float64" or (dtype == "float32" and grad_reduce == "float32")
    return (zero == 0 and dp > 1 and pp == 1 and tp == 1 and precision_ok and not cpu_offload
            and grad_compression != "powersgd")


def replicate_degree(zero: int, dp: int, cfg_dp: int, cfg_replicate: int) -> int:
    """How many replica groups a generation with ``dp`` data-parallel ranks has (HSDP's R).

    ZeRO-0 replicates everything: R = dp (shard groups of one rank). Otherwise the *shard group
    size* S = cfg_dp / cfg_replicate is what the config fixes (the memory per rank depends on it),
    so an elastic resize adds or drops whole replicas: R = dp / S when S divides dp. When it does not
    (a shrink that left a partial replica), the generation falls back to plain sharding over all dp
    ranks (R = 1): every rank still holds a 1/dp shard, which is at least as small as 1/S, and DCP
    reshards the checkpoint into it. ``mesh.dp_replicate`` = 1 is plain FSDP at every dp.
    """
    if zero == 0:
        return dp
    if cfg_replicate <= 1:
        return 1
    shard = cfg_dp // cfg_replicate
    return dp // shard if dp % shard == 0 and dp >= shard else 1
