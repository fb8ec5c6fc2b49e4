"""Where a shard directory lives: a local path (memory-mapped reads) or any fsspec URI (s3://, gs://...).

``Location`` is the only place that touches the filesystem, so the rest of the package reads the same
way from a laptop directory and from object storage. Local paths (plain or ``file://``) are opened
with ``memory_map=True``: Parquet pages come straight from the page cache, nothing is read ahead.
Any other URI goes through fsspec (the same library ``checkpoints/storage.py`` uses for
``checkpoint.dir``, so one set of credentials and endpoint settings — e.g. ``AWS_ENDPOINT_URL`` —
serves both).

Remote calls can hang for minutes inside an SDK's retry loop when a bucket or endpoint is wrong;
``bounded`` runs one in a daemon thread and turns "no answer within the deadline" into a DataError.
"""

from __future__ import annotations

import os
import posixpath
import threading
from collections.abc import Callable
from typing import TypeVar

from meshdata.errors import DataError, one_line
from meshspeak.locations import local_path

T = TypeVar("T")

REMOTE_TIMEOUT_S = 25.0  # opening a remote directory: list + sidecar + footers, under the 30 s promise
_FIX_REMOTE = ("check the bucket/path name, the endpoint (AWS_ENDPOINT_URL for S3-compatible stores) "
               "and the credentials")


def bounded(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """``fn()`` or a DataError if it neither returns nor raises within ``timeout_s`` seconds."""
    box: list = []

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as exc:  # re-raised in the caller's thread
            box.append((False, exc))

    thread = threading.Thread(target=run, daemon=True, name="elastimesh-data-open")
    thread.start()
    thread.join(timeout_s)
    if not box:
        raise DataError(f"{what} did not answer within {timeout_s:g} s; {_FIX_REMOTE}")
    ok, value = box[0]
    if ok:
        return value
    raise value


class Location:
    """A shard directory. ``name`` is what users see (absolute path or the URI without a trailing /)."""

    def __init__(self, path: str) -> None:
        lp = local_path(path)
        self.is_local = lp is not None
        if self.is_local:
            self.root = os.path.abspath(os.path.expanduser(lp))
            self.name = self.root
            self.fs = None
        else:
            from fsspec.core import url_to_fs  # lazy: only URIs need fsspec

            self.name = path.rstrip("/")
            try:
                self.fs, self.root = url_to_fs(self.name)
            except (ImportError, ValueError) as exc:
                raise DataError(f"data.path = {path!r}: cannot open this URI ({one_line(exc)}); install "
                                "the filesystem's fsspec package (e.g. s3fs, gcsfs) or use a local path") from None
            self.root = self.root.rstrip("/")

    def join(self, name: str) -> str:
        return os.path.join(self.root, name) if self.is_local else posixpath.join(self.root, name)

    def uri(self, name: str) -> str:
        """``name``'s full address as users see it (for messages)."""
        return os.path.join(self.root, name) if self.is_local else f"{self.name}/{name}"

    def kind(self) -> str:
        """"dir", "file" or "missing"."""
        if self.is_local:
            return "dir" if os.path.isdir(self.root) else "file" if os.path.exists(self.root) else "missing"
        try:
            info = self.fs.info(self.root)
        except FileNotFoundError:
            return "missing"
        except PermissionError as exc:
            raise DataError(f"data.path = {self.name!r}: access denied ({one_line(exc)}); "
                            f"{_FIX_REMOTE}") from None
        except Exception as exc:  # SDK errors (botocore's) are not all OSErrors
            raise DataError(f"data.path = {self.name!r} cannot be reached ({one_line(exc)}); "
                            f"{_FIX_REMOTE}") from None
        return "dir" if info.get("type") == "directory" else "file"

    def files(self) -> dict[str, int]:
        """Base name -> byte size of the regular files directly under the directory."""
        if self.is_local:
            out = {}
            with os.scandir(self.root) as it:
                for e in it:
                    if e.is_file():
                        out[e.name] = e.stat().st_size
            return out
        try:
            entries = self.fs.ls(self.root, detail=True)
        except PermissionError as exc:
            raise DataError(f"data.path = {self.name!r}: access denied ({one_line(exc)}); "
                            f"{_FIX_REMOTE}") from None
        except Exception as exc:
            raise DataError(f"data.path = {self.name!r} cannot be listed ({one_line(exc)}); "
                            f"{_FIX_REMOTE}") from None
        return {posixpath.basename(e["name"].rstrip("/")): int(e.get("size") or 0)
                for e in entries if e.get("type") == "file"}

    def read_bytes(self, name: str) -> bytes:
        if self.is_local:
            with open(self.join(name), "rb") as f:
                return f.read()
        return self.fs.cat_file(self.join(name))

    def open_parquet(self, name: str, metadata=None):
        """A ``pyarrow.parquet.ParquetFile`` reading lazily (footer now, unless ``metadata`` is the
        parsed footer already; row groups on demand)."""
        import pyarrow.parquet as pq

        if self.is_local:
            return pq.ParquetFile(self.join(name), memory_map=True, metadata=metadata)
        # Parquet reads are a footer then row-group ranges: fsspec's read-ahead would fetch bytes
        # that are thrown away, so read exactly what pyarrow asks for.
        return pq.ParquetFile(self.fs.open(self.join(name), "rb", cache_type="none"))
