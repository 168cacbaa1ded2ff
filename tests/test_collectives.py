"""torch.distributed across processes on remote tensors (genie/frontend/collectives.py): two
processes, each a client of the session daemon, in one gloo group on loopback: collectives, DDP,
FSDP2, SyncBatchNorm and sparse embedding gradients against the same training in one process."""
import json
import os
import socket
import subprocess
import sys
import textwrap

import torch

RANK_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    import genie
    from torch.nn.parallel import DistributedDataParallel as DDP

    def sync_bn_model():
        return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                   torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 2))

    def sparse_embedding_model():
        return torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Flatten(), torch.nn.Linear(8, 1))

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dev = "remote_accelerator:0"
    out = {}
    t = torch.full((3,), float(rank + 1), device=dev)
    dist.all_reduce(t)
    out["all_reduce"] = t.cpu().tolist()
    parts = [torch.empty(2, device=dev) for _ in range(world)]
    dist.all_gather(parts, torch.full((2,), float(rank), device=dev))
    out["all_gather"] = [p.cpu().tolist() for p in parts]
    b = torch.full((2,), float(rank), device=dev)
    dist.broadcast(b, src=1)
    out["broadcast"] = b.cpu().tolist()
    if rank == 0:
        dist.send(torch.arange(3.0, device=dev), dst=1)
    else:
        r = torch.zeros(3, device=dev)
        dist.recv(r, src=0)
        out["recv"] = r.cpu().tolist()

    # find_unused_parameters and static_graph stage a map of used parameters through pinned memory,
    # which DDP's reducer asserts is pinned.
    for name, options in (("params", {}), ("params_unused", {"find_unused_parameters": True}),
                          ("params_static", {"static_graph": True})):
        torch.manual_seed(rank)  # different initial weights: DDP broadcasts rank 0's
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).to(dev)
        ddp = DDP(model, **options)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(3):
            x = torch.randn(5, 4, generator=g).to(dev)
            loss = ddp(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        out[name] = [p.detach().cpu().flatten().tolist() for p in model.parameters()]

    # FSDP2: parameters sharded over the ranks, all-gathered for each forward and backward into
    # memory freed again after (untyped_storage().resize_), gradients reduce-scattered.
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)  # FSDP2 does not broadcast: every rank starts from the same weights
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).to(dev)
    # init_device_mesh wants letters only: genie/frontend/device_mesh.py lets the name through.
    mesh = init_device_mesh("remote_accelerator", (world,))
    assert type(mesh.device_type) is str and mesh.device_type == "remote_accelerator"
    assert mesh.mesh.tolist() == DeviceMesh("remote_accelerator", torch.arange(world)).mesh.tolist()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        x = torch.randn(5, 4, generator=g).to(dev)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    out["params_fsdp2"] = [p.full_tensor().detach().cpu().flatten().tolist() for p in model.parameters()]

    # SyncBatchNorm under DDP, batches of unequal size: statistics over both ranks' samples.
    torch.manual_seed(0)
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(sync_bn_model()).to(dev)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(200 + rank)
    for _ in range(3):
        ddp(torch.randn(3 + rank, 3, 6, 6, generator=g).to(dev)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    out["params_sync_bn"] = [p.detach().cpu().flatten().tolist() for p in model.parameters()]
    out["running_sync_bn"] = [model[1].running_mean.cpu().tolist(), model[1].running_var.cpu().tolist()]

    # DDP over an nn.Embedding(sparse=True): its sparse gradients all-reduced as they are.
    torch.manual_seed(0)
    model = sparse_embedding_model().to(dev)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        ddp(torch.randint(0, 10, (3, 2), generator=g).to(dev)).pow(2).mean().backward()
        assert model[0].weight.grad.is_sparse
        opt.step()
        opt.zero_grad()
    out["params_sparse"] = [p.detach().cpu().flatten().tolist() for p in model.parameters()]
    dist.destroy_process_group()
    print("RESULT", json.dumps(out))
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_reference() -> list[list[float]]:
    """What DDP computes: rank 0's initial weights, each step's gradient the mean of the ranks'."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gens = [torch.Generator().manual_seed(100 + rank) for rank in range(2)]
    for _ in range(3):
        grads = []
        for g in gens:
            model(torch.randn(5, 4, generator=g)).pow(2).mean().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            opt.zero_grad()
        for p, a, b in zip(model.parameters(), *grads):
            p.grad = (a + b) / 2
        opt.step()
        opt.zero_grad()
    return [p.detach().flatten().tolist() for p in model.parameters()]


def _sync_bn_reference() -> tuple[list[list[float]], list[list[float]]]:
    """What SyncBatchNorm under DDP computes: batch statistics over both ranks' samples, and the
    gradient of the mean of the ranks' losses."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gens = [torch.Generator().manual_seed(200 + rank) for rank in range(2)]
    for _ in range(3):
        batches = [torch.randn(3 + rank, 3, 6, 6, generator=g) for rank, g in enumerate(gens)]
        out = model(torch.cat(batches))
        ((out[:3].pow(2).mean() + out[3:].pow(2).mean()) / 2).backward()
        opt.step()
        opt.zero_grad()
    return ([p.detach().flatten().tolist() for p in model.parameters()],
            [model[1].running_mean.tolist(), model[1].running_var.tolist()])


def _sparse_embedding_reference() -> list[list[float]]:
    """DDP over an embedding with sparse gradients: SGD on the mean of the two ranks' losses."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Flatten(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gens = [torch.Generator().manual_seed(100 + rank) for rank in range(2)]
    for _ in range(3):
        ids = [torch.randint(0, 10, (3, 2), generator=g) for g in gens]
        ((model(ids[0]).pow(2).mean() + model(ids[1]).pow(2).mean()) / 2).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().flatten().tolist() for p in model.parameters()]


def test_collectives_and_ddp_across_two_processes(daemon_endpoint, tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = dict(os.environ, GENIE_SERVER_URL=daemon_endpoint, MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), WORLD_SIZE="2")
    procs = [subprocess.Popen([sys.executable, str(script)], env=dict(env, RANK=str(rank)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    results = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=180)
            assert p.returncode == 0, stderr[-3000:]
            line = next(line for line in stdout.splitlines() if line.startswith("RESULT "))
            results.append(json.loads(line[len("RESULT "):]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r in results:
        assert r["all_reduce"] == [3.0] * 3
        assert r["all_gather"] == [[0.0, 0.0], [1.0, 1.0]]
        assert r["broadcast"] == [1.0, 1.0]
    assert results[1]["recv"] == [0.0, 1.0, 2.0]
    expected = _ddp_reference()
    for r in results:  # both ranks hold the same parameters, those of averaged-gradient SGD
        for name in ("params", "params_unused", "params_static", "params_fsdp2"):
            for got, want in zip(r[name], expected):
                torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    # SyncBatchNorm's ops are CUDA-only in torch: a CPU daemon runs daemon/sync_batch_norm.py.
    params, running = _sync_bn_reference()
    for r in results:
        for got, want in zip(r["params_sync_bn"] + r["running_sync_bn"], params + running):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    # Sparse gradients (genie/frontend/sparse_coo.py) through the same CPU staging.
    expected = _sparse_embedding_reference()
    for r in results:
        for got, want in zip(r["params_sparse"], expected):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
