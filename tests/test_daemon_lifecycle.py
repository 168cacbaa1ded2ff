"""Daemon lifecycle: clean exit on signals, memory of departed or silent clients reclaimed."""
import signal
import time

import pytest
import zmq

from daemons import DaemonProcess
from genie.transport import protocol


def request(sock, kind, rid, body=None, frames=()):
    sock.send_multipart([protocol.pack([kind, rid, body or {}]), *frames])
    header = sock.recv_multipart()[0]
    return protocol.unpack_header(header)


def client(ctx, endpoint):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 10_000)
    s.connect(endpoint)
    return s


def test_sigterm_and_sigint_stop_cleanly():
    for sig in (signal.SIGTERM, signal.SIGINT):
        with DaemonProcess() as d:
            d.proc.send_signal(sig)
            assert d.proc.wait(10) == 0


def test_a_stopped_daemon_removes_its_ipc_socket_file(tmp_path):
    # ZeroMQ leaves an ipc:// socket file behind when the socket closes; the daemon removes its own.
    path = tmp_path / "d.sock"
    with DaemonProcess(listen=f"ipc://{path}") as d:
        assert path.exists()
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(10) == 0
    assert not path.exists()
    assert not (tmp_path / "d.sock.bulk").exists()


def test_bye_and_lease_expiry_free_client_memory(zmq_ctx):
    with DaemonProcess(extra=["--client-lease", "1"]) as d:
        watcher, leaver, silent = (client(zmq_ctx, d.endpoint) for _ in range(3))
        baseline = request(watcher, "stats", 1)[2]["allocated"]
        alloc = [["aten::ones", [[1000]], {}, 1]]
        for s in (leaver, silent):
            _, ok, _ = request(s, "exec", 2, {"ops": alloc})
            assert ok
        assert request(watcher, "stats", 3)[2]["allocated"] == baseline + 8000
        request(leaver, "bye", 4)
        assert request(watcher, "stats", 5)[2]["allocated"] == baseline + 4000
        # `silent` never says goodbye: its lease (1 s) expires while `watcher` keeps talking.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if request(watcher, "stats", 6)[2]["allocated"] == baseline:
                break
            time.sleep(0.2)
        assert request(watcher, "stats", 7)[2]["allocated"] == baseline
        for s in (watcher, leaver, silent):
            s.close()


def test_sigterm_drains_work_in_flight_and_answers_it(zmq_ctx):
    with DaemonProcess() as d:
        s = client(zmq_ctx, d.endpoint)
        # About a second of matmuls, then a fetch: in flight when the signal arrives.
        ops = [["aten::ones", [[256, 256]], {}, 1]]
        ops += [["aten::mm", [protocol.encode_handle(1), protocol.encode_handle(1)], {}, 1] for _ in range(1500)]
        ops += [["aten::sum", [protocol.encode_handle(1)], {}, 2]]
        s.send_multipart([protocol.pack(["exec", 7, {"ops": ops, "fetch": [2]}])])
        time.sleep(0.3)
        d.proc.send_signal(signal.SIGTERM)
        header = s.recv_multipart()[0]  # the answer still comes (RCVTIMEO bounds the wait)
        rid, ok, body = protocol.unpack_header(header)
        assert rid == 7 and ok and "error" not in body["fetched"][0], body
        assert d.proc.wait(10) == 0
        s.close()


def test_a_request_waiting_for_a_transfer_does_not_hold_up_other_clients(zmq_ctx):
    with DaemonProcess(extra=["--transfer-timeout", "2"]) as d:
        waiter, other = client(zmq_ctx, d.endpoint), client(zmq_ctx, d.endpoint)
        # genie::recv of a transfer that never comes: parked off the executor until the timeout.
        waiter.send_multipart([protocol.pack(["exec", 1, {"ops": [["genie::recv", ["0" * 32], {}, 1]], "fetch": [1]}])])
        time.sleep(0.2)
        started = time.monotonic()
        rid, ok, body = request(other, "exec", 2, {"ops": [["aten::ones", [[3]], {}, 5]], "fetch": [5]})
        assert ok and "error" not in body["fetched"][0]
        assert time.monotonic() - started < 1.0  # served while the other request still waits
        rid, ok, body = protocol.unpack_header(waiter.recv_multipart()[0])
        assert rid == 1 and "no tensor arrived" in body["fetched"][0]["error"]["message"]
        stats = request(other, "stats", 3)[2]
        assert stats["parked_requests"] == 0
        for s in (waiter, other):
            s.close()


