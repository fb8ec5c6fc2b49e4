"""A checkpoint root that is not writable is a clear error naming it (checkpoints.catalog).

The check runs in a forked child: as root (CI and the project machines) permission bits do not stop
writes, so the child drops to the unprivileged uid 65534 (``nobody``) first; as any other user it keeps
that user. Either way the directory really refuses writes to the process that tries. (A fork, not a
new interpreter: the venv's python lives under root's 0700 home, which ``nobody`` cannot execute.)
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from checkpoints.catalog import ensure_writable, prepare_step
from checkpoints.errors import CheckpointError

pytestmark = pytest.mark.timeout(60)
NOBODY = 65534


def _check_refused(locked: str) -> str:
    """What the unprivileged child found: "refused" when every write was refused with a clear error."""
    try:
        open(os.path.join(locked, "probe"), "w").close()
        return "this process can write to a 0o555 directory: the check would prove nothing"
    except PermissionError:
        pass
    root = os.path.join(locked, "ckpt")
    try:
        ensure_writable(root)
        return "ensure_writable accepted an unwritable root"
    except CheckpointError as err:
        if "not writable" not in str(err) or root not in str(err):
            return f"unclear error: {err}"
    try:
        prepare_step(locked, 10)
        return "prepare_step wrote into an unwritable root"
    except CheckpointError:
        return "refused"


def _in_unprivileged_child(locked: str) -> str:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop root, check, report through the pipe, never return into pytest
        try:
            os.close(read_end)
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            os.write(write_end, _check_refused(locked).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as answer:
        found = answer.read()
    os.waitpid(pid, 0)
    return found


def test_unwritable_root_is_a_clear_error():
    base = tempfile.mkdtemp(prefix="elastimesh-unwritable-")  # under /tmp: traversable by nobody once 0o755
    try:
        os.chmod(base, 0o755)
        locked = os.path.join(base, "locked")
        os.mkdir(locked)
        os.chmod(locked, 0o555)
        assert _in_unprivileged_child(locked) == "refused"
        assert os.listdir(locked) == []
    finally:
        shutil.rmtree(base, ignore_errors=True)
