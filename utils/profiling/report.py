"""From the workers' records to the answer: the latency filter, the ranking, the table, the files.

The bound (``--max_latency_ms``) is applied here, not while measuring, so a rerun with another
bound re-ranks what was measured without measuring it again:

* offline: the time per generated token is the decode step's time (decode ms/token: every row of
  the batch gets one token per step); the first token is not bounded (a batch job has no user
  waiting for it);
* online: at each concurrency level, the inter-token latency p99 and the time to first token p99
  must both be within the bound; the configuration's figures are those of its best level within
  it (the most tokens/s), or, when no level is, of its lowest-latency level, rejected.

Status of a row: ``ok`` (within the bound), ``rejected`` (measured, over it: ``why`` says what),
``skipped`` (would not fit in memory: ``why`` gives the figure), ``failed``.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

COLUMNS = ("key", "scenario", "tp", "dtype", "max_batch", "input_len", "output_len", "speculate", "status", "why",
           "tokens_per_s", "tokens_per_s_per_card", "latency_ms", "ttft_ms", "decode_ms_per_token", "batch_s",
           "requests_per_s", "clients", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "need_gib",
           "startup_s", "acceptance", "wall_s")


def _online_choice(levels: list[dict], bound: float | None) -> tuple[dict, str | None]:
    """(the level a configuration is judged by, why it is rejected or None)."""
    def within(level):
        return bound is None or (level["itl_p99"] <= bound and level["ttft_p99"] <= bound)

    ok = [level for level in levels if within(level)]
    if ok:
        return max(ok, key=lambda level: level["tok_s"]), None
    best = min(levels, key=lambda level: max(level["itl_p99"], level["ttft_p99"]))
    over = [f"{name} p99 {best[key]:.1f} ms" for name, key in (("ITL", "itl_p99"), ("TTFT", "ttft_p99"))
            if best[key] > bound]
    return best, f"{' and '.join(over)} > {bound:g} ms even at {best['clients']} client(s)"


def judge(record: dict, bound: float | None) -> dict:
    """A record as a row of COLUMNS (plus what the plot needs), under ``bound``."""
    row = {k: record.get(k) for k in ("key", "scenario", "tp", "dtype", "max_batch", "input_len", "output_len")}
    row.update(speculate=record.get("speculate", "off"), status=record["status"], why=record.get("reason"),
               startup_s=record.get("startup_s"), wall_s=record.get("wall_s"))
    if record.get("need_bytes") is not None:
        row["need_gib"] = round(record["need_bytes"] / 2**30, 3)
    if record["status"] != "measured":
        return row
    if record["scenario"] == "offline":
        figures = record["offline"]
        row.update(tokens_per_s=figures["tokens_per_s"], ttft_ms=figures["ttft_ms"], batch_s=figures["batch_s"],
                   decode_ms_per_token=figures["decode_ms_per_token"], acceptance=figures.get("acceptance"))
        row["latency_ms"] = figures["decode_ms_per_token"]
        why = None
        if bound is not None and (row["latency_ms"] or 0) > bound:
            why = f"decode {row['latency_ms']:.1f} ms/token > {bound:g} ms"
    else:
        level, why = _online_choice(record["levels"], bound)
        row.update(tokens_per_s=level["tok_s"], requests_per_s=level["req_s"], clients=level["clients"],
                   ttft_p50_ms=level["ttft_p50"], ttft_p99_ms=level["ttft_p99"], itl_p50_ms=level["itl_p50"],
                   itl_p99_ms=level["itl_p99"], latency_ms=level["itl_p99"], ttft_ms=level["ttft_p99"])
    row["tokens_per_s_per_card"] = row["tokens_per_s"] / row["tp"]
    row["status"], row["why"] = ("rejected", why) if why else ("ok", None)
    return row


def rank(rows: list[dict]) -> list[dict]:
    """Best first: within the bound by tokens/s, then rejected by tokens/s, then skipped and failed."""
    order = {"ok": 0, "rejected": 1, "skipped": 2, "failed": 3}
    return sorted(rows, key=lambda r: (order[r["status"]], -(r.get("tokens_per_s") or 0)))


def pareto_front(rows: list[dict]) -> list[dict]:
    """The measured rows no other beats on both latency (lower) and tokens/s (higher)."""
    measured = [r for r in rows if r.get("latency_ms") is not None]
    return [r for r in measured
            if not any(o is not r and o["latency_ms"] <= r["latency_ms"] and o["tokens_per_s"] >= r["tokens_per_s"]
                       and (o["latency_ms"], o["tokens_per_s"]) != (r["latency_ms"], r["tokens_per_s"])
                       for o in measured)]


def _cell(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def table(rows: list[dict], top: int) -> str:
    """The top rows as text, best first; the first within the bound is named "best"."""
    head = ("rank", "configuration", "tok/s", "tok/s/card", "ms/token", "TTFT ms", "batch s", "req/s", "clients",
            "status")
    lines = [head]
    for i, r in enumerate(rows[:top], 1):
        status = "best" if i == 1 and r["status"] == "ok" else r["status"]
        if r.get("why"):
            status += f": {r['why']}"
        lines.append((str(i), r["key"], _cell(r.get("tokens_per_s")), _cell(r.get("tokens_per_s_per_card")),
                      _cell(r.get("latency_ms"), 2), _cell(r.get("ttft_ms")), _cell(r.get("batch_s"), 2),
                      _cell(r.get("requests_per_s"), 2), _cell(r.get("clients")), status))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head) - 1)]
    out = ["  ".join([c.rjust(w) if i != 1 else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))]
                     + [line[-1]]) for line in lines]
    out.insert(1, "-" * len(out[0]))
    return "\n".join(out)


def csv_text(rows: list[dict]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: ("" if r.get(k) is None else r[k]) for k in COLUMNS})
    return buffer.getvalue()


def write_atomically(path: Path, text: str) -> None:
    """Readers (and a Ctrl-C) never see half a file: written beside, then renamed over."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)


