"""Held-out evaluation (the ``[eval]`` section), driven from the controller between steps.

After step k (every ``eval.every`` steps and after the last), every rank runs ``eval.batches``
forward-only batches of the eval source (workers/batching.py): batch b is samples ``[b*G, (b+1)*G)``
in order, split over replicas and microbatches like a training batch, so the set of windows and the
math are the same on any mesh. The loss is the sum of cross-entropy over counted targets divided by
their count over all eval batches (document masks apply as in training); perplexity = exp(loss).
Recorded as ``{"event": "eval", "step", "loss", "perplexity", "tokens", "batches"}`` and as
``eval/loss`` / ``eval/perplexity`` in TensorBoard. A rank lost during eval is an ordinary failure.
"""

from __future__ import annotations

import math

from meshspeak.messages import CallOutcome
from meshspeak.rank_calls import RankCalls
from meshspeak.sections import EvalConfig


class Evaluator:
    def __init__(self, section: EvalConfig, *, last_step: int, step_timeout_s: float, eval_path: str,
                 mask_eos_id: int | None) -> None:
        self.every, self.batches = section.every, section.batches
        self.last_step = last_step  # train.steps: evaluated after it too
        self.step_timeout_s = step_timeout_s  # elastic.step_timeout_s: each eval batch's bound
        self.path = eval_path  # resolved by the driver (absolute path or URI)
        self.mask_eos_id = mask_eos_id

    def due(self, step: int) -> bool:
        every = self.every
        return bool(self.path) and (step == self.last_step or (every > 0 and step % every == 0))

    def run(self, group, gen, metrics, step: int) -> CallOutcome | None:
        """Evaluate generation ``gen``; None when done, the failed outcome otherwise."""
        loss_sum = 0.0
        count = 0
        for batch in range(self.batches):
            # Each rank runs the forward-only part of the action list it got once per generation.
            refs = group.submit(list(gen.members.values()), RankCalls.eval_step, (self.path, batch, self.mask_eos_id))
            outcome = group.collect(refs, self.step_timeout_s, stop_early=lambda o: bool(o.dead or o.failed))
            if not outcome.ok:
                return outcome
            results = list(outcome.results.values())
            batch_count = results[0]["count"]
            # Each share is normalised by its batch's global count: weight the batch means back.
            loss_sum += sum(r["loss"] for r in results if r["loss"] is not None) * batch_count
            count += batch_count
        loss = loss_sum / max(1, count)
        metrics.eval(step=step, loss=loss, perplexity=math.exp(min(loss, 700.0)), tokens=count,
                     batches=self.batches)
        return None
