"""Reading checkpoint files without running code from them.

``torch.distributed.checkpoint``'s ``FileSystemReader`` unpickles ``.metadata`` with plain
``pickle.load`` and DeepSpeed loads its files with ``torch.load(weights_only=False)``: either runs
whatever a crafted file asks for. Here:

- ``SafeFileSystemReader``: DCP's reader with ``.metadata`` unpickled by an allowlist (DCP's own
  metadata dataclasses and enums, ``torch.Size``, dtypes, layouts, paths).
- ``safe_byte_items()``: DCP's load planners (torch's default and megatron-core's subclass) unpickle
  every non-tensor item (an optimizer's param-group values, megatron's ShardedObjects) with
  ``torch.load(weights_only=False)``. Inside this context each such item must first load with
  ``weights_only=True``; one that does not is refused. Tensor items are raw bytes, never unpickled.
- ``check_weights_only(path, extra_globals)``: opens a ``torch.save`` file with
  ``torch.load(weights_only=True, mmap=True)`` (the pickle only, not the tensor bytes) under an
  allowlist; used as a gate before a library that loads unsafely touches the file.
Any failure is a ``CheckpointError`` naming the file and what is wrong.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import os
import pickle
from typing import Iterable

import torch
from torch.distributed.checkpoint import FileSystemReader


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be trusted or read: the message names the path and the problem."""


_ALLOWED_MODULE_PREFIXES = ("torch.distributed.checkpoint", "megatron.core.dist_checkpointing")
_ALLOWED_EXACT = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                  ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
                  ("pathlib", "PureWindowsPath"), ("builtins", "set"), ("builtins", "frozenset"),
                  ("builtins", "slice"), ("builtins", "tuple"), ("builtins", "list"), ("builtins", "dict")}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only plain-data classes: DCP/dist_checkpointing dataclasses and enums, and the
    exact names above. Dotted names (attribute chains) and functions are refused."""

    def find_class(self, module: str, name: str):
        if "." in name:
            raise pickle.UnpicklingError(f"refused global {module}.{name} (attribute chain)")
        if (module, name) in _ALLOWED_EXACT:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                         torch.memory_format)):
            return getattr(torch, name)
        if module.startswith(_ALLOWED_MODULE_PREFIXES):
            obj = super().find_class(module, name)
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
                return obj
        raise pickle.UnpicklingError(f"refused global {module}.{name}: not a checkpoint metadata class")


def read_dcp_metadata(path: str):
    """Unpickle a DCP ``.metadata`` file through the allowlist."""
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (the checkpoint was not finished or was moved)") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: not a valid torch.distributed.checkpoint metadata file "
                              f"(corrupt, truncated or carrying code): {e}") from None


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is unpickled through the allowlist."""

    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")
        get_path = getattr(self, "_get_metadata_path", None)
        path = get_path(rank) if get_path else os.path.join(str(self.path), ".metadata")
        metadata = read_dcp_metadata(str(path))
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta  # noqa: PLC0415
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


def check_weights_only(path: str, extra_globals: Iterable = ()) -> None:
    """Raise ``CheckpointError`` unless ``path`` loads with ``torch.load(weights_only=True)`` allowing
    only ``extra_globals`` besides torch's defaults. Reads the pickle, not the tensor bytes (mmap)."""
    try:
        with torch.serialization.safe_globals(list(extra_globals)):
            torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        first = str(e).split("Check the documentation")[0].strip().splitlines()
        why = next((ln for ln in first if "Unsupported" in ln or "WeightsUnpickler" in ln), first[-1] if first else "")
        raise CheckpointError(f"{path}: refused - holds a pickled object outside the allowlist ({why.strip()}); "
                              f"this is not a checkpoint written by this trainer, or it was tampered with") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable (corrupt or truncated): {e}") from None


class ByteItemGuard:
    """What ``safe_byte_items`` refused: ``refused`` lists "item: why" for each byte item that
    would not load with ``weights_only=True``."""

    def __init__(self) -> None:
        self.refused: list = []

    def error(self, step_dir: str):
        """A ``CheckpointError`` for the first refused item, or None."""
        if not self.refused:
            return None
        return CheckpointError(f"{step_dir}: refused - item {self.refused[0]}; this is not a checkpoint "
                               f"written by this trainer, or it was tampered with")


@contextlib.contextmanager
def safe_byte_items():
    """Within the context, DCP's ``DefaultLoadPlanner.load_bytes`` (inherited by megatron-core's
    planner) loads an item only after it loaded with ``torch.load(weights_only=True)``, so a pickled
    object outside torch's allowlist is refused, not run. Yields a ``ByteItemGuard``: after a failed
    load, ``guard.error(step_dir)`` tells whether a refusal was the cause."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner  # noqa: PLC0415
    original = DefaultLoadPlanner.load_bytes
    guard = ByteItemGuard()

    def load_bytes(self, read_item, value):
        start = value.tell()
        try:
            torch.load(value, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - every way the safe unpickler says no
            first = str(e).split("Check the documentation")[0].strip().splitlines()
            why = next((ln for ln in first if "Unsupported" in ln or "WeightsUnpickler" in ln),
                       first[-1] if first else type(e).__name__)
            fqn = getattr(getattr(read_item, "dest_index", None), "fqn", "?")
            guard.refused.append(f"{fqn!r}: holds a pickled object outside the allowlist ({why.strip()})")
            raise pickle.UnpicklingError(guard.refused[-1]) from None
        value.seek(start)
        return original(self, read_item, value)

    DefaultLoadPlanner.load_bytes = load_bytes
    try:
        yield guard
    finally:
        DefaultLoadPlanner.load_bytes = original