def plot_points(rows: list[dict], bound: float | None) -> dict:
    """What profile.png draws: a point per measured configuration, the front, the bound."""
    measured = [r for r in rows if r.get("latency_ms") is not None]
    front = sorted(pareto_front(rows), key=lambda r: r["latency_ms"])
    return {"points": [{"key": r["key"], "latency_ms": r["latency_ms"], "tokens_per_s": r["tokens_per_s"],
                        "status": r["status"], "scenario": r["scenario"]} for r in measured],
            "pareto": [r["key"] for r in front], "bound_ms": bound}


def draw(points: dict, title: str):
    """The figure of ``plot_points``: tokens/s against ms per token, the bound as a vertical line,
    the Pareto front joined, the best labelled. Returns the matplotlib Figure."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display here
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=100)
    styles = {("offline", "ok"): ("o", "tab:blue"), ("online", "ok"): ("s", "tab:green"),
              ("offline", "rejected"): ("o", "lightgray"), ("online", "rejected"): ("s", "lightgray")}
    for (scenario, status), (marker, color) in styles.items():
        chosen = [p for p in points["points"] if p["scenario"] == scenario and p["status"] == status]
        if chosen:
            ax.scatter([p["latency_ms"] for p in chosen], [p["tokens_per_s"] for p in chosen], marker=marker,
                       color=color, edgecolors="black", linewidths=0.5, zorder=3,
                       label=f"{scenario}, {'within the bound' if status == 'ok' else 'over the bound'}")
    by_key = {p["key"]: p for p in points["points"]}
    front = [by_key[k] for k in points["pareto"]]
    if front:
        # Ringed and joined: a front of one point (one configuration beats all) still shows.
        ax.plot([p["latency_ms"] for p in front], [p["tokens_per_s"] for p in front], "--", color="tab:red", zorder=2)
        ax.scatter([p["latency_ms"] for p in front], [p["tokens_per_s"] for p in front], s=160, facecolors="none",
                   edgecolors="tab:red", linewidths=1.5, zorder=4, label="Pareto front")
    if points["bound_ms"] is not None:
        ax.axvline(points["bound_ms"], color="tab:orange", linewidth=1.5, label=f"bound {points['bound_ms']:g} ms")
    ok = [p for p in points["points"] if p["status"] == "ok"]
    if ok:
        best = max(ok, key=lambda p: p["tokens_per_s"])
        ax.annotate(f"best: {best['key']}", (best["latency_ms"], best["tokens_per_s"]), textcoords="offset points",
                    xytext=(8, 6), fontsize=8)
    ax.set_xlabel("latency: ms per generated token (offline: decode step; online: inter-token p99)")
    ax.set_ylabel("throughput: generated tokens/s")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    return fig


def write_outputs(out: Path, records: list[dict], meta: dict, bound: float | None, top: int) -> list[dict]:
    """results.csv, results.json and profile.png from every record; returns the ranked rows."""
    rows = rank([judge(r, bound) for r in records])
    write_atomically(out / "results.csv", csv_text(rows))
    points = plot_points(rows, bound)
    best = rows[0]["key"] if rows and rows[0]["status"] == "ok" else None
    document = {**meta, "max_latency_ms": bound, "best": best, "configurations": rows, "plot": points,
                "records": records}
    write_atomically(out / "results.json", json.dumps(document, indent=2) + "\n")
    if points["points"]:
        fig = draw(points, meta.get("title", ""))
        partial = out / "profile.partial.png"
        fig.savefig(partial)
        partial.replace(out / "profile.png")
        import matplotlib.pyplot as plt

        plt.close(fig)
    return rows
