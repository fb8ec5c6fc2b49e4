"""Document-boundary masks: which targets count toward the loss.

With ``data.mask_document_boundaries`` on, a target whose *input* token is EOS is not counted: the
model is never trained to predict the first token of a document from the end of the previous one
(TorchTitan does the same). Masked targets are set to ``IGNORE`` (-100, PyTorch cross-entropy's
``ignore_index``), so the summed loss skips them; the step's loss is then the sum over counted
targets divided by their *global* count (every replica's microbatches), which keeps any mesh equal
to one process (workers/runtime.py, workers/reference.py).

Chat shards (``data prepare --chat``) carry their own mask: their targets come out of the source
already IGNORE outside the assistant's tokens (meshdata.chat_source), and the same global count
normalises them (:func:`counts_every_target` is False for them). A sample there is one conversation,
so there is no document boundary inside a window to mask: the setting changes nothing on them.
"""

from __future__ import annotations

import numpy as np

from meshdata.errors import DataError

IGNORE = -100
KEY = "data.mask_document_boundaries"


def boundary_eos(setting: bool | str, source) -> int | None:
    """The EOS id whose following targets are masked, or None for no masking.

    ``setting``: True, False or "auto" (= on when the source's sidecar names an EOS id). None for
    chat shards, whatever the setting: no window holds two conversations.
    """
    if getattr(source, "has_loss_mask", False):
        return None
    if setting == "auto":
        return source.eos_id
    if setting is True or setting == "true":
        if source.eos_id is None:
            raise DataError(f"{KEY} = true but data.path = {source.name!r} records no EOS token (byte shards or "
                            "shards without a sidecar); set data.mask_document_boundaries = false, or prepare "
                            "the shards with `elastimesh data prepare --tokenizer TOK`", key=KEY)
        return int(source.eos_id)
    return None


def mask_targets(inputs: np.ndarray, targets: np.ndarray, eos_id: int | None) -> np.ndarray:
    """``targets`` with every position whose input is ``eos_id`` set to IGNORE (a copy; None: as is)."""
    if eos_id is None:
        return targets
    out = targets.copy()
    out[inputs == eos_id] = IGNORE
    return out


def counts_every_target(source, eos_id: int | None) -> bool:
    """True when no target of ``source`` can be IGNORE (no document mask, no loss mask): the step's
    count is then ``G * seq_len`` without asking the other replicas."""
    return eos_id is None and not getattr(source, "has_loss_mask", False)


def counted(targets: np.ndarray) -> int:
    """How many targets count toward the loss."""
    return int(np.count_nonzero(targets != IGNORE))


def mask_eos_for(data_cfg) -> int | None:
    """:func:`boundary_eos` for a ``[data]`` config section: data.path's source, or data.mix's
    (their common EOS id: meshdata/mixture.py). Opens them; sources are cached per process."""
    from meshdata.mixture import open_mixture

    return boundary_eos(data_cfg.mask_document_boundaries, open_mixture(data_cfg.mix or data_cfg.path, 1))
