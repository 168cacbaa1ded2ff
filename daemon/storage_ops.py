"""Genie's ops on a client's storages, run by the daemon's Executor (a mixin of it).

- genie::alias_storage: torch.load's rebuild of a checkpoint tensor as a view of a storage it
  uploaded (`t.set_(storage, offset, size, stride)`), checked to lie inside that storage.
- genie::storage_of: the whole storages behind torch.save of remote tensors, named so that
  tensors sharing one are written once.
- genie::resize_storage: `t.untyped_storage().resize_(n)` (FSDP2 frees and re-allocates).
- genie::copy_storage: copy.deepcopy, one copy of a storage per memo.
Every argument is checked; a malformed call is a ProtocolError for that request alone.
"""
from __future__ import annotations

import hashlib

import torch

from genie.transport.errors import ProtocolError
from genie.transport.protocol import (ALIAS_STORAGE_OP, COPY_STORAGE_OP, RESIZE_STORAGE_OP, STORAGE_OF_OP, HandleRef,
                                      OpCall)
from genie.transport.tensors import as_marked_view, check_shape, elements_spanned

from .handles import MAX_COPY_MEMOS, ClientState, held

MAX_STORAGE_BYTES = 1 << 62  # a resize beyond any memory is refused as malformed, before allocating


class StorageOps:
    """Handlers of the storage ops. The Executor provides `_storage_name_key` (a secret: storage
    names are not addresses) and `_enforce_limit` (the memory limit after a copy)."""

    def _alias_storage(self, client: ClientState, call: OpCall):
        """A tensor of `dtype`, `sizes`, `strides` at `offset` (elements) in the storage of one of
        this client's tensors, stored under the output handle: how torch.load's rebuild of a tensor
        from a storage it placed on the device (`t.set_(storage, offset, size, stride)`) runs here.
        aten::set_ itself stays refused (it can point at any storage); this names the client's own
        tensor and checks that the view lies inside its storage."""
        args = call.args
        if (len(args) != 5 or not isinstance(args[0], HandleRef) or not isinstance(args[1], torch.dtype)
                or type(args[2]) is not int or not _dims(args[3]) or not _dims(args[4])
                or len(args[3]) != len(args[4]) or type(call.outs) is not int):
            raise ProtocolError(f"{ALIAS_STORAGE_OP} takes [handle, dtype, offset, sizes, strides] and one output handle")
        source = held(client, args[0])
        dtype, offset, sizes, strides = args[1:]
        storage = source.untyped_storage()
        itemsize = torch.empty((), dtype=dtype).element_size()
        extent = elements_spanned(offset, sizes, strides)
        if offset < 0 or extent * itemsize > storage.nbytes():
            raise ProtocolError(f"{ALIAS_STORAGE_OP}: a view reaching element {extent} of {dtype} lies outside the "
                                f"{storage.nbytes()}-byte storage")
        tensor = torch.empty(0, dtype=dtype, device=source.device).set_(storage, offset, sizes, strides)
        client.put(call.outs, tensor)
        return tensor

    def _storage_of(self, client: ClientState, call: OpCall):
        """For each of the client's tensors named: its whole storage as a 1-D uint8 tensor, stored
        under the output handle given for it, reported with the storage's name (the same for every
        tensor sharing it; not its address), the tensor's storage offset and strides, and its
        conjugate and negative bits: torch.save of remote tensors writes each storage once and the
        tensors as views of it, as for CPU tensors. Several tensors in one call: one round trip
        for a whole state_dict."""
        outs = call.outs
        if (not call.args or not all(isinstance(a, HandleRef) for a in call.args) or type(outs) is not list
                or len(outs) != len(call.args)
                or any(type(o) is not list or len(o) != 5 or type(o[0]) is not int or any(x is not None for x in o[1:])
                       for o in outs)):
            raise ProtocolError(f"{STORAGE_OF_OP} takes handles and outputs [handle, None, None, None, None] for each")
        return [self._one_storage(client, ref, out[0]) for ref, out in zip(call.args, outs)]

    def _one_storage(self, client: ClientState, ref: HandleRef, out: int):
        source = held(client, ref)
        storage = source.untyped_storage()
        whole = torch.empty(0, dtype=torch.uint8, device=source.device).set_(storage, 0, (storage.nbytes(),), (1,))
        client.put(out, whole)
        name = hashlib.blake2b(f"{source.device}:{storage.data_ptr()}".encode(), key=self._storage_name_key,
                               digest_size=8).digest()
        # A conjugate or negative view's storage holds the unconjugated, unnegated values: its bits too.
        bits = [source.is_conj(), source.is_neg()]
        return whole, int.from_bytes(name, "little") >> 1, source.storage_offset(), list(source.stride()), bits

    def _resize_storage(self, client: ClientState, call: OpCall) -> None:
        """The client's `t.untyped_storage().resize_(n)`: its storage (shared with its views) gets n
        bytes, freed to 0 and allocated again as FSDP2 does with unsharded parameters; what it
        held is kept up to the smaller size, as PyTorch's resize keeps it."""
        args = call.args
        if (len(args) != 2 or not isinstance(args[0], HandleRef) or type(args[1]) is not int
                or not 0 <= args[1] <= MAX_STORAGE_BYTES or call.outs is not None):
            raise ProtocolError(f"{RESIZE_STORAGE_OP} takes [handle, 0 <= nbytes <= {MAX_STORAGE_BYTES}] and no output")
        held(client, args[0]).untyped_storage().resize_(args[1])
        client.recount(args[0].id)

    def _copy_storage(self, client: ClientState, call: OpCall, frames: list, device: torch.device):
        """copy.deepcopy of one of this client's tensors, as PyTorch copies a CPU one: the same
        view (offset, sizes, strides) of a copy of its whole storage, stored under the output
        handle. The second argument names the copy's memo (a handle the client frees when its
        deepcopy is over): tensors sharing a storage share one copy of it within one memo, so
        views of one another stay views of one another in the copy."""
        args = call.args
        if (len(args) != 2 or not isinstance(args[0], HandleRef) or not isinstance(args[1], HandleRef)
                or type(call.outs) is not int):
            raise ProtocolError(f"{COPY_STORAGE_OP} takes [handle, memo handle] and one output handle")
        source = held(client, args[0])
        memo = client.copy_memos.get(args[1].id)
        if memo is None:
            if args[1].id in client.tensors:
                raise ProtocolError(f"{COPY_STORAGE_OP}: handle {args[1].id} names a tensor, not a copy memo")
            if len(client.copy_memos) >= MAX_COPY_MEMOS:
                raise ProtocolError(f"a client may keep at most {MAX_COPY_MEMOS} copy memos at once; free some")
            memo = client.copy_memos[args[1].id] = {}
        storage = source.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        copied = memo.get(key)
        if copied is None:
            # The source storage is kept with its copy: its address names it while the memo lives.
            copied = memo[key] = (storage, storage.clone())
        copy = torch.empty(0, dtype=source.dtype, device=source.device).set_(
            copied[1], source.storage_offset(), source.shape, source.stride())
        # The copy is the same conjugate / negative view of the copy (the client then makes it a
        # plain tensor, as torch).
        copy = as_marked_view(copy, source.is_conj(), source.is_neg())
        client.put(call.outs, copy)
        self._enforce_limit(client, call)
        return copy



def _dims(value) -> bool:
    """A list of sizes or strides, within the bounds of any shape on the wire (tensors.check_shape)."""
    try:
        check_shape(value)
    except ProtocolError:
        return False
    return isinstance(value, list)
