"""`genie-daemon` command line: parse flags, pick devices, serve until signalled."""
from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys

import torch

from genie.transport import ucx_lane
from genie.transport.lane_set import MAX_LANES

from . import device_faults
from .bulk_server import BULK_POOL_BYTES
from .memory_guard import cap_process_memory
from .server import DaemonServer

log = logging.getLogger("genie.daemon")

READY_LINE = "GENIE_DAEMON_READY"


def pick_devices(spec: str) -> list[torch.device]:
    """`auto`: every CUDA GPU, else the CPU. Otherwise a comma list such as `cuda:0,cuda:1` or `cpu`."""
    if spec == "auto":
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        return [torch.device("cpu")]
    devices = [torch.device(part.strip()) for part in spec.split(",") if part.strip()]
    for d in devices:
        if d.type == "cuda":
            if not torch.cuda.is_available():
                raise SystemExit(f"genie-daemon: {d} requested but CUDA is not available here")
            if d.index is None:
                raise SystemExit("genie-daemon: name CUDA devices with an index, e.g. cuda:0")
        elif d.type != "cpu":
            raise SystemExit(f"genie-daemon: unsupported device {d}")
    return devices


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="genie-daemon", description="Execute Genie clients' tensor work on this node.")
    p.add_argument("--listen", default=os.environ.get("GENIE_LISTEN", "tcp://127.0.0.1:5555"),
                   help="ZeroMQ endpoint to bind: tcp://HOST:PORT (port 0 picks a free one) or ipc:///path")
    p.add_argument("--device", default=os.environ.get("GENIE_DEVICE", "auto"),
                   help="auto (all GPUs, else cpu), cpu, or a list such as cuda:0,cuda:1")
    p.add_argument("--client-lease", type=float, default=60.0,
                   help="seconds without a message after which a silent client's tensors are freed")
    p.add_argument("--exit-with-parent", type=int, default=0, metavar="PID",
                   help="exit when process PID is gone (used by the embedded daemon)")
    p.add_argument("--private-dir", default="", metavar="DIR",
                   help="a folder made for this daemon alone, holding its socket: removed at exit if empty "
                        "(used by the embedded daemon, whose client may end without removing it)")
    p.add_argument("--memory-limit", type=float, default=float(os.environ.get("GENIE_MEMORY_LIMIT_GB", "0") or 0),
                   metavar="GB", help="most GiB of tensors all clients together may keep (0: no limit); "
                   "env GENIE_MEMORY_LIMIT_GB")
    p.add_argument("--max-frame-mb", type=float, default=1024,
                   help="payloads larger than this go as several ZeroMQ frames (must stay under 2048)")
    p.add_argument("--curve-secret", default=os.environ.get("GENIE_CURVE_SECRET"), metavar="FILE",
                   help="this daemon's .key_secret file (from `genie-daemon keygen`): turns CURVE on; "
                   "env GENIE_CURVE_SECRET")
    p.add_argument("--allow-keys", default=os.environ.get("GENIE_CURVE_ALLOW"), metavar="DIR",
                   help="directory of the client public .key files to accept (with --curve-secret); "
                   "env GENIE_CURVE_ALLOW")
    p.add_argument("--insecure", action="store_true",
                   help="allow listening on a non-loopback address without CURVE keys (anyone who can reach "
                   "the port can run work here)")
    p.add_argument("--no-bulk-lane", action="store_true",
                   help="send large payloads over ZeroMQ only (no second socket for bulk transfers)")
    p.add_argument("--lane-port", type=int, default=int(os.environ.get("GENIE_LANE_PORT", "0") or 0), metavar="PORT",
                   help="TCP port of the bulk and direct lanes' listener (0: any free port, told to clients); "
                        "with a firewall, open this and the --listen port. Env GENIE_LANE_PORT")
    p.add_argument("--peer-lanes", type=int, default=int(os.environ.get("GENIE_PEER_LANES", "0") or 0),
                   metavar="N", help="bulk lanes (TCP connections) this daemon opens to each peer daemon for "
                   "daemon-to-daemon copies, 1 to 8 (0: 4 over TCP, 1 over a Unix socket, as a client's); "
                   "env GENIE_PEER_LANES")
    p.add_argument("--transfer-timeout", type=float, default=120.0, metavar="S",
                   help="seconds a request may wait for a peer daemon's tensor or its bulk-lane bytes")
    p.add_argument("--kv-dir", default=os.environ.get("GENIE_KV_DIR"), metavar="DIR",
                   help="keep a copy of every KV session (genie.KVSession) here, so sessions survive a daemon "
                   "restart and reload after eviction; env GENIE_KV_DIR")
    p.add_argument("--no-fuse-programs", action="store_true",
                   default=os.environ.get("GENIE_FUSE_PROGRAMS", "1") == "0",
                   help="replay genie.graph programs op by op from Python instead of as traced TorchScript "
                   "segments; env GENIE_FUSE_PROGRAMS=0")
    p.add_argument("--spin-us", type=float, default=float(os.environ.get("GENIE_SPIN_US", _default_spin_us())),
                   metavar="US", help="when idle, poll for the next request this long before sleeping (lower "
                   "latency for a client in a request loop, at the cost of that much CPU per request; 0: off; "
                   "default 1000 with 2 or more CPUs); env GENIE_SPIN_US")
    p.add_argument("--no-cuda-ipc", action="store_true", default=os.environ.get("GENIE_CUDA_IPC", "1") == "0",
                   help="refuse CUDA IPC handles from clients on this host (they then send bytes); "
                        "handles are only ever accepted on an ipc:// or loopback endpoint, or from clients "
                        "on the local lane (this daemon's user, on this host)")
    p.add_argument("--no-shared-memory", action="store_true",
                   default=os.environ.get("GENIE_SHARED_MEMORY", "1") == "0",
                   help="refuse shared-memory segments for large payloads on ipc:// bulk lanes (they then go "
                        "through the Unix socket), and offer no local lane on tcp://; env GENIE_SHARED_MEMORY=0")
    p.add_argument("--no-local-lane", action="store_true", default=os.environ.get("GENIE_LOCAL_LANE", "1") == "0",
                   help="a tcp:// daemon takes the lanes of clients and peers on its own host over TCP too "
                        "(sealed under CURVE), not on its local Unix socket with shared memory; env GENIE_LOCAL_LANE=0")
    p.add_argument("--ucx", choices=ucx_lane.MODES, default=os.environ.get("GENIE_UCX", "auto").lower(),
                   help="bulk payloads over UCX (the ucxx library): auto = on hosts with an RDMA device; "
                        "on = whenever ucxx is importable (clients need GENIE_UCX=on too); off")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--log-level", default=os.environ.get("GENIE_LOG_LEVEL", "INFO"))
    args = p.parse_args(argv)
    if not 0 <= args.peer_lanes <= MAX_LANES:
        p.error(f"--peer-lanes must be from 0 to {MAX_LANES}")
    return args


