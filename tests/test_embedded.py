"""With no daemon configured, Genie starts a local one for the process and stops it at exit."""
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os, torch, genie
    from genie.runtime import get_runtime
    x = torch.randn(64, 64, device="remote_accelerator:0")
    y = torch.relu(x @ x + 1)
    print("SUM", y.sum().item() > 0)
    d = get_runtime().local_daemon
    print("PID", d.process.pid)
    print("ENDPOINT", d.endpoint)
""")


def test_embedded_daemon_starts_and_stops(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "GENIE_SERVER_URL"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
    assert lines["SUM"] == "True"
    assert lines["ENDPOINT"].startswith("ipc://")
    pid = int(lines["PID"])
    # The daemon is gone once the client process has exited.
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        raise AssertionError("embedded daemon outlived its client")
    # Its private folder (the socket files) went with it: each run used to leave one in /tmp.
    folder = os.path.dirname(lines["ENDPOINT"][len("ipc://"):])
    assert os.path.basename(folder).startswith("genie-") and not os.path.exists(folder)


CRASH_SCRIPT = textwrap.dedent("""
    import os, signal, torch, genie
    from genie.runtime import get_runtime
    x = torch.randn(8, device="remote_accelerator:0")
    print("FIRST", (x + 1).sum().item() is not None)
    print("ENDPOINT", get_runtime().local_daemon.endpoint)
    os.kill(get_runtime().local_daemon.process.pid, signal.SIGKILL)
    try:
        (x * 2).sum().item()
    except genie.GenieConnectionError as e:
        print("ERROR", str(e).replace(chr(10), " "))
""")


def test_a_crashed_local_daemon_is_reported_with_how_it_ended():
    # A daemon that dies mid-run (a GPU library crashing, the OOM killer) must not read as a mere
    # network loss: the error says the process ended and how.
    env = {k: v for k, v in os.environ.items() if k != "GENIE_SERVER_URL"}
    env["GENIE_HEARTBEAT_TIMEOUT"] = "1"
    out = subprocess.run([sys.executable, "-c", CRASH_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    lines = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
    assert lines.get("FIRST") == "True", out.stderr
    assert "was lost" in lines["ERROR"] and "the local genie-daemon was killed by signal 9" in lines["ERROR"], lines
    assert not os.path.exists(os.path.dirname(lines["ENDPOINT"][len("ipc://"):]))  # removed though it crashed


ABRUPT_SCRIPT = textwrap.dedent("""
    import os, torch, genie
    from genie.runtime import get_runtime
    x = torch.ones(4, device="remote_accelerator:0")
    print("SUM", (x + 1).sum().item(), flush=True)
    print("ENDPOINT", get_runtime().local_daemon.endpoint, flush=True)
    print("PID", get_runtime().local_daemon.process.pid, flush=True)
    os._exit(0)  # as a forked multiprocessing child or a killed process ends: no atexit, no stop()
""")


def test_a_client_ending_without_stop_leaves_no_folder_behind():
    env = {k: v for k, v in os.environ.items() if k != "GENIE_SERVER_URL"}
    out = subprocess.run([sys.executable, "-c", ABRUPT_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    lines = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
    assert lines.get("SUM") == "8.0", out.stderr
    folder = os.path.dirname(lines["ENDPOINT"][len("ipc://"):])
    pid = int(lines["PID"])
    import time

    deadline = time.monotonic() + 20  # the daemon notices its parent is gone within 0.5 s, then stops
    while time.monotonic() < deadline and os.path.exists(folder):
        time.sleep(0.1)
    try:
        os.kill(pid, 0)
        alive = True
    except ProcessLookupError:
        alive = False
    if alive and os.path.exists(folder):
        os.kill(pid, 9)
    assert not os.path.exists(folder)


def test_curve_settings_for_network_daemons_leave_the_embedded_daemon_plain(tmp_path):
    """A user whose shell is set up for a CURVE cluster (client keys, and on a GPU node a daemon
    secret too) and who runs a script without GENIE_SERVER_URL: the embedded daemon failed the
    first op with "the CURVE handshake failed" (client keys alone) or did not start (a secret
    without GENIE_CURVE_ALLOW). Those settings are for daemons on the network; the embedded one is
    private to the process and connected to without them."""
    from daemons import keygen

    server_public, server_secret = keygen(tmp_path, "daemon")
    _, client_secret = keygen(tmp_path, "client")
    env = {k: v for k, v in os.environ.items() if k != "GENIE_SERVER_URL"}
    script = textwrap.dedent("""
        import torch, genie
        x = torch.ones(3, device="remote_accelerator:0")
        print("VALUES", (x + 1).tolist())
        print("ENCRYPTED", [v["encrypted"] for v in genie.transport_info()["links"].values()])
    """)
    for secret in ({}, {"GENIE_CURVE_SECRET": server_secret}):
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                             env={**env, **secret, "GENIE_CURVE_CLIENT_KEY": client_secret,
                                  "GENIE_CURVE_SERVER_KEY": server_public})
        assert out.returncode == 0, out.stderr[-3000:]
        assert "VALUES [2.0, 2.0, 2.0]" in out.stdout and "ENCRYPTED [False]" in out.stdout, out.stdout
