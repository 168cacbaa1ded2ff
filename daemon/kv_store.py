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
"""
from __future__ import annotations

import re
import time

import torch

from genie.transport.errors import ProtocolError

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


class KVStore:
    def __init__(self, account) -> None:
        self.account = account
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
        return entry.views()

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
            self.evicted[session.id] = "least recently used session, evicted under memory pressure"
            freed += before - self.account.allocated
        return freed

    def stats(self) -> dict:
        return {"kv_sessions": len(self.sessions), "kv_bytes": sum(s.nbytes() for s in self.sessions.values()),
                "kv_evicted": len(self.evicted)}


def _others(t: torch.Tensor, dim: int) -> tuple:
    return tuple(s for i, s in enumerate(t.shape) if i != dim)
