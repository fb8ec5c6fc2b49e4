"""Where checkpoints live: the ``CheckpointStorage`` seam, a local/shared-path backend and an fsspec one.

The driver uses this module to list, validate, commit and purge checkpoints, so it must stay free
of ``torch`` and ``torch.distributed`` (fsspec is imported lazily, only for URI roots). Workers write
the shard files themselves through DCP's own writers (see :mod:`checkpoints.writer`); this module
only has to see the same files.

Paths are strings. A plain path or a ``file://`` URI is local (:class:`LocalStorage`); any other URI
(``memory://``, ``s3://``, ``gs://`` ...) goes through fsspec (:class:`FsspecStorage`).
"""

from __future__ import annotations

import errno
import os
import posixpath
import shutil
import uuid
from typing import Any, Protocol, runtime_checkable

from meshspeak.locations import local_path


@runtime_checkable
class CheckpointStorage(Protocol):
    """The operations the checkpoint catalog needs from a filesystem or object store."""

    is_local: bool
    """True when paths are OS paths that DCP's ``FileSystemWriter``/``Reader`` can use directly."""

    def join(self, base: str, *names: str) -> str: ...

    def exists(self, path: str) -> bool: ...

    def listdir(self, path: str) -> list[str]:
        """Base names of the entries directly under ``path``; [] when ``path`` does not exist."""
        ...

    def file_size(self, path: str) -> int: ...

    def read_text(self, path: str) -> str: ...

    def write_text_atomic(self, path: str, text: str) -> None:
        """Make ``path`` appear complete or not at all (tmp + rename; one put on object stores)."""
        ...

    def create_text_exclusive(self, path: str, text: str) -> bool:
        """Write ``text`` to ``path`` only if nothing is there (False if something is): a conditional create."""
        ...

    def remove_tree(self, path: str) -> None: ...

    def makedirs(self, path: str) -> None: ...

    def size_of_tree(self, path: str) -> int: ...


class LocalStorage:
    """A local or shared (NFS, Lustre...) directory. ``file://`` URIs are accepted too."""

    is_local = True

    def join(self, base: str, *names: str) -> str:
        return os.path.join(base, *names)

    def exists(self, path: str) -> bool:
        return os.path.exists(_os(path))

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(_os(path)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def file_size(self, path: str) -> int:
        return os.stat(_os(path)).st_size

    def read_text(self, path: str) -> str:
        with open(_os(path), encoding="utf-8") as f:
            return f.read()

    def write_text_atomic(self, path: str, text: str) -> None:
        final = _os(path)
        tmp = f"{final}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)  # atomic on POSIX: readers see the old state or the whole file
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
        _fsync_dir(os.path.dirname(final) or ".")

    def create_text_exclusive(self, path: str, text: str) -> bool:
        try:
            fd = os.open(_os(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        return True

    def remove_tree(self, path: str) -> None:
        target = _os(path)
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target)
        else:
            os.remove(target)

    def makedirs(self, path: str) -> None:
        os.makedirs(_os(path), exist_ok=True)

    def size_of_tree(self, path: str) -> int:
        total = 0
        for dirpath, _dirs, files in os.walk(_os(path)):
            for name in files:
                try:
                    total += os.lstat(os.path.join(dirpath, name)).st_size
                except FileNotFoundError:  # deleted while we walked (a purge running): not ours to report
                    pass
        return total


class FsspecStorage:
    """Any fsspec filesystem addressed by URI (``memory://``, ``s3://bucket/run``, ``gs://``...).

    Object stores have no directories and no rename, so ``write_text_atomic`` is one put, which
    object stores make visible atomically; ``makedirs`` is a no-op there.

    Args:
        uri: any URI on the filesystem; only its scheme (and storage options) matter.
        storage_options: passed to fsspec (credentials, endpoint...).
    """

    is_local = False

    def __init__(self, uri: str, **storage_options: Any) -> None:
        from fsspec.core import url_to_fs  # lazy: only URI roots need fsspec

        self.fs, _ = url_to_fs(uri, **storage_options)

    def join(self, base: str, *names: str) -> str:
        return posixpath.join(base.rstrip("/"), *names) if names else base

    def _fresh(self, path: str) -> None:
        # s3fs/gcsfs cache listings per process; the ranks write files behind this process's
        # back, so a cached listing would show a shard as missing or 0 bytes (seen on s3).
        self.fs.invalidate_cache(path)

    def exists(self, path: str) -> bool:
        self._fresh(path)
        return bool(self.fs.exists(path))

    def listdir(self, path: str) -> list[str]:
        self._fresh(path)
        try:
            entries = self.fs.ls(path, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted({posixpath.basename(str(e).rstrip("/")) for e in entries})

    def file_size(self, path: str) -> int:
        self._fresh(path)
        return int(self.fs.size(path))

    def read_text(self, path: str) -> str:
        return self.fs.cat_file(path).decode("utf-8")

    def write_text_atomic(self, path: str, text: str) -> None:
        self.fs.pipe_file(path, text.encode("utf-8"))

    def create_text_exclusive(self, path: str, text: str) -> bool:
        # fsspec's mode="create": S3's If-None-Match: * (s3fs), an "xb" open elsewhere. A store that
        # refuses it answers like an existing object on S3 (PreconditionFailed, which s3fs raises as EINVAL).
        try:
            self.fs.pipe_file(path, text.encode("utf-8"), mode="create")
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno == errno.EINVAL or "PreconditionFailed" in str(exc):
                return False
            raise
        self.fs.invalidate_cache(path)
        return True

    def remove_tree(self, path: str) -> None:
        self.fs.rm(path, recursive=True)

    def makedirs(self, path: str) -> None:
        if _is_object_store(self.fs):
            # No directories to make, and s3fs/gcsfs would *create the bucket* of a mistyped
            # checkpoint.dir: let the first write fail with "no such bucket" instead.
            return
        self.fs.makedirs(path, exist_ok=True)

    def size_of_tree(self, path: str) -> int:
        self._fresh(path)
        if not self.fs.exists(path):
            return 0
        return sum(int(info.get("size") or 0) for info in self.fs.find(path, detail=True).values())


OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "abfs", "az", "oss"}


def _is_object_store(fs) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return bool(OBJECT_STORES & set(protocol))


def storage_for(uri_or_path: str | os.PathLike[str], **storage_options: Any) -> CheckpointStorage:
    """The storage backend for a checkpoint root: local for paths and ``file://``, else fsspec."""
    text = os.fspath(uri_or_path)
    if local_path(text) is not None:
        return LocalStorage()
    return FsspecStorage(text, **storage_options)


def _os(path: str) -> str:
    resolved = local_path(path)
    if resolved is None:
        raise ValueError(f"not a local path: {path!r}")
    return resolved


def _fsync_dir(directory: str) -> None:
    # Make the rename itself durable; some filesystems (and all of Windows) refuse a dir fd.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
