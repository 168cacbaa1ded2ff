"""`model.to(...)`, `model.cpu()`, `model.half()` and `p.data = p.data.to(...)` keep a module's
Parameter objects, as for CUDA.

For CPU and CUDA tensors nn.Module._apply changes each parameter in place (`param.data = new`).
A remote tensor is another tensor type, so for it _apply either swaps the Python objects'
contents (torch.utils.swap_tensors, chosen for tensor subclasses) or makes new Parameters. Two
cases went wrong:
- `model.cpu()` of a remote model: a CPU result is no subclass, so each module got a new
  Parameter. Tied weights came apart (an embedding and its tied output layer then trained as
  two CPU copies) and an optimizer made before the move held parameters the model no longer had.
- `model.to("remote_accelerator")` while an autograd graph of an earlier forward is alive (a
  notebook's `loss` from a CPU run): swap_tensors refuses a tensor another holder references,
  so `.to()` failed with "_apply(): Couldn't swap Linear.weight".

Now a module that holds remote parameters converts them by swapping (PyTorch's own swap mode,
torch.__future__, turned on for this thread while that module converts), and a swap that
involves a remote tensor goes ahead when the only objection is such a reference, or weak
references to the parameter (torch.export leaves them on the model it exported: moving that
model failed). The holder keeps the old tensor and values. If the holder is an autograd graph, its backward would put
gradients on the old tensor, so that tensor's gradient accumulator raises instead, as
swap_tensors arranges when the graph's accumulator is the only holder. On CUDA the same
backward fails too (a CPU gradient for a CUDA parameter).

A swap also left behind the hooks registered on a parameter (they live on the C++ tensor) and
the attributes set on it (it exchanges the whole __dict__): both stay with the parameter. And a
lazy module's uninitialized parameters (nn.LazyLinear before its first forward) cannot become
remote tensors: they are made by that forward, on the CPU, and then moved as the module was asked.

`t.data = new` between a remote tensor and a CPU or CUDA one is refused by PyTorch ("incompatible
tensor type": it lets `.data` change type only between its own backends), so a property over
torch.Tensor.data does that move by the same swap; within one type it is PyTorch's C setter, and
torch.compile traces `.data` as before (it reads the attribute by name).
"""
from __future__ import annotations

import copyreg
import functools
import threading

import torch

from . import read_ahead, subclasses
from .lazy_tensor import OWN_STATE, LazyTensor

_state = threading.local()  # .swap: this thread is converting a module that holds remote parameters
_installed = False

_STALE_GRAPH = (
    "this autograd graph was built before its parameter moved to another device or dtype "
    "(module.to / .cpu / .half on remote_accelerator): run the forward again after moving the model")


def _holds_remote(module: torch.nn.Module) -> bool:
    return any(isinstance(p, LazyTensor) for p in module._parameters.values())


def _uninitialized(module: torch.nn.Module) -> list[tuple[dict, str]]:
    return [(table, key) for table in (module._parameters, module._buffers)
            for key, t in table.items() if torch.nn.parameter.is_lazy(t)]


def _defer_uninitialized(module: torch.nn.Module, fn) -> bool:
    """A lazy module's uninitialized parameters (nn.LazyLinear, ...) cannot become remote tensors:
    they stay as they are and `fn` is applied to them once its first forward has made them (on
    the CPU: the uninitialized ones know no device). Whether `fn` makes remote tensors is seen by
    applying it to an empty tensor."""
    pending = module.__dict__.get("_genie_after_init")
    if pending is None:
        with torch.no_grad():
            if not isinstance(fn(torch.empty(0)), LazyTensor):
                return False
        pending = module.__dict__["_genie_after_init"] = []

        def move_once_made(mod, args, kwargs=None):
            if _uninitialized(mod):
                return
            handle.remove()
            for later in mod.__dict__.pop("_genie_after_init", ()):
                mod._apply(later, recurse=False)

        # Registered after the module's own initializing hook, so it runs after it.
        handle = module.register_forward_pre_hook(move_once_made, with_kwargs=True)
    pending.append(fn)
    return True