async def _watch_parent(pid: int, server: DaemonServer) -> None:
    while True:
        await asyncio.sleep(0.5)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            log.info("parent %d is gone; stopping", pid)
            server.stop()
            return
        except PermissionError:
            pass


def security_from(args: argparse.Namespace):
    """CURVE keys from the flags, and the rule: no open daemon on a network unless --insecure."""
    from genie.transport import security

    if bool(args.curve_secret) != bool(args.allow_keys):
        raise SystemExit("genie-daemon: --curve-secret and --allow-keys go together")
    if args.curve_secret:
        try:
            return security.server_keys(args.curve_secret, args.allow_keys)
        except (OSError, ValueError) as e:
            raise SystemExit(f"genie-daemon: {e}") from None
    if not security.is_loopback_endpoint(args.listen):
        if not args.insecure:
            raise SystemExit(f"genie-daemon: refusing to listen on {args.listen} without CURVE keys: anyone who "
                             "can reach it could run work here. Use `genie-daemon keygen`, --curve-secret and "
                             "--allow-keys, or pass --insecure on a network you trust.")
        log.warning("listening on %s WITHOUT authentication or encryption (--insecure)", args.listen)
    return None


async def _run(args: argparse.Namespace) -> tuple[str, str, str] | None:
    """Serve until stopped; the endpoint and devices to serve again when a GPU's context was lost."""
    devices = pick_devices(args.device)
    memory_limit = int(args.memory_limit * 2**30)
    server = DaemonServer(args.listen, devices, client_lease_s=args.client_lease,
                          memory_limit=memory_limit, bulk_lanes=not args.no_bulk_lane,
                          curve=security_from(args), transfer_timeout=args.transfer_timeout,
                          kv_dir=args.kv_dir, spin_s=max(0.0, args.spin_us) / 1e6,
                          cuda_ipc_allowed=not args.no_cuda_ipc, shared_memory=not args.no_shared_memory,
                          local_lane=not args.no_local_lane, ucx=args.ucx, lane_port=args.lane_port, peer_lanes=args.peer_lanes)
    try:
        endpoint = server.bind()
    except OSError as e:
        raise SystemExit(f"genie-daemon: {e}") from None
    server.process_cap = cap_process_memory(devices, memory_limit, BULK_POOL_BYTES if server.bulk else 0)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.stop)
    watcher = asyncio.create_task(_watch_parent(args.exit_with_parent, server)) if args.exit_with_parent else None
    # What exists now (torch and the libraries, ~180k objects) lives as long as the process: out
    # of the cyclic collector's sight, a full collection no longer walks it (31-58 ms each here,
    # holding the interpreter while requests and transfers wait). Clients' state comes later and
    # is collected as before.
    gc.freeze()
    log.info("serving %s on %s", ", ".join(map(str, devices)), endpoint)
    print(f"{READY_LINE} {endpoint}", flush=True)
    await server.serve()
    if watcher:
        watcher.cancel()
    if server.device_lost is not None:  # restarted in place (see main): its folder stays
        return endpoint, ",".join(map(str, devices)), server.restart_notice()
    if args.private_dir:
        try:
            os.rmdir(args.private_dir)  # only once empty: the socket files are gone by now
        except OSError:
            pass