_HOLDER = """
import sys, time, socket, torch, genie
genie.init(sys.argv[1])
x = torch.full((10_000_000,), 2.0, device="remote_accelerator:0")  # 40 MB on the daemon
x.sum().item()
if sys.argv[2] == "close-lane":  # the direct lane fails, the process lives on (over ZeroMQ)
    genie.get_runtime().links[0].channel.direct_stream.shutdown(socket.SHUT_RDWR)
print("ready", genie.transport_info()["links"][sys.argv[1]]["local_lane"], flush=True)
if sys.argv[2] == "close-lane":
    time.sleep(7)  # longer than a killed client's grace (4 pings of 1 s)
    print(x.sum().item(), flush=True)
else:
    time.sleep(120)
"""


def _holder(endpoint: str, mode: str):
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-c", _HOLDER, endpoint, mode], stdout=subprocess.PIPE, text=True)


@pytest.mark.parametrize("local_lane", [False, True], ids=["tcp lanes", "local lane"])
def test_a_killed_client_s_memory_is_freed_within_seconds(local_lane, zmq_ctx):
    # The default lease is 60 s; a client that dies (SIGKILL, the OOM killer) closed its direct
    # lane and stopped its pings: the daemon frees its memory seconds later, as CUDA does at once.
    # The same where its lanes went to the daemon's local listener (a client on its host).
    with DaemonProcess(local_lane=local_lane) as d:
        watcher = client(zmq_ctx, d.endpoint)
        baseline = request(watcher, "stats", 1)[2]["allocated"]
        holder = _holder(d.endpoint, "hold")
        try:
            assert holder.stdout.readline().strip() == f"ready {local_lane}"
            assert request(watcher, "stats", 2)[2]["allocated"] >= baseline + 40_000_000
            holder.send_signal(signal.SIGKILL)
            holder.wait(10)
            killed_at = time.monotonic()
            while time.monotonic() - killed_at < 20 and request(watcher, "stats", 3)[2]["allocated"] != baseline:
                time.sleep(0.2)
            assert request(watcher, "stats", 4)[2]["allocated"] == baseline
            assert time.monotonic() - killed_at < 20
        finally:
            holder.kill()
            holder.wait(10)
            watcher.close()


def test_a_live_client_whose_direct_lane_closed_keeps_its_memory():
    with DaemonProcess() as d:
        holder = _holder(d.endpoint, "close-lane")
        try:
            assert holder.stdout.readline().startswith("ready")
            assert holder.stdout.readline().strip() == "20000000.0"  # its tensor outlived the grace
            assert holder.wait(30) == 0
        finally:
            holder.kill()
            holder.wait(10)


def test_hello_validates_the_heartbeat(zmq_ctx):
    with DaemonProcess() as d:
        s = client(zmq_ctx, d.endpoint)
        for bad in ("1", -1, 1e9, [1]):
            _, ok, body = request(s, "hello", 1, {"version": protocol.VERSION, "heartbeat": bad})
            assert not ok and "heartbeat" in body["message"]
        _, ok, _ = request(s, "hello", 2, {"version": protocol.VERSION, "heartbeat": 0.5})
        assert ok
        s.close()
        # A client that pings less often than the protocol's bound promises no pings, and connects.
        import os
        import subprocess
        import sys

        done = subprocess.run(
            [sys.executable, "-c", "import sys, torch, genie; genie.init(sys.argv[1]); "
             "print((torch.ones(2, device='remote_accelerator:0') + 1).tolist())", d.endpoint],
            capture_output=True, text=True, timeout=120, env={**os.environ, "GENIE_HEARTBEAT": "7200"})
        assert done.stdout.strip() == "[2.0, 2.0]", done.stderr[-2000:]
