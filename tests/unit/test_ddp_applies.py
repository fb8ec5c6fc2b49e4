"""Where ZeRO-0 runs through torch DDP rather than FSDP2's HSDP (meshspeak.dp_plan.ddp_applies)."""

from meshspeak.dp_plan import ddp_applies


def test_plain_dp_zero0_fp32_is_ddp():
    assert ddp_applies(0, 2, 1, 1, "float32")
    assert ddp_applies(0, 4, 1, 1, "float64", "float64")


def test_everything_else_stays_fsdp2():
    assert not ddp_applies(3, 2, 1, 1, "float32")  # sharded levels
    assert not ddp_applies(0, 1, 1, 1, "float32")  # nothing to reduce
    assert not ddp_applies(0, 2, 1, 2, "float32")  # TP: DTensor parameters
    assert not ddp_applies(0, 2, 2, 1, "float32")  # PP
    assert not ddp_applies(0, 2, 1, 1, "bfloat16")  # mixed precision: FSDP2's fp32 master weights
    assert not ddp_applies(0, 2, 1, 1, "float32", "bfloat16")  # train.grad_reduce
    assert not ddp_applies(0, 2, 1, 1, "float32", cpu_offload=True)
    assert not ddp_applies(0, 2, 1, 1, "float32", grad_compression="powersgd")
