"""What a location in the config means: ``checkpoint.dir``, ``data.path`` and the paths of ``data.mix``
are each a plain path or a URI (``file://``, ``s3://``, ``gs://``, any fsspec scheme).

A plain path or a ``file://`` URI is local: the checkpoint side hands it to DCP's file writers and
readers, the data side memory-maps its shards. Any other URI goes through fsspec. Both sides read the
same strings from the same TOML, so the rule lives here, once.
"""

from __future__ import annotations

import os


def local_path(uri_or_path: str | os.PathLike[str]) -> str | None:
    """The OS path for a plain path or ``file://`` URI; None for any other URI scheme."""
    text = os.fspath(uri_or_path)
    if text.startswith("file://"):
        return text[len("file://") :] or "/"
    if "://" in text:
        return None
    return text
