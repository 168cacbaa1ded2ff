"""Explicit KV-cache sessions on a daemon, for serving code.

    session = genie.KVSession("remote_accelerator:0")      # or KVSession.resume(session_id)
    k_all, v_all = session.append(layer, k_new, v_new, dim=2)

The daemon keeps each layer's keys and values in a buffer that grows in place
(see genie_daemon.kv_store); `append` returns views of everything cached so far
without moving the cache anywhere. A session outlives the connection that
created it: after a reconnect, `KVSession.resume(id)` picks it up. A session
evicted under memory pressure raises RemoteExecutionError saying so.
"""
from __future__ import annotations

import secrets

import torch

from genie import errors as genie_errors
from genie.runtime import get_runtime
from genie.transport.protocol import KV_APPEND_OP, KV_CLOSE_OP, KV_GET_OP

from . import capture
from .lazy_tensor import LazyTensor

CHUNK = 256  # must match genie_daemon.kv_store.CHUNK: the client mirrors the buffers' capacity


def _capacity(length: int) -> int:
    return max(CHUNK, -(-length // CHUNK) * CHUNK)


class KVSession:
    def __init__(self, device="remote_accelerator:0", session_id: str | None = None) -> None:
        d = torch.device(device)
        self.stream = get_runtime().stream(d.index)
        self.id = session_id or secrets.token_hex(16)
        self._resumed = session_id is not None  # layers may already exist on the daemon
        self._layers: dict[int, tuple[tuple[int, ...], int, torch.dtype]] = {}  # layer -> (shape, dim, dtype)

    @classmethod
    def resume(cls, session_id: str, device="remote_accelerator:0") -> "KVSession":
        return cls(device, session_id)

    def _views(self, shape, dim, dtype, handles):
        capacity = _capacity(shape[dim])
        buffer_shape = list(shape)
        buffer_shape[dim] = capacity
        strides, acc = [], 1
        for s in reversed(buffer_shape):
            strides.append(acc)
            acc *= max(s, 1)
        strides = tuple(reversed(strides))
        nbytes = acc * dtype.itemsize
        return tuple(LazyTensor(self.stream, h, shape, strides, 0, dtype, nbytes) for h in handles)

    def append(self, layer: int, key: torch.Tensor, value: torch.Tensor, dim: int = -2):
        """Add `key`/`value` (same shape) along `dim`; returns the whole cached (keys, values)."""
        if key.shape != value.shape:
            raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must have one shape")
        dim = dim % key.dim()
        known = self._layers.get(layer)
        if known is None and self._resumed:
            try:
                self.get(layer)  # a resumed session: learn the cached length first
                known = self._layers[layer]
            except genie_errors.RemoteExecutionError:
                known = None  # this layer is new
        shape = list(key.shape)
        if known is not None:
            shape[dim] += known[0][dim]
        shape = tuple(shape)
        s = self.stream
        with s.lock:
            handles = (s.new_handle(), s.new_handle())
            outs = self._views(shape, dim, key.dtype, handles)
            s.append([KV_APPEND_OP, [self.id, layer, *capture.encode_call([key, value], {}, s)[0], dim], {},
                      list(handles)])
        self._layers[layer] = (shape, dim, key.dtype)
        return outs

    def get(self, layer: int):
        """The cached (keys, values) of a layer, as the daemon holds them."""
        s = self.stream
        with s.lock:
            handles = [s.new_handle(), s.new_handle(), None]
        k, v, dim = capture._from_report(s.run_reported([KV_GET_OP, [self.id, layer], {}, handles]), s)
        self._layers[layer] = (tuple(k.shape), dim, k.dtype)
        return k, v

    def close(self) -> None:
        s = self.stream
        with s.lock:
            s.append([KV_CLOSE_OP, [self.id], {}, None])
        self._layers.clear()

    def has_layer(self, layer: int) -> bool:
        return layer in self._layers

    def update(self, layer: int, key, value):
        """Adapter for models that take a cache object: append along the sequence axis (dim 2)."""
        return self.append(layer, key, value, dim=2)

