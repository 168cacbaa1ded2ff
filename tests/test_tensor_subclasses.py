"""The program's own tensor subclasses on a remote device, compared with what the same code does
on the CPU (and on CUDA): `.to(device)` keeps the class, ops keep it as the class decides, and the
way back gives the class on the CPU. The three kinds of class below are the usual ones: a plain
subclass, a torchvision-tv_tensors-like one (ops unwrap to plain tensors, a few keep the class and
its metadata), and a MONAI-MetaTensor-like one (metadata copied through the whole __dict__)."""
import copy
import gc
import io

import pytest
import torch
from torch._C import DisableTorchFunctionSubclass

import genie
from genie.errors import UnsupportedOperationError


class Tagged(torch.Tensor):
    pass


_KEEPS_CLASS = {torch.Tensor.clone, torch.Tensor.to, torch.Tensor.detach, torch.Tensor.requires_grad_}


class Boxes(torch.Tensor):
    """As torchvision's tv_tensors: most ops give plain tensors, a few keep the class and its format."""

    @classmethod
    def wrap(cls, t, *, fmt):
        out = t.as_subclass(cls)
        out.fmt = fmt
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if not all(issubclass(cls, t) for t in types):
            return NotImplemented
        with DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if func in _KEEPS_CLASS and isinstance(args[0], cls):
            return cls.wrap(out, fmt=args[0].fmt)
        if isinstance(out, cls):
            return out.as_subclass(torch.Tensor)
        return out


