"""A process forked after Genie connected: the child gets a connection of its own.

Only the forking thread survives a fork, and the child shares its parent's sockets. Before the
at-fork hook, a child's requests went out on the parent's sockets and both read each other's
answers. Each case runs in its own interpreter (an embedded daemon over ipc, so the shared-memory
lane is in play), bounded by a timeout.
"""
from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from daemons import curve_pair

COMMON = textwrap.dedent("""
    import os, sys, torch, genie
    from genie.runtime import get_runtime

    DEV = "remote_accelerator:0"
    x = torch.arange(6.0, device=DEV)
    assert (x + 1).sum().item() == 21
    rt = get_runtime()
    parent_token, endpoint = rt.links[0].token, rt.links[0].endpoint
    daemon = rt.local_daemon.process

    def work(n):
        ones = torch.ones(3, device=DEV)
        for i in range(n):
            y = torch.full((3,), float(i), device=DEV)
            assert (y + ones).sum().item() == 3 * (i + 1), i
        big = torch.arange(1 << 19, dtype=torch.float32)  # 2 MiB: goes by the bulk lane
        assert torch.equal(big.to(DEV).mul(2).cpu(), big * 2)

    def old_tensor_error(mixed=False):
        try:
            (x + torch.ones(6, device=DEV) if mixed else x + 1).sum().item()
        except genie.GenieConnectionError as e:
            return str(e)
        return "no error"
""")

CONCURRENT = COMMON + textwrap.dedent("""
    import multiprocessing as mp

    def child(q):
        try:
            work(150)
            link = get_runtime().links[0]
            q.put(("ok", link.endpoint == endpoint, link.token != parent_token, old_tensor_error(),
                   old_tensor_error(mixed=True)))
        except BaseException as e:
            q.put(("failed", repr(e)))

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    work(150)  # at the same time as the child
    print("CHILD", q.get(timeout=90))
    p.join(30)
    print("EXIT", p.exitcode)
    assert (x + 1).sum().item() == 21
    print("PARENT ok", daemon.poll() is None, get_runtime().links[0].endpoint == endpoint)
""")

PLAIN_FORK_EXIT = COMMON + textwrap.dedent("""
    pid = os.fork()
    if pid == 0:
        work(20)
        sys.exit(0)  # runs atexit handlers, the parent's runtime's among them
    _, status = os.waitpid(pid, 0)
    print("CHILD status", status)
    work(20)
    assert (x + 1).sum().item() == 21
    print("PARENT ok", daemon.poll() is None, get_runtime().links[0].endpoint == endpoint)
""")


def _run(script: str | None, argv: list[str] | None = None, extra_env: dict | None = None) -> dict[str, str]:
    """Run `script` (or the file and arguments in `argv`) in an interpreter of its own; its "KEY value" lines."""
    env = {k: v for k, v in os.environ.items() if k != "GENIE_SERVER_URL"}  # the embedded daemon
    env.update(extra_env or {})
    # A session of its own: on a timeout the whole group goes (the forked child and the daemon too).
    proc = subprocess.Popen([sys.executable, *(argv or ["-c", script])], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"timed out:\n{stdout}{stderr}") from None
    assert proc.returncode == 0, stdout + stderr
    return dict(line.split(" ", 1) for line in stdout.strip().splitlines())


@pytest.mark.parametrize("cluster_keys", [False, True], ids=["plain", "with CURVE client keys in the env"])
def test_forked_child_works_beside_its_parent(cluster_keys, tmp_path):
    # With a cluster's CURVE client keys in the environment the embedded daemon is used without
    # them; a forked child read them again and failed its handshake with the parent's daemon.
    extra_env = {}
    if cluster_keys:
        _, keys = curve_pair(tmp_path)
        extra_env = {"GENIE_CURVE_CLIENT_KEY": keys["client_key"], "GENIE_CURVE_SERVER_KEY": keys["server_key"]}
    lines = _run(CONCURRENT, extra_env=extra_env)
    status, *checks = ast.literal_eval(lines["CHILD"])
    assert status == "ok", lines["CHILD"]
    same_daemon, own_connection, old_error, mixed_error = checks
    assert same_daemon and own_connection  # the parent's embedded daemon, as another client
    # A tensor from before the fork, alone or with one of the child's: the reason, not a hang.
    for error in (old_error, mixed_error):
        assert "forked from pid" in error and "make them again in this process" in error
    assert lines["EXIT"] == "0"
    assert lines["PARENT"] == "ok True True"


def test_forked_child_exit_leaves_the_parents_daemon_alone():
    lines = _run(PLAIN_FORK_EXIT)
    assert lines["CHILD"] == "status 0"
    assert lines["PARENT"] == "ok True True"  # same daemon, still running, same connection


