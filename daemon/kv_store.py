"""The daemon's KV-cache store: key/value tensors by (session, layer), grown in place.

A session belongs to no client: a client that reconnects resumes it by id
(session ids are 128-bit random capabilities chosen by the client). Each layer
keeps one preallocated buffer per key and value; an append writes the new
positions in place and hands out a view of the filled part, so a decode step
costs O(new tokens), not O(context). Capacity grows in CHUNK-sized steps along
the sequence axis, a rule the client mirrors to know every view's strides.
Under memory pressure the least recently used sessions not touched by the
running request are evicted; using an evicted session raises an error that
says so, never silent garbage.

With a directory (`genie-daemon --kv-dir`), every append is also written there
(`KVDisk`), so a session survives the daemon itself: after a crash or restart
its next use loads it back, and an evicted session reloads instead of failing.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time

import torch

from genie.transport.errors import ProtocolError
from genie.transport.tensors import dtype_name, parse_dtype

CHUNK = 256  # sequence positions added to a buffer at a time
SESSION_ID = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")


def capacity_for(length: int) -> int:
    return max(CHUNK, -(-length // CHUNK) * CHUNK)


class KVSessionEvicted(RuntimeError):
    pass


class _Layer:
    __slots__ = ("k", "v", "length", "dim")

    def __init__(self, k: torch.Tensor, v: torch.Tensor, length: int, dim: int) -> None:
        self.k, self.v, self.length, self.dim = k, v, length, dim

    def views(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k.narrow(self.dim, 0, self.length), self.v.narrow(self.dim, 0, self.length)


class _Session:
    def __init__(self, sid: str) -> None:
        self.id = sid
        self.layers: dict[int, _Layer] = {}
        self.last_used = time.monotonic()
        self.stamp = 0  # request counter when last used

    def nbytes(self) -> int:
        return sum(l.k.untyped_storage().nbytes() + l.v.untyped_storage().nbytes() for l in self.layers.values())


class KVDisk:
    """Sessions on disk: per layer, keys and values as raw bytes with the sequence axis first
    (so an append is an append to the file) and a small JSON record written after the bytes.
    Only the length in the record counts, so bytes of an append cut short by a crash are ignored.
    Nothing read back is executed or unpickled: dtype names and shapes are checked like wire input."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)

    def _dir(self, sid: str) -> str:
        return os.path.join(self.root, sid)  # sid matched SESSION_ID: no separators, no dots

    def append(self, sid: str, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, dim: int, length: int) -> None:
        d = self._dir(sid)
        os.makedirs(d, exist_ok=True)
        for name, t in (("k", k_new), ("v", v_new)):
            data = t.detach().movedim(dim, 0).contiguous().cpu()
            with open(os.path.join(d, f"{layer}.{name}"), "ab") as f:
                f.write(memoryview(data.view(torch.uint8).numpy()) if data.numel() else b"")
        record = {"dtype": dtype_name(k_new.dtype), "others": list(_others(k_new, dim)), "dim": dim, "length": length,
                  "device": str(k_new.device)}
        tmp = os.path.join(d, f"{layer}.json.tmp")
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, os.path.join(d, f"{layer}.json"))

    def has(self, sid: str) -> bool:
        return os.path.isdir(self._dir(sid))

    def load(self, sid: str):
        """{layer: (keys, values, dim, length)} with the sequence axis back in place (CPU tensors)."""
        d, layers = self._dir(sid), {}
        for entry in os.listdir(d):
            if not entry.endswith(".json") or not entry[:-5].isdigit():
                continue
            layer = int(entry[:-5])
            with open(os.path.join(d, entry)) as f:
                record = json.load(f)
            dtype, dim, length = parse_dtype(record.get("dtype")), record.get("dim"), record.get("length")
            others = record.get("others")
            if (type(dim) is not int or type(length) is not int or length < 0 or not isinstance(others, list)
                    or not all(type(x) is int and x >= 0 for x in others) or not 0 <= dim <= len(others)):
                raise ValueError(f"KV session {sid} layer {layer}: bad record on disk")
            shape = [length, *others]
            tensors = []
            for name in ("k", "v"):
                count = length * dtype.itemsize
                for x in others:
                    count *= x
                with open(os.path.join(d, f"{layer}.{name}"), "rb") as f:
                    raw = f.read(count)
                if len(raw) != count:
                    raise ValueError(f"KV session {sid} layer {layer}: {len(raw)} bytes on disk, expected {count}")
                flat = torch.frombuffer(bytearray(raw), dtype=dtype) if count else torch.empty(0, dtype=dtype)
                tensors.append(flat.reshape(shape).movedim(0, dim))
            layers[layer] = (*tensors, dim, length, record.get("device"))
        return layers

    def remove(self, sid: str) -> None:
        shutil.rmtree(self._dir(sid), ignore_errors=True)


