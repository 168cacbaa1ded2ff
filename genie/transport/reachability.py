"""Whether anything listens at a daemon's endpoint, found out quickly.

ZeroMQ connects in the background and retries forever, so a client given a wrong port or a
daemon that is not running waited out its whole connect timeout (60 s by default) to learn
only that nothing answered. `wait_until_refused` tries a plain connection beside ZeroMQ's: a
host that does not resolve is an error at once; a connection refused (nothing listens on that
port, no such ipc socket file) for `grace` seconds in a row is an error then, naming the cause.
A daemon being started at the same time gets that long to begin listening. A connection that
is made, or attempts that neither succeed nor fail (a firewall dropping packets), end the watch
without a verdict: the connect timeout then decides, as before.
"""
from __future__ import annotations

import asyncio
import errno
import socket
import time

_DEFINITE = (errno.ECONNREFUSED, errno.ENOENT, errno.EHOSTUNREACH, errno.ENETUNREACH)
_ATTEMPT_TIMEOUT = 2.0  # seconds per plain connection attempt
_RETRY_EVERY = 0.25  # seconds between refused attempts


class Unreachable(Exception):
    """Nothing listens at the endpoint (the message says what was found)."""


def parse(endpoint: str) -> tuple[str, object] | None:
    """("tcp", (host, port)) or ("ipc", path) for a ZeroMQ endpoint a client connects to; None for
    others (inproc, or one this module cannot read: left to ZeroMQ)."""
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        return ("ipc", path) if path and not path.startswith("@") else None  # @: Linux abstract sockets
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint[len("tcp://"):].rpartition(":")
        if not sep or not port.isdigit() or not host:
            return None
        host = host.split(";")[-1]  # "source;destination" form: the destination
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        return ("tcp", (host, int(port)))
    return None


async def wait_until_refused(endpoint: str, grace: float) -> None:
    """Raise Unreachable once `endpoint` cannot be resolved, or has refused every connection for
    `grace` seconds; return once a connection was made or an attempt timed out (no verdict)."""
    target = parse(endpoint)
    if target is None:
        return
    kind, address = target
    first_refusal: float | None = None
    this_task = asyncio.current_task()
    while True:
        try:
            if kind == "tcp":
                connecting = asyncio.open_connection(*address)
            else:
                connecting = asyncio.open_unix_connection(address)
            try:
                _, writer = await asyncio.wait_for(connecting, _ATTEMPT_TIMEOUT)
            finally:
                # wait_for (3.11) hands back its inner result or error when cancelled just as that
                # finished: the cancel would be lost and the watch go on, failing unread later.
                if this_task is not None and this_task.cancelling():
                    raise asyncio.CancelledError
            writer.close()
            return
        except socket.gaierror as e:
            raise Unreachable(f"cannot resolve the host {address[0]!r} of {endpoint}: {e.strerror}") from None
        except asyncio.TimeoutError:
            return
        except OSError as e:
            if e.errno not in _DEFINITE:
                return
            now = time.monotonic()
            first_refusal = first_refusal or now
            if now - first_refusal >= grace:
                what = ("no such socket file: is a genie-daemon listening there?" if e.errno == errno.ENOENT
                        else f"{e.strerror} for {now - first_refusal:.0f}s: is a genie-daemon running there, "
                             "started with this --listen address?")
                raise Unreachable(f"nothing listens at {endpoint} ({what})") from None
        await asyncio.sleep(_RETRY_EVERY)
