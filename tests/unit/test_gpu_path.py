"""CPU checks of the GPU path's speed basics: flash-eligible attention, optimizer kernel choice, TF32."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from meshmodels.gpt_model import build_stage
from orchestrator.config.load import load_config
from workers.optim import build_optimizer


def test_causal_attention_calls_sdpa_the_way_the_cuda_flash_kernel_accepts(monkeypatch):
    """The CUDA flash kernel takes no mask tensor (only is_causal), no dropout, 16-bit q/k/v with
    unit last stride and head_dim a multiple of 8 up to 256. The CPU build cannot ask CUDA's
    selector, so the call's arguments are checked against those rules, and the block also runs with
    only the flash backend allowed (the CPU's flash kernel)."""
    import torch.nn.functional as F

    cfg = load_config(None, ["model.d_model=64", "model.n_heads=4", "model.seq_len=32", "model.n_layers=1"])
    model = build_stage(cfg.model, range(1), seed=0).to(torch.bfloat16)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len))
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        seen.append((q, k, v, attn_mask, dropout_p, is_causal))
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        model(tokens).float().sum().backward()
    (q, k, v, mask, dropout, causal), = seen
    assert mask is None and causal is True and dropout == 0.0
    for t in (q, k, v):
        assert t.dtype == torch.bfloat16 and t.stride(-1) == 1
        assert t.shape[-1] % 8 == 0 and t.shape[-1] <= 256


def test_adamw_is_multi_tensor_on_the_cpu_and_fused_only_on_cuda():
    cfg = load_config(None, [])
    model = build_stage(cfg.model, range(1), seed=0)
    opt = build_optimizer(model, cfg.train)
    assert opt.defaults["foreach"] is True and not opt.defaults["fused"]
    if torch.cuda.is_available():
        opt = build_optimizer(model.cuda(), cfg.train)
        assert opt.defaults["fused"] is True


def test_a_cuda_rank_allows_tf32_for_fp32_matmuls():
    from workers.device import configure_cuda

    before = torch.backends.cuda.matmul.fp32_precision
    try:
        configure_cuda()
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    finally:
        torch.backends.cuda.matmul.fp32_precision = before


def test_compiled_blocks_keep_names_and_train_like_eager():
    """``train.compile``'s per-block compile, traced with dynamo + AOT autograd ("aot_eager": the
    graphs inductor would get, without its minutes of C++ compiling on 2 cores; inductor itself is
    the slow distributed test): same parameter names, same losses and weights over 3 AdamW steps."""
    import copy

    from meshmodels.gpt_model import lm_loss_sum
    from workers.parallelize import apply_compile

    cfg = load_config(None, ["model.d_model=32", "model.n_heads=4", "model.seq_len=16", "model.n_layers=2"])
    eager = build_stage(cfg.model, range(2), seed=0, activation_checkpointing=True)
    compiled = copy.deepcopy(eager)
    from meshmodels.gpt import GPTFamily

    apply_compile(compiled, GPTFamily(), backend="aot_eager")
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    opts = [build_optimizer(m, cfg.train) for m in (eager, compiled)]
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        x, y = (torch.randint(0, cfg.model.vocab_size, (2, 16), generator=gen) for _ in range(2))
        losses = []
        for model, opt in zip((eager, compiled), opts):
            opt.zero_grad()
            loss = lm_loss_sum(model(x), y)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=name)


def test_fp16_step_records_carry_the_loss_scale_and_the_skip():
    from meshspeak.mesh import MeshShape
    from meshspeak.messages import StepResult
    from orchestrator.metrics import step_record

    cfg = load_config(None, ["train.dtype=float16"])
    skipped = [StepResult(step=3, world_rank=r, ok=True, loss=1.0 if r == 0 else None, step_time_s=0.1,
                          loss_scale=32768.0, skipped=True) for r in range(2)]
    record = step_record(3, skipped, train=cfg.train, seq_len=64, shape=MeshShape(2, 1, 1), generation=1)
    assert record["loss_scale"] == 32768.0 and record["skipped"] is True
    plain = [StepResult(step=3, world_rank=0, ok=True, loss=1.0, step_time_s=0.1)]
    record = step_record(3, plain, train=cfg.train, seq_len=64, shape=MeshShape(1, 1, 1), generation=1)
    assert "loss_scale" not in record and "skipped" not in record


