"""Writes a replay's results: ``results.json``, ``requests.csv`` and ``report.html`` with PNG
plots (CDFs of TTFT and TBT, throughput and prefix hit rate over time, effective capacity vs
the TBT threshold, one line per compared system)."""

from __future__ import annotations

import csv
import html
import json
import math
from pathlib import Path

from kvpool.bench.metrics import DEFAULT_TBT_THRESHOLDS, RequestRecord, meets

PLOT_THRESHOLDS = (0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0)


def write_report(out: Path, runs: dict[str, tuple[list[RequestRecord], dict]], meta: dict) -> Path:
    """``runs``: system name -> (records, summary). Returns the HTML report's path."""
    out.mkdir(parents=True, exist_ok=True)
    doc = {"meta": meta, "systems": {n: {"summary": s} for n, (_, s) in runs.items()}}
    # one system: its summary; several: {system: summary}
    doc["summary"] = next(iter(runs.values()))[1] if len(runs) == 1 else \
        {n: s for n, (_, s) in runs.items()}  # fmt: skip
    (out / "results.json").write_text(json.dumps(doc, indent=2, default=_jsonable))
    with (out / "requests.csv").open("w", newline="") as f:
        writer = None
        for name, (records, _) in runs.items():
            for r in records:
                row = {"system": name, **r.to_row()}
                if writer is None:
                    writer = csv.DictWriter(f, fieldnames=list(row))
                    writer.writeheader()
                writer.writerow(row)
    pngs = _plots(out, runs, meta)
    return _html(out, runs, meta, pngs)


def _jsonable(x):
    return None if isinstance(x, float) and not math.isfinite(x) else str(x)


def _plots(out: Path, runs: dict, meta: dict) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, attr, label in ((axes[0], "ttft", "TTFT (s)"), (axes[1], "tbt", "TBT (s)")):
        for name, (records, _) in runs.items():
            xs = sorted(v for v in (getattr(r, attr) for r in records if r.status == "ok")
                        if v is not None)  # fmt: skip
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
        ax.set_xlabel(label)
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
        ax.legend()
    names.append(_save(fig, out / "cdf_ttft_tbt.png"))

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, (records, _) in runs.items():
        t, thr, hit = _over_time(records)
        axes[0].plot(t, thr, label=name)
        axes[1].plot(t, hit, label=name)
    axes[0].set_ylabel("output tokens/s")
    axes[1].set_ylabel("prefix hit rate")
    for ax in axes:
        ax.set_xlabel("time (s)")
        ax.grid(alpha=0.3)
        ax.legend()
    names.append(_save(fig, out / "over_time.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    slo_ttft = meta.get("slo_ttft_s")
    for name, (records, _) in runs.items():
        ys = [sum(meets(r, slo_ttft, th) for r in records) / max(1, len(records))
              for th in PLOT_THRESHOLDS]  # fmt: skip
        ax.plot(PLOT_THRESHOLDS, ys, marker="o", label=name)
    ax.set_xlabel("TBT threshold (s)")
    ax.set_ylabel(f"requests meeting TTFT<={slo_ttft}s and TBT (share)")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend()
    names.append(_save(fig, out / "capacity_vs_tbt.png"))
    return names


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path.name


def _over_time(records: list[RequestRecord], bins: int = 20) -> tuple[list, list, list]:
    ok = [r for r in records if r.status == "ok"]
    if not ok:
        return [], [], []
    end = max(r.sent_s + r.end_s for r in ok)
    width = max(end / bins, 1e-9)
    toks, cached, prompt = [0.0] * bins, [0] * bins, [0] * bins
    for r in ok:
        i = min(bins - 1, int((r.sent_s + r.end_s) / width))
        toks[i] += r.output_tokens
        cached[i] += r.cached_tokens
        prompt[i] += r.prompt_tokens
    t = [(i + 1) * width for i in range(bins)]
    return (
        t,
        [x / width for x in toks],
        [c / p if p else 0.0 for c, p in zip(cached, prompt, strict=True)],
    )


_SHOW = ("completed", "rejected", "failed", "request_throughput", "output_throughput",
         "median_ttft_s", "p99_ttft_s", "median_tpot_s", "p99_itl_s", "median_tbt_s",
         "p99_tbt_s", "median_e2e_s", "prefix_hit_rate", "rejection_rate", "request_goodput",
         *(f"effective_capacity_tbt_{t:g}s" for t in DEFAULT_TBT_THRESHOLDS))  # fmt: skip


def _html(out: Path, runs: dict, meta: dict, pngs: list[str]) -> Path:
    head = "".join(f"<th>{html.escape(n)}</th>" for n in runs)
    rows = []
    for key in _SHOW:
        cells = "".join(f"<td>{_fmt(s.get(key))}</td>" for _, s in runs.values())
        rows.append(f"<tr><td>{key}</td>{cells}</tr>")
    meta_rows = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>"
                        for k, v in meta.items())  # fmt: skip
    imgs = "".join(f'<p><img src="{p}" alt="{p}"></p>' for p in pngs)
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>kvpool replay</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}}td:first-child{{text-align:left}}
</style></head><body><h1>kvpool trace replay</h1>
<h2>Summary</h2><table><tr><th>figure</th>{head}</tr>{"".join(rows)}</table>
{imgs}<h2>Run</h2><table>{meta_rows}</table>
<p>Per-request data: <a href="requests.csv">requests.csv</a>; all figures:
<a href="results.json">results.json</a>.</p></body></html>"""
    path = out / "report.html"
    path.write_text(page)
    return path


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return html.escape(str(v))
