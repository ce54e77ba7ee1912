"""PNG plots of a bench run (matplotlib, Agg backend; small files: low dpi).

- ``timeline_<scenario>.png``: one row per policy (first repeat): normalised throughput per job over
  time (left) and worker target per job (right), events as vertical lines.
- ``policies.png``: aggregate normalised throughput per policy, grouped by scenario (median; whiskers
  min..max over repeats).
"""
from __future__ import annotations

from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def timeline(phases: list[dict], scenario: str, path: Path) -> Path | None:
    rows = [ph for ph in phases if ph["scenario"] == scenario and ph.get("rep") == 0 and ph.get("series")]
    if not rows:
        return None
    plt = _plt()
    fig, axes = plt.subplots(len(rows), 2, figsize=(9, 1.7 * len(rows) + 0.6), squeeze=False, sharex=True)
    jobs = sorted({j for ph in rows for j in ph["series"]})
    colors = {j: f"C{i}" for i, j in enumerate(jobs)}
    for (ax_t, ax_w), ph in zip(axes, rows):
        origin = ph.get("origin") or 0.0
        for j, s in sorted(ph["series"].items()):
            ax_t.plot(s["t"], s["normalised"], color=colors[j], lw=1, label=j)
            nudge = 0.05 * (jobs.index(j) - (len(jobs) - 1) / 2)   # equal counts stay visible
            ax_w.step(s["wt"], [w + nudge for w in s["workers"]], where="post", color=colors[j], lw=1)
        for e in ph.get("events") or []:
            for ax in (ax_t, ax_w):
                ax.axvline(e["t"] - origin, color="k", ls="--", lw=0.7)
        if ph.get("warmup_s") and ph.get("kind") != "dynamic":
            ax_t.axvspan(0, ph["warmup_s"], color="0.9", lw=0)
        ax_t.set_ylabel(ph["policy"], fontsize=8)
        ax_t.set_ylim(0, 1.1)
        ax_w.set_ylim(0, max(1, max((max(s["workers"]) for s in ph["series"].values()), default=1)) + 0.5)
        for ax in (ax_t, ax_w):
            ax.tick_params(labelsize=7)
    axes[0][0].set_title("normalised throughput per job", fontsize=9)
    axes[0][1].set_title("worker target per job", fontsize=9)
    axes[-1][0].set_xlabel("s since all initial jobs run (grey: warm-up; dashed: events)", fontsize=8)
    axes[-1][1].set_xlabel("s", fontsize=8)
    axes[0][0].legend(fontsize=6, loc="lower right", ncol=min(3, len(jobs)))
    fig.suptitle(f"{scenario} (repeat 1)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=60)
    plt.close(fig)
    return path


def policy_bars(summary: dict, path: Path) -> Path | None:
    scenarios = [s for s in summary if summary[s]]
    if not scenarios:
        return None
    plt = _plt()
    policies = []
    for s in scenarios:
        for p in summary[s]:
            if p not in policies:
                policies.append(p)
    fig, ax = plt.subplots(figsize=(max(5, 1.4 * len(scenarios) + 2), 3.2))
    width = 0.8 / max(1, len(policies))
    for k, p in enumerate(policies):
        xs, ys, lo, hi = [], [], [], []
        for i, s in enumerate(scenarios):
            r = summary[s].get(p) or {}
            if "agg_normalised" not in r:
                continue
            xs.append(i + (k - (len(policies) - 1) / 2) * width)
            ys.append(r["agg_normalised"])
            lo.append(r["agg_normalised"] - r.get("agg_normalised_min", r["agg_normalised"]))
            hi.append(r.get("agg_normalised_max", r["agg_normalised"]) - r["agg_normalised"])
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=p, color=f"C{k}")
    ax.set_xticks(range(len(scenarios)))
    ax.set_xticklabels(scenarios, fontsize=8)
    ax.set_ylabel("aggregate normalised throughput", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=60)
    plt.close(fig)
    return path


def write_plots(result: dict, out_dir: Path) -> list[Path]:
    out = []
    for sc in result.get("summary", {}):
        p = timeline(result["phases"], sc, out_dir / f"timeline_{sc}.png")
        if p:
            out.append(p)
    p = policy_bars(result.get("summary", {}), out_dir / "policies.png")
    if p:
        out.append(p)
    return out


def main(argv=None) -> int:
    """Re-draw the plots of a finished run: ``python -m evaluation.plots BENCH.json [OUT_DIR]``."""
    import argparse
    import json
    import sys

    from evaluation.flags import path_arg

    ap = argparse.ArgumentParser(prog="python -m evaluation.plots",
                                 description="Re-draw the PNG plots of a finished `adloader bench` run from its "
                                             "bench.json (timeline_<scenario>.png, policies.png).")
    ap.add_argument("bench", type=path_arg, metavar="BENCH.json", help="the run's bench.json")
    ap.add_argument("out", type=path_arg, metavar="OUT_DIR", nargs="?", default=None,
                    help="where the PNGs go (default: BENCH.json's folder)")
    a = ap.parse_args(argv)
    src = Path(a.bench)
    try:   # (a missing file, or --help taken for one, was a traceback)
        result = json.loads(src.read_text())
    except (OSError, ValueError) as e:
        ap.error(f"{src}: cannot read it as JSON: {getattr(e, 'strerror', None) or e}")
    if not isinstance(result, dict) or not isinstance(result.get("phases"), list):
        ap.error(f"{src}: not the bench.json of an `adloader bench` run (no phases)")
    out = Path(a.out) if a.out else src.parent
    try:
        out.mkdir(parents=True, exist_ok=True)
        paths = write_plots(result, out)
    except OSError as e:
        print(f"{ap.prog}: {out}: {e.strerror or e}", file=sys.stderr)
        return 1
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
