"""Scheduling and placement over hand-made network models (no daemons, no I/O)."""
import torch

from genie.examples.gpt import GPTConfig, TinyGPT
from genie.examples.zoo import TwoTower
from genie.frontend.graph_capture import Capture, build_graph
from genie.semantic import DeviceSpec, LinkSpec, NetworkModel, analyze_graph
from genie.semantic.cache import AnalysisCache

GPU = 5e12  # FLOP/s of a fake fast remote device


def remote(i, flops=GPU, bandwidth=10e9, latency=50e-6):
    return DeviceSpec(f"remote_accelerator:{i}", flops, LinkSpec(bandwidth, latency), op_overhead=10e-6)


def local(flops=5e10):
    return DeviceSpec("local", flops, LinkSpec(float("inf"), 0.0), is_local=True)


def analyse(model, args, kwargs, network):
    with torch.no_grad():
        graph, out = build_graph(model, args, kwargs)
    return analyze_graph(graph, network, cache=AnalysisCache()), out


def test_two_towers_go_to_different_devices_and_run_in_parallel():
    torch.manual_seed(0)
    model = TwoTower(image_width=32).eval()
    net = NetworkModel([remote(0, flops=2e10), remote(1, flops=2e10)])
    a, _ = analyse(model, (torch.randn(4, 3, 32, 32), torch.randint(0, 1000, (4, 16))), {}, net)
    s = a.schedule
    towers = {}
    for n in a.graph.op_nodes():
        tower = n.module_path.split(".")[0]
        if tower in ("image_encoder", "text_encoder"):
            towers.setdefault(tower, set()).add(s.placement[n.id])
    assert len(towers["image_encoder"]) == 1 and len(towers["text_encoder"]) == 1
    assert towers["image_encoder"] != towers["text_encoder"]
    assert any(st.strategy == "parallel" for st in s.stages)


def test_a_much_slower_daemon_gets_almost_none_of_the_work():
    torch.manual_seed(0)
    model = TwoTower(image_width=32).eval()
    net = NetworkModel([remote(0, flops=2e10), remote(1, flops=2e8)])  # as a bad calibration could report
    a, _ = analyse(model, (torch.randn(4, 3, 32, 32), torch.randint(0, 1000, (4, 16))), {}, net)
    flops = {}
    for n in a.graph.op_nodes():
        device = a.schedule.placement[n.id]
        flops[device] = flops.get(device, 0.0) + a.costs.nodes[n.id].flops
    # Greedy earliest-finish placement may still give the idle slow daemon near-free ops.
    assert flops.get("remote_accelerator:1", 0.0) < 0.05 * sum(flops.values())


def gpt_step(model, context, network):
    ids = torch.randint(0, model.cfg.vocab_size, (1, context))
    with torch.no_grad():
        _, past = model(ids, torch.arange(context))
    return analyse(model, (ids[:, -1:], torch.tensor([context])), {"past_key_values": past}, network)[0]


def test_decoder_cache_and_attention_share_a_device_and_bytes_do_not_grow():
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(n_layers=2, dim=64, max_seq_len=300)).eval()
    net = NetworkModel([remote(0), local()])
    moved = {}
    for context in (16, 256):
        a = gpt_step(model, context, net)
        s = a.schedule
        for m in a.matches("kv_cache"):
            assert s.placement[m.hints["cache_node"]] == s.placement[m.hints["attention"]]
            for past in m.hints["past_inputs"]:
                assert s.placement[past] == s.placement[m.hints["attention"]]
        moved[context] = s.bytes_moved
    assert moved[16] == moved[256], moved


def test_weights_stay_where_they_were_uploaded():
    w = torch.randn(16, 16)
    with Capture() as cap:
        y = torch.randn(4, 16) @ w
        cap.set_outputs(y)
    w_node = next(n for n in cap.graph.nodes if n.is_input and n.meta.shape == (16, 16))
    w_node.resident = "remote_accelerator:1"
    net = NetworkModel([remote(0), remote(1), local()])
    a = analyze_graph(cap.graph, net, cache=AnalysisCache())
    mm = next(n for n in cap.graph.op_nodes() if n.op == "aten::mm")
    assert a.schedule.placement[mm.id] == "remote_accelerator:1"


def small_work():
    with Capture() as cap:
        x = torch.randn(8, 8)
        y = torch.relu(x @ x + 1)
        cap.set_outputs(y)
    return cap.graph


def medium_work():
    x = torch.randn(256, 256)  # comes from the client: 256 KiB must cross the link
    with Capture() as cap:
        y = (x @ x).relu() @ x
        cap.set_outputs(y.sum())
    return cap.graph


def big_work():
    with Capture() as cap:
        x = torch.randn(1024, 1024)
        y = x @ x @ x
        cap.set_outputs(y.sum())
    return cap.graph


def placements(graph, network):
    a = analyze_graph(graph, network, cache=AnalysisCache())
    return {a.schedule.placement[n.id] for n in graph.op_nodes()}


def test_slow_link_keeps_small_work_local_and_placement_follows_the_network():
    fast = NetworkModel([remote(0, bandwidth=10e9, latency=20e-6), local()])
    slow = NetworkModel([remote(0, bandwidth=1e6, latency=10e-3), local()])
    assert placements(small_work(), slow) == {"local"}
    assert placements(small_work(), fast) == {"local"}  # a few hundred FLOPs never pay a round trip
    # The same medium-sized work moves when the measured link changes.
    assert placements(medium_work(), fast) == {"remote_accelerator:0"}
    assert placements(medium_work(), slow) == {"local"}
    # Heavy work whose data is made on the device goes remote even over the slow link.
    assert placements(big_work(), slow) == {"remote_accelerator:0"}


def test_stages_are_topological_generations():
    torch.manual_seed(0)
    a, _ = analyse(TwoTower().eval(), (torch.randn(1, 3, 8, 8), torch.randint(0, 1000, (1, 4))), {},
                   NetworkModel([remote(0), remote(1)]))
    s = a.schedule
    stage_of = {gid: st.index for st in s.stages for gid in st.groups}
    group_of = {n: gid for gid, g in s.groups.items() for n in g.nodes}
    for n in a.graph.op_nodes():
        for i in n.input_ids:
            if not a.graph[i].is_input and group_of[i] != group_of[n.id]:
                assert stage_of[group_of[i]] < stage_of[group_of[n.id]]
