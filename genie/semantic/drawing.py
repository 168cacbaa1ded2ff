"""Pictures of an analysis: the graph coloured by phase, outlined by placement (matplotlib)."""
from __future__ import annotations

PHASE_COLOURS = {
    "llm_prefill": "#4C72B0", "llm_decode": "#DD8452", "vision_backbone": "#55A868",
    "forward": "#8C8C8C", "backward": "#C44E52", "input": "#FFFFFF",
}
DEVICE_EDGES = ["#000000", "#9467BD", "#17BECF", "#BCBD22", "#E377C2", "#7F7F7F"]


def draw(analysis, path: str, fmt: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError as e:
        raise RuntimeError("drawing needs matplotlib: pip install 'genie[viz]'") from e
    import networkx as nx

    g = analysis.graph.to_networkx()
    # Layered layout: x = program order, y = depth so that branches separate.
    depth: dict[int, int] = {}
    for n in nx.topological_sort(g):
        depth[n] = 1 + max((depth[p] for p in g.predecessors(n)), default=-1)
    by_depth: dict[int, int] = {}
    pos = {}
    for n in sorted(g.nodes):
        lane = by_depth.get(depth[n], 0)
        by_depth[depth[n]] = lane + 1
        pos[n] = (depth[n], -lane)
    placement = analysis.schedule.placement if analysis.schedule else {}
    devices = sorted(set(placement.values()))
    colours = [PHASE_COLOURS["input"] if analysis.graph[n].is_input else PHASE_COLOURS[analysis.phases[n]]
               for n in g.nodes]
    edges = [DEVICE_EDGES[devices.index(placement[n]) % len(DEVICE_EDGES)] if n in placement else "#000000"
             for n in g.nodes]
    width = max(8, min(60, len(depth and set(depth.values())) * 0.25))
    height = max(4, min(30, max(by_depth.values(), default=1) * 0.4))
    fig, ax = plt.subplots(figsize=(width, height))
    nx.draw_networkx_edges(g, pos, ax=ax, arrows=False, alpha=0.3, width=0.6)
    nx.draw_networkx_nodes(g, pos, ax=ax, node_color=colours, edgecolors=edges, linewidths=1.5, node_size=60)
    handles = [Patch(color=c, label=p) for p, c in PHASE_COLOURS.items() if p != "input"]
    handles += [Line2D([], [], marker="o", color="w", markeredgecolor=DEVICE_EDGES[i % len(DEVICE_EDGES)],
                       markerfacecolor="w", label=f"on {d}") for i, d in enumerate(devices)]
    ax.legend(handles=handles, loc="upper left", fontsize=8)
    ax.set_title(analysis.summary().splitlines()[0], fontsize=9)
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, format=fmt)
    plt.close(fig)
    return path
