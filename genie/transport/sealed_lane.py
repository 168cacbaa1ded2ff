"""Sealed lanes: the bulk and direct lanes' streams encrypted and authenticated (AES-256-GCM),
for CURVE daemons.

Under CURVE every ZeroMQ message is encrypted by libsodium inside ZeroMQ's I/O thread, which
moved large payloads at 0.3-0.5 GB/s here (3 GB/s without CURVE). The plaintext bulk lane cannot
stand in for it there; a sealed one can: AES-GCM through OpenSSL (the `cryptography` package)
runs at 5-7 GB/s per core on CPUs with AES instructions.

Keys. The daemon gives each client a fresh 32-byte lane key in its hello answer, which CURVE has
encrypted and authenticated. A connection opens with ``MAGIC_SEALED + token + client random``;
the daemon answers ACCEPTED and its own random, and both sides derive one key per direction
with HKDF-SHA256 over the lane key, salted with both randoms: a connection never reuses another's
keys, so nonces (a counter per direction) never repeat under one key. The client's first record
(HELLO, sealed) proves it holds the lane key; only then does the daemon attach the lane to the
client, so a token seen on the wire does not let anyone else in.

Records. What a plaintext lane writes as is, a sealed one writes as units, each ``ciphertext +
16-byte tag`` under the next nonce: a bulk record's 28-byte header is one unit, and its payload
follows as units of up to CHUNK_BYTES, cut the same way at both ends (a direct-lane message: its
length, then its bytes; see stream_framing). The direct lane's connection is keyed like the bulk
lane's, greeted with its own magic. A unit that fails its
tag (altered, replayed, reordered, dropped) raises ProtocolError and the lane closes.
"""
from __future__ import annotations

import os
import struct

from .errors import ProtocolError

KEY_BYTES = 32
RANDOM_BYTES = 16
TAG_BYTES = 16
CHUNK_BYTES = 1 << 20  # payload per sealed unit: large enough to amortise each call, small enough for the cache
_NONCE = struct.Struct("<4xQ")  # 96-bit nonce: 32 zero bits, then the unit's number in this direction

try:
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF
except ImportError:  # a node installed with --no-deps: CURVE daemons then send large payloads over ZeroMQ
    AESGCM = None


def available() -> bool:
    """Whether lanes can be sealed here: the `cryptography` package is importable, and recent
    enough to seal into a given buffer (an older one: large payloads go over ZeroMQ under CURVE)."""
    return AESGCM is not None and hasattr(AESGCM, "encrypt_into") and hasattr(AESGCM, "decrypt_into")


def new_lane_key() -> bytes:
    return os.urandom(KEY_BYTES)


def new_random() -> bytes:
    return os.urandom(RANDOM_BYTES)


def check_lane_key(key: object) -> bytes:
    """A lane key received in hello (validated, as every received field is)."""
    if type(key) is not bytes or len(key) != KEY_BYTES:
        raise ProtocolError("bad lane key")
    return key


def sealed_size(nbytes: int) -> int:
    """Bytes on the wire for a payload of `nbytes` (its units' tags included)."""
    return nbytes + TAG_BYTES * -(-nbytes // CHUNK_BYTES)


class Direction:
    """One direction of a sealed lane: its key and the number of the next unit."""

    __slots__ = ("_aead", "_counter")

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)
        self._counter = 0

    def _next_nonce(self) -> bytes:
        nonce = _NONCE.pack(self._counter)
        self._counter += 1
        return nonce

    def seal(self, data) -> bytes:
        """A unit: `data` encrypted, then its tag."""
        return self._aead.encrypt(self._next_nonce(), data, None)

    def seal_into(self, data, out: bytearray) -> memoryview:
        """`data` sealed into `out` (at least TAG_BYTES longer): the unit, a view of `out`."""
        n = len(data) + TAG_BYTES
        view = memoryview(out)[:n]
        self._aead.encrypt_into(self._next_nonce(), data, None, view)
        return view

    def open(self, unit) -> bytes:
        try:
            return self._aead.decrypt(self._next_nonce(), unit, None)
        except InvalidTag:
            raise ProtocolError("a sealed lane record failed authentication") from None

    def open_into(self, unit, out: memoryview) -> None:
        """Decrypt `unit` into `out` (exactly TAG_BYTES shorter), checking its tag first."""
        try:
            self._aead.decrypt_into(self._next_nonce(), unit, None, out)
        except InvalidTag:
            raise ProtocolError("a sealed lane record failed authentication") from None


def directions(lane_key: bytes, client_random: bytes, server_random: bytes, client_side: bool
               ) -> tuple[Direction, Direction]:
    """(sending, receiving) for one connection: a key per direction, derived from the lane key and
    both sides' randoms."""
    material = HKDF(algorithm=hashes.SHA256(), length=2 * KEY_BYTES, salt=client_random + server_random,
                    info=b"genie sealed lane v1").derive(lane_key)
    to_daemon, to_client = material[:KEY_BYTES], material[KEY_BYTES:]
    if client_side:
        return Direction(to_daemon), Direction(to_client)
    return Direction(to_client), Direction(to_daemon)
