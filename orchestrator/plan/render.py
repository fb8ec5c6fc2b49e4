"""Render `elastimesh plan`'s data (orchestrator.plan.mesh_plan.describe) as a readable text report."""

from __future__ import annotations


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _units(units: list[list[int]] | None, lo: int, hi: int) -> str:
    """'0-1 | 2-3 | root' style: which blocks share an all-gather; the rest ride with the stage's root."""
    if units is None:
        return "none (no FSDP: dp=1, fp32)"
    in_root = (hi - lo + 1) - sum(len(u) for u in units)
    parts = [f"{u[0]}-{u[-1]}" if len(u) > 1 else f"{u[0]}" for u in units]
    root = f"root (+ {in_root} blocks)" if in_root else "root"
    return " | ".join([*parts, root])


def _data_parallel(dp: dict) -> str:
    """The generation's data-parallel plan (meshspeak/dp_plan.py) in one line."""
    how = {"ddp": "torch DDP (all-reduce)", "none": "none (one rank)"}.get(dp["wrapper"], "FSDP2")
    if dp["wrapper"] == "fsdp":
        how += (", reshard after forward" if dp["reshard_after_forward"] else ", gathered through the step")
        how += f", {dp['replicate']} replica group(s)" if dp["replicate"] > 1 else ""
        how += ", over the one-rank shard axis" if dp["fsdp_over"] == "shard" else ""
    extras = [f"reduce {dp['reduce_dtype']}"] + ([dp["compression"]] if dp["compression"] != "none" else []) + (
        ["cpu offload"] if dp["cpu_offload"] else [])
    return f"data-par    zero={dp['zero']}: {how}; {', '.join(extras)}"


def render(info: dict) -> str:
    m = info["mesh"]
    lines = [
        f"mesh        dp={m['dp']} pp={m['pp']} tp={m['tp']}  ({info['world']} ranks, TP innermost)",
        f"model       {info['total_params']:,} parameters ({info.get('model_family', 'gpt')}"
        + (f", shape from {info['model_source']}/config.json)" if info.get("model_source") else ")"),
        f"schedule    {info['schedule']} (virtual stages {info['virtual_stages']}), "
        f"{info['microbatches_per_replica']} microbatches per replica, "
        f"bubble estimate {info['bubble_estimate']:.1%}",
        _data_parallel(info["data_parallel"]),
        "",
        "stage  pp_rank  layers        params  fsdp units (mesh.fsdp_unit_mb)",
    ]
    for s in info["stages"]:
        lo, hi = s["layers"]
        lines.append(f"{s['stage']:>5}  {s['pp_rank']:>7}  {lo:>3}..{hi:<3}     {s['params']:>12,}  "
                     f"{_units(s['fsdp_units'], lo, hi)}")
    lines += ["", "rank  dp  pp  tp"]
    lines += [f"{r['rank']:>4}  {r['dp']:>2}  {r['pp']:>2}  {r['tp']:>2}" for r in info["ranks"]]
    lines += ["", "memory per rank (estimate)   params      grads       optimizer   activations  total"]
    for pp_rank, mem in info["memory_per_rank"].items():
        total = mem["params"] + mem["grads"] + mem["optimizer"] + mem["activations"]
        lines.append(
            f"  pp_rank {pp_rank:<3} (peak {mem['peak_microbatches_in_flight']} mb in flight) "
            f"{_mib(mem['params']):>10}  {_mib(mem['grads']):>10}  {_mib(mem['optimizer']):>10}  "
            f"{_mib(mem['activations']):>11}  {_mib(total)}"
        )
    lines += ["", *_host_memory(info.get("snapshot_host_memory"))]
    if "strategy" in info:
        lines += ["", *_strategy(info["strategy"])]
    return "\n".join(lines) + "\n"


def _host_memory(host: dict | None) -> list[str]:
    """Snapshot and staging copies of a rank's state in host memory (orchestrator/plan/host_memory.py)."""
    if not host:
        return ["in-memory snapshots and checkpoint staging: off (checkpoint.dir unset)"]
    copies = host["copies"]
    listed = " + ".join(f"{name} {n}" for name, n in copies.items())
    snapshots = ("in-memory snapshots: off (checkpoint.memory_every = 0); " if "own" not in copies else
                 f"checkpoint.memory_keep={host['memory_keep']}: ")
    lines = [f"host memory per rank: {snapshots}{sum(copies.values())} copies of the rank's state ({listed})"]
    lines += [f"  pp_rank {p:<3} {_mib(n):>10}" for p, n in host["per_rank"].items()]
    return lines


def _strategy(rec: dict) -> list[str]:
    """`--memory-gib`: the recommended data-parallel strategy and every option's estimate."""
    head = (f"strategy    mesh.zero={rec['zero']} mesh.dp_replicate={rec['dp_replicate']}: cheapest that fits "
            f"{_mib(rec['device_bytes'])}" if rec["fits"] else
            f"strategy    nothing fits {_mib(rec['device_bytes'])}; smallest: mesh.zero={rec['zero']} "
            f"mesh.dp_replicate={rec['dp_replicate']} (try mesh.cpu_offload=true or more tp/pp)")
    return [head, *(f"  zero={o['zero']} dp_replicate={o['dp_replicate']:<3} {_mib(o['bytes']):>12}"
                    for o in rec["options"])]
