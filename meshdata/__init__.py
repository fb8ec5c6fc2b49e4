"""Token data for elastimesh: sources (lazy, any storage), the global sample order, document masks,
and ``elastimesh data prepare``.

Pure numpy + pyarrow (no torch; ray only inside ``prepare``'s parallel path) because both sides use it:
the driver validates ``data.path`` before starting any actor and runs ``data prepare``; each actor
opens the same source and reads only the windows of the microbatches it is told to.

Data model (public contract, README "Data")
--------------------------------------------
A source is one flat stream of int32 token ids. ``data.path = "builtin"`` is the shipped synthetic
English corpus (``workers/corpus/builtin.txt``, byte tokens, vocab 256). Otherwise ``data.path`` is a
directory — a local path, ``file://``, ``s3://``, ``gs://`` or any fsspec URI — of ``*.parquet`` files
with a column ``tokens: list<int32>``, read in sorted file-name order, one document (or a piece of
one) per row, rows concatenated in order with no separator. ``data prepare`` ends every document with
the tokenizer's EOS; third-party shards (no sidecar) work as long as they have the ``tokens`` column.

Sample ``i`` of sequence length ``L`` is the window ``tokens[i*L : i*L + L + 1]`` (inputs ``[:-1]``,
targets ``[1:]``); the order in which samples are visited is ``meshdata.order``. With
``data.mask_document_boundaries`` a target whose input token is EOS is not counted
(``meshdata.masks``). Chat shards (``data prepare --chat``: sidecar format 3, a ``loss_mask`` column)
are the exception: sample ``i`` is conversation ``i`` padded to the window, its targets counted only
on the assistant's tokens (``meshdata.chat_source``).

Modules: ``storage`` (local / fsspec locations), ``index`` (row-group token counts, sidecar, content
identity), ``source`` (TokenSource, open/validate), ``order`` (sample order), ``mixture``
(``data.mix``: weighted sources as one sample space), ``masks``, ``inputs`` /
``tokenizer`` / ``prepare`` (``data prepare``), ``chat`` / ``conversations`` / ``chat_source``
(``data prepare --chat`` and its shards).
"""

from meshdata.errors import DataError
from meshdata.index import FORMAT_VERSION, SIDECAR
from meshdata.mixture import Mixture, open_mixture
from meshdata.order import global_sample_ids, replica_microbatches, replica_slice, sample_order
from meshdata.prepare import MAX_ROW_TOKENS, prepare
from meshdata.source import (
    BUILTIN,
    BUILTIN_FILE,
    BYTE_VOCAB,
    TokenSource,
    microbatch_tokens,
    open_source,
    sample_windows,
    validate_source,
)

__all__ = [
    "BUILTIN", "BUILTIN_FILE", "BYTE_VOCAB", "DataError", "FORMAT_VERSION", "MAX_ROW_TOKENS", "SIDECAR",
    "Mixture", "TokenSource", "global_sample_ids", "microbatch_tokens", "open_mixture", "open_source", "prepare",
    "replica_microbatches", "replica_slice", "sample_order", "sample_windows", "validate_source",
]  # fmt: skip
