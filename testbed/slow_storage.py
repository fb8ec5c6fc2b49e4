"""Slow storage on purpose (#36: a slow but healthy run never fails): a throttled fsspec filesystem
and a slow ``checkpoint.init_from`` read, for tests.

``ThrottledFileSystem`` is the local filesystem behind the ``throttled://`` protocol, every byte read
or written paced to ``bytes_per_s`` (default ``THROTTLE_ENV`` or 1 MB/s): ``throttled:///abs/dir``
works as a ``checkpoint.dir`` (``checkpoints.storage.FsspecStorage``) or a ``data.path``
(``meshdata.storage.Location``) in any process that ran ``register()``. Each call sleeps for what it
moved over the rate, so a test asserts on ``slept_s`` (the seconds asked for), never on a clock.

``slow_init_from()`` is a Ray ``worker_process_setup_hook`` (``runtime_env``): in every worker it
wraps ``meshmodels.hf_io.load_hf`` so that each rank first reads every file of the ``init_from``
directory through the throttled filesystem (at ``THROTTLE_ENV`` bytes/s), then loads as before — a
join as slow as a large model's read from slow storage. With ``MARKS_ENV`` set, each read leaves
``<dir>/read-started-<pid>-<n>`` and ``<dir>/read-done-<pid>-<n>`` (``n``: the process's nth read;
``time.time()`` inside), so a test
can act while a read is under way and order what happened without timing it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import fsspec
from fsspec.implementations.local import LocalFileSystem

PROTOCOL = "throttled"
THROTTLE_ENV = "ELASTIMESH_TEST_THROTTLE_BPS"
MARKS_ENV = "ELASTIMESH_TEST_SLOW_READ_MARKS"
DEFAULT_BYTES_PER_S = 1e6


class _ThrottledFile:
    """A local file whose reads and writes sleep ``bytes / rate`` after moving the bytes."""

    def __init__(self, inner, fs: ThrottledFileSystem) -> None:
        self._inner, self._fs = inner, fs

    def read(self, size: int = -1) -> bytes:
        data = self._inner.read(size)
        self._fs.pace(len(data))
        return data

    def readinto(self, buffer) -> int:
        n = self._inner.readinto(buffer)
        self._fs.pace(n or 0)
        return n

    def write(self, data) -> int:
        n = self._inner.write(data)
        self._fs.pace(len(memoryview(data).cast("B")))
        return n

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._inner.close()

    def __iter__(self):
        return iter(self._inner)

    def __getattr__(self, name: str):  # seek, tell, close, closed, seekable, flush...
        return getattr(self._inner, name)


class ThrottledFileSystem(LocalFileSystem):
    protocol = PROTOCOL
    root_marker = "/"

    def __init__(self, bytes_per_s: float | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.bytes_per_s = float(bytes_per_s or os.environ.get(THROTTLE_ENV) or DEFAULT_BYTES_PER_S)
        self.slept_s = 0.0  # seconds of pacing asked for so far (what tests check)
        self.moved_bytes = 0

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        if path.startswith(PROTOCOL + "://"):
            path = path[len(PROTOCOL) + 3:] or "/"
        return super()._strip_protocol(path)

    def unstrip_protocol(self, name: str) -> str:
        return f"{PROTOCOL}://{self._strip_protocol(name)}"

    def pace(self, nbytes: int) -> None:
        delay = nbytes / self.bytes_per_s
        self.moved_bytes += nbytes
        self.slept_s += delay
        time.sleep(delay)

    def _open(self, path, mode="rb", block_size=None, **kwargs):
        return _ThrottledFile(super()._open(path, mode, block_size=block_size, **kwargs), self)

    def cat_file(self, path, start=None, end=None, **kwargs) -> bytes:
        with self._open(path, "rb") as fh:
            if start:
                fh.seek(start)
            return fh.read(-1 if end is None else end - (start or 0))


def register() -> None:
    """Make ``throttled://`` known to fsspec in this process (idempotent)."""
    fsspec.register_implementation(PROTOCOL, ThrottledFileSystem, clobber=True)


def read_throttled(directory: str, bytes_per_s: float | None = None) -> int:
    """Read every file of ``directory`` through the throttled filesystem; bytes read."""
    fs = ThrottledFileSystem(bytes_per_s=bytes_per_s, skip_instance_cache=True)
    total = 0
    for path in sorted(Path(directory).iterdir()):
        if path.is_file():
            total += len(fs.cat_file(str(path)))
    return total


def slow_init_from() -> None:
    """Ray ``worker_process_setup_hook``: every ``init_from`` read in this worker goes through
    ``read_throttled`` first (see the module docstring)."""
    register()
    import meshmodels.hf_io as hf_io

    original = hf_io.load_hf

    def slow_load_hf(parts, family, directory, process_group=None):
        marks = os.environ.get(MARKS_ENV)
        _mark(marks, "read-started")
        read_throttled(directory)
        _mark(marks, "read-done")
        return original(parts, family, directory, process_group=process_group)

    hf_io.load_hf = slow_load_hf


_reads_begun = [0]  # this process's init_from reads so far (each read's marks carry its number)


def _mark(directory: str | None, name: str) -> None:
    if name == "read-started":
        _reads_begun[0] += 1
    if directory:
        Path(directory, f"{name}-{os.getpid()}-{_reads_begun[0]}").write_text(repr(time.time()))