def _wrap_apply(original):
    @functools.wraps(original)
    def _apply(self, fn, recurse=True):
        lazy = _uninitialized(self)
        deferred = [(table, key, table[key]) for table, key in lazy] if lazy and _defer_uninitialized(self, fn) else []
        for table, key, _ in deferred:
            table[key] = None  # skipped by _apply, which keeps None entries as they are
        before = getattr(_state, "swap", False)
        # Children set and restore their own mode; the module's own parameters convert after them.
        _state.swap = _holds_remote(self)
        try:
            with read_ahead.reading_module(self):
                return original(self, fn, recurse)
        finally:
            _state.swap = before
            for table, key, t in deferred:
                table[key] = t

    _apply._genie_wraps = original
    return _apply


def _wrap_swap_mode(original):
    @functools.wraps(original)
    def get_swap_module_params_on_conversion():
        return getattr(_state, "swap", False) or original()

    get_swap_module_params_on_conversion._genie_wraps = original
    return get_swap_module_params_on_conversion


def _poison_accumulator(t: torch.Tensor) -> None:
    if t.requires_grad and t.is_leaf:
        def refuse(grad_outputs):
            raise RuntimeError(_STALE_GRAPH)

        torch.autograd.graph.get_gradient_edge(t).node.register_prehook(refuse)


def _swap_held(t1: torch.Tensor, t2: torch.Tensor) -> None:
    """torch.utils.swap_tensors without its objection to other references to t1's tensor: they
    keep the old tensor (and t1's old gradient accumulator refuses to run)."""
    _poison_accumulator(t1)
    for name in ("__class__", "__dict__"):
        tmp = getattr(t1, name)
        setattr(t1, name, getattr(t2, name))
        setattr(t2, name, tmp)
    for slot in copyreg._slotnames(t1.__class__):  # both classes' slots are equal (checked first)
        has1, has2 = hasattr(t1, slot), hasattr(t2, slot)
        v1, v2 = getattr(t1, slot, None), getattr(t2, slot, None)
        if has2:
            setattr(t1, slot, v2)
        elif has1:
            delattr(t1, slot)
        if has1:
            setattr(t2, slot, v1)
        elif has2:
            delattr(t2, slot)
    torch._C._swap_tensor_impl(t1, t2)


def _keep_hooks(t: torch.Tensor) -> None:
    """Hooks registered on a tensor (register_hook, register_post_accumulate_grad_hook) live on its
    C++ tensor, which a swap replaces: registered again on the new one, as `param.data = new` keeps them."""
    for name in ("_backward_hooks", "_post_accumulate_grad_hooks"):
        hooks = getattr(t, name, None)
        if hooks:
            setattr(t, name, hooks)


def _keep_attributes(t: torch.Tensor, former: dict) -> None:
    """Attributes the program set on a parameter (p.my_flag = ..., as libraries mark parameters
    for their optimizers) stay with it, as `param.data = new` keeps them; a swap exchanges the
    whole __dict__, whose tensor state must come with the new contents."""
    for key, value in former.items():
        if key not in OWN_STATE and key not in t.__dict__:
            t.__dict__[key] = value


def _keep_class(t1: torch.Tensor, t2: torch.Tensor) -> None:
    """A parameter of the program's own subclass of nn.Parameter keeps its class across a move, as
    `param.data = new` keeps it on CUDA: nn.Module._apply wraps the moved tensor in a plain
    Parameter, whose class the swap gave t1 (t2 now has t1's former class)."""
    former = subclasses.program_class(t2) or type(t2)
    if type(t1) not in (LazyTensor, torch.nn.Parameter) or former in (LazyTensor, torch.nn.Parameter, torch.Tensor):
        return
    if isinstance(t1, LazyTensor):
        t1.__class__ = subclasses.remote_twin(former)
        subclasses.handle_out_of_dict(t1)
    else:
        t1.__class__ = former