def test_loss_scale_follows_gradscalers_rule():
    from workers.loss_scale import DynamicLossScale

    scale = DynamicLossScale(growth_interval=3)
    for finite in (True, True):
        scale.update(finite)
    assert (scale.scale, scale.growth_tracker) == (2.0**16, 2)
    scale.update(False)
    assert (scale.scale, scale.growth_tracker) == (2.0**15, 0)
    for _ in range(3):
        scale.update(True)
    assert (scale.scale, scale.growth_tracker) == (2.0**16, 0)
    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(2)]
    for p in params:
        p.grad = torch.full((3,), 4.0)
    scale.scale = 2.0
    assert scale.unscale_(params, torch.device("cpu"), None) is True
    assert all(torch.equal(p.grad, torch.full((3,), 2.0)) for p in params)
    params[1].grad[0] = float("nan")
    assert scale.unscale_(params, torch.device("cpu"), None) is False
    restored = DynamicLossScale()
    restored.load_state_dict(scale.state_dict())
    assert restored.state_dict() == {"scale": 2.0, "growth_tracker": 0}


def test_a_failed_decision_all_reduce_raises_instead_of_handing_back_the_unreduced_value(monkeypatch):
    """What NCCL does when the watchdog or the kick aborts an all-reduce: the call had returned at
    once, the work ends with an error and the tensor still holds this rank's own value. The grad
    norm and the fp16 overflow decision wait on the work with a timeout (which makes NCCL's wait
    block the host and rethrow) and raise; neither hands back a value to step on."""
    from datetime import timedelta

    from torch import nn

    from workers import optim
    from workers.loss_scale import DynamicLossScale

    waits = []

    class AbortedWork:
        def wait(self, timeout=None):
            waits.append(timeout)
            raise RuntimeError("NCCL communicator was aborted on rank 0")

    monkeypatch.setattr(optim.dist, "all_reduce",
                        lambda tensor, op=None, group=None, async_op=False: AbortedWork() if async_op else None)
    monkeypatch.setattr(optim.dist, "get_world_size", lambda group=None: 2)
    param = nn.Parameter(torch.ones(3))
    param.grad = torch.full((3,), 2.0)
    with pytest.raises(RuntimeError, match="aborted"):
        optim.clip_grad_norm([param], 1.0, group=object(), timeout_s=7.0)
    with pytest.raises(RuntimeError, match="aborted"):
        DynamicLossScale().unscale_([param], torch.device("cpu"), object(), timeout_s=7.0)
    assert waits == [timedelta(seconds=7.0)] * 2
    assert torch.equal(param.grad, torch.full((3,), 2.0 / 2.0**16))  # unscaled locally, never stepped


def test_microbatch_tokens_go_to_cuda_pinned_and_asynchronously_and_stay_put_on_the_cpu(monkeypatch):
    """A pageable host->device copy is synchronous; the token batches are pinned and copied with
    non_blocking on CUDA. The CPU build cannot pin or copy to CUDA, so the calls are recorded."""
    import numpy as np

    from workers.batching import to_device

    array = np.arange(6, dtype=np.int64).reshape(2, 3)
    on_cpu = to_device(array, torch.device("cpu"))
    assert on_cpu.data_ptr() == array.ctypes.data  # no copy at all on the CPU
    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: calls.append("pin") or self)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: calls.append(("to", a, k)) or self)
    to_device(array, torch.device("cuda", 0))
    assert calls == ["pin", ("to", (torch.device("cuda", 0),), {"non_blocking": True})]


