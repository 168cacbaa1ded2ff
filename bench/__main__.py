"""`python -m bench`: run the whole suite, write JSON and PNG plots under bench/results/ (or
GENIE_BENCH_RESULTS), print a summary.

    python -m bench [--quick] [--only transport_throughput,capture_overhead,...]

Each benchmark runs in its own process (its own daemons); see each module's
docstring for what it measures. --quick shrinks sizes and repetitions.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench.common import results_dir

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = results_dir()

SUITE = {
    "capture_overhead": (["--repeats", "5"], ["--repeats", "3", "--ops", "8000", "--roundtrips", "200"]),
    "transport_throughput": (["--repeats", "3"], ["--repeats", "2", "--max-mb", "64"]),
    "model_transfer": (["--repeats", "5"], ["--repeats", "2", "--layers", "2"]),
    "end_to_end": (["--repeats", "3"], ["--repeats", "2", "--tokens", "16"]),
    "hf_decode": (["--repeats", "5"], ["--repeats", "2", "--tokens", "16"]),
    "many_clients": ([], ["--clients", "1,4", "--requests", "100"]),
    "pipeline": (["--repeats", "5"], ["--repeats", "2"]),
    "analysis_cache": ([], ["--steps", "20"]),
    "gpu_paths": (["--repeats", "5"], ["--repeats", "2", "--max-mb", "64"]),
    "rpc_peer": (["--repeats", "3"], ["--repeats", "2", "--tokens", "16"]),
    "network_latency": (["--repeats", "5"], ["--repeats", "2", "--rtt-ms", "0,2", "--tokens", "8"]),
    "layouts": (["--repeats", "5"], ["--repeats", "2", "--mb", "16"]),
    "peer_transfer": (["--repeats", "5"], ["--repeats", "2", "--sizes-mb", "4,16"]),
    "flow_cap": (["--repeats", "7"], ["--repeats", "2", "--sizes-mb", "16"]),  # needs root: says so otherwise
    "opinfo_sweep": (["--json", os.path.join(RESULTS, "opinfo_sweep.json")],
                     ["--json", os.path.join(RESULTS, "opinfo_sweep.json"), "--max-samples", "2"]),
}


def load(name: str) -> dict:
    path = os.path.join(RESULTS, f"{name}.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def plot() -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots")
        return []
    written = []
    tt = load("transport_throughput")
    if tt:
        n = len(tt["results"])
        fig, axes = plt.subplots(1, n, figsize=(5.5 * n, 4), sharey=True, squeeze=False)
        axes = axes[0]
        for ax, (kind, per_size) in zip(axes, tt["results"].items()):
            sizes = [int(s) for s in per_size]
            for key, label in (("raw_MBps", "raw socket"), ("zmq_MBps", "pyzmq"), ("genie_up_MBps", "genie upload"),
                               ("genie_down_MBps", "genie download")):
                ax.plot(sizes, [per_size[str(s)][key] for s in sizes], marker="o", label=label)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{kind}: MB/s by payload size")
            ax.set_xlabel("bytes")
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("MB/s")
        axes[0].legend()
        fig.tight_layout()
        path = os.path.join(RESULTS, "transport_throughput.png")
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    mc = load("many_clients")
    if mc:
        runs = mc["runs"]
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [r["clients"] for r in runs]
        ax.plot(xs, [r["p50_ms"] for r in runs], marker="o", label="p50 latency")
        ax.plot(xs, [r["p99_ms"] for r in runs], marker="o", label="p99 latency")
        ax2 = ax.twinx()
        ax2.bar(xs, [r["requests_per_s"] for r in runs], alpha=0.2, color="gray", label="requests/s")
        ax.set_xlabel("client processes")
        ax.set_ylabel("ms")
        ax2.set_ylabel("requests/s")
        ax.legend(loc="upper left")
        fig.tight_layout()
        path = os.path.join(RESULTS, "many_clients.png")
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def summary() -> None:
    rows = []
    co = load("capture_overhead")
    if co:
        rows.append(("capture per op (target <= 2x floor, < 10 us)",
                     f"{co['capture_us_per_op']:.1f} us = {co['capture_over_floor']:.2f}x floor"
                     + (f" ({co['capture_with_daemon_us_per_op']:.1f} us with the daemon on the same cores)"
                        if "capture_with_daemon_us_per_op" in co else "")))
        rows.append(("tiny-op round trip (target <= 1.5x echo)",
                     f"{co['tiny_op_roundtrip_us']:.0f} us = {co['roundtrip_over_echo']:.2f}x echo"))
    tt = load("transport_throughput")
    if tt:
        from bench.transport_throughput import worse_way

        for kind, per_size in tt["results"].items():
            big = [r for s, r in per_size.items() if int(s) >= 4 << 20]
            if big:
                worst = min(worse_way(r) for r in big)
                target = "encrypted, against a plaintext socket" if "CURVE" in kind else "target >= 90%"
                rows.append((f"{kind} transfer >= 4 MB vs raw socket ({target})", f"worst {worst * 100:.0f}%"))
    fc = load("flow_cap")
    if fc:
        size = max(fc["raw_MBps"]["1"], key=int)
        rates = {lanes: min(ways["up"][size], ways["down"][size]) for lanes, ways in fc["genie_MBps"].items()}
        rows.append((f"{int(size) >> 20} MiB over a link capping each flow at {fc['flow_mbit']} Mbit/s"
                     + (" (CURVE)" if fc.get("curve") else ""),
                     ", ".join(f"{lanes} lane(s) {rate:.0f} MB/s" for lanes, rate in sorted(rates.items()))
                     + f" (raw socket, 1 flow: {fc['raw_MBps']['1'][size]:.0f})"))
    pt = load("peer_transfer")
    sizes = [s for s in pt if s.isdigit()]
    if sizes:
        size = max(sizes, key=int)
        r = pt[size]
        rows.append((f"daemon to daemon, {int(size) >> 20} MiB, vs x.cpu().to(other daemon)",
                     f"{r['ms']['peer, default lanes']:.1f} ms ({r['GBps']['peer, default lanes']:.2f} GB/s) vs "
                     f"{r['ms']['through the client']:.1f} ms: "
                     f"{r['speedup_over_client_path']['peer, default lanes']:.2f}x faster"))
    mt = load("model_transfer")
    for kind, r in mt.get("results", {}).items():
        rows.append((f"model.to() of {r['bytes'] / 2**20:.0f} MiB in {r['tensors']} tensors, {kind}, vs raw socket",
                     f"up {r['up_over_raw'] * 100:.0f}%, down {r['down_over_raw'] * 100:.0f}%"))
    e2e = load("end_to_end")
    if e2e:
        gpt = e2e["gpt"]
        rows.append(("GPT decode vs local eager (target <= 1.3x)", f"{gpt['decode_slowdown']:.1f}x slower op by op"
                     + (f", {gpt['decode_slowdown_replay']:.2f}x with genie.graph replay"
                        if "decode_slowdown_replay" in gpt else "")))
        rows.append(("GPT wire bytes per token", f"{gpt['wire_bytes_per_token']:.0f} B"
                     + (f" ({gpt['wire_bytes_per_token_replay']:.0f} B replayed)"
                        if "wire_bytes_per_token_replay" in gpt else "")))
    hf = load("hf_decode")
    if hf:
        rows.append(("Hugging Face Llama decode, time per token vs local",
                     f"{hf['slowdown_vs_local']['remote']:.2f}x generate() op by op, "
                     f"{hf['slowdown_vs_local']['remote_replay']:.2f}x StaticCache step replayed"))
    gp = load("gpu_paths")
    if gp:
        for n, r in gp["results_MBps"].items():
            rows.append((f"GPU paths, {int(n) >> 20} MiB ({gp['device']}), MB/s",
                         f"CUDA IPC up {r['genie_up_cuda_ipc']:,.0f} vs as bytes {r['genie_up_cuda_bytes']:,.0f}; "
                         f"CPU up {r['genie_up_cpu']:,.0f} (local pageable copy {r['local_pageable_h2d']:,.0f})"))
    rp = load("rpc_peer")
    if rp:
        rows.append(("torch.distributed.rpc decode tokens/s", f"{rp['decode_tokens_per_s']['rpc']:.0f}"))
    mc = load("many_clients")
    for r in mc.get("runs", []):
        rows.append((f"{r['clients']} clients: requests/s, p50/p99 ms",
                     f"{r['requests_per_s']:.0f}, {r['p50_ms']:.2f}/{r['p99_ms']:.2f}, {r['wrong']} wrong"))
    pl = load("pipeline")
    if pl:
        rows.append(("two-stage pipeline vs back to back", f"{pl['reduction'] * 100:.0f}% less wall time"))
    ac = load("analysis_cache_fx")
    if ac:
        rows.append(("analysis cache over decode steps", f"{ac['topology_hit_rate'] * 100:.0f}% hits, "
                                                          f"{ac['analysis_on_topology_hit_ms']:.2f} ms per analysis"))
    nl = load("network_latency")
    for r in nl.get("runs", []):
        t, d = r["train_step"], r["decode_per_token"]
        rows.append((f"RTT {r['rtt_ms']:g} ms (proxy): training step / decode token, op by op",
                     f"{t[0] * 1e3:.1f} ms, {t[1]:.0f} round trip for {t[2]:.0f} ops / {d[0] * 1e3:.2f} ms, "
                     f"{d[1]:.1f} for {d[2]:.0f} ops"))
        if "model_cpu" in r:
            ms = lambda key: r[key][0] * 1e3  # noqa: E731
            rows.append((f"RTT {r['rtt_ms']:g} ms (proxy): GPT model.cpu() / torch.save(state_dict)",
                         f"{ms('model_cpu'):.1f} ms ({ms('model_cpu_one_by_one'):.1f} a tensor at a time) / "
                         f"{ms('save_state_dict'):.1f} ms ({ms('save_state_dict_one_by_one'):.1f})"))
    lay = load("layouts").get("layouts", {})
    if lay:
        rows.append(("channels-last / transposed vs row-major (upload, .cpu())",
                     ", ".join(f"{name} {r['up_vs_row_major']:.2f}x / {r['down_vs_row_major']:.2f}x"
                               for name, r in lay.items() if name != "row-major")))
    op = load("opinfo_sweep")
    if op:
        rows.append(("OpInfo float32 samples equal to CPU", f"{op['pass_rate'] * 100:.1f}%"))
    from bench.common import print_table

    print("\n# summary")
    print_table(rows, ("measure", "result"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", default="")
    args = p.parse_args(argv)
    os.makedirs(RESULTS, exist_ok=True)
    names = [n for n in SUITE if not args.only or n in args.only.split(",")]
    failed = []
    for name in names:
        full, quick = SUITE[name]
        cmd = [sys.executable, "-m", f"bench.{name}", *(quick if args.quick else full)]
        print(f"\n$ {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, cwd=os.path.dirname(HERE)).returncode
        print(f"({name}: {time.perf_counter() - t0:.0f}s, exit {rc})", flush=True)
        if rc != 0:
            failed.append(name)
    for path in plot():
        print("wrote", path)
    summary()
    if failed:
        print("failed:", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
