"""The job's data, checked and resolved on the driver before Ray or any actor starts.

``data.path`` or ``data.mix`` (meshdata/mixture.py) for training, ``eval.path`` or ``eval.mix`` for
the held-out loss: every source is opened and checked (it exists, holds enough samples for its share,
its token ids fit ``model.vocab_size``, document masks can apply), and a mixture's paths are replaced
by the names its sources resolve to (absolute paths or URIs), because the ranks may run on other
nodes with another working directory. Every problem is a ``DataError``: one line, exit 2.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from meshdata import DataError, Mixture, validate_source
from meshdata.masks import boundary_eos
from meshdata.mixture import MixSpec, resolved, source_counters, validate_mixture
from meshspeak.sections import JobConfig


@dataclass(frozen=True)
class JobData:
    cfg: JobConfig  # with data.mix / eval.mix resolved (what the controller and the ranks use)
    train: Mixture  # data.path as a one-source mixture, or data.mix
    eval_spec: str | MixSpec  # the resolved eval.path or eval.mix; "" = no evaluation
    eval_mask_eos_id: int | None

    def counters(self, step: int) -> list[dict]:
        """Per training source after ``step``: samples, tokens and epoch (step records' ``sources``)."""
        return source_counters(self.train, step, self.cfg.train.global_batch_size)


def check_job_data(cfg: JobConfig, vocab: int) -> JobData:
    """Check and resolve the job's training and eval data; raises ``DataError``."""
    masks, seq_len, batch = cfg.data.mask_document_boundaries, cfg.model.seq_len, cfg.train.global_batch_size
    if cfg.data.mix:
        train = validate_mixture(cfg.data.mix, seq_len, vocab, batch, key="data.mix", masks=masks)
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, mix=resolved(cfg.data.mix)))
    else:
        train = Mixture([validate_source(cfg.data.path, seq_len, vocab, batch)], (1.0,), seq_len)
    boundary_eos(masks, train)  # a bad setting is exit 2 before any actor
    eval_spec, eval_eos = "", None
    if cfg.eval.mix:
        held_out = validate_mixture(cfg.eval.mix, seq_len, vocab, batch, key="eval.mix", masks=masks,
                                    eval_batches=cfg.eval.batches)
        eval_spec = resolved(cfg.eval.mix)
        cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, mix=eval_spec))
        eval_eos = boundary_eos(masks, held_out)
    elif cfg.eval.path:
        source = validate_eval_path(cfg, vocab)
        eval_spec, eval_eos = source.name, boundary_eos(masks, source)
    return JobData(cfg, train, eval_spec, eval_eos)


def validate_eval_path(cfg: JobConfig, vocab: int):
    """The eval.path source, checked like data.path (enough samples for eval.batches)."""
    try:
        src = validate_source(cfg.eval.path, cfg.model.seq_len, vocab,
                              cfg.train.global_batch_size * cfg.eval.batches)
        boundary_eos(cfg.data.mask_document_boundaries, src)
    except DataError as exc:
        # The data checks name data.path; here the file at fault is the eval one.
        key = "eval.path" if exc.key == "data.path" else exc.key
        raise DataError(str(exc).replace("data.path", "eval.path").replace(
            "fewer than one global batch", "fewer than eval.batches global batches"), key=key) from None
    return src
