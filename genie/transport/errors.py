"""Errors raised by the wire layer (shared by client and daemon)."""


class ProtocolError(ValueError):
    """A message that does not follow the protocol; the peer answers with an error."""
