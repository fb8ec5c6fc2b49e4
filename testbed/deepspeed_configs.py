"""DeepSpeed configs the tests map and run (tests/unit/test_deepspeed_config.py, tests/ray/test_deepspeed_run.py).

A seed-style one (ZeRO-3 with overlap_comm and contiguous_gradients, micro 16, accumulation 8,
pipeline activation checkpointing) and two verbatim from DeepSpeed's documentation: the getting-started
tutorial's (github.com/deepspeedai/DeepSpeed/blob/master/docs/_tutorials/getting-started.md, "Writing
DeepSpeed Models") and the CIFAR-10 tutorial's (github.com/deepspeedai/DeepSpeed/blob/master/docs/_tutorials/cifar-10.md).
"""

from __future__ import annotations

SEED = {
    "train_micro_batch_size_per_gpu": 16,
    "gradient_accumulation_steps": 8,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                          "stage3_prefetch_bucket_size": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 1000, "warmup_num_steps": 100,
                                                       "warmup_type": "linear", "cos_min_ratio": 0.1}},
    "pipeline": {"stages": 2, "activation_checkpoint_interval": 1},
}
GETTING_STARTED = """{
  "train_batch_size": 8,
  "gradient_accumulation_steps": 1,
  "optimizer": {
    "type": "Adam",
    "params": {
      "lr": 0.00015
    }
  },
  "fp16": {
    "enabled": true
  },
  "zero_optimization": true
}"""
CIFAR10 = """ {
   "train_batch_size": 4,
   "steps_per_print": 2000,
   "optimizer": {
     "type": "Adam",
     "params": {
       "lr": 0.001,
       "betas": [
         0.8,
         0.999
       ],
       "eps": 1e-8,
       "weight_decay": 3e-7
     }
   },
   "scheduler": {
     "type": "WarmupLR",
     "params": {
       "warmup_min_lr": 0,
       "warmup_max_lr": 0.001,
       "warmup_num_steps": 1000
     }
   },
   "wall_clock_breakdown": false
 }"""