class WithMeta(torch.Tensor):
    """As MONAI's MetaTensor: each result takes its input's metadata by replacing its whole __dict__."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        ret = super().__torch_function__(func, types, args, kwargs)
        source = next((a for a in args if isinstance(a, WithMeta)), None)
        if isinstance(ret, WithMeta) and source is not None and ret is not source:
            ret.__dict__ = dict(source.__dict__)
        return ret


def _plain(t):
    return t.as_subclass(torch.Tensor)


def test_a_plain_subclass_moves_and_keeps_its_class_through_ops(dev):
    cpu = torch.arange(6.0).reshape(2, 3).as_subclass(Tagged)
    remote = cpu.to(dev)
    assert isinstance(remote, Tagged) and type(remote).__name__ == "Tagged" and remote.device.type == "remote_accelerator"
    results = {"add": (remote + 1, cpu + 1), "sum": (remote.sum(), cpu.sum()), "index": (remote[0], cpu[0]),
               "t": (remote.t(), cpu.t()), "cat": (torch.cat([remote, remote]), torch.cat([cpu, cpu])),
               "mixed": (remote + torch.ones(2, 3, device=dev), cpu + torch.ones(2, 3))}
    for name, (r, c) in results.items():
        assert isinstance(r, Tagged) and r.device.type == "remote_accelerator", name
        back = r.cpu()
        assert type(back) is Tagged and back.device.type == "cpu", name  # the program's class, not the twin
        assert torch.equal(_plain(back), _plain(c)), name
    assert remote.tolist() == cpu.tolist()
    assert repr(remote).startswith("Tagged([[0., 1., 2.],") and "device='remote_accelerator:0'" in repr(remote)


def test_in_place_ops_and_autograd_on_a_subclass(dev):
    t = torch.arange(6.0).as_subclass(Tagged).to(dev)
    assert t.add_(1) is t and isinstance(t, Tagged)
    t.mul_(2)
    assert t.tolist() == [2.0, 4.0, 6.0, 8.0, 10.0, 12.0]
    w = torch.arange(3.0).as_subclass(Tagged).to(dev).requires_grad_()
    (w * w).sum().backward()
    assert w.is_leaf and isinstance(w, Tagged) and w.grad.tolist() == [0.0, 2.0, 4.0]


def test_a_tv_tensors_like_class_keeps_its_metadata_both_ways(dev):
    boxes = Boxes.wrap(torch.tensor([[0.0, 0.0, 4.0, 4.0]]), fmt="XYXY")
    target = {"boxes": boxes, "labels": torch.tensor([3])}
    moved = {k: v.to(dev) for k, v in target.items()}  # as a detection training loop moves its targets
    assert type(moved["boxes"]).__name__ == "Boxes" and moved["boxes"].fmt == "XYXY"
    assert isinstance(moved["boxes"], Boxes) and moved["boxes"].device.type == "remote_accelerator"
    scaled = moved["boxes"] * 2  # unwrapped to a plain tensor, as on the CPU
    assert not isinstance(scaled, Boxes) and type(boxes * 2) is torch.Tensor
    assert moved["boxes"].clone().fmt == "XYXY"
    back = moved["boxes"].to("cpu")
    assert type(back) is Boxes and back.fmt == "XYXY" and _plain(back).tolist() == [[0.0, 0.0, 4.0, 4.0]]


def test_metadata_copied_through_the_whole_dict_does_not_carry_the_remote_tensor(dev):
    # Such a class hands every result its input's __dict__: the daemon tensor a result names
    # must stay its own (its handle is not in __dict__).
    image = torch.arange(4.0).as_subclass(WithMeta)
    image.meta = {"spacing": 1.5}
    remote = image.to(dev)
    out = remote * 2 + 1
    assert type(out).__name__ == "WithMeta" and out.meta == {"spacing": 1.5}
    assert out.tolist() == [1.0, 3.0, 5.0, 7.0] and remote.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_subclass_parameters_and_buffers_move_with_their_module(dev):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.arange(4.0).as_subclass(Tagged))
            self.register_buffer("offset", torch.ones(4).as_subclass(Tagged))

        def forward(self, x):
            return x * self.w + self.offset

    net = Net()
    w = net.w
    net.to(dev)
    assert net.w is w and isinstance(net.w, Tagged) and isinstance(net.w, torch.nn.Parameter)
    assert isinstance(net.offset, Tagged) and net.offset.device.type == "remote_accelerator"
    y = net(torch.ones(4, device=dev))
    y.sum().backward()
    torch.optim.SGD(net.parameters(), lr=0.5).step()
    assert y.tolist() == [1.0, 2.0, 3.0, 4.0] and net.w.tolist() == [-0.5, 0.5, 1.5, 2.5]
    net.cpu()
    assert net.w is w and type(net.w) is Tagged and net.w.device.type == "cpu"
    assert net.w.tolist() == [-0.5, 0.5, 1.5, 2.5] and type(net.offset) is Tagged


def test_checkpoints_and_deepcopy_keep_the_class(dev):
    remote = torch.arange(3.0).as_subclass(Tagged).to(dev)
    remote.note = "kept"
    buf = io.BytesIO()
    torch.save(remote, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded) is Tagged and loaded.device.type == "cpu" and loaded.note == "kept"
    buf.seek(0)
    onto = torch.load(buf, weights_only=False, map_location=dev)
    assert isinstance(onto, Tagged) and onto.device.type == "remote_accelerator" and onto.tolist() == [0.0, 1.0, 2.0]
    twin = copy.deepcopy(remote)
    assert isinstance(twin, Tagged) and twin.device.type == "remote_accelerator" and twin.note == "kept"
    twin.add_(1)
    assert remote.tolist() == [0.0, 1.0, 2.0] and twin.tolist() == [1.0, 2.0, 3.0]


def test_handles_of_subclass_tensors_go_with_them(dev):
    from genie.frontend import subclasses

    gc.collect()
    before = len(subclasses._handles)
    for _ in range(20):
        x = torch.ones(8).as_subclass(Tagged).to(dev) * 2
    del x
    gc.collect()
    assert len(subclasses._handles) == before


def test_a_subclass_with_its_own_dispatch_is_refused(dev):
    class Wrapper(torch.Tensor):
        @staticmethod
        def __new__(cls, x):
            return torch.Tensor._make_wrapper_subclass(cls, x.shape, dtype=x.dtype)

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError

    with pytest.raises(UnsupportedOperationError, match="its own __torch_dispatch__"):
        torch.ones(2, device=dev).as_subclass(Wrapper)
    with pytest.raises(TypeError, match="subclass of torch.Tensor"):
        torch.ones(2, device=dev).as_subclass(int)
    assert type(torch.ones(2, device=dev).as_subclass(torch.Tensor)) is genie.frontend.lazy_tensor.LazyTensor


class MarkedParameter(torch.nn.Parameter):
    """A parameter class of the program's own (as some optimizers and quantizers find theirs)."""


def test_a_parameter_subclass_keeps_its_class_and_identity_across_moves(dev):
    net = torch.nn.Linear(3, 2)
    net.weight = MarkedParameter(net.weight.detach().clone())
    weight = net.weight
    net.to(dev)
    assert net.weight is weight and isinstance(net.weight, MarkedParameter) and net.weight.device.type == "remote_accelerator"
    assert isinstance(net.weight, torch.nn.Parameter) and type(net.weight).__name__ == "MarkedParameter"
    net(torch.ones(1, 3, device=dev)).sum().backward()
    before = net.weight.cpu()
    torch.optim.SGD(net.parameters(), lr=1.0).step()
    assert torch.equal(net.weight.cpu(), before - 1.0)  # its gradient: ones
    copied = copy.deepcopy(net)
    assert isinstance(copied.weight, MarkedParameter) and copied.weight.tolist() == net.weight.tolist()
    net.half().cpu()
    assert net.weight is weight and type(net.weight) is MarkedParameter
    assert net.weight.dtype == torch.float16 and net.weight.device.type == "cpu"