SENDING = textwrap.dedent("""
    import sys, torch, genie
    import torch.multiprocessing as mp
    from multiprocessing.reduction import ForkingPickler

    DEV = "remote_accelerator:0"

    class Tagged(torch.Tensor):  # a tensor class of the program's own
        pass

    def child(q, answers):
        try:
            got = []
            for _ in range(3):
                t = q.get(timeout=90)
                got.append((t.device.type, t.cpu().tolist(), isinstance(t, torch.nn.Parameter), t.requires_grad,
                            t.is_leaf))
            t = q.get(timeout=90)
            got.append((type(t).__name__, t.device.type, t.tolist(), t.note))
            answers.put(("ok", got))
        except BaseException as e:
            answers.put(("failed", repr(e)))

    if __name__ == "__main__":
        ctx = mp.get_context(sys.argv[1])
        q, answers = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=child, args=(q, answers))
        p.start()
        x = torch.arange(6.0, device=DEV).reshape(2, 3)
        q.put(x[:, 1:])  # a view: its own values arrive
        q.put(torch.nn.Parameter(torch.ones(2, device=DEV)))
        q.put(torch.zeros(2, device=DEV, requires_grad=True))
        tagged = torch.arange(2.0).as_subclass(Tagged).to(DEV)
        tagged.note = "kept"
        q.put(tagged)
        print("CHILD", answers.get(timeout=90))
        p.join(60)
        try:
            ForkingPickler.dumps(x.requires_grad_() * 2)
            print("NONLEAF sent")
        except RuntimeError as e:
            print("NONLEAF", str(e)[:40])
""")


def test_remote_tensors_sent_to_a_process_arrive_on_the_device(tmp_path):
    """torch.multiprocessing (Queue, Pipe, Process arguments) delivered remote tensors to the other
    process as CPU tensors (pickled as for torch.save): its work silently ran on its CPU. They
    arrive on remote_accelerator now, as copies (CUDA shares memory by IPC; a daemon's memory
    belongs to one client), Parameters as Parameters; a non-leaf requiring grad is refused as
    torch.multiprocessing refuses it. A tensor of the program's own class arrives as one, with its
    attributes (it arrived on the CPU: its twin class had no reducer)."""
    script = tmp_path / "sending.py"
    script.write_text(SENDING)
    for method in ("spawn", "fork"):
        lines = _run_file(script, method)
        status, got = ast.literal_eval(lines["CHILD"])
        assert status == "ok", (method, got)
        assert got == [("remote_accelerator", [[1.0, 2.0], [4.0, 5.0]], False, False, True),
                       ("remote_accelerator", [1.0, 1.0], True, True, True),
                       ("remote_accelerator", [0.0, 0.0], False, True, True),
                       ("Tagged", "remote_accelerator", [0.0, 1.0], "kept")], method
        assert lines["NONLEAF"] == "Cowardly refusing to serialize non-leaf", method


LOADING = textwrap.dedent("""
    import sys, torch, genie

    class Tagged(torch.Tensor):  # a tensor class of the program's own
        pass

    class Samples(torch.utils.data.Dataset):  # samples made on the device, in the workers
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return {"x": torch.full((3,), float(i), device="remote_accelerator"), "label": i,
                    "tagged": torch.full((2,), float(i)).as_subclass(Tagged).to("remote_accelerator")}

    if __name__ == "__main__":
        loader = torch.utils.data.DataLoader(Samples(), batch_size=4, num_workers=2,
                                             multiprocessing_context=sys.argv[1])
        print("BATCHES", [(b["x"].device.type, b["x"][:, 0].tolist(), b["label"].tolist()) for b in loader])
        print("TAGGED", [(type(b["tagged"]).__name__, b["tagged"].device.type, b["tagged"][:, 0].tolist())
                         for b in loader])
""")


def test_data_loader_workers_may_make_remote_samples(tmp_path):
    """A Dataset whose samples are made on the device, loaded by worker processes: torch's default
    collate stacked each batch into new shared-memory storage of the samples' device, which
    remote tensors cannot have ('cannot allocate or copy storage'); batches are stacked on the
    device now, and arrive as any remote tensor sent between processes does (a copy)."""
    script = tmp_path / "loading.py"
    script.write_text(LOADING)
    for method in ("spawn", "fork"):
        lines = _run_file(script, method)
        assert ast.literal_eval(lines["BATCHES"]) == [
            ("remote_accelerator", [0.0, 1.0, 2.0, 3.0], [0, 1, 2, 3]),
            ("remote_accelerator", [4.0, 5.0, 6.0, 7.0], [4, 5, 6, 7])], method
        assert ast.literal_eval(lines["TAGGED"]) == [  # a class of the program's own: stacked on the device too
            ("Tagged", "remote_accelerator", [0.0, 1.0, 2.0, 3.0]),
            ("Tagged", "remote_accelerator", [4.0, 5.0, 6.0, 7.0])], method


def _run_file(script, *args) -> dict[str, str]:
    return _run(None, [str(script), *args])
