"""The benchmark scripts run end to end in their --quick mode and write well-formed JSON.

The step_overhead test runs by default (~10 s); the ones that spawn ranks (zero3_memory, checkpoint_stall,
pipeline_bubble, preemption, chaos, powersgd_convergence, powersgd_ddp_oracle, compression) are marked slow.
Smoke tests only: no timing thresholds (the figures depend on the machine and its load), just that
each script runs, writes where ``--out`` says, and reports the keys and positive numbers the README
and the closing notes read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.command_line import run_bench_script, run_cli

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_step_overhead_quick_writes_json(tmp_path: Path) -> None:
    result = run_bench_script("step_overhead.py", tmp_path / "nested" / "step_overhead.json", "--steps", "2")
    assert result["benchmark"] == "step_overhead"
    assert result["quick"] is True
    for side in ("elastimesh", "plain"):
        assert result["median_step_s"][side] > 0
        assert result["median_step_cpu_s"][side] > 0
        assert len(result["step_times_s"][side]) == 2
    assert result["ratio"] > 0 and result["cpu_ratio"] > 0
    assert isinstance(result["goal_met"], bool)
    # Its spread: 2 measured steps in blocks of 2 (the default) are one interleaved block per side.
    assert result["ratio_per_block"]["n"] == 1 and result["blocks_meeting_goal"] in ("0 of 1", "1 of 1")
    assert result["cpu_ratio_per_block"]["median"] > 0
    # Same model, same samples, same math: the two loops must produce the same losses.
    assert result["losses_match"] is True
    warmup = result["config"]["warmup_steps_per_side"]
    assert len(result["losses"]["elastimesh"]) == len(result["losses"]["plain"]) == warmup + 2
    assert all(loss > 0 for loss in result["losses"]["elastimesh"])
    config = result["config"]
    assert config["num_params"] > 0 and config["torch_num_threads"] >= 1
    assert config["mesh"] == {"dp": 1, "pp": 1, "tp": 1, "zero": 3, "schedule": "1f1b"}


@pytest.mark.slow  # spawns 3 gloo ranks: ~12 s idle, over a minute on a loaded 2-core machine
@pytest.mark.timeout(180)
def test_zero3_memory_quick_writes_json(tmp_path: Path) -> None:
    result = run_bench_script("zero3_memory.py", tmp_path / "zero3_memory.json", timeout=170)
    assert result["benchmark"] == "zero3_memory"
    assert result["dps"] == [1, 2]
    model = result["models"]["tiny"]
    assert model["num_params"] > 0
    # One fp32 rank holds params + grads + two AdamW moments: 16 bytes per parameter.
    assert model["dp1_matches_analytic"] is True
    assert model["unsharded_bytes"] == 16 * model["num_params"]
    for dp in ("1", "2"):
        run = model["by_dp"][dp]
        assert len(run["per_rank_allocated_bytes"]) == int(dp)
        assert all(b > 0 for b in run["per_rank_local_bytes"] + run["per_rank_allocated_bytes"])
        assert run["ratio_local"] > 0 and run["ratio_allocated"] > 0
    # Sharding really happened: each of two ranks holds about half.
    assert model["by_dp"]["2"]["max_local_bytes"] < model["by_dp"]["1"]["max_local_bytes"]


@pytest.mark.slow  # spawns 2 gloo ranks that re-form twice: ~25 s idle, longer on a loaded machine
@pytest.mark.timeout(300)
def test_checkpoint_stall_quick_writes_json(tmp_path: Path) -> None:
    result = run_bench_script("checkpoint_stall.py", tmp_path / "checkpoint_stall.json", timeout=290)
    assert result["benchmark"] == "checkpoint_stall" and result["quick"] is True
    assert result["state_bytes"] > 0 and result["sync_save_median_s"] > 0
    repeats = result["config"]["repeats"]
    assert len(result["sync_save_s"]) == repeats
    for mode in ("async_staged", "async_background"):
        figures = result["async"][mode]
        assert len(figures["stall_s"]) == repeats + 1 and all(s > 0 for s in figures["stall_s"])
        assert figures["staging_buffers_reused"] is True
        assert figures["saves_started_with_none_in_flight"] is True  # each save is timed alone
    assert result["async"]["async_background"]["staging_median_s"] > 0  # the copy ran off the step
    assert result["stall_ratio"] > 0 and isinstance(result["goal_met"], bool)
    for target in ("tp2", "dp1"):  # resharded loads put back exactly the saved parameters
        load = result["loads"][target]
        assert load["params_match_saved"] is True
        assert load["resharded_from_dp2_median_s"] > 0 and load["same_mesh_median_s"] > 0
    assert result["loads"]["dp2"]["same_mesh_median_s"] > 0


@pytest.mark.slow  # spawns 2-4 gloo ranks for 17 short runs: ~70 s idle, minutes on a loaded machine
@pytest.mark.timeout(900)
def test_pipeline_bubble_quick_writes_json(tmp_path: Path) -> None:
    result = run_bench_script("pipeline_bubble.py", tmp_path / "pipeline_bubble.json", timeout=890)
    rows = result["bubble_1f1b"]
    assert [(r["pp"], r["m"]) for r in rows] == [(2, 4), (2, 8), (4, 4), (4, 8)]
    for row in rows:
        assert 0 < row["measured"] < 1 and 0 < row["replay_measured_action_durations"] < 1
        # With the measured mean F and B for every stage the simulator gives exactly the formula.
        assert row["simulated_mean_costs"] == pytest.approx(row["theory"])
        assert row["handoff_latency_ms"]["n"] + row["recv_of_an_already_sent_tensor_ms"]["n"] > 0
    for iv in result["interleaved_vs_1f1b_by_m"].values():
        assert iv["speedup_step"] > 0 and iv["interleaved_1f1b"]["bubble_theory"] < iv["1f1b"]["bubble_theory"]
    assert result["activation_memory"]["goal_met"] is True  # byte counts, not timings: deterministic
    assert result["activation_memory"]["zb_h1_goal_met"] is True  # ZB-H1 holds what 1F1B holds
    (zb,) = result["zero_bubble"]["gemm_bound"]  # --quick: the goal's shape only
    assert (zb["pp"], zb["m"]) == (2, 8) and zb["same_activation_peak"] is True
    for name in ("1f1b", "interleaved_1f1b", "zb-h1", "zbv"):
        assert 0 < zb[name]["measured"] < 1 and zb[name]["simulated_idle_over_busy"] > 0
        assert zb[name]["bottleneck_idle_over_busy"] >= 0
    # At equal F, I, W the simulated ZB-H1 bubble is a third of 1F1B's; at measured costs it is below 1F1B's.
    assert zb["zb_h1_over_1f1b_idle_simulated_at_measured_costs"] < 1
    assert 0 < zb["zb_h1_over_1f1b_formula_at_measured_costs"] < 1
    assert set(result["goals"]) == {"bubble_within_5_points_pp2", "bubble_within_5_points_pp4",
                                    "interleaved_faster", "gpipe_holds_more_activations",
                                    "zb_h1_same_activation_peak", "zb_h1_bubble_third_of_1f1b"}


@pytest.mark.slow  # two multi-node Rays, a 20 s drain deadline and Ray Train's restart: minutes
@pytest.mark.timeout(900)
def test_preemption_quick_writes_json(tmp_path: Path) -> None:
    result = run_bench_script("preemption.py", tmp_path / "preemption.json", timeout=890)
    assert result["benchmark"] == "preemption" and result["quick"] is True
    em, rt = result["elastimesh"], result["ray_train"]
    # Figures, not timings: elastimesh evacuated the drained node's ranks before it went, losing no step.
    assert em["action"] == "evacuate" and len(em["victim_ranks"]) == 2 and em["new_dp"] == 2
    assert em["steps_lost"] == 0 and em["steps_logged_twice"] == 0 and em["failures"] == 0
    assert em["drain_to_next_step_done_s"] > 0 and rt["drain_to_next_step_done_s"] > 0
    assert rt["new_world"] == 2 and rt["steps_lost"] is not None and rt["fit_error"] is None
    assert result["ratio_drain_to_next_step"] > 0 and isinstance(result["goal_met"], bool)


@pytest.mark.slow  # a multi-node Ray, 11 faults (one a 20 s drain, one a 12 s slow save) over 60 steps: minutes
@pytest.mark.timeout(900)
def test_chaos_quick_survives_every_kind_of_fault(tmp_path: Path) -> None:
    copy = tmp_path / "metrics.jsonl"
    result = run_bench_script("chaos.py", tmp_path / "chaos.json", "--metrics-copy", str(copy), timeout=890)
    assert result["benchmark"] == "chaos" and result["quick"] is True
    # At least one fault of each of the 10 kinds of a local Ray (slow storage among them), all survived;
    # the damaged checkpoint was found invalid and no other committed checkpoint is corrupt; the fp64 run
    # equals the failure-free fp64 reference.
    assert result["kinds"] == 10 and result["survived"] and result["error"] is None
    assert "slow_storage" in result["faults_by_kind"] and "partition" not in result["faults_by_kind"]
    assert result["truncated_on_purpose"] == result["truncated_found_invalid"] and not result["corrupt_committed"]
    assert result["max_param_diff"] is not None and result["max_param_diff"] <= 1e-9
    assert 0 < result["goodput"] <= 1
    # Its goodput is the report's accounting (issue 28): every second of the run in one bucket, and
    # `elastimesh report` of the campaign's metrics copy says the same.
    ledger = result["goodput_accounting"]
    assert ledger["accounted_s"] == pytest.approx(ledger["wall_s"], rel=0.01) and ledger["finished"]
    assert ledger["seconds"]["useful"] == pytest.approx(result["useful_step_time_s"])
    assert ledger["recoveries"] and ledger["steps"]["rerun"] == result["steps_rerun"]
    proc = run_cli("report", str(copy), "--out", str(tmp_path / "report"))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((tmp_path / "report" / "report.json").read_text())
    assert doc["seconds"] == pytest.approx(ledger["seconds"]) and doc["wall_s"] == pytest.approx(ledger["wall_s"])


@pytest.mark.timeout(180)
def test_gpu_bench_dry_run_runs_every_part_on_the_cpu(tmp_path: Path) -> None:
    """bench/gpu.py --dry-run: parts a-c through the same code as on a GPU (tiny, gloo, compile
    traced with aot_eager); part d (Ray, >= 2 GPUs) says why it was skipped."""
    out = tmp_path / "gpu.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--dry-run", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, f"gpu.py failed:\n{proc.stdout}\n{proc.stderr}"
    result = json.loads(out.read_text())
    assert result["benchmark"] == "gpu" and result["dry_run"] is True and "not a measurement" in result["note"]
    # CPU against CPU: the file claims no goal, met or missed (issue 26), only the figures themselves.
    assert _goal_fields(result) and set(_goal_fields(result)) == {None}
    a = result["cpu_vs_cuda"]
    assert a["max_rel_diff"] <= 1e-4 and len(a["cpu"]) == len(a["cuda_fp32"]) == a["steps"]
    b = result["throughput"]
    assert set(b["runs"]) == {"eager", "compile"} and b["flops_per_token"] > 6 * b["params_non_embedding"]
    assert all(r["tokens_per_s"] > 0 and r["mfu"] is None for r in b["runs"].values())
    c = result["checkpoint_stall"]
    assert c["median_sync_s"] > 0 and c["ratio"] > 0 and len(c["async_stall_s"]) == 2
    assert "skipped" in result["nccl_mesh"]


def _goal_fields(result: dict) -> list:
    """Every ``goal_met`` value in a result, at any depth."""
    found = []
    for key, value in result.items():
        if key == "goal_met":
            found.append(value)
        elif isinstance(value, dict):
            found += _goal_fields(value)
    return found


def _gpu_module():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return gpu


def test_gpu_bench_dry_run_never_claims_a_goal_nor_writes_gpu_json() -> None:
    gpu = _gpu_module()
    part = {"goal": "x", "goal_met": True, "nested": {"goal_met": False, "value": 1.0}}
    result = gpu.withhold_goals({"cpu_vs_cuda": part, "nccl_mesh": {"goal_met": True}, "goal_met": True})
    assert _goal_fields(result) == [None, None, None, None] and result["cpu_vs_cuda"]["nested"]["value"] == 1.0
    assert gpu.output_path(None, dry=True).name == "gpu_dry_run.json"
    assert gpu.output_path(None, dry=False) == gpu.DEFAULT_OUT and gpu.DEFAULT_OUT.name == "gpu.json"
    assert gpu.output_path("/x/y.json", dry=True) == Path("/x/y.json")


def test_gpu_bench_peak_lookup_and_flops_formula() -> None:
    gpu = _gpu_module()
    from orchestrator.config.load import load_config

    assert gpu.peak_flops("NVIDIA H100 80GB HBM3") == gpu.peak_flops("NVIDIA H200") == 989e12
    assert gpu.peak_flops("NVIDIA H100 PCIe") == 756e12
    assert gpu.peak_flops("NVIDIA L40S") == 362e12 and gpu.peak_flops("NVIDIA L4") == 121e12
    assert gpu.peak_flops("Tesla V100-SXM2-16GB") is None  # no bf16: MFU is not reported
    cfg = load_config(None, gpu.LLAMA_1B)
    n, per_token = gpu.model_flops_per_token(cfg)
    layer = 4 * 2048**2 + 3 * 2048 * 5632 + 2 * 2048
    assert n == 16 * layer + 2048 + 32000 * 2048  # blocks, final norm, head (no embedding table)
    assert per_token == 6 * n + 12 * 16 * 2048 * 2048


@pytest.mark.slow  # two 20-step runs of spawned gloo ranks at dp=2 (~10 s idle)
@pytest.mark.timeout(300)
def test_powersgd_convergence_quick_writes_json(tmp_path: Path) -> None:
    # No loss threshold: a 20-step gap says nothing about convergence (the 200-step figures are the
    # bench's and the slow test's in tests/distributed/test_powersgd.py).
    result = run_bench_script("powersgd_convergence.py", tmp_path / "powersgd.json", timeout=280)
    assert result["benchmark"] == "powersgd_convergence" and result["quick"] is True
    assert {(r["variant"], r["steps"]) for r in result["runs"]} == {("plain", 20), ("r2", 20)}
    (row,) = result["summary"]
    assert row["variant"] == "r2" and row["plain_loss"] > 0 and row["powersgd_loss"] > 0
    # measured bytes: rank 2 sends far fewer on compressed steps, and the plain steps count in the mean
    assert row["bytes_ratio"] >= 4 and 1 < row["bytes_ratio_mean"] < row["bytes_ratio"]
    assert isinstance(row["met"], bool)


@pytest.mark.slow  # four 20-step runs of spawned gloo ranks at dp=2 (~20 s idle)
@pytest.mark.timeout(600)
def test_compression_quick_writes_json(tmp_path: Path) -> None:
    # No loss threshold: a 20-step gap says nothing about convergence (the 500-step figures are the
    # bench's; tests/distributed/test_quantized_grads.py compares short runs with the plain one).
    result = run_bench_script("compression.py", tmp_path / "compression.json", timeout=580)
    assert result["benchmark"] == "compression" and result["quick"] is True
    assert {(r["variant"], r["steps"]) for r in result["runs"]} == {
        ("plain", 20), ("int8", 20), ("int4", 20), ("onebit_w5", 20)}
    rows = {row["variant"]: row for row in result["summary"]}
    assert set(rows) == {"int8", "int4", "onebit_w5"}
    assert all(row["loss"] > 0 and row["plain_loss"] > 0 for row in rows.values())
    # measured bytes per compressed step, and the goals' verdicts for the quantized codecs
    assert rows["int8"]["bytes_ratio"] >= 3.5 and rows["int4"]["bytes_ratio"] >= 7
    assert rows["onebit_w5"]["bytes_ratio"] >= 20 and 1 < rows["onebit_w5"]["bytes_ratio_mean"]
    assert isinstance(rows["int8"]["met"], bool) and "met" not in rows["onebit_w5"]


@pytest.mark.slow  # two 20-step runs of 2 spawned gloo ranks under torch's DDP (~30 s idle)
@pytest.mark.timeout(300)
def test_powersgd_ddp_oracle_quick_writes_json(tmp_path: Path) -> None:
    # No loss threshold here either (20 steps); what is checked: the oracle is torch's DDP with one
    # bucket, its hook compresses as much as elastimesh's adapter (the same PowerSGDState settings).
    result = run_bench_script("powersgd_ddp_oracle.py", tmp_path / "oracle.json", "--mesh-results",
                         str(tmp_path / "none.json"), timeout=280)
    assert result["benchmark"] == "powersgd_ddp_oracle" and result["quick"] is True
    assert {(r["variant"], r["steps"]) for r in result["runs"]} == {("plain", 20), ("r2", 20)}
    assert all("," not in str(r["bucket_sizes"]) for r in result["runs"])
    (row,) = result["summary"]
    assert row["ddp_plain_loss"] > 0 and row["ddp_powersgd_loss"] > 0 and row["elastimesh_gap"] is None
    assert row["ddp_bytes_ratio"] >= 4  # rank 2 on the default model: 21.7x, as bench/results/powersgd.json


@pytest.mark.slow  # two 10-step runs of 4 rank actors on an embedded Ray (~1-2 min)
@pytest.mark.timeout(400)
def test_rebalance_quick_writes_json(tmp_path: Path) -> None:
    # No throughput threshold (10 steps on a shared machine); what is checked: each mode ran its steps
    # from scratch, the slow replica got fewer microbatches, the ratios are computed against the bound.
    result = run_bench_script("rebalance.py", tmp_path / "rebalance.json", "--scenarios", "device",
                              "--modes", "healthy,rebalance", "--steps", "10", "--repeats", "1", timeout=380)
    assert result["benchmark"] == "rebalance" and result["steps"] == 10
    device = result["scenarios"]["device"]
    (round_,) = device["rounds"]
    assert set(round_["modes"]) == {"healthy", "rebalance"}
    assert all(m["final_step"] == 10 and m["tokens_per_s"] > 0 for m in round_["modes"].values())
    moves = round_["modes"]["rebalance"]["rebalance_events"]
    assert moves and sum(moves[-1]["microbatches"]) == 24 and moves[-1]["microbatches"][3] < 6
    assert device["of_capacity_bound"]["rebalance"] > 0 and isinstance(device["goal_met"], bool)


@pytest.mark.timeout(120)
def test_scale_simulated_part_writes_json(tmp_path: Path) -> None:
    """bench/scale.py's simulated part alone: the real controller on 64 in-process ranks, one rank lost."""
    result = run_bench_script("scale.py", tmp_path / "scale.json", "--skip-real", "--sim", "64")
    assert result["benchmark"] == "scale" and result["real"] == []
    (sim,) = result["simulated"]
    assert sim["ranks"] == 64 and sim["steps_measured"] > 0
    assert sim["driver_cpu_per_step_s"] > 0 and sim["driver_cpu_per_recovery_s"] > 0
    assert 0 < sim["of_which_sim_group_us_per_rank"] < sim["driver_cpu_per_step_per_rank_us"]


@pytest.mark.slow  # 4 and 8 gloo ranks forming twice each, both ways
@pytest.mark.timeout(600)
def test_formation_quick_writes_json(tmp_path: Path) -> None:
    result = run_bench_script("formation.py", tmp_path / "formation.json", timeout=590)
    assert [s["ranks"] for s in result["sizes"]] == [4, 8]
    for size in result["sizes"]:
        for mode in ("world_wide", "own_groups", "build_process_groups"):
            assert size[mode]["formation_s"] > 0 and size[mode]["connections_per_rank_max"] > 0
        # each rank makes its own groups only: never more connections than when it made every group
        assert size["own_groups"]["connections_per_rank_max"] <= size["world_wide"]["connections_per_rank_max"]
