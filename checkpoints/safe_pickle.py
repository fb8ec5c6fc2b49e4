"""DCP's ``.metadata`` is a pickle: read it without running code a checkpoint directory brings.

A checkpoint directory may come from someone else (``checkpoint.resume`` of a copied directory,
``elastimesh export`` of a downloaded one). ``torch.distributed.checkpoint`` reads ``.metadata``
with ``pickle.load``, and a pickle can call any importable function while it loads (e.g.
``os.system``). Two guards, both limited to the names in ``ALLOWED`` (the classes DCP's metadata is
made of; ``torch`` dtypes and ``torch.Size``; ``pathlib`` paths, which DCP stores as the checkpoint
id):

* ``scan_globals`` / ``check_metadata_bytes``: a static reading of the pickle's opcodes (stdlib
  ``pickletools``, nothing is built or imported), so the driver — which imports no
  ``torch.distributed`` — can refuse a checkpoint before any rank loads it. Every name the pickle
  would import must be spelled out in the stream (``GLOBAL``, or ``STACK_GLOBAL`` of two string
  constants, possibly through the memo); anything it cannot resolve, an extension-registry code or a
  persistent id is refused too.
* ``restricted_loads``: the ranks (and ``export``) unpickle through an ``Unpickler`` whose
  ``find_class`` only returns allowed names (the standard way to restrict pickle, Python's
  ``pickle`` documentation, "Restricting Globals").

Hand-written because torch offers no restricted loader for DCP metadata: ``torch.load``'s
``weights_only`` unpickler does not know DCP's classes and ``FileSystemReader.read_metadata`` calls
``pickle.load`` directly. Byte items are loaded with ``weights_only=True`` (``checkpoints.reader``).
No torch import at module level: the driver uses the static check.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools

from checkpoints.errors import CheckpointError

DCP_METADATA = "torch.distributed.checkpoint.metadata"
DTYPES = frozenset({
    "float32", "float64", "float16", "bfloat16", "complex64", "complex128", "uint8", "int8", "int16", "int32",
    "int64", "uint16", "uint32", "uint64", "bool", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
    "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2", "quint8", "qint8", "qint32", "quint4x2",
})
ALLOWED: dict[str, frozenset[str]] = {
    DCP_METADATA: frozenset({"Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                             "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),  # looks a layout up by its name
    "torch": DTYPES | {"Size"},
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"}),
    "collections": frozenset({"OrderedDict"}),
}
_STRINGS = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"})
_REFUSED_OPS = frozenset({"EXT1", "EXT2", "EXT4", "PERSID", "BINPERSID"})
_UNKNOWN = object()


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint's ``.metadata`` would import something DCP metadata never needs."""


def _refuse(what: str, path: str | None) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"DCP .metadata {what}, which checkpoint metadata never does: loading it could run code from the "
        "checkpoint directory, so it is refused (README, Trust boundary); use checkpoints written by "
        "elastimesh, from storage you trust", path)


def allowed(module: str, name: str) -> bool:
    return name in ALLOWED.get(module, ())


def scan_globals(data: bytes) -> list[tuple[str, str]]:
    """Every (module, name) the pickle ``data`` would import, read from its opcodes without loading it.

    Raises:
        ValueError: the stream is not a pickle, or an import's name is not a constant in it, or it
            uses an opcode that imports by other means (extension codes, persistent ids).
    """
    stack: list = []
    marks: list[int] = []
    memo: dict[int, object] = {}
    found: list[tuple[str, str]] = []
    for op, arg, _ in pickletools.genops(data):
        name = op.name
        if name in _REFUSED_OPS:
            raise ValueError(f"opcode {name}")
        if name in _STRINGS:
            stack.append(arg)
        elif name == "MARK":
            marks.append(len(stack))
        elif name == "MEMOIZE":
            memo[len(memo)] = stack[-1]
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[arg] = stack[-1]
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            stack.append(memo.get(arg, _UNKNOWN))
        elif name in ("GLOBAL", "INST"):
            module, _, attr = arg.partition(" ")
            found.append((module, attr))
            if name == "INST":
                del stack[marks.pop():]
            stack.append(_UNKNOWN)
        elif name == "STACK_GLOBAL":
            attr, module = stack.pop(), stack.pop()
            if not isinstance(module, str) or not isinstance(attr, str):
                raise ValueError("an import whose name is computed, not a constant")
            found.append((module, attr))
            stack.append(_UNKNOWN)
        elif name == "DUP":
            stack.append(stack[-1])
        else:  # everything else only moves values around: its documented stack effect
            before = op.stack_before
            if pickletools.markobject in before:
                del stack[marks.pop():]
                below = before.index(pickletools.markobject)
            else:
                below = len(before)
            if below:
                if len(stack) < below:
                    raise ValueError(f"opcode {name} on a short stack")
                del stack[-below:]
            stack.extend([_UNKNOWN] * len(op.stack_after))
    return found


