"""CUDA IPC descriptors: every field is checked before torch sees it (no GPU needed)."""
import msgpack
import pytest
import torch

from genie.transport import cuda_ipc, protocol
from genie.transport.errors import ProtocolError

GPU = "GPU-0a1b2c3d-0000-1111-2222-333344445555"


def fields(**change):
    base = dict(gpu=GPU, handle=b"\x00" * 66, storage_bytes=4096, storage_offset=512, byte_offset=1024,
                ref=b"/torch_492_1810607509_0", slot=3, event=b"\x01" * 64, sync=True, dtype="float32", shape=[8, 16])
    base.update(change)
    return list(base.values())


def decode(values):
    return protocol.unpack_header(protocol.pack([protocol.encode_cuda_ipc(values)]))[0]


def test_a_good_descriptor_decodes_to_a_checked_marker():
    seen = []
    shared = protocol.unpack_header(protocol.pack([protocol.encode_cuda_ipc(fields())]), seen)[0]
    assert seen == [shared]  # the receiver learns what to import without walking the request
    assert shared.gpu == GPU and shared.dtype is torch.float32 and shared.shape == (8, 16)
    assert shared.nbytes == 512 and shared.byte_offset == 1024 and shared.event == b"\x01" * 64
    assert decode(fields(event=None, sync=False)).event is None


@pytest.mark.parametrize("change, message", [
    (dict(gpu="../../etc"), "gpu"),
    (dict(handle=b""), "handle"),
    (dict(handle="not bytes"), "handle"),
    (dict(handle=b"x" * 4096), "handle"),
    (dict(ref=b"/dev/shm/../../etc/passwd"), "reference counter"),
    (dict(ref=b"/torch_1_2_3/../x"), "reference counter"),
    (dict(slot=10000), "counter slot"),
    (dict(slot=-1), "counter slot"),
    (dict(event=b"short"), "event handle"),
    (dict(sync=1), "event flag"),
    (dict(storage_bytes=0), "storage size"),
    (dict(storage_offset=True), "offset"),
    (dict(byte_offset=4000), "overruns"),
    (dict(shape=[1 << 20]), "overruns"),
    (dict(dtype="object"), "dtype"),
])
def test_bad_descriptors_are_protocol_errors(change, message):
    with pytest.raises(ProtocolError, match=message):
        decode(fields(**change))


def test_a_descriptor_of_the_wrong_length_is_refused():
    with pytest.raises(ProtocolError, match="descriptor"):
        decode(fields()[:-1])
    with pytest.raises(ProtocolError, match="payload"):
        protocol.unpack_header(protocol.pack([msgpack.ExtType(protocol.EXT_CUDA_IPC, b"\xc1")]))


@pytest.mark.parametrize("endpoint, local", [
    ("ipc:///tmp/genie/daemon.sock", True),
    ("tcp://127.0.0.1:5555", True),
    ("tcp://127.3.4.5:1", True),
    ("tcp://localhost:5555", True),
    ("tcp://[::1]:5555", True),
    ("tcp://0.0.0.0:5555", False),
    ("tcp://10.0.0.7:5555", False),
    ("tcp://*:5555", False),
    ("inproc://x", False),
])
def test_handles_are_only_offered_on_endpoints_this_host_alone_reaches(endpoint, local):
    assert cuda_ipc.local_only(endpoint) is local


def test_no_offer_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cuda_ipc.offer("ipc:///tmp/x.sock") is None


def test_beyond_this_host_handles_are_offered_only_over_the_local_lane(monkeypatch):
    """A daemon listening on the network offers handles only where it has a local listener, and
    says that only clients on it may send them; one on a loopback or ipc endpoint offers them to all."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(cuda_ipc, "gpu_uuid", lambda index: GPU)
    monkeypatch.setattr(cuda_ipc, "host_id", lambda: "this-host")
    assert cuda_ipc.offer("tcp://0.0.0.0:5555") is None
    network = cuda_ipc.offer("tcp://0.0.0.0:5555", local_lane=True)
    assert network["gpus"] == [GPU] and cuda_ipc.needs_local_lane(network)
    for endpoint in ("tcp://127.0.0.1:5555", "ipc:///tmp/x.sock"):
        assert not cuda_ipc.needs_local_lane(cuda_ipc.offer(endpoint, local_lane=True))
    assert not cuda_ipc.needs_local_lane(None) and not cuda_ipc.needs_local_lane({"local_lane": 1})


def test_the_daemon_takes_handles_beyond_this_host_only_from_clients_on_its_local_lane():
    from types import SimpleNamespace

    from genie_daemon.server import DaemonServer

    def server(offer, local_users=()):
        return SimpleNamespace(ipc_offer=offer, bulk=SimpleNamespace(local_users=set(local_users)))

    takes = DaemonServer._takes_cuda_ipc
    on_host = {"host": "h", "uid": 0, "gpus": [GPU]}
    network = {**on_host, "local_lane": True}
    assert not takes(server(None, [b"a"]), b"a")
    assert takes(server(on_host), b"a")
    assert takes(server(network, [b"a"]), b"a") and not takes(server(network, [b"a"]), b"b")
    assert not takes(SimpleNamespace(ipc_offer=network, bulk=None), b"a")


def test_an_offer_from_another_host_or_user_is_not_used(monkeypatch):
    import os

    monkeypatch.setattr(cuda_ipc, "host_id", lambda: "this-host")
    monkeypatch.setattr(cuda_ipc, "gpu_uuid", lambda index: GPU)
    me = os.getuid()
    assert cuda_ipc.usable({"host": "this-host", "uid": me, "gpus": [GPU]}, torch.device("cuda", 0))
    assert not cuda_ipc.usable({"host": "other-host", "uid": me, "gpus": [GPU]}, torch.device("cuda", 0))
    assert not cuda_ipc.usable({"host": "this-host", "uid": me + 1, "gpus": [GPU]}, torch.device("cuda", 0))
    assert not cuda_ipc.usable({"host": "this-host", "uid": me, "gpus": ["GPU-other"]}, torch.device("cuda", 0))
    assert not cuda_ipc.usable(None, torch.device("cuda", 0))
    assert not cuda_ipc.usable({"host": "this-host", "uid": me, "gpus": "all"}, torch.device("cuda", 0))



@pytest.mark.skipif(not __import__("os").path.isdir("/dev/shm"), reason="needs /dev/shm (Linux)")
def test_a_reference_counter_of_another_user_or_of_nothing_is_refused():
    import os

    name = f"/torch_{os.getpid()}_424242_0"
    shared = decode(fields(ref=name.encode()))
    with pytest.raises(ProtocolError, match="no reference counter"):
        cuda_ipc.check_ref_counter_owner(shared)  # no such file: another host or container
    path = cuda_ipc.SHM_DIR + name
    with open(path, "wb") as f:
        f.write(b"\0" * 8 * cuda_ipc.REF_COUNTER_SLOTS)
    try:
        cuda_ipc.check_ref_counter_owner(shared)  # this user's: accepted
        if os.getuid() == 0:
            os.chown(path, 65534, 65534)  # as root, make it another user's file
            with pytest.raises(ProtocolError, match="another user"):
                cuda_ipc.check_ref_counter_owner(shared)
    finally:
        os.unlink(path)
