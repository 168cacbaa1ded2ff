"""The client side of `import genie`: the remote_accelerator device, its capture and runtime, and
the functions `genie.*` exports (genie/__init__.py imports them from here, except in a genie-daemon)."""
from __future__ import annotations

from .frontend import device as _device
from .runtime import get_runtime
from .runtime.device_type import DEVICE_TYPE

remote_accelerator = _device.register()


def init(urls: str | list[str] | None = None, *, client_key: str | None = None,
         server_key: str | None = None) -> None:
    """Connect to daemons: "tcp://a:5555,ipc:///tmp/b" or a list. None: GENIE_SERVER_URL, else a local daemon.

    CURVE: `client_key` is this client's .key_secret file, `server_key` the daemons' public .key file
    (defaults: GENIE_CURVE_CLIENT_KEY, GENIE_CURVE_SERVER_KEY). With both set, every connection is
    authenticated and encrypted, and a daemon that does not hold the server key is refused.
    """
    get_runtime().init(urls, client_key=client_key, server_key=server_key)


def capture(model=None):
    """`with genie.capture() as g:` records the ops of the block (ordinary CPU tensors are fine)
    into `g.graph`; `g.run()` then executes the graph on remote devices per its schedule."""
    from .frontend.graph_capture import Capture

    return Capture(model)


def analyze(model_or_graph, *args, **kwargs):
    """Patterns, phases, costs and schedule of `model(*args, **kwargs)` (or of a captured graph).

    Keyword-only options: network=, devices=[indices], allow_local=True, quiet=False.
    Prints a summary; the result has .summary(), .to_png(path), .to_svg(path).
    """
    from .frontend.analysis import analyze as _analyze

    return _analyze(model_or_graph, *args, **kwargs)


def analysis_cache_stats() -> dict:
    """Hit rates and hit latency of the two-level analysis cache used by genie.analyze."""
    from .semantic.analyzer import default_cache

    return default_cache.stats()


def shutdown() -> None:
    """Free everything this process holds on its daemons and disconnect (stops an embedded daemon)."""
    get_runtime().shutdown()


async def materialize(value):
    """The async form of ``.cpu()``. A remote tensor gives its CPU tensor. A list, tuple or dict
    (nested, e.g. a state_dict or an optimizer's) gives the same structure with every remote
    tensor in it on the CPU, fetched together: one round trip per daemon. Other values stay."""
    from .frontend.materialize import materialize_tree

    return await materialize_tree(_remote_or_structure(value))


def materialize_sync(value):
    """Blocking form of `materialize`: `genie.materialize_sync(model.state_dict())` reads all
    the values in one round trip per daemon, where `{k: v.cpu() ...}` waits once per tensor."""
    from .frontend.materialize import to_cpu_tree

    return to_cpu_tree(_remote_or_structure(value))


def _remote_or_structure(value):
    import collections

    import torch

    if isinstance(value, torch.Tensor):
        if value.device.type != DEVICE_TYPE:
            raise TypeError(f"expected a remote_accelerator tensor, got a tensor on {value.device}")
    elif not isinstance(value, (list, tuple, dict, collections.deque)):
        hint = " (a module's values: model.state_dict())" if isinstance(value, torch.nn.Module) else ""
        raise TypeError(f"expected a remote_accelerator tensor, or lists, tuples or dicts holding some; got "
                        f"{type(value).__name__}{hint}")
    return value


def flush() -> None:
    """Send everything queued so far to the daemons without waiting (lets devices start early)."""
    for stream in get_runtime().streams:
        stream.flush()


def synchronize() -> None:
    """Wait until every remote device has run everything queued so far."""
    for stream in get_runtime().streams:
        stream.synchronize()


def transport_stats() -> dict:
    """Bytes and messages sent to / received from each daemon by this process."""
    return get_runtime().transport_stats()


def transport_info() -> dict:
    """How data travels to each daemon (ZeroMQ, plus a tcp or unix bulk lane for large payloads),
    and which faster paths this process has (RDMA libraries, CUDA, CuPy), said plainly."""
    return get_runtime().transport_info()


def capture_stats() -> dict:
    """Metadata-cache statistics of the op capture (hits, misses, bypasses)."""
    from .frontend.capture import meta_cache

    return meta_cache.info()
