"""CURVE authentication and encryption (ZeroMQ's CurveZMQ), shared by clients and daemons.

Keys are ZeroMQ certificate files as written by `genie-daemon keygen`:
``NAME.key`` holds the public key, ``NAME.key_secret`` both keys. A daemon
serves with its secret file and accepts only clients whose public key files
are in its allow directory; a client names the daemon's public key file, so
the handshake fails against any daemon that does not hold the matching
secret. Once set up, every message is encrypted.
"""
from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass

import zmq
import zmq.auth


@dataclass(frozen=True)
class ClientKeys:
    public: bytes
    secret: bytes
    server_public: bytes

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret
        sock.curve_serverkey = self.server_public


@dataclass(frozen=True)
class ServerKeys:
    public: bytes
    secret: bytes
    allow_dir: str

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret
        sock.curve_server = True

    def as_client_of(self, server_public: bytes) -> ClientKeys:
        """Daemon-to-daemon links: this daemon's own key pair as a client's."""
        return ClientKeys(self.public, self.secret, server_public)


def _load(path: str, need_secret: bool) -> tuple[bytes, bytes | None]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no key file at {path}")
    public, secret = zmq.auth.load_certificate(path)
    if need_secret and not secret:
        raise ValueError(f"{path} holds no secret key (use the .key_secret file)")
    return public, secret


def client_keys(client_secret_file: str, server_public_file: str) -> ClientKeys:
    public, secret = _load(client_secret_file, need_secret=True)
    server_public, _ = _load(server_public_file, need_secret=False)
    return ClientKeys(public, secret, server_public)


def server_keys(secret_file: str, allow_dir: str) -> ServerKeys:
    public, secret = _load(secret_file, need_secret=True)
    if not os.path.isdir(allow_dir):
        raise FileNotFoundError(f"no allow directory at {allow_dir}")
    return ServerKeys(public, secret, allow_dir)


def write_key_pair(directory: str, name: str) -> tuple[str, str]:
    """Write NAME.key (public) and NAME.key_secret (keep private) in `directory`."""
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq was built without CURVE support")
    os.makedirs(directory, exist_ok=True)
    public_file, secret_file = zmq.auth.create_certificates(directory, name)
    os.chmod(secret_file, 0o600)
    return public_file, secret_file


def is_loopback_endpoint(endpoint: str) -> bool:
    """ipc:// and inproc:// never leave the host; tcp:// is local only on a loopback address."""
    if not endpoint.startswith("tcp://"):
        return True
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # an interface name or a wildcard such as '*': not provably loopback
