"""A simulation's report: the bench report (``results.json`` with the same summary as
``kvpool bench replay``, ``requests.csv``, ``report.html`` and its plots), plus ``sim.json``
(nodes, timelines, the capacity sweep) and ``simulation.html`` with the simulator's plots:
TTFT by policy, hit rate over time (predicted and realized), queues, per-node load and the
effective capacity against the TBT threshold."""

from __future__ import annotations

import html
import json
import math
from pathlib import Path

from kvpool.bench.report import write_report
from kvpool.sim.job import OUTCOMES
from kvpool.sim.run import SystemResult

_TABLE = ("completed", "rejected", "mean_ttft_s", "median_ttft_s", "p90_ttft_s", "p99_ttft_s",
          "median_tbt_s", "p99_tbt_s", "prefix_hit_rate", "sim_predicted_hit_rate",
          "sim_best_hit_rate", *(f"sim_route_{k}" for k in OUTCOMES),
          "sim_route_cache_left_elsewhere", "sim_route_ttft_over_prediction",
          "sim_pool_evictions", "sim_local_cache_evictions", "sim_wall_s")  # fmt: skip


def write_sim_report(out: Path, results: dict[str, SystemResult], meta: dict,
                     capacity: dict | None = None) -> tuple[Path, Path]:  # fmt: skip
    """(report.html, simulation.html)."""
    runs = {name: (r.records, r.summary) for name, r in results.items()}
    bench_html = write_report(out, runs, meta)
    doc = {"meta": meta, "capacity": capacity,
           "systems": {n: {"summary": r.summary, **r.details} for n, r in results.items()}}  # fmt: skip
    (out / "sim.json").write_text(json.dumps(doc, indent=1, default=_jsonable))
    pngs = _plots(out, results, capacity)
    return bench_html, _html(out, results, meta, capacity, pngs)


def _jsonable(x):
    return None if isinstance(x, float) and not math.isfinite(x) else str(x)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path.name