def check_metadata_bytes(data: bytes, path: str | None = None) -> None:
    """Refuse a ``.metadata`` pickle that imports anything outside ``ALLOWED`` (see the module docstring).

    Raises:
        UnsafeCheckpointError: naming the first name refused (or why the stream cannot be read).
    """
    try:
        names = scan_globals(data)
    except Exception as exc:  # pickletools' ValueError, or a malformed stream's IndexError
        raise _refuse(f"cannot be read safely ({exc})", path) from None
    for module, name in names:
        if not allowed(module, name):
            raise _refuse(f"imports {module}.{name}", path)


def check_metadata_file(step_dir: str) -> None:
    """``check_metadata_bytes`` of ``step_dir``'s ``.metadata`` (local path or URI); nothing to check
    when it cannot be read (the catalog reports a missing file, DCP an unreadable one).

    Raises:
        UnsafeCheckpointError: see ``check_metadata_bytes``.
    """
    from checkpoints.layout import DCP_METADATA
    from meshspeak.locations import local_path

    local = local_path(step_dir)
    try:
        if local is not None:
            with open(os.path.join(local, DCP_METADATA), "rb") as fh:
                data = fh.read()
        else:
            import fsspec

            with fsspec.open(f"{step_dir.rstrip('/')}/{DCP_METADATA}", "rb") as fh:
                data = fh.read()
    except OSError:
        return
    check_metadata_bytes(data, step_dir)


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if not allowed(module, name):
            raise _refuse(f"imports {module}.{name}", None)
        obj = super().find_class(module, name)
        if module == "torch" and name != "Size":
            import torch

            if not isinstance(obj, torch.dtype):
                raise _refuse(f"imports torch.{name}, not a dtype", None)
        return obj

    def persistent_load(self, pid):
        raise _refuse("holds a persistent id", None)


def restricted_loads(data: bytes, path: str | None = None):
    """Unpickle DCP metadata, importing only ``ALLOWED`` names (checked statically first)."""
    check_metadata_bytes(data, path)
    try:
        metadata = _RestrictedUnpickler(io.BytesIO(data)).load()
        check_storage_paths(metadata)
        return metadata
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(exc.message, path) from None


def check_storage_paths(metadata) -> None:
    """Refuse metadata that stores a tensor outside its own checkpoint directory.

    DCP's ``FileSystemReader`` joins each item's ``relative_path`` to the checkpoint directory as it
    stands, so an absolute path or one that climbs with ``..`` would make every rank read a file of
    the crafter's choosing (loaded with ``weights_only``, but read all the same). DCP itself only
    ever writes plain file names (``__0_0.distcp``).

    Raises:
        UnsafeCheckpointError: naming the first path that is not a plain file name.
    """
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        name = getattr(info, "relative_path", None)
        if name is None:  # not a file-system entry (our in-memory snapshots index by position)
            continue
        text = str(name)
        if not text or text in (".", "..") or "/" in text or "\\" in text or os.path.isabs(text):
            raise UnsafeCheckpointError(
                f"DCP .metadata stores data at {text!r}, a path rather than a file name of its own directory, "
                "which DCP never writes: loading it would read files outside the checkpoint, so it is refused "
                "(README, Trust boundary); use checkpoints written by elastimesh, from storage you trust")
