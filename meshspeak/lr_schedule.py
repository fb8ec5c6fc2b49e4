"""The learning-rate schedule as a pure function of the step (warm-up, then a cosine or linear decay
to a floor: ``train.lr_decay``).

Pure so both sides use the one definition: the actors set it on their optimizers, the driver logs it.
Stateless on purpose: a resumed or resharded run recomputes it from the step, no scheduler state.
"""

from __future__ import annotations

import math


def lr_at(step: int, train) -> float:
    """Learning rate for optimizer step ``step`` (1-based) under the [train] section ``train``."""
    if train.warmup_steps and step <= train.warmup_steps:
        return train.lr * step / train.warmup_steps
    decay_steps = max(1, train.steps - train.warmup_steps)
    progress = min(1.0, (step - train.warmup_steps) / decay_steps)
    floor = train.lr * train.min_lr_ratio
    if getattr(train, "lr_decay", "cosine") == "linear":
        return floor + (train.lr - floor) * (1.0 - progress)
    return floor + (train.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