def _plots(out: Path, results: dict[str, SystemResult], capacity: dict | None) -> list[str]:
    plt = _plt()
    names = list(results)
    pngs = []
    fig, ax = plt.subplots(figsize=(max(5, 1.4 * len(names)), 4))
    means = [results[n].summary.get("mean_ttft_s") or 0.0 for n in names]
    p90 = [results[n].summary.get("p90_ttft_s") or 0.0 for n in names]
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], means, 0.4, label="mean")
    ax.bar([x + 0.2 for x in xs], p90, 0.4, label="p90")
    for x, m in zip(xs, means, strict=True):
        ax.annotate(f"{m:.2f}", (x - 0.2, m), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), names, rotation=20, ha="right")
    ax.set_ylabel("TTFT (s)")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    pngs.append(_save(plt, fig, out / "ttft_by_policy.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    for n in names:
        t, real, pred = _hits_over_time(results[n])
        line = ax.plot(t, real, label=f"{n}")[0]
        ax.plot(t, pred, linestyle="--", color=line.get_color(), alpha=0.6)
    ax.set_xlabel("arrival time (s)")
    ax.set_ylabel("prefix hit rate (dashed: predicted)")
    ax.grid(alpha=0.3)
    ax.legend()
    pngs.append(_save(plt, fig, out / "hit_rate_over_time.png"))

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for n in names:
        tl = results[n].details["timeline"]
        axes[0].plot(tl["t"], [sum(q) for q in tl["queued_prefill_tokens"]], label=n)
        axes[1].plot(tl["t"], [sum(b) for b in tl["decode_batch"]], label=n)
    axes[0].set_ylabel("queued prefill tokens (all nodes)")
    axes[1].set_ylabel("running sequences (all nodes)")
    for ax in axes:
        ax.set_xlabel("time (s)")
        ax.grid(alpha=0.3)
        ax.legend()
    pngs.append(_save(plt, fig, out / "queues.png"))

    fig, ax = plt.subplots(figsize=(9, 4))
    for n in names:
        nodes = results[n].details["nodes"]
        ax.plot(range(len(nodes)), [x["utilization"] for x in nodes], marker="o", label=n)
    ax.set_xlabel("node (prefill first, then decode)")
    ax.set_ylabel("busy share of the run")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend()
    pngs.append(_save(plt, fig, out / "node_load.png"))

    if capacity:
        fig, ax = plt.subplots(figsize=(6, 4))
        ths = capacity["thresholds"]
        for n, cap in capacity["capacity"].items():
            ax.plot(ths, [cap[f"{t:g}"] for t in ths], marker="o", label=n)
        ax.set_xscale("log")
        ax.set_xlabel("TBT threshold (s)")
        ax.set_ylabel(f"effective capacity (req/s, {capacity['quantile']:.0%} within SLOs)")
        ax.grid(alpha=0.3)
        ax.legend()
        pngs.append(_save(plt, fig, out / "effective_capacity.png"))
    return pngs


def _hits_over_time(r: SystemResult, bins: int = 20) -> tuple[list, list, list]:
    ok = [x for x in r.records if x.status == "ok"]
    if not ok:
        return [], [], []
    end = max(x.arrival_s for x in ok)
    width = max(end / bins, 1e-9)
    real, pred, prompt = [0] * bins, [0] * bins, [0] * bins
    for x in ok:
        i = min(bins - 1, int(x.arrival_s / width))
        real[i] += x.realized_hit_tokens
        pred[i] += x.predicted_hit_tokens
        prompt[i] += x.prompt_tokens
    t = [(i + 0.5) * width for i in range(bins)]
    return (t, [a / p if p else 0.0 for a, p in zip(real, prompt, strict=True)],
            [a / p if p else 0.0 for a, p in zip(pred, prompt, strict=True)])  # fmt: skip


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else html.escape(str(v))


def _html(out: Path, results: dict[str, SystemResult], meta: dict, capacity: dict | None,
          pngs: list[str]) -> Path:  # fmt: skip
    head = "".join(f"<th>{html.escape(n)}</th>" for n in results)
    shapes = "".join(f"<td>{html.escape(r.details['system']['shape'])}"
                     f"{' + pool' if r.details['system']['pool'] else ''}</td>"
                     for r in results.values())  # fmt: skip
    rows = [f"<tr><td>cluster</td>{shapes}</tr>"]
    for key in _TABLE:
        cells = "".join(f"<td>{_fmt(r.summary.get(key))}</td>" for r in results.values())
        rows.append(f"<tr><td>{key}</td>{cells}</tr>")
    cap = ""
    if capacity:
        ths = capacity["thresholds"]
        cap_rows = "".join(
            f"<tr><td>{html.escape(n)}</td>" + "".join(f"<td>{_fmt(c[f'{t:g}'])}</td>" for t in ths)
            + "</tr>" for n, c in capacity["capacity"].items())  # fmt: skip
        cap = ("<h2>Effective capacity (requests/s)</h2><table><tr><th>TBT threshold (s)</th>"
               + "".join(f"<th>{t:g}</th>" for t in ths) + f"</tr>{cap_rows}</table>")  # fmt: skip
    meta_rows = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>"
                        for k, v in meta.items() if not isinstance(v, dict | list))  # fmt: skip
    imgs = "".join(f'<p><img src="{p}" alt="{p}"></p>' for p in pngs)
    basis = "".join(f"<h3>{title}</h3><ul>" + "".join(f"<li>{html.escape(str(x))}</li>"
                                                      for x in meta.get(key) or []) + "</ul>"
                    for key, title in (("profile_sources", "Profile sources"),
                                       ("profile_assumptions", "Profile assumptions")))  # fmt: skip
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>kvpool sim</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}}td:first-child{{text-align:left}}
</style></head><body><h1>kvpool cluster simulation</h1>
<p>Figures of a simulation, not a measurement (docs/simulator.md says what is modeled). The
bench-format report of the same runs: <a href="report.html">report.html</a>.</p>
<h2>Summary</h2><table><tr><th>figure</th>{head}</tr>{"".join(rows)}</table>{cap}
{imgs}<h2>Run</h2><table>{meta_rows}</table>{basis}
<p>Per-request data (predicted and realized hits, route outcome): <a href="requests.csv">
requests.csv</a>; nodes and timelines: <a href="sim.json">sim.json</a>.</p></body></html>"""
    path = out / "simulation.html"
    path.write_text(page)
    return path
