"""LazyTensor: a `torch.Tensor` wrapper subclass living on `remote_accelerator:N`.

It holds no data, only metadata (shape, stride, offset, dtype) and a `HandleRef`
naming the real tensor on a daemon. Every ATen op on it reaches
`__torch_dispatch__` and is captured (see `capture`); reading its values
(`.cpu()`, `.item()`, `print`, `bool`, `.numpy()`, `.tolist()`) materializes.
"""
from __future__ import annotations

import collections
import copy
import functools
import heapq
import itertools
import operator
import weakref

import torch

from genie.runtime.stream import DeviceStream, HandleRef
from genie.transport.death_notes import DeathNotes
from genie.transport.protocol import RESIZE_STORAGE_OP
from genie.transport.tensors import as_marked_view

from .meta import CONJ, NEG, key_bits, meta_key, set_view_bits, view_bits


_NO_KWARGS: dict = {}
_TENSOR_DATA = torch._C.TensorBase.__dict__["data"]  # Tensor.data's C getter and setter
_UNTYPED_STORAGE = torch._C.TensorBase.untyped_storage
_BACKWARD_HOOKS = torch._C.TensorBase.__dict__["_backward_hooks"]  # its C getter and setter
# A remote tensor's own entries in its __dict__ (its daemon handle, torch's mark of a Parameter);
# the rest are attributes the program set.
OWN_STATE = frozenset({"_genie", "_is_param"})
_make_wrapper = torch.Tensor._make_wrapper_subclass

# The address of a remote tensor's (data-less) storage -> the handle of the daemon tensor whose
# storage it stands for, for each storage this process handed out (untyped_storage(), and so
# storage() / _typed_storage()) or registered: `set_(storage, ...)` (storage reads such as
# `storage.tolist()`, torch.jit.save's writer) is given a storage, the daemon needs a tensor.
# The storage object itself keeps that handle alive (`_genie_ref`), as a CPU storage keeps its
# memory after its tensors are gone.
_storage_owners: "weakref.WeakValueDictionary[int, HandleRef]" = weakref.WeakValueDictionary()


def storage_owner(storage: torch.UntypedStorage) -> HandleRef | None:
    return storage.__dict__.get("_genie_ref") or _storage_owners.get(storage._cdata)


class StorageIdentity:
    """What the handles of one storage on the daemon share here: views of one another (made by
    view ops, `t.set_(...)`, torch.load's tensors of one checkpoint storage, deepcopy's copies of
    views of one storage). Its stand-in address is what `untyped_storage().data_ptr()` and
    `data_ptr()` answer, with no round trip: equal exactly for tensors sharing a storage, as the
    CPU's are. It lives as long as one of them, and a later storage may get the same address, as
    freed memory is reused."""

    __slots__ = ("slot", "__weakref__")

    def __init__(self) -> None:
        self.slot = 0  # its address range, once asked for (see storage_address); 0: none yet


class _AddressSlots:
    """Numbers for the live storages whose address was asked for, the lowest free first, so that
    addresses stay below 2**63 as a pointer's (an address made from id() overflowed int64: a
    C consumer of data_ptr(), struct.pack('q', ...), refused it). No lock (a forked child could
    inherit one held): heappop, heappush, next() of a count and a dict's item set or pop are each
    one step under the GIL.

    A number comes back when its StorageIdentity dies, noted in C (transport/death_notes.py): a
    `__del__` ran Python at that moment, and a Ctrl-C landing in it was swallowed ("Exception
    ignored in __del__")."""

    def __init__(self) -> None:
        self._free: list[int] = []
        self._numbers = itertools.count(1)
        self._deaths = DeathNotes()  # slots whose StorageIdentity is watched

    def take(self) -> int:
        if self._deaths.dead:
            for slot in self._deaths.take_all():
                heapq.heappush(self._free, slot)
        try:
            return heapq.heappop(self._free)
        except IndexError:
            return next(self._numbers)

    def hold(self, slot: int, identity: StorageIdentity) -> None:
        """`slot` is `identity`'s until it dies."""
        self._deaths.watch(identity, slot)

    def release(self, slot: int) -> None:
        heapq.heappush(self._free, slot)


_address_slots = _AddressSlots()

# Each storage's stand-in addresses span this many bytes (more than one GPU's memory), so no two
# live storages' ranges overlap; 2**25 of them fit below 2**63.
STORAGE_SPAN = 1 << 38


