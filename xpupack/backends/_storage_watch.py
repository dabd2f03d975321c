"""Whether a module still holds the storages that compiled code or a recording reads (graph, AOTInductor)."""

from __future__ import annotations

from operator import is_

import torch
from torch import nn

from .._torch_compat import data_ptrs_equal as _ptrs_equal
from ..distributed import is_dtensor

_data_ptr = torch.Tensor.data_ptr


class StorageWatch:
    """Tells, in microseconds, whether a module still holds the storage a recording reads.

    Two kinds of change make a recording stale: a parameter, buffer or submodule
    object replaced (``module.weight = nn.Parameter(...)``,
    ``load_state_dict(assign=True)``), caught by an identity check of every
    entry, and a tensor's storage swapped (``.to()``, ``.half()``,
    ``param.data = ...``), caught by comparing storage addresses. The watch
    keeps the recorded storages alive, so no new tensor can ever reuse one of
    those addresses: an unchanged address really is the recorded memory, with
    the recorded dtype and shape. It installs no hook anywhere: a process-wide
    module hook is traced by anyone's ``torch.compile`` and makes it recompile.
    """

    def __init__(self, module: nn.Module):
        entries = []
        for submodule in module.modules():
            for table in (submodule._parameters, submodule._buffers, submodule._modules):
                entries += [(table, name, value) for name, value in table.items() if value is not None]
        # three parallel lists, so that `changed` runs its loops in C (map) on every call
        self.tables = [table for table, _, _ in entries]
        self.names = [name for _, name, _ in entries]
        self.values = [value for _, _, value in entries]
        self.tensors = [value for value in self.values if isinstance(value, torch.Tensor)]
        self.pinned = [tensor.detach() for tensor in self.tensors]
        self.addresses = [tensor.data_ptr() for tensor in self.tensors]
        self.indices = list(range(len(self.tensors)))
        # a DTensor's own address is 0 and ``.to()`` swaps its shard in place: its local shard is watched
        self.shards = [
            (tensor, tensor._local_tensor, tensor._local_tensor.data_ptr())  # type: ignore[attr-defined]
            for tensor in self.tensors
            if is_dtensor(tensor)
        ]
        self.pinned += [shard for _, shard, _ in self.shards]

    def changed(self) -> bool:
        if not all(map(is_, map(dict.get, self.tables, self.names), self.values)):  # type: ignore[arg-type]
            return True
        for tensor, shard, address in self.shards:
            if tensor._local_tensor is not shard or shard.data_ptr() != address:  # type: ignore[attr-defined]
                return True
        if _ptrs_equal is not None:
            return not _ptrs_equal(self.tensors, self.addresses, self.indices)
        return list(map(_data_ptr, self.tensors)) != self.addresses
