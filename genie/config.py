"""Every GENIE_* environment variable is read here, and only here.

GENIE_SERVER_URL      comma-separated daemon endpoints (tcp://host:port or ipc:///path);
                      unset: start an embedded local daemon on first use.
GENIE_CONNECT_TIMEOUT seconds to wait for a daemon's hello (default 60: an embedded
                      daemon has to import torch first).
GENIE_REQUEST_TIMEOUT seconds a blocking materialization may wait (default 600).
GENIE_BATCH_OPS       ops queued per device before a batch is sent without waiting
                      for a materialization (default 32; up to 8x that while many
                      sent batches are unanswered).
GENIE_BATCH_BYTES     inline payload bytes queued before such a send (default 8 MiB).
GENIE_MAX_INFLIGHT_MB payload MiB sent to one daemon and not yet acknowledged before
                      further sends wait (backpressure; default 256).
GENIE_FRAME_MB        payloads larger than this MiB are sent as several frames (default 1024).
GENIE_BULK_MIN_KB     payloads of at least this many KiB go over the daemon's bulk lane, a
                      plain stream socket beside ZeroMQ (default 1024; 0: never).
GENIE_SEALED_MIN_KB   with CURVE, payloads of at least this many KiB go over the sealed bulk lane
                      instead of inside ZeroMQ messages (default 128; 0 turns that lane off).
GENIE_BULK_LANES      bulk lanes (connections) to each daemon; payloads of GENIE_STRIPE_MIN_KB or more
                      are split across them (default: 4 over TCP, 1 over a Unix socket; see
                      transport.lane_set).
GENIE_STRIPE_MIN_KB   the smallest payload split across several bulk lanes (default 8192).
GENIE_HOST_POOL_MB    MiB of idle receive buffers kept for reuse (default 1024).
GENIE_HEARTBEAT       seconds between keep-alive pings to each daemon (default 1).
GENIE_HEARTBEAT_TIMEOUT seconds a ping may stay unanswered before the daemon is declared
                      lost and everything waiting on it fails (default 3).
GENIE_CURVE_CLIENT_KEY this client's CURVE .key_secret file (with GENIE_CURVE_SERVER_KEY).
GENIE_CURVE_SERVER_KEY the daemons' CURVE public .key file: connections are authenticated
                      and encrypted, and only a daemon holding its secret is accepted.
GENIE_DAEMON_THREADS  torch threads for the embedded daemon (default: half the CPUs, at least 1,
                      since it shares the host with this process; 0: torch's choice).
GENIE_CUDA_IPC        0: never hand CUDA tensors to a daemon on this host by CUDA IPC; send
                      their bytes (default 1: IPC where the daemon offers it).
GENIE_LOG_INTERCEPTS  1: log every captured op at DEBUG level on logger "genie.capture".
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from genie.transport.ucx_lane import MODES as UCX_MODES


def _float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {raw!r}") from None


def _choice(name: str, allowed: tuple[str, ...], default: str) -> str:
    raw = (os.environ.get(name) or default).strip().lower()
    if raw not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {raw!r}")
    return raw


@dataclass(frozen=True)
class Config:
    server_url: str | None
    connect_timeout: float
    connect_refused_timeout: float  # fail a connect refused this long in a row (see transport.reachability)
    request_timeout: float
    batch_ops: int
    batch_bytes: int
    max_inflight_bytes: int
    max_frame_bytes: int
    bulk_min_bytes: int
    shared_min_bytes: int
    sealed_min_bytes: int
    bulk_lanes: int  # 0: 4 over TCP, 1 over a Unix socket
    stripe_min_bytes: int
    host_pool_bytes: int
    heartbeat: float
    heartbeat_timeout: float
    daemon_threads: int
    curve_client_key: str | None
    curve_server_key: str | None
    log_intercepts: bool
    cuda_ipc: bool
    direct_lane: bool
    shared_memory: bool
    client_spin_us: float
    ucx: str  # the UCX lane: auto (hosts with an RDMA device), on, off


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _lanes() -> int:
    from genie.transport.lane_set import MAX_LANES

    lanes = _float("GENIE_BULK_LANES", 0)  # 0: as the lane's kind wants (DaemonLink._join_more_lanes)
    if lanes != int(lanes) or not 0 <= lanes <= MAX_LANES:
        raise ValueError(f"GENIE_BULK_LANES must be a whole number from 1 to {MAX_LANES} (0 or unset: the "
                         f"default), got {lanes:g}")
    return int(lanes)


def load() -> Config:
    return Config(
        server_url=os.environ.get("GENIE_SERVER_URL") or None,
        connect_timeout=_float("GENIE_CONNECT_TIMEOUT", 60.0),
        connect_refused_timeout=_float("GENIE_CONNECT_REFUSED_TIMEOUT", 10.0),
        request_timeout=_float("GENIE_REQUEST_TIMEOUT", 600.0),
        batch_ops=int(_float("GENIE_BATCH_OPS", 32)),
        batch_bytes=int(_float("GENIE_BATCH_BYTES", 8 << 20)),
        max_inflight_bytes=int(_float("GENIE_MAX_INFLIGHT_MB", 256) * (1 << 20)),
        max_frame_bytes=int(_float("GENIE_FRAME_MB", 1024) * (1 << 20)),
        bulk_min_bytes=int(_float("GENIE_BULK_MIN_KB", 1024) * 1024),
        shared_min_bytes=int(_float("GENIE_SHARED_MIN_KB", 1024) * 1024),
        sealed_min_bytes=int(_float("GENIE_SEALED_MIN_KB", 128) * 1024),
        bulk_lanes=_lanes(),
        stripe_min_bytes=int(_float("GENIE_STRIPE_MIN_KB", 8192) * 1024),
        host_pool_bytes=int(_float("GENIE_HOST_POOL_MB", 1024) * (1 << 20)),
        heartbeat=_float("GENIE_HEARTBEAT", 1.0),
        heartbeat_timeout=_float("GENIE_HEARTBEAT_TIMEOUT", 3.0),
        daemon_threads=int(_float("GENIE_DAEMON_THREADS", max(1, (os.cpu_count() or 2) // 2))),
        curve_client_key=os.environ.get("GENIE_CURVE_CLIENT_KEY") or None,
        curve_server_key=os.environ.get("GENIE_CURVE_SERVER_KEY") or None,
        log_intercepts=os.environ.get("GENIE_LOG_INTERCEPTS", "") == "1",
        cuda_ipc=os.environ.get("GENIE_CUDA_IPC", "1") != "0",
        direct_lane=os.environ.get("GENIE_DIRECT_LANE", "1") != "0",
        shared_memory=os.environ.get("GENIE_SHARED_MEMORY", "1") != "0",
        client_spin_us=_float("GENIE_CLIENT_SPIN_US", 1000.0 if _cpus() >= 2 else 0.0),
        ucx=_choice("GENIE_UCX", UCX_MODES, "auto"),
    )