def storage_identity(ref: HandleRef) -> StorageIdentity:
    """The identity of the storage behind `ref`, made on first use."""
    identity = ref.storage
    if identity is None:
        identity = ref.storage = StorageIdentity()
    return identity


def storage_address(ref: HandleRef) -> int:
    """A stand-in for the address of the storage behind `ref`: 0 for an empty one, as on the CPU.
    Nothing can read through it."""
    if ref.storage_nbytes == 0:
        return 0
    identity = storage_identity(ref)
    if not identity.slot:
        slot = _address_slots.take()
        if identity.slot:  # another thread was first
            _address_slots.release(slot)
        else:
            _address_slots.hold(slot, identity)
            identity.slot = slot
    return identity.slot * STORAGE_SPAN


def register_storage(t: "LazyTensor") -> None:
    """Make t's storage known to storage_owner (for C++ readers that get it without Python)."""
    _storage_owners[_UNTYPED_STORAGE(t)._cdata] = t._genie


_HOLDS_NO_TENSOR = frozenset({int, float, bool, str, bytes, type(None)})  # skipped in bulk by tensors_in


def tensors_in(value):
    """The tensors in `value`: itself, those in nested dicts, lists and tuples, and the parameters
    and buffers of modules among them (a tensor may come more than once). Each structure is walked
    once, one that holds itself too; a list of a million numbers takes ~0.05 s."""
    seen, stack = set(), [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, (dict, list, tuple)):
            if id(item) not in seen:
                seen.add(id(item))
                items = item.values() if isinstance(item, dict) else item
                stack.extend([x for x in items if type(x) not in _HOLDS_NO_TENSOR])
        elif isinstance(item, torch.nn.Module):
            stack.extend((*item.parameters(), *item.buffers()))


def resize_storage(ref: HandleRef, nbytes) -> None:
    """`t.untyped_storage().resize_(nbytes)` for a remote tensor: queued for the daemon, which
    resizes the storage (shared with t's views there); ops planned on t from now on see the new
    size. Views made before keep the size they had."""
    nbytes = operator.index(nbytes)
    if nbytes < 0:
        raise RuntimeError(f"resize_: the size must be at least 0, not {nbytes}")
    stream = ref.stream
    with stream.lock:
        stream.append([RESIZE_STORAGE_OP, [ref.wire, nbytes], {}, None])
        dtype, shape, stride, offset = ref.meta_key[:4]
        ref.storage_nbytes = nbytes
        ref.meta_key = meta_key(dtype, shape, stride, offset, nbytes, key_bits(ref.meta_key))


def _warn_compile_once() -> None:
    global _compile_warned
    if not _compile_warned:
        _compile_warned = True
        import warnings

        warnings.warn("torch.compile runs code on remote_accelerator tensors eagerly (Genie captures and "
                      "batches its ops); genie.graph records and replays a steady step", stacklevel=2)


_compile_warned = False


NO_DLPACK = ("a remote_accelerator tensor cannot be shared by DLPack: its memory is on the genie-daemon, "
             "not in this process. Copy it first: t.cpu() (or t.to('cuda') on a GPU host)")


def refuse_dlpack_export() -> None:
    """torch.utils.dlpack.to_dlpack (torch's C function, which reads the storage without dispatch)
    refuses remote tensors too, as their __dlpack__ does."""
    from torch.utils import dlpack

    export = dlpack.to_dlpack
    if getattr(export, "_genie", False):
        return

    def to_dlpack(tensor):
        if isinstance(tensor, LazyTensor):
            raise BufferError(NO_DLPACK)
        return export(tensor)

    to_dlpack.__doc__ = export.__doc__
    to_dlpack._genie = True
    dlpack.to_dlpack = to_dlpack


class OtherSubclassDecides(Exception):
    """An op's arguments include a tensor of another class with its own __torch_dispatch__ (a
    nested jagged tensor's dummy, ...): per PyTorch's protocol that class is asked next."""


def _dispatch(func, args, kwargs):
    # Replaced by genie.frontend.capture.dispatch when that module loads (it imports this one).
    from .capture import dispatch

    return dispatch(func, args, kwargs)