class KVStore:
    def __init__(self, account, disk: KVDisk | None = None, devices: list[torch.device] | None = None) -> None:
        self.account = account
        self.disk = disk
        self.devices = devices or [torch.device("cpu")]  # where sessions loaded from disk may go
        self.sessions: dict[str, _Session] = {}
        self.evicted: dict[str, str] = {}
        self.request_stamp = 0

    def begin_request(self) -> None:
        self.request_stamp += 1

    # ------------------------------------------------------------ operations

    def _session(self, sid, create: bool) -> _Session:
        if not isinstance(sid, str) or not SESSION_ID.match(sid):
            raise ProtocolError(f"bad KV session id {sid!r}")
        if sid in self.evicted:
            raise KVSessionEvicted(f"KV session {sid} was evicted: {self.evicted[sid]}")
        session = self.sessions.get(sid)
        if session is None and self.disk is not None and self.disk.has(sid):
            session = self._load(sid)
        if session is None:
            if not create:
                raise KeyError(f"KV session {sid} does not exist on this daemon")
            session = self.sessions[sid] = _Session(sid)
        session.last_used = time.monotonic()
        session.stamp = self.request_stamp
        return session

    def append(self, sid, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, dim: int):
        if type(layer) is not int or layer < 0 or type(dim) is not int:
            raise ProtocolError("kv_append takes an integer layer and dim")
        if k_new.shape != v_new.shape or k_new.dim() == 0:
            raise ValueError(f"key {tuple(k_new.shape)} and value {tuple(v_new.shape)} must have one shape")
        dim = dim % k_new.dim()
        session = self._session(sid, create=True)
        entry = session.layers.get(layer)
        new = k_new.shape[dim]
        if entry is None:
            entry = session.layers[layer] = _Layer(*self._alloc(k_new, dim, capacity_for(new)), 0, dim)
        elif entry.dim != dim or _others(entry.k, dim) != _others(k_new, dim):
            raise ValueError(f"KV session {sid} layer {layer}: appended shape {tuple(k_new.shape)} does not "
                             f"match the cache {tuple(entry.k.shape)} along dim {dim}")
        if entry.length + new > entry.k.shape[dim]:
            self._grow(entry, capacity_for(entry.length + new))
        entry.k.narrow(dim, entry.length, new).copy_(k_new)
        entry.v.narrow(dim, entry.length, new).copy_(v_new)
        entry.length += new
        if self.disk is not None:
            self.disk.append(sid, layer, k_new, v_new, dim, entry.length)
        return entry.views()

    def _load(self, sid: str) -> _Session:
        session = self.sessions[sid] = _Session(sid)
        by_name = {str(d): d for d in self.devices}
        for layer, (k, v, dim, length, device) in self.disk.load(sid).items():
            target = by_name.get(device, self.devices[0])  # recorded as str(device); else the first device
            kb, vb = self._alloc(k.to(target), dim, capacity_for(length))
            kb.narrow(dim, 0, length).copy_(k)
            vb.narrow(dim, 0, length).copy_(v)
            session.layers[layer] = _Layer(kb, vb, length, dim)
        return session

    def get(self, sid, layer: int):
        """(keys, values, sequence dim) of a layer."""
        entry = self._session(sid, create=False).layers.get(layer)
        if entry is None:
            raise KeyError(f"KV session {sid} has no layer {layer}")
        return (*entry.views(), entry.dim)

    def close(self, sid) -> None:
        session = self.sessions.pop(sid, None)
        if session is not None:
            self._release(session)
        if self.disk is not None and isinstance(sid, str) and SESSION_ID.match(sid):
            self.disk.remove(sid)

    # ------------------------------------------------------------ memory

    def _alloc(self, like: torch.Tensor, dim: int, capacity: int):
        shape = list(like.shape)
        shape[dim] = capacity
        k = torch.zeros(shape, dtype=like.dtype, device=like.device)
        v = torch.zeros(shape, dtype=like.dtype, device=like.device)
        for t in (k, v):
            self.account.add(*self.account.key_of(t))
        return k, v

    def _grow(self, entry: _Layer, capacity: int) -> None:
        k, v = self._alloc(entry.k, entry.dim, capacity)
        k.narrow(entry.dim, 0, entry.length).copy_(entry.k.narrow(entry.dim, 0, entry.length))
        v.narrow(entry.dim, 0, entry.length).copy_(entry.v.narrow(entry.dim, 0, entry.length))
        for t in (entry.k, entry.v):
            self.account.remove(self.account.key_of(t)[0])
        entry.k, entry.v = k, v

    def _release(self, session: _Session) -> None:
        for entry in session.layers.values():
            for t in (entry.k, entry.v):
                self.account.remove(self.account.key_of(t)[0])
        session.layers.clear()

    def evict_for(self, nbytes: int) -> int:
        """Evict least recently used sessions idle in this request until `nbytes` are freed (or none is left)."""
        freed = 0
        idle = sorted((s for s in self.sessions.values() if s.stamp != self.request_stamp),
                      key=lambda s: s.last_used)
        for session in idle:
            if freed >= nbytes:
                break
            before = self.account.allocated
            self._release(session)
            del self.sessions[session.id]
            if self.disk is None:  # with a disk copy, the next use loads it back instead
                self.evicted[session.id] = "least recently used session, evicted under memory pressure"
            freed += before - self.account.allocated
        return freed

    def stats(self) -> dict:
        return {"kv_sessions": len(self.sessions), "kv_bytes": sum(s.nbytes() for s in self.sessions.values()),
                "kv_evicted": len(self.evicted)}


def _others(t: torch.Tensor, dim: int) -> tuple:
    return tuple(s for i, s in enumerate(t.shape) if i != dim)
