"""The client runtime: one asyncio loop on a background thread, per-device ordered
op streams with batching, materialization futures, remote handle lifetimes, and
the registry of connected daemons (starting an embedded one when none is set).

Imports genie.transport below it; the frontend above calls into it.
"""
from .runtime import Runtime, get_runtime, started_runtime

__all__ = ["Runtime", "get_runtime", "started_runtime"]