def test_compiled_step_records_report_the_most_recompiles_of_any_rank(monkeypatch):
    from meshspeak.mesh import MeshShape
    from meshspeak.messages import StepResult
    from orchestrator.metrics import step_record
    from workers import compile_stats

    cfg = load_config(None, ["train.compile=true"])
    results = [StepResult(step=5, world_rank=r, ok=True, loss=0.5, step_time_s=0.1, recompiles=n)
               for r, n in enumerate((0, 3))]
    record = step_record(5, results, train=cfg.train, seq_len=64, shape=MeshShape(2, 1, 1), generation=2)
    assert record["recompiles"] == 3
    plain = [StepResult(step=5, world_rank=0, ok=True, loss=0.5, step_time_s=0.1)]
    assert "recompiles" not in step_record(5, plain, train=cfg.train, seq_len=64, shape=MeshShape(1, 1, 1),
                                           generation=1)
    graphs = iter([10, 14, 14, 14, 14, 16])  # the first compiled step compiles 4; then 0; then 2 again
    monkeypatch.setattr(compile_stats, "compiled_graphs", lambda: next(graphs))
    counter = compile_stats.RecompileCounter()
    counts = []
    for _ in range(3):
        counter.start()
        counts.append(counter.stop())
    assert counts == [0, 0, 2]


def test_a_step_reports_the_seconds_it_spent_compiling_the_running_compile_included():
    """#36 item 10: what ``status`` answers so the driver does not count compile time as step time."""
    from workers import compile_stats

    now = [0.0]
    clock = compile_stats.CompileClock(clock=lambda: now[0])
    counter = compile_stats.RecompileCounter(clock)
    assert counter.step_compile_s() == 0.0  # outside a step
    counter.start()
    now[0] = 5.0
    clock.started()
    now[0] = 12.0
    assert counter.step_compile_s() == 7.0  # a compile running now counts as far as it got
    clock.ended()
    now[0] = 20.0
    assert counter.step_compile_s() == 7.0  # running compiled code is step time
    counter.stop()
    assert counter.step_compile_s() == 0.0
    counter.start()  # the next step starts from what the process compiled so far
    assert counter.step_compile_s() == 0.0 and clock.total_s() == 7.0

    torch._dynamo.reset()  # (clears dynamo's callbacks: ``start`` registers them again)
    real = compile_stats.RecompileCounter()  # dynamo's own callbacks drive it
    real.start()
    compiled = torch.compile(lambda x: torch.sin(x) * 2 + 1, backend="eager")
    compiled(torch.ones(4))
    assert real.step_compile_s() > 0.0
    real.stop()


def test_a_non_finite_loss_in_fp16_is_a_bad_step_not_an_overflow_and_the_scale_has_a_floor():
    """#36 item 9: a rank's non-finite loss poisons its gradients, which the overflow check saw as an
    overflow: the step read good, the bad-step counter reset, the scale halved every step, unbounded.
    The loss verdict travels in the same all-reduce; an overflow at the floor is a bad step too."""
    from workers.loss_scale import DynamicLossScale

    params = [torch.nn.Parameter(torch.ones(3))]
    params[0].grad = torch.full((3,), float("nan"))  # what poison_grads leaves after a NaN loss
    scale = DynamicLossScale(scale=8.0, min_scale=2.0)
    checked = scale.unscale_and_check(params, torch.device("cpu"), None, loss_bad=True)
    assert checked == (False, False) and scale.judge(*checked) == "loss" and scale.scale == 8.0
    assert scale.judge(False, True) == "overflow" and scale.scale == 4.0  # a real overflow: halved
    assert scale.judge(False, True) == "overflow" and scale.scale == 2.0
    assert scale.judge(False, True) == "grad_norm" and scale.scale == 2.0  # at the floor: a bad step
    params[0].grad = torch.full((3,), 4.0)
    assert scale.unscale_and_check(params, torch.device("cpu"), None) == (True, True)
    assert scale.judge(True, True) == "" and torch.equal(params[0].grad, torch.full((3,), 2.0))
