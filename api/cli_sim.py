"""`tierplan sim`: the trace-driven simulator over the cost model, to plan past the machine at hand.

Runs in the user's shell. Heavy modules are imported inside the command. Bad input prints `error: ...` on
stderr and exits 2 (no traceback); nothing is written then.

Example (bench/results/sim_examples.md has the output and where every number comes from): Qwen3-235B-A22B on
one H200 over PCIe Gen5, links as measured on our H200 (bench/results/substrate_h200.md: engine H2D 53.4 GB/s,
disk->host 1.99, host->disk 2.97; ~8 us per load) and our engine's per-layer decode compute there as the
compute prior (bench/results/engine_h200.md; the defaults of --layer-compute-ms / --layer-ms-per-token):

    tierplan sim --routing data/routing/flame_moe_290m_sample.npz \
        --requests data/requests/mooncake_conversation_sample.jsonl --limit 100 --preset qwen3-235b-a22b \
        --kv-gb 24 --policy lru-layer --link-gbps 53.4 --hbm-gb 141 \
        --out bench/results/sim/qwen3-235b-a22b-h200_pcie5 --json
    ... steps=5954 requests=100 tokens_out=36758 tokens/s=4.2 hit_rate=0.422
    ... decode p50=1427.96 ms; time split: compute 12.2%, expert stall 87.8%

and on a GH200 (450 GB/s NVLink-C2C, 96 GB HBM) the same with `--link-gbps 450 --hbm-gb 96`: decode p50 293 ms.
With `--calibrate telemetry.jsonl` (the agent's Telemetry windows, one JSON per line) the cost model is fitted
to a real run first, the hardware and compute options serving only as its prior.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

_ROUTING = "A routing trace (npz, data/README.md layout)."
_REQUESTS = "Mooncake jsonl, or synthetic:NUM,RATE_PER_S,PROMPT_LEN,OUTPUT_LEN (Poisson arrivals)."


def _fail(message: str) -> typer.Exit:
    print(f"error: {message}", file=sys.stderr)
    return typer.Exit(2)


def _requests(spec: str, limit: int | None, time_scale: float, max_prompt: int | None, max_output: int | None,
              seed: int) -> list[Any]:
    from tierplan.controller import sim_traces

    if spec.startswith("synthetic:"):
        parts = spec.removeprefix("synthetic:").split(",")
        try:
            num, rate, prompt, output = int(parts[0]), float(parts[1]), int(parts[2]), int(parts[3])
            if len(parts) != 4 or num < 1 or not rate > 0 or prompt < 1 or output < 1:
                raise ValueError
        except (ValueError, IndexError):
            raise sim_traces.TraceError(f"--requests {spec!r}: expected synthetic:NUM,RATE_PER_S,PROMPT_LEN,"
                                        "OUTPUT_LEN with NUM, the lengths >= 1 and RATE > 0") from None
        reqs = sim_traces.synthetic_requests(num, rate, prompt, output, seed)
    else:
        reqs = sim_traces.load_mooncake(spec, limit=limit, time_scale=time_scale)
    if max_prompt is not None or max_output is not None:
        reqs = sim_traces.scale_requests(reqs, max_prompt or max(r.prompt_len for r in reqs),
                                         max_output or max(r.output_len for r in reqs))
    return reqs


def _read_text(path: Path, option: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (FileNotFoundError, IsADirectoryError, UnicodeDecodeError) as e:
        raise ValueError(f"{option} {str(path)!r}: cannot read it ({type(e).__name__})") from None


def _calibrate(cost: Any, path: Path) -> int:
    """Fold every Telemetry line of `path` into the cost model, in order; -> windows read."""
    from tierplan.controller.protocol import ProtocolError, Telemetry, parse

    num = 0
    for n, line in enumerate(_read_text(path, "--calibrate").splitlines(), 1):
        if not line.strip():
            continue
        try:
            cost.calibrate(parse(Telemetry, line))
        except ProtocolError as e:
            raise ValueError(f"--calibrate {str(path)!r} line {n}: {e}") from None
        num += 1
    if not num:
        raise ValueError(f"--calibrate {str(path)!r}: no telemetry windows")
    return num


def register(app: typer.Typer) -> None:
    """Add this module's command(s) to `app` (called from api.cli.main)."""

    @app.command("sim")
    def sim(
        routing: Annotated[Path, typer.Option(help=_ROUTING)],
        requests: Annotated[str, typer.Option(help=_REQUESTS)],
        preset: Annotated[str | None, typer.Option(
            help="Built-in shape: qwen3-30b-a3b, qwen3-235b-a22b, mixtral-8x7b, deepseek-v3, tiny.")] = None,
        config: Annotated[Path | None, typer.Option(help="A Hugging Face config.json (or its folder).")] = None,
        link_gbps: Annotated[float, typer.Option(min=1e-6, help="Host<->HBM link, GB/s each way.")] = 53.4,
        disk_read_gbps: Annotated[float, typer.Option(min=1e-6, help="NVMe -> host, GB/s.")] = 1.99,
        disk_write_gbps: Annotated[float, typer.Option(min=1e-6, help="Host -> NVMe, GB/s.")] = 2.97,
        overhead_us: Annotated[float, typer.Option(min=0, help="Host cost per transfer record, µs.")] = 8.0,
        hbm_gb: Annotated[float, typer.Option(min=1e-6, help="HBM of the GPU, GB.")] = 141.0,
        hbm_tbps: Annotated[float, typer.Option(min=1e-6, help="HBM read bandwidth, TB/s (expert reads).")] = 4.8,
        kv_gb: Annotated[float, typer.Option(min=0, help="HBM given to KV blocks, GB.")] = 16.0,
        workspace_gb: Annotated[float, typer.Option(min=0, help="HBM kept for activations, GB.")] = 4.0,
        layer_compute_ms: Annotated[float, typer.Option(min=0, help="Dense/attention compute per layer, ms.")] = 0.19,
        layer_ms_per_token: Annotated[float, typer.Option(min=0, help="Extra compute per layer per token, ms.")
                                      ] = 0.0054,
        chunked_step_ms: Annotated[float, typer.Option(
            min=0, help="Once per decode step whose experts outrun a layer's slots (run chunked, off the engine's "
                        "graphs), ms; the H100/H200 phase runs measured 9-27.")] = 0.0,
        resident_frac: Annotated[float | None, typer.Option(
            min=0.0, max=1.0, help="Expert slots as a fraction of all experts (instead of what HBM leaves).")] = None,
        policy: Annotated[str, typer.Option(
            help="Expert cache: lru (one pool), lru-layer, lfu-layer, or plan (with --plan).")] = "lru",
        plan: Annotated[Path | None, typer.Option(
            help="A controller Plan (JSON) to replay whole: its per-layer expert bytes, pins and GPU KV blocks "
                 "(instead of --kv-gb; --policy plan).")] = None,
        max_batch: Annotated[int, typer.Option(min=1, help="Continuous batching: most sequences per step.")] = 32,
        limit: Annotated[int | None, typer.Option(min=1, help="First N requests of the trace.")] = None,
        time_scale: Annotated[float, typer.Option(min=1e-9, help="Multiply arrival times by this.")] = 1.0,
        max_prompt_len: Annotated[int | None, typer.Option(min=1, help="Scale prompts so the longest fits.")] = None,
        max_output_len: Annotated[int | None, typer.Option(min=1, help="Scale outputs so the longest fits.")] = None,
        max_steps: Annotated[int | None, typer.Option(min=1, help="Stop after N steps.")] = None,
        calibrate: Annotated[Path | None, typer.Option(
            help="Telemetry windows (JSON lines, controller.protocol.Telemetry) to calibrate the cost model "
                 "from, in order; the hardware and compute options are then only its prior.")] = None,
        seed: Annotated[int, typer.Option(help="Seed of synthetic requests.")] = 0,
        out: Annotated[Path, typer.Option(help="Folder for sim.json and sim.png.")] = Path("bench/results/sim"),
        json_out: Annotated[bool, typer.Option("--json", help="End with one JSON line: the summary.")] = False,
    ) -> None:
        """Simulate serving a routing + request trace on given hardware; writes sim.json and sim.png."""
        from tierplan.api.cli import _io, _progress
        from tierplan.api.sim_report import write_sim_report
        from tierplan.controller import sim_traces
        from tierplan.controller.costmodel import ComputeParams, CostModel, HardwareSpec
        from tierplan.controller.model_shape import ShapeError, builtin_shape, shape_from_config
        from tierplan.controller.protocol import Link, Plan, ProtocolError, Tier, parse
        from tierplan.controller.sim import SimConfig, Simulator, expert_slots_for
        from tierplan.controller.sim_policy import POLICY_NAMES, PlanPolicy, make_policy

        if (preset is None) == (config is None):
            raise _fail("give exactly one of --preset NAME or --config config.json" if preset is None else
                        f"--preset {preset!r} and --config {str(config)!r} both given; give one")
        if policy not in (*POLICY_NAMES, "plan"):
            raise _fail(f"--policy {policy!r}: expected one of {', '.join((*POLICY_NAMES, 'plan'))}")
        if (policy == "plan") != (plan is not None):
            raise _fail("--policy plan needs --plan PLAN.json" if plan is None else
                        f"--plan {str(plan)!r} is replayed only with --policy plan, got --policy {policy!r}")
        try:
            shape = builtin_shape(preset) if preset is not None else shape_from_config(config)  # type: ignore[arg-type]
            trace = sim_traces.load_routing(routing, shape.num_moe_layers, shape.top_k, shape.num_experts)
            reqs = _requests(requests, limit, time_scale, max_prompt_len, max_output_len, seed)
            hw = HardwareSpec({Link.H2D: link_gbps * 1e9, Link.D2H: link_gbps * 1e9, Link.DISK2H: disk_read_gbps * 1e9,
                               Link.H2DISK: disk_write_gbps * 1e9}, overhead_us * 1e-6, int(hbm_gb * 1e9),
                              hbm_tbps * 1e12, name=f"{hbm_gb:g} GB HBM, {link_gbps:g} GB/s link")
            applied = parse(Plan, _read_text(plan, "--plan")) if plan is not None else None
            if applied is not None:  # the plan's own KV split replaces --kv-gb: it is replayed whole
                kv_blocks = applied.kv_blocks_per_tier.get(Tier.GPU, 0)
                if kv_blocks < 1:
                    raise ValueError(f"--plan {str(plan)!r}: it gives no GPU KV blocks (kv_blocks_per_tier.gpu)")
            else:
                kv_blocks = int(kv_gb * 1e9 // shape.kv_bytes_per_block)
                if kv_blocks < 1:
                    raise ValueError(f"--kv-gb {kv_gb} holds no KV block of {shape.kv_bytes_per_block} bytes")
            total = shape.num_moe_layers * shape.num_experts
            slots = (max(1, round(resident_frac * total)) if resident_frac is not None
                     else expert_slots_for(shape, hw.hbm_bytes, kv_blocks, int(workspace_gb * 1e9)))
            layers_ms = shape.kv_bytes_per_token / shape.num_layers / hw.hbm_bytes_per_s * 1e3
            prior = ComputeParams(dense_ms=layer_compute_ms, dense_ms_per_token=layer_ms_per_token,
                                  attn_ms_per_ctx_token=layers_ms,
                                  moe_ms_per_active_expert=shape.expert_bytes / hw.hbm_bytes_per_s * 1e3,
                                  chunked_step_ms=chunked_step_ms)
            cost = CostModel(shape, hw, prior)
            num_windows = _calibrate(cost, calibrate) if calibrate is not None else 0
            if applied is not None:
                try:
                    cache = PlanPolicy(applied, shape.moe_layers, shape.expert_bytes)
                except ValueError as e:
                    raise ValueError(f"--plan {str(plan)!r}: {e}") from None
                planned = sum(applied.expert_bytes_per_layer) // shape.expert_bytes
                if planned > slots:
                    raise ValueError(f"--plan {str(plan)!r}: its expert bytes hold {planned} experts, the HBM left "
                                     f"by dense weights, KV and workspace holds {slots}")
                slots = planned
            else:
                cache = make_policy(policy, slots, shape.num_moe_layers)
            simulator = Simulator(shape, cost, trace, cache,
                                  SimConfig(kv_gpu_blocks=kv_blocks, max_batch=max_batch, max_steps=max_steps), slots)
            with _progress("sim", len(reqs)) as tick:
                report = simulator.run(reqs, on_finished=tick)
        except (ShapeError, sim_traces.TraceError, ProtocolError, ValueError, RuntimeError) as e:
            raise _fail(str(e)) from None
        inputs = {"model": shape.name, "hardware": hw.name, "routing": str(routing), "requests": requests,
                  "num_requests": len(reqs), "kv_gpu_blocks": kv_blocks, "expert_slots": slots,
                  "resident_frac": slots / total, "link_gbps": link_gbps, "overhead_us": overhead_us,
                  "hbm_gb": hbm_gb, "layer_compute_ms": layer_compute_ms, "layer_ms_per_token": layer_ms_per_token,
                  "chunked_step_ms": chunked_step_ms, "policy": policy, "max_batch": max_batch,
                  "calibration_windows": num_windows,
                  "compute_params": vars(cost.compute), "h2d_overhead_us": cost.overhead_s(Link.H2D) * 1e6,
                  "h2d_gbps_fitted": cost.link_bytes_per_s(Link.H2D) / 1e9}
        json_path, png_path = write_sim_report(out, report, inputs)
        s = report.summary()
        say = _io.out.print
        say(f"model={shape.name} experts={total} x {shape.expert_bytes / 2**20:.1f} MiB slots={slots} "
            f"({slots / total:.1%}) kv_blocks={kv_blocks} policy={policy} hardware='{hw.name}'")
        if num_windows:
            gbps = cost.link_bytes_per_s(Link.H2D) / 1e9
            say(f"calibrated from {num_windows} telemetry windows: h2d {gbps:.2f} GB/s + "
                f"{cost.overhead_s(Link.H2D) * 1e6:.1f} us/load; compute {vars(cost.compute)}")
        say(f"steps={s['steps']} requests={s['requests']} tokens_out={s['tokens_out']} "
            f"tokens/s={s['tokens_per_s']:.1f} hit_rate={s['expert_hit_rate']:.3f}")
        say(f"step ms mean={s['step_ms_mean']:.2f} p50={s['step_ms_p50']:.2f} p99={s['step_ms_p99']:.2f}; "
            f"decode p50={s['decode_step_ms_p50']:.2f}; TPOT p50={s['tpot_ms_p50']:.2f} ms")
        busy = (s["compute_ms_total"] + s["expert_stall_ms_total"] + s["kv_stall_ms_total"]
                + s["both_stall_ms_total"]) or 1.0
        say(f"time split: compute {s['compute_ms_total'] / busy:.1%}, expert stall "
            f"{s['expert_stall_ms_total'] / busy:.1%}, KV stall {s['kv_stall_ms_total'] / busy:.1%}, both "
            f"{s['both_stall_ms_total'] / busy:.1%}")
        say(f"wrote {json_path} and {png_path}")
        if json_out:
            print(json.dumps(s))
