"""Reading a torch.distributed.checkpoint folder safely and in place.

DCP's FileSystemReader unpickles the folder's index (`.metadata`) and loads each stored tensor
with torch.load into a new tensor (through a bytes copy: twice the tensor's size), then copies it
into the one being loaded. For a checkpoint a user points us at, and a rank whose largest tensor
is a 1,000,000-class classifier's rows, neither will do. This reader reads the index with an
unpickler that allows only the index's own classes, and reads each stored tensor's bytes (torch
.save keeps them uncompressed in a zip entry) straight into the tensor being loaded; nothing in
the folder is unpickled. Items a folder claims to hold as pickled data are refused.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import struct
import zipfile
from pathlib import Path
from typing import Any, ClassVar, cast

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future


class UnsafeCheckpoint(ValueError):
    """A checkpoint folder holds something other than tensors and their index."""


class SafeMetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's index allowing only the classes such an index holds."""

    MODULES = ("torch.distributed.checkpoint.metadata",)
    NAMES: ClassVar[set[tuple[str, str]]] = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("pathlib", "PosixPath"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if module in self.MODULES or (module, name) in self.NAMES or dtype:
            return super().find_class(module, name)
        raise UnsafeCheckpoint(f"checkpoint index refers to {module}.{name}: refused")


def read_index(folder: Path) -> Metadata:
    with open(Path(folder) / ".metadata", "rb") as f:
        metadata = SafeMetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpoint(f"{folder}/.metadata is not a checkpoint index")
    return metadata


class FileSlice(io.RawIOBase):
    """A read-only window [offset, offset + length) of an open file, for zipfile."""

    def __init__(self, file: io.BufferedReader, offset: int, length: int):
        self.file, self.offset, self.length, self.pos = file, offset, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.length}[whence]
        self.pos = min(max(0, base + pos), self.length)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        size = min(len(view), self.length - self.pos)
        self.file.seek(self.offset + self.pos)
        done = self.file.readinto(view[:size]) or 0
        self.pos += done
        return done


def _read_exact(source: Any, target: torch.Tensor) -> None:
    """Fill a contiguous CPU tensor from `source`, byte for byte."""
    # numpy's stubs declare ndarray's buffer protocol only for Python >= 3.12.
    buffer = memoryview(target.view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
    done = 0
    while done < len(buffer):
        got = source.readinto(buffer[done:])
        if not got:
            raise UnsafeCheckpoint("a stored tensor is shorter than its index says")
        done += got


class SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_index(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        cast(StorageMeta, metadata.storage_meta).load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs):
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self.index = metadata.state_dict_metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative, items in by_file.items():
            with open(Path(self.path) / relative, "rb") as f:
                for item in items:
                    if item.type == LoadItemType.BYTE_IO:
                        raise UnsafeCheckpoint(
                            f"checkpoint item {item.dest_index.fqn} is pickled data: refused"
                        )
                    self._read_tensor(f, item, planner)
        done: Future = Future()
        done.set_result(None)
        return done

    def _read_tensor(self, f: io.BufferedReader, item: ReadItem, planner: LoadPlanner) -> None:
        info = self.storage_data[item.storage_index]
        meta = cast(TensorStorageMetadata, self.index[item.storage_index.fqn])  # BYTE_IO: refused
        chunk = next(c for c in meta.chunks if c.offsets == item.storage_index.offset)
        target = planner.resolve_tensor(item).detach()
        dtype = meta.properties.dtype
        window = FileSlice(f, info.offset, info.length)
        with zipfile.ZipFile(window) as archive:
            names = [n for n in archive.namelist() if "/data/" in n and not n.endswith("/")]
            entry = archive.getinfo(names[0]) if len(names) == 1 else None
        if entry is None or entry.compress_type != zipfile.ZIP_STORED:
            raise UnsafeCheckpoint(f"checkpoint item {item.dest_index.fqn}: not one tensor")
        # The entry's bytes, read where they lie: zipfile's own reader goes through a bytes
        # object as large as the tensor.
        window.seek(entry.header_offset)
        header = window.read(30)
        name_length, extra_length = struct.unpack("<HH", header[26:30])
        start = info.offset + entry.header_offset + 30 + name_length + extra_length
        data = FileSlice(f, start, entry.file_size)
        self._copy_region(data, chunk.sizes, item, target, dtype)
        planner.commit_tensor(item, target)

    @staticmethod
    def _copy_region(data: Any, sizes, item: ReadItem, target: torch.Tensor, dtype) -> None:
        """The item's region of the stored chunk into `target`: read in place where the region
        is whole rows (a split along the first axis), else through one chunk-sized copy."""
        whole_rows = list(item.storage_offsets[1:]) == [0] * (len(sizes) - 1) and list(
            item.lengths[1:]
        ) == list(sizes[1:])
        row = math.prod(sizes[1:]) * torch.empty((), dtype=dtype).element_size()
        if whole_rows and target.dtype == dtype:
            data.seek(item.storage_offsets[0] * row if sizes else 0)
            staging = target if target.is_contiguous() and target.device.type == "cpu" else None
            into = staging if staging is not None else torch.empty(target.shape, dtype=dtype)
            _read_exact(data, into)
            if staging is None:
                target.copy_(into)
            return
        stored = torch.empty(tuple(sizes), dtype=dtype)
        _read_exact(data, stored)
        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
            stored = stored.narrow(dim, start, length)
        target.copy_(stored)


class TensorsOnly(DefaultLoadPlanner):
    """DCP's load planner, refusing pickled (non-tensor) items."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        raise UnsafeCheckpoint(
            f"checkpoint item {read_item.dest_index.fqn} is pickled data: refused"
        )
