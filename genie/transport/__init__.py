"""The wire: message framing, tensor frames, ZeroMQ sockets.

Imports nothing of Genie above it; the daemon (genie_daemon) depends only on
this package. Contract: nothing received is unpickled, evaluated or imported;
every field is validated by `protocol` before anyone uses it.
"""