def _as_parameter_class(data, positional_requires_grad, requires_grad: bool | None):
    """`type(p)(data, requires_grad=...)`: a remote nn.Parameter is a LazyTensor marked as a
    parameter, so code that remakes a parameter by its class (accelerate's dispatch of a
    `device_map` over several devices, and others) calls this class as nn.Parameter's constructor,
    as it would call nn.Parameter on CUDA. It gets nn.Parameter's answer."""
    if data is not None and not isinstance(data, torch.Tensor):
        raise TypeError(f"LazyTensor(...) takes a tensor, as nn.Parameter does, not {type(data).__name__}: "
                        "remote tensors are made by ops on remote_accelerator")
    if positional_requires_grad is not None:
        requires_grad = positional_requires_grad
    return torch.nn.Parameter(data, True if requires_grad is None else requires_grad)


class LazyTensor(torch.Tensor):
    _genie: HandleRef

    @staticmethod
    def __new__(cls, stream: DeviceStream | torch.Tensor | None = None, handle_id: int | bool | None = None, shape=None,
                stride=None, offset: int = 0, dtype: torch.dtype | None = None, storage_nbytes: int = 0,
                requires_grad: bool | None = None):
        if not isinstance(stream, DeviceStream):
            return _as_parameter_class(stream, handle_id, requires_grad)
        t = torch.Tensor._make_wrapper_subclass(
            cls, shape, strides=stride, storage_offset=offset, dtype=dtype, device=stream.device,
            requires_grad=requires_grad is True, storage_size=storage_nbytes,
        )
        t._genie = ref = HandleRef(stream, handle_id, storage_nbytes)
        # Plans hand tuples of ints, equal (and equal-hashing) to torch.Size and t.stride(): no C++ round trips.
        ref.meta_key = (dtype, shape if isinstance(shape, tuple) else t.shape,
                        stride if isinstance(stride, tuple) else t.stride(), offset, storage_nbytes)
        return t

    @staticmethod
    def planned(stream: DeviceStream, handle_id: int, plan) -> "LazyTensor":
        """LazyTensor(...) for an output described by a cached plan (meta.NewTensor): the same
        tensor, without the class call and with the key worked out with the plan, and for a dense
        output (most) without strides and storage size, which torch then derives (0.7 us less per
        captured op, of ~10)."""
        if plan.dense:
            t = _make_wrapper(LazyTensor, plan.shape, dtype=plan.dtype, device=stream.device)
        else:
            t = _make_wrapper(LazyTensor, plan.shape, strides=plan.stride, storage_offset=plan.offset,
                              dtype=plan.dtype, device=stream.device, storage_size=plan.storage_nbytes)
            if plan.bits:
                set_view_bits(t, plan.bits)
        t._genie = ref = HandleRef(stream, handle_id, plan.storage_nbytes)
        ref.meta_key = plan.meta_key
        return t

    def _refresh_meta_key(self) -> None:
        """After an in-place metadata change (t_, resize via out=, ...)."""
        ref = self._genie
        ref.meta_key = meta_key(self.dtype, self.shape, self.stride(), self.storage_offset(), ref.storage_nbytes,
                                view_bits(self))

    # The default __torch_function__ costs far more than the op capture itself.
    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        try:
            return _dispatch(func, args, kwargs or _NO_KWARGS)
        except OtherSubclassDecides:
            return NotImplemented

    # Having these makes nn.Module._apply swap parameters in place (torch.utils.swap_tensors)
    # instead of creating new ones, so `module.to(device)` keeps tied weights tied.
    def __tensor_flatten__(self):
        return [], (self._genie,)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        # Reached by torch.compile, which rebuilds subclass tensors as fakes to trace them. A graph
        # break instead: compiled code runs its remote_accelerator parts eagerly, as on any
        # untraceable code (fullgraph=True and torch.export raise this explanation).
        from torch._dynamo.exc import unimplemented

        _warn_compile_once()
        unimplemented(
            gb_type="remote_accelerator tensor", context="genie.LazyTensor",
            explanation="torch.compile cannot trace remote_accelerator tensors: that code runs eagerly "
                        "(Genie captures and batches its ops anyway)",
            hints=["Record a steady step once with genie.graph and replay it for the lowest overhead.",
                   "torch.export: export the model while it is on CPU (or on meta tensors), then "
                   "move it to remote_accelerator."])

    def as_subclass(self, cls):
        # torch's refused any class but torch.Tensor: this tensor already has a Python object,
        # a LazyTensor. Genie gives the program's class a remote twin (frontend/subclasses.py).
        from .subclasses import as_subclass

        return as_subclass(self, cls)

    @property
    def data(self):
        return _TENSOR_DATA.__get__(self)

    @data.setter
    def data(self, new) -> None:
        # `t.data = new`: PyTorch copies new's metadata into t, but the remote tensor t names is
        # Genie's (`_genie`), which PyTorch does not know of: without this, t kept naming its old
        # values (a silent no-op, measured). t names its own alias of new's tensor instead.
        if not isinstance(new, LazyTensor):
            raise RuntimeError(f"cannot set the data of a {self.device} tensor to a tensor on {new.device}: "
                               f"move it first, e.g. t.data = new.to('{self.device}')")
        with torch.no_grad():
            alias = torch.Tensor.detach(new)  # a new handle on the daemon, sharing new's storage
        _TENSOR_DATA.__set__(self, alias)
        self._genie = alias._genie

    @property
    def _backward_hooks(self):
        return _BACKWARD_HOOKS.__get__(self)

    @_backward_hooks.setter
    def _backward_hooks(self, hooks) -> None:
        _BACKWARD_HOOKS.__set__(self, hooks)
        # torch.load's rebuild (_rebuild_tensor_v2) gives a checkpoint's conjugate or negative view
        # its bit with torch._C._set_tensor_metadata, on this wrapper only (no dispatch reaches
        # Genie: reads and ops on the daemon's tensor then ignored it, measured), and sets this
        # attribute next: the moment to make the daemon's tensor that view too. (The wrapper's
        # bits otherwise always equal those of the daemon's tensor, kept in its meta_key.)
        bits = view_bits(self)
        if bits != key_bits(self._genie.meta_key):
            self._view_bits_to_daemon(bits)

    def _view_bits_to_daemon(self, bits: int) -> None:
        set_view_bits(self, 0)  # as the daemon's tensor is: the views below are planned from it
        with torch.no_grad():
            view = as_marked_view(self, bool(bits & CONJ), bool(bits & NEG))
        set_view_bits(self, bits)
        self._genie = view._genie  # as `t.data = new`: this wrapper now names the view

    def data_ptr(self) -> int:
        """A stand-in for the address, as programs compare them (same memory? a copy or a view?):
        the stand-in address of its storage (`storage_address`) plus this tensor's byte offset in
        it, so views of one storage differ by their offsets, as addresses do, and a tensor covering
        its storage from the start has its storage's `data_ptr()`. Nothing can read through it; no
        round trip. An empty storage's is 0, as on the CPU."""
        if self._genie.storage_nbytes == 0:
            return 0
        return storage_address(self._genie) + self.storage_offset() * self.element_size()

    def untyped_storage(self):
        # A wrapper's storage has no memory, and PyTorch refuses its data_ptr(). Libraries read it
        # as the storage's identity: safetensors (shared tensors, save_model's `data_ptr() ==
        # storage.data_ptr()`) and Hugging Face's save_pretrained (tied weights) failed on remote
        # models. The daemon storage's stand-in address (storage_address) answers, as data_ptr()'s.
        storage = _UNTYPED_STORAGE(self)
        if "data_ptr" not in storage.__dict__:
            ref = self._genie
            storage.data_ptr = lambda: storage_address(ref)
            # resize_ (FSDP2 frees unsharded parameters with resize_(0) and allocates them again)
            # acts on the daemon's storage; the size read back is the one set. These hold the
            # handle, not the tensor: the storage object lives as long as the tensor does.
            storage.resize_ = functools.partial(resize_storage, ref)
            storage.nbytes = storage.size = lambda: ref.storage_nbytes
        storage._genie_ref = _storage_owners[storage._cdata] = self._genie
        return storage

    def _user_attributes(self) -> dict:
        """Attributes the program set on this tensor: not Genie's handle, nor torch's mark of an
        nn.Parameter (which deepcopy and pickling restore their own way)."""
        return {k: v for k, v in self.__dict__.items() if k not in OWN_STATE}

    def __deepcopy__(self, memo):
        # As PyTorch copies a tensor (Tensor.__deepcopy__, nn.Parameter.__deepcopy__), with the
        # copies made by the daemon: a Parameter is a clone of its data; any other tensor a view
        # of a copy of its storage shared by the deepcopy's copies of views of that storage,
        # with its grad and attributes copied too.
        if id(self) in memo:
            return memo[id(self)]
        if getattr(self, "_is_param", False):  # nn.Parameter(remote) is this class marked as one
            with torch.no_grad():
                new = torch.nn.Parameter(self.clone(), requires_grad=self.requires_grad)
            if type(new) is LazyTensor and type(self) is not LazyTensor:  # a subclass of nn.Parameter's
                from .subclasses import become

                become(new, type(self))
            memo[id(self)] = new
            return new
        if not self.is_leaf:  # torch's refusal, word for word
            raise RuntimeError(
                "Only Tensors created explicitly by the user (graph leaves) support the deepcopy protocol at the "
                "moment.  If you were attempting to deepcopy a module, this may be because of a "
                "torch.nn.utils.weight_norm usage, see https://github.com/pytorch/pytorch/pull/103001")
        from .transfers import copy_in_storage_copy

        new = copy_in_storage_copy(self, memo)
        if new.is_conj() or new.is_neg():  # as torch: a plain tensor of the view's values
            with torch.no_grad():
                new = new.resolve_conj().resolve_neg()
        new = self._in_program_class(new)
        if self.requires_grad:
            new.requires_grad_()
        if self.grad is not None:
            new.grad = copy.deepcopy(self.grad, memo)
        state = self._user_attributes()
        if state:
            new.__dict__.update(copy.deepcopy(state, memo))
        memo[id(self)] = new
        return new

    # ---------------------------------------------------------- materialization triggers

    def __repr__(self, *, tensor_contents=None) -> str:
        from .printing import remote_repr

        return remote_repr(self)

    def __format__(self, format_spec: str) -> str:
        if self.dim() == 0:
            return self.detach().item().__format__(format_spec)
        return format(repr(self), format_spec)

    def numpy(self, *, force: bool = False):
        from .materialize import to_cpu

        if self.requires_grad and not force:  # torch's own refusal, before anything is fetched
            raise RuntimeError("Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() instead.")
        return to_cpu(self).numpy()

    def tolist(self):
        from .materialize import to_cpu

        return to_cpu(self).tolist()

    def __array__(self, dtype=None, copy=None):
        arr = self.numpy()
        return arr.astype(dtype, copy=False) if dtype is not None else arr

    # DLPack shares memory within one process, and a remote tensor's memory is on the daemon:
    # torch's own export gave a capsule with a null data pointer (torch.utils.dlpack.from_dlpack
    # of it made a tensor over address 0). Refused, saying what to do (as torch refuses devices
    # DLPack has no type for).
    def __dlpack__(self, *args, **kwargs):
        raise BufferError(NO_DLPACK)

    def __dlpack_device__(self):
        raise BufferError(NO_DLPACK)

    def __reduce_ex__(self, protocol):
        # torch.save / pickling of a remote tensor stores its values, fetched now, as a CPU tensor
        # (a checkpoint loads anywhere; map_location puts it back on a device). Tensors sharing a
        # storage on the daemon share one in the checkpoint, as torch.save keeps views of CPU and
        # CUDA tensors (see serialization.cpu_for_saving).
        from .serialization import cpu_for_saving

        values = cpu_for_saving(self)
        state = self._user_attributes()  # saved with it, as torch.save keeps them
        if getattr(self, "_is_param", False):  # nn.Parameter(remote) is this class marked as one
            if state:
                return torch._utils._rebuild_parameter_with_state, (
                    values.detach(), self.requires_grad, collections.OrderedDict(), state)
            return torch._utils._rebuild_parameter, (values.detach(), self.requires_grad, collections.OrderedDict())
        values = self._in_program_class(values)  # a CPU Boxes saves as one: it loads as one
        if state:
            values.__dict__.update(state)
        return values.__reduce_ex__(protocol)

    def _in_program_class(self, t: torch.Tensor) -> torch.Tensor:
        """`t` as an instance of this tensor's own class of the program's, if it has one (this is
        then its remote twin, frontend/subclasses.py)."""
        from .subclasses import program_class

        cls = program_class(self)
        return t if cls is None else t.as_subclass(cls)

    @property
    def genie_handle(self) -> int:
        return self._genie.id