# What swap_tensors objects to that a move to or from a remote device goes ahead despite: another
# reference to t1's tensor (an autograd graph), and weak references to either object (the
# weak-keyed caches torch.export leaves on a model's parameters: exporting a model and then moving
# it failed with "Couldn't swap Linear.weight"). A weak reference names the Python object, which
# after the swap holds the moved tensor, as after `param.data = new` on CUDA.
_HELD_OBJECTIONS = ("Expected use_count of t1", "Cannot swap t1 because it has weakref",
                    "Cannot swap t2 because it has weakref")


def _wrap_swap(original):
    @functools.wraps(original)
    def swap_tensors(t1, t2):
        remote = isinstance(t1, LazyTensor) or isinstance(t2, LazyTensor)
        twins = [t for t in (t1, t2) if subclasses.is_twin(t)]
        for t in twins:
            subclasses.handle_into_dict(t)
        try:
            original(t1, t2)
        except RuntimeError as e:
            # Checked before anything is swapped: the other reason (slots that differ) stands.
            if not (remote and str(e).startswith(_HELD_OBJECTIONS)
                    and set(copyreg._slotnames(t1.__class__)) == set(copyreg._slotnames(t2.__class__))):
                raise
            _swap_held(t1, t2)
        finally:
            for t in (t1, t2) if twins else ():
                if subclasses.is_twin(t):
                    subclasses.handle_out_of_dict(t)
        if remote:
            _keep_class(t1, t2)
            _keep_hooks(t1)
            _keep_attributes(t1, t2.__dict__)  # t2 now holds t1's former attributes

    swap_tensors._genie_wraps = original
    return swap_tensors


def _moves_across(t: torch.Tensor, new) -> bool:
    """Whether `t.data = new` crosses between the remote device and a device of PyTorch's own (a
    strided tensor on the CPU or CUDA), which PyTorch's setter refuses as another tensor type."""
    if not isinstance(new, torch.Tensor) or isinstance(t, LazyTensor) == isinstance(new, LazyTensor):
        return False
    local = t if isinstance(new, LazyTensor) else new
    return local.layout == torch.strided and local.device.type in ("cpu", "cuda")


def _move_by_data(t: torch.Tensor, new: torch.Tensor) -> None:
    """`t.data = new` across devices, as on CUDA: t, the same Python object, becomes a tensor
    sharing new's memory, keeping its class, requires_grad, hooks and attributes (the swap that
    model.to uses). Its gradient stays behind with the old tensor (on CUDA a gradient of the old
    device failed at the next backward)."""
    with torch.no_grad():
        alias = torch.Tensor.detach(new)
    if isinstance(t, torch.nn.Parameter):
        alias = torch.nn.Parameter(alias, requires_grad=t.requires_grad)
    elif t.requires_grad:
        alias.requires_grad_(True)
    torch.utils.swap_tensors(t, alias)


def _setting_data_across(set_data):
    """A `.data` setter that moves the tensor where `set_data` would refuse the other type."""
    def setter(t, new) -> None:
        if _moves_across(t, new):
            _move_by_data(t, new)
        else:
            set_data(t, new)

    return setter


def _install_data_setters() -> None:
    # torch.Tensor (so nn.Parameter and the program's subclasses) from the C getter and setter;
    # LazyTensor has its own setter, for a remote tensor given another remote one.
    plain = torch._C.TensorBase.__dict__["data"]
    torch.Tensor.data = property(plain.__get__, _setting_data_across(plain.__set__), doc=plain.__doc__)
    LazyTensor.data = property(LazyTensor.data.fget, _setting_data_across(LazyTensor.data.fset))


def install() -> None:
    global _installed
    if _installed:
        return
    _install_data_setters()
    torch.nn.Module._apply = _wrap_apply(torch.nn.Module._apply)
    torch.__future__.get_swap_module_params_on_conversion = _wrap_swap_mode(
        torch.__future__.get_swap_module_params_on_conversion)
    torch.utils.swap_tensors = _wrap_swap(torch.utils.swap_tensors)
    _installed = True
