"""Reading torch.distributed.checkpoint's `.metadata` without running code from it.

`dcp.load` unpickles `<checkpoint>/.metadata` with plain `pickle.load`, so a crafted file runs
code before a single tensor is read (the tensor files themselves are read with
`weights_only=True`). Here `.metadata` is read with an unpickler that constructs only the classes
DCP's metadata is made of (checked against torch 2.13: the `torch.distributed.checkpoint.metadata`
dataclasses, `_StorageInfo`, `pathlib` paths, `torch.Size`, dtypes, layouts and memory formats);
anything else raises :class:`UnsafeCheckpointError` naming the file and the refused name.

* :func:`check_dcp_tree`: every `.metadata` under a folder (the trainer runs it on a checkpoint
  before the workers load it).
* :class:`SafeFileSystemReader`: a `FileSystemReader` whose `read_metadata` is the restricted one
  (for loads in this process, e.g. model_merger).
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader

from hybridrl.utils.safe_io import UnsafeCheckpointError

__all__ = ["SafeFileSystemReader", "check_dcp_tree", "read_dcp_metadata"]

METADATA_FILE = ".metadata"
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "ChunkStorageMetadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    # Megatron's dist_checkpointing also keeps the save plans in its metadata
    "torch.distributed.checkpoint.planner": {
        "SavePlan",
        "WriteItem",
        "WriteItemType",
        "TensorWriteData",
        "LoadPlan",
        "ReadItem",
        "LoadItemType",
    },
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset"},
}


def _torch_value(name: str) -> Any:
    """torch.Size, or a dtype / layout / memory format object of the torch module; else None."""
    if name == "Size":
        return torch.Size
    value = getattr(torch, name, None)
    return value if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)) else None


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: str) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch":
            value = _torch_value(name)
            if value is not None:
                return value
        elif name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"refusing to load {self.path!r}: it would construct {module}.{name}, which is not part of "
            "torch.distributed.checkpoint's metadata and could run code when unpickled. Do not load "
            "checkpoints you do not trust; re-save this one from a trusted copy."
        )


def read_dcp_metadata(path: str) -> Any:
    """Unpickle one `.metadata` file with the restricted unpickler; returns DCP's Metadata."""
    with open(path, "rb") as f:
        try:
            return _MetadataUnpickler(f, path).load()
        except UnsafeCheckpointError:
            raise
        except Exception as e:  # truncated / not a pickle
            raise UnsafeCheckpointError(
                f"{path!r} is not a readable DCP metadata file ({type(e).__name__}: {e})"
            ) from None


def check_dcp_tree(root: str) -> list[str]:
    """Read every `.metadata` under `root` restrictedly; returns the files checked.

    Raises:
        UnsafeCheckpointError: a file names a class outside the allow-list, or is unreadable.
    """
    checked = []
    for dirpath, _dirs, files in os.walk(root):
        if METADATA_FILE in files:
            read_dcp_metadata(os.path.join(dirpath, METADATA_FILE))
            checked.append(os.path.join(dirpath, METADATA_FILE))
    return sorted(checked)


class SafeFileSystemReader(FileSystemReader):
    """`FileSystemReader` that reads `.metadata` with the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = os.fspath(self._get_metadata_path(kwargs.get("rank")))
        metadata = read_dcp_metadata(path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