def keygen(argv: list[str]) -> None:
    """`genie-daemon keygen DIR [--name NAME]`: write a CURVE key pair."""
    from genie.transport import security

    p = argparse.ArgumentParser(prog="genie-daemon keygen",
                                description="Write a CURVE key pair: NAME.key (public) and NAME.key_secret.")
    p.add_argument("directory")
    p.add_argument("--name", default="genie")
    args = p.parse_args(argv)
    public, secret = security.write_key_pair(args.directory, args.name)
    print(f"public key: {public}\nsecret key: {secret} (keep it private)")


def _default_spin_us() -> str:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return "1000" if cpus >= 2 else "0"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["keygen"]:
        keygen(argv[1:])
        return
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s genie-daemon[%(process)d] %(levelname)s %(message)s")
    from genie.transport import tensors

    tensors.MAX_FRAME_BYTES = max(1, int(args.max_frame_mb * 2**20))
    from . import programs

    programs.FUSE = not args.no_fuse_programs
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    lost = run(_run(args))
    if lost is not None:
        restart(*lost)


def restart(endpoint: str, devices: str, notice: str) -> None:
    """Start this daemon again in this process (same pid and flags, the endpoint it bound, the
    port included, and the devices it served: a GPU that is gone then stops it rather than
    leaving a CPU daemon in its place), with fresh CUDA contexts: the old ones were lost (see
    device_faults). Clients see their connection drop and reconnect; `notice` tells the new
    process which clients lost their tensors, and why (device_faults.take_restart_notice)."""
    log.warning("restarting (pid %d) on %s", os.getpid(), endpoint)
    os.environ[device_faults.RESTART_NOTICE_ENV] = notice
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:], "--listen", endpoint, "--device", devices])


if __name__ == "__main__":
    main()
