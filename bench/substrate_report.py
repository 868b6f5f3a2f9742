"""Writes what `tierplan bench substrate` measured (bench process): JSON, a Markdown table per section, a plot."""

from __future__ import annotations

import json
from pathlib import Path

MiB = 1 << 20


def write_substrate_report(out_dir: Path, res: dict, device: str) -> None:
    """substrate_<device>.json, .md (a table per section) and, for a full run, .png."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"substrate_{device}"
    stem.with_suffix(".json").write_text(json.dumps(res, indent=2))
    md = [f"# Substrate benchmark ({res['device']}, torch {res['torch']}, {res['when']})", "",
          f"Python GIL switch interval: {res['gil_switch_interval_us']:.0f} µs (the interpreter's default).", ""]
    if "expert_loads" in res:
        md += ["## Expert loads, pinned host -> slot (map + copy + publish), vs raw pinned host -> device copies of",
               "the same sizes and count on one stream", "",
               "| chunk | in flight | absent experts | maps in | submitted | published | expert bytes "
               "| loads in flight | pipelined GB/s | raw GB/s | ratio | single load ms "
               "| link µs/load: hook · issue · blocked (worker) · retire (retire thread) | "
               "link worker µs/load mapping beside the copy |",
               "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        md += [f"| {_chunk_label(e['chunk_bytes'], e.get('urgent_stream', False))} | "
               f"{e['max_inflight_bytes'] >> 20} MiB | "
               f"{'poison' if e['poison_unmapped'] else 'unmapped'} | {_maps_in(e)}"
               f"{'' if e.get('retire_thread') else ', inline retire'} | "
               f"{'load_many' if e.get('submit', 'each') == 'list' else 'load each'} | "
               f"{'when issued' if e.get('publish') == 'issued' else 'when done'} | {e['expert_bytes']:,} | "
               f"{e['batch']} | {e['pipelined_gbps']:.1f} | {e['raw_gbps']:.1f} | {e['pipelined_ratio']:.3f} | "
               f"{e['single_ms']:.3f} | {_phases(e)} | {_mapper_us(e)} |" for e in res["expert_loads"]]
    if "host_calls" in res:
        c = res["host_calls"]
        md += ["", f"## Host µs per call of what a load issues ({c['expert_bytes']:,}-byte experts, lists of "
               f"{c['batch']}; submission timed with the link's worker held back)", "",
               "| call | µs |", "|---|---|"]
        md += [f"| {k.removesuffix('_us').removesuffix('_us_per_expert').replace('_', ' ')}"
               f"{' (per expert)' if k.endswith('per_expert') else ''} | {v:.1f} |"
               for k, v in c.items() if k.endswith(("_us", "_per_expert"))]
        if c.get("submit_profile"):
            md += ["", "Where submitting a list goes (cProfile of one `load_many`, own time per expert; profiling "
                   "inflates every call):", "", "| function | calls | own µs / expert | total µs / expert |",
                   "|---|---|---|---|"]
            md += [f"| `{r['function']}` | {r['calls']} | {r['own_us_per_expert']:.2f} | "
                   f"{r['total_us_per_expert']:.2f} |" for r in c["submit_profile"]]
    if "map_cost" in res:
        md += ["", "## Map + set access per slot", "", "| slot bytes | map+access µs (median) | p90 | unmap µs |",
               "|---|---|---|---|"]
        md += [f"| {m['stride_bytes']:,} | {m['map_access_us_median']:.1f} | {m['map_access_us_p90']:.1f} | "
               f"{m['unmap_us_median']:.1f} |" for m in res["map_cost"]]
    if "map_while_copying" in res:
        m = res["map_while_copying"]
        md += ["", f"Map / unmap of a {m['stride_bytes']:,}-byte slot while a {m['copy_bytes']:,}-byte H2D copy "
               f"(~{m['copy_us_at_55GBps']:.0f} µs) is in flight: map {m['map']:.1f} µs (copy already done after it: "
               f"{m['copy_done_after_map']:.0f}), unmap {m['unmap']:.1f} µs (copy done after it: "
               f"{m['copy_done_after_unmap']:.0f}). An unmap that waits for DMA shows ~the copy time and 1."]
    if "links" in res:
        md += ["", f"## Transfer engine per link, 1 GiB transfers (disk O_DIRECT: {res['disk_direct_io']})", "",
               "| link | engine GB/s | raw GB/s | ratio |", "|---|---|---|---|"]
        md += [f"| {k} | {v['engine_gbps']:.2f} | {v['raw_gbps']:.2f} | {v['ratio']:.3f} |"
               for k, v in res["links"].items()]
    if "urgent_kv" in res:
        md += ["", "## Small urgent KV transfer (64 KiB) behind a LOW-priority 1 GiB expert stream", "",
               "| chunking | in flight | urgent latency ms | urgent queue delay ms | stream ms |",
               "|---|---|---|---|---|"]
        md += [f"| {_chunk_label(u['chunk_bytes'], u.get('urgent_stream', False))} | "
               f"{u['max_inflight_bytes'] >> 20} MiB | "
               f"{u['urgent_latency_ms_median']:.3f} | {u['urgent_queue_delay_ms_median']:.3f} | "
               f"{u['stream_ms_median']:.2f} |" for u in res["urgent_kv"]]
    if "kv_moves" in res:
        md += _kv_moves_md(res["kv_moves"])
    stem.with_suffix(".md").write_text("\n".join(md) + "\n")
    if {"raw_h2d_gbps", "expert_loads", "urgent_kv"} <= set(res):
        _plot(stem.with_suffix(".png"), res)


# Stored results name the map-in mode by its current name or, in files written before the rename, its old one.
_MAP_IN_LABELS = {"before_copy": "before the copy", "beside_copy": "beside the copy",
                  "worker": "before the copy", "link": "beside the copy"}


def _maps_in(e: dict) -> str:
    m = e.get("map_in", "before_copy")
    return _MAP_IN_LABELS.get(m, m)


def _phases(e: dict) -> str:
    w = e.get("worker_us_per_load")
    return "" if w is None else " · ".join(f"{w[k]:.0f}" for k in ("hook", "issue", "blocked", "retire"))


def _mapper_us(e: dict) -> str:
    w = e.get("worker_us_per_load")
    return "" if w is None or _maps_in(e) != "beside the copy" else f"{w.get('idle', 0.0):.0f}"


def _chunk_label(chunk_bytes: int, urgent_stream: bool = False) -> str:
    label = f"{chunk_bytes >> 20} MiB chunks" if chunk_bytes else "off"
    return label + (" + urgent stream" if urgent_stream else "")


def _plot(path: Path, res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    xs = [int(s) / MiB for s in res["raw_h2d_gbps"]]
    a.plot(xs, list(res["raw_h2d_gbps"].values()), "o-", label="raw pinned H2D")
    a.plot(xs, list(res["raw_d2h_gbps"].values()), "s-", label="raw pinned D2H")
    def key(e: dict) -> tuple:
        return (e["chunk_bytes"], e["max_inflight_bytes"], e["poison_unmapped"], _maps_in(e),
                e.get("submit", "each"), e.get("retire_thread", False), e.get("publish", "done"))

    for cfg in sorted({key(e) for e in res["expert_loads"]}):
        pts = [e for e in res["expert_loads"] if key(e) == cfg]
        pts = [max((p for p in pts if p["expert_bytes"] == n), key=lambda p: p["batch"])
               for n in sorted({p["expert_bytes"] for p in pts})]
        a.plot([e["expert_bytes"] / MiB for e in pts], [e["pipelined_gbps"] for e in pts], "^--", ms=8,
               label=f"loads, {_chunk_label(cfg[0])}, {cfg[1] >> 20} MiB in flight, "
                     f"{'poison' if cfg[2] else 'unmapped'}, maps in {cfg[3]}, submit {cfg[4]}"
                     f"{'' if cfg[5] else ', inline retire'}, published when {cfg[6]}")
    a.set_xscale("log", base=2)
    a.set_xlabel("transfer size (MiB)")
    a.set_ylabel("GB/s")
    a.set_title("Host<->device bandwidth")
    a.legend(fontsize=7)
    labels = [f"{_chunk_label(u['chunk_bytes'])}\n{u['max_inflight_bytes'] >> 20} MiB" for u in res["urgent_kv"]]
    b.bar(labels, [u["urgent_latency_ms_median"] for u in res["urgent_kv"]],
          color=["tab:green" if u["chunk_bytes"] else "tab:red" for u in res["urgent_kv"]])
    b.set_yscale("log")
    b.set_ylabel("ms (median)")
    b.set_title("64 KiB urgent KV copy behind an expert stream")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _kv_moves_md(k: dict) -> list[str]:
    """The kvmoves section: µs per block of a GPU <-> CPU list, one move at a time, as one list, raw copies."""
    md = ["", f"## KV block lists through the KV handler ({k['num_blocks']:,} blocks of {k['block_bytes'] >> 10} "
          f"KiB, median of {k['reps']}), µs per block", "",
          "| direction | raw copies | one list | one move at a time | list / raw | each / list "
          "| list: caller submits · waits | list: link worker hook · issue · blocked · retire |",
          "|---|---|---|---|---|---|---|---|"]
    for d, name in (("to_cpu", "GPU -> CPU"), ("to_gpu", "CPU -> GPU")):
        lst = k["list"]
        worker = " · ".join(f"{lst[f'{d}_worker_{p}_us']:.1f}" for p in ("hook", "issue", "blocked", "retire"))
        md.append(f"| {name} | {k[f'raw_{d}_us']:.1f} | {lst[f'{d}_us']:.1f} | {k['each'][f'{d}_us']:.1f} | "
                  f"{k[f'list_over_raw_{d}']:.2f} | {k[f'each_over_list_{d}']:.2f} | "
                  f"{lst[f'{d}_submit_us']:.1f} · {lst[f'{d}_wait_us']:.1f} | {worker} |")
    return md
