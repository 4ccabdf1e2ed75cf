"""The pictures of the suites (matplotlib, headless). Each function takes a suite's rows as they are
written to JSON, so a figure can be redrawn from a results file alone."""

from __future__ import annotations

import math
import statistics
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _save(fig, out: Path, title: str | None = None, fontsize: int = 10, tight: bool = False) -> None:
    """`title` over the panels; `tight`: the panels laid out again once it is there."""
    if title is not None:
        fig.suptitle(title, fontsize=fontsize)
    if tight:
        fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {out}", flush=True)


def _label_bars(ax, bars, labels: list[str | None], fontsize: float | None = 7) -> None:
    """Write each label (None: none) just above its bar (`fontsize` None: matplotlib's default)."""
    for bar, label in zip(bars, labels, strict=True):
        if label is not None:
            x = bar.get_x() + bar.get_width() / 2
            ax.text(x, bar.get_height(), label, ha="center", va="bottom", fontsize=fontsize)


def _named_bars(
    ax, names: list[str], values: list[float], fmt: str, color: str, ylabel: str, **ticks
) -> None:
    """One bar per name, each labelled with its value in `fmt`; `ticks`: how the names are written."""
    bars = ax.bar(range(len(names)), values, color=color)
    _label_bars(ax, bars, [fmt.format(v) for v in values])
    ax.set_xticks(range(len(names)), names, fontsize=8, **ticks)
    ax.set_ylabel(ylabel)


def ablation(rows: list[dict], out: Path, subtitle: str) -> None:
    """Fig. 8: decode tokens/s per case as a box over requests, stall per token beside it."""
    fig, (speed, stall) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    labels = [f"{r['case']}\n" + "\n".join(textwrap.wrap(r["label"], 12)) for r in rows]
    speed.boxplot([r["decode_tokens_per_s"]["values"] for r in rows], widths=0.5)
    speed.plot(range(1, len(rows) + 1), [r["decode_tokens_per_s"]["mean"] for r in rows], "D", color="C3")
    speed.set_xticks(range(1, len(rows) + 1), labels, fontsize=8)
    speed.set(ylabel="decode tokens/s", title="decode speed (box: requests, diamond: mean)")
    bars = stall.bar(range(len(rows)), [r["stall_ms_per_token"] for r in rows], color="C1")
    _label_bars(stall, bars, [None if r["recall"] is None else f"recall\n{r['recall']:.2f}" for r in rows])
    stall.set_xticks(range(len(rows)), [str(r["case"]) for r in rows])
    stall.set(xlabel="case", ylabel="stall ms per decode token", title="waiting for expert loads")
    stall.margins(y=0.25)
    _save(fig, out, f"ablation cases (paper Fig. 8)\n{subtitle}", tight=True)


def heatmaps(
    rows: list[dict], keys: list[tuple[str, str, str]], out: Path, title: str
) -> list[tuple[list[int], list[int], list[list[float]]]]:
    """Fig. 9: one heatmap per (key, title, format) over token_period (rows) x kv_period (columns)."""
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4.8), squeeze=False)
    grids = []
    for ax, (key, panel, fmt) in zip(axes[0], keys, strict=True):
        tokens, kvs, values = period_grid(rows, key)
        grids.append((tokens, kvs, values))
        image = ax.imshow(values, cmap="viridis", origin="lower")
        ax.set_xticks(range(len(kvs)), [str(k) for k in kvs])
        ax.set_yticks(range(len(tokens)), [str(t) for t in tokens])
        ax.set(xlabel="KV alignment period", ylabel="token alignment period", title=panel)
        for i, row in enumerate(values):
            for j, v in enumerate(row):
                if not math.isnan(v):
                    ax.text(j, i, fmt.format(v), ha="center", va="center", color="white", fontsize=8)
        fig.colorbar(image, ax=ax, shrink=0.8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    _save(fig, out)
    return grids


def period_grid(rows: list[dict], key: str) -> tuple[list[int], list[int], list[list[float]]]:
    tokens = sorted({int(r["token_period"]) for r in rows})
    kvs = sorted({int(r["kv_period"]) for r in rows})
    cell = {
        (int(r["token_period"]), int(r["kv_period"])): float(r[key])
        for r in rows
        if r.get(key) not in ("", None)
    }
    return tokens, kvs, [[cell.get((t, k), math.nan) for k in kvs] for t in tokens]


def _rolling(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def recall_vs_token(
    rows: list[dict], precisions: list[str], out: Path, subtitle: str, window: int = 8
) -> None:
    """Fig. 3: recall(n) (Eq. 2) vs output-token index, a panel per shadow precision, a line per
    alignment; the two baseline predictors in grey in every panel. Curves are rolling means."""
    cols = min(3, len(precisions))
    nrows = math.ceil(len(precisions) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.6 * cols, 3.4 * nrows), squeeze=False, sharey=True)
    baselines = [r for r in rows if "precision" not in r]
    for ax, precision in zip(axes.flat, precisions, strict=False):
        for r in baselines:
            grey = "0.55" if r["predictor"] == "frequency" else "0.3"
            _recall_curve(ax, r, window, r["predictor"], "--", color=grey, lw=1)
        for r in (r for r in rows if r.get("precision") == precision):
            _recall_curve(ax, r, window, r["alignment"], lw=1.5)
        ax.set_title(f"shadow {precision}", fontsize=10)
        ax.set_xlabel("output token index")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")
    for ax in axes[:, 0]:
        ax.set_ylabel("recall")
    for ax in list(axes.flat)[len(precisions) :]:
        ax.axis("off")
    title = (
        f"recall vs output token (paper Fig. 3; rolling mean over {window} tokens, "
        f"overall Eq. 3 in brackets)\n{subtitle}"
    )
    _save(fig, out, title, 9, tight=True)


def _recall_curve(ax, row: dict, window: int, name: str, *style, **kw) -> None:
    """One row's recall per output token as a rolling mean, labelled with its overall recall."""
    xs = [int(n) for n in row["per_token"]]
    ys = _rolling(list(row["per_token"].values()), window)
    ax.plot(xs, ys, *style, label=f"{name} ({row['overall']:.3f})", **kw)


def grid(cells: list[dict], systems: dict, out: Path, subtitle: str) -> None:
    """Table 2 as bars: TTFT, decode and overall tokens/s per (input/output) cell and system, and
    each system's device memory stacked by node."""
    fig, axes = plt.subplots(1, 4, figsize=(17, 4.2), gridspec_kw={"width_ratios": [3, 3, 3, 2]})
    names = list(systems)
    width = 0.8 / len(names)
    panels = [("ttft_s", "TTFT ms", 1e3), ("decode_tokens_per_s", "decode tokens/s", 1),
              ("overall_tokens_per_s", "overall tokens/s", 1)]  # fmt: skip
    for ax, (key, label, scale) in zip(axes, panels, strict=False):
        for j, name in enumerate(names):
            by_cell = {c["name"]: c for c in systems[name]["cells"]}
            values = [statistics.mean(r[key] for r in by_cell[c["name"]]["runs"]) * scale for c in cells]
            ax.bar([i + j * width for i in range(len(cells))], values, width, label=name, color=f"C{j}")
        ax.set_xticks(
            [i + width * (len(names) - 1) / 2 for i in range(len(cells))], [c["name"] for c in cells]
        )
        ax.set(xlabel="input / output tokens", title=label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    mem = axes[3]
    for j, name in enumerate(names):
        bottom = 0.0
        for k, (node, b) in enumerate(sorted(systems[name]["device_bytes"].items())):
            mem.bar(
                j, b / 2**20, 0.6, bottom=bottom, color=f"C{j}", edgecolor="white", alpha=1 - 0.12 * (k % 5)
            )
            if b / 2**20 > 0.5:
                mem.text(j, bottom + b / 2**21, node, ha="center", va="center", fontsize=6)
            bottom += b / 2**20
    mem.set_xticks(range(len(names)), names, rotation=20, fontsize=7)
    mem.set_title("device memory MiB, by node")
    _save(fig, out, f"odmoe and baselines (paper Table 2)\n{subtitle}", tight=True)


def timeline(events: list[dict], window: tuple[float, float], out: Path, title: str) -> None:
    """Fig. 2/5 as measured: one row per node lane, spans coloured by MoE layer; waits grey, the
    shadow's late departure a red band above its row, preloads that were never used hatched."""
    t0, t1 = window
    lanes = dict.fromkeys(e["lane_name"] for e in events)  # each once, in order of appearance
    order = sorted(lanes, key=lambda n: (not n.startswith("main"), not n.startswith("shadow"), n))
    row = {name: i for i, name in enumerate(reversed(order))}
    fig, ax = plt.subplots(figsize=(14, 0.5 * len(order) + 1.6))
    for e in events:
        if e["ph"] != "X" or e["ts"] + e["dur"] < t0 or e["ts"] > t1:
            continue
        name, y = e["name"], row[e["lane_name"]]
        layer = _layer_of(name)
        height = 0.76
        if name.startswith("wait"):
            color = "0.85"
        elif name == "late departure":  # drawn as a thin red band over the shadow's row
            color, height = "red", 0.2
        else:
            color = "0.5" if layer is None else f"C{layer % 10}"
        hatch = "////" if name.startswith("load") and not e["args"].get("used", True) else None
        start, dur = (e["ts"] - t0) / 1e3, e["dur"] / 1e3
        bottom = y + 0.38 if name == "late departure" else y - height / 2
        ax.broken_barh(
            [(start, dur)], (bottom, height), facecolors=color, edgecolor="black", linewidth=0.3, hatch=hatch
        )
        middle = start + dur / 2
        if dur > (t1 - t0) / 1e3 / 60 and 0 <= middle <= (t1 - t0) / 1e3 and name != "late departure":
            label = name.replace("compute ", "").replace("load ", "").replace("waiting for alignment", "wait")
            ax.text(middle, y, label, ha="center", va="center", fontsize=5.5, clip_on=True)
    for e in events:  # flows: a tick where each message arrives
        if e["ph"] == "f" and t0 <= e["ts"] <= t1:
            ax.plot((e["ts"] - t0) / 1e3, row[e["lane_name"]] + 0.45, "v", color="black", markersize=2.5)
    ax.set_yticks(list(row.values()), list(row.keys()), fontsize=8)
    ax.set_xlim(0, (t1 - t0) / 1e3)
    ax.set_xlabel("ms")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title, fontsize=9)
    _save(fig, out, tight=True)


def _layer_of(name: str) -> int | None:
    for word in name.split():
        if word.startswith("L") and word[1:].isdigit():
            return int(word[1:])
    return None


def compression(report: dict, out: Path, subtitle: str) -> None:
    """The compression suite: stored/raw per method and dtype, decompression GB/s, decode tokens/s."""
    panels = 3 if report.get("decode") else 2
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4.2))
    ratio, speed = axes[0], axes[1]
    by_dtype = report["ratios"]["model"]
    methods = ["odmoe", "zipnn", "zstd", "lz4", "bound"]
    width = 0.8 / len(methods)
    for m, method in enumerate(methods):
        values = [by_dtype[d]["all"][method] for d in by_dtype]
        xs = [i + m * width for i in range(len(by_dtype))]
        ratio.bar(xs, [v * 100 if v is not None else 0 for v in values], width, label=method)
    ratio.set_xticks([i + 0.4 - width / 2 for i in range(len(by_dtype))], list(by_dtype))
    ratio.set(ylabel="stored / raw bytes (%)", title="every expert of the model")
    ratio.legend(fontsize=7)
    for d, row in report["speed"].items():
        threads = sorted(row["odmoe_gbps"], key=int)
        odmoe = [row["odmoe_gbps"][n] for n in threads]
        speed.plot([int(n) for n in threads], odmoe, "o-", label=f"odmoe {d}")
        if row["zipnn_gbps"]:
            zipnn = [row["zipnn_gbps"][n] for n in threads]
            speed.plot([int(n) for n in threads], zipnn, "x--", label=f"zipnn {d}")
    speed.set(xlabel="threads", ylabel="decompressed GB/s", title="decompression speed")
    speed.legend(fontsize=7)
    if panels == 3:
        decode = axes[2]
        rows = report["decode"]
        decode.bar(
            range(len(rows)),
            [r["decode_tokens_per_s"]["mean"] for r in rows.values()],
            yerr=[r["decode_tokens_per_s"]["stdev"] for r in rows.values()],
            color="C2",
        )
        decode.set_xticks(range(len(rows)), list(rows), fontsize=8)
        decode.set(ylabel="decode tokens/s", title="decode, storage-bound link")
    _save(fig, out, f"lossless compressed expert store — {subtitle}", fontsize=9)


def faults(rows: list[dict], out: Path, subtitle: str) -> None:
    """Inter-token latency of one stream around each failure (a dashed line where it fired)."""
    cols = min(len(rows), 2)
    lines = math.ceil(len(rows) / cols)
    fig, axes = plt.subplots(lines, cols, figsize=(6 * cols, 2.6 * lines), squeeze=False, sharey=False)
    for ax, row in zip(axes.flat, rows, strict=False):
        gaps = [g * 1e3 for g in row["gaps_s"]]
        ax.plot(range(1, len(gaps) + 1), gaps, ".-", lw=1, ms=3)
        ax.axvline(row["fired_at_token"], color="C3", ls="--", lw=1)
        ax.set_yscale("log")
        detect = "n/a" if row["detect_s"] is None else f"{row['detect_s']:.2f} s"
        ax.set_title(
            f"{row['node']} {row['action']}: detected {detect}, tokens "
            f"{'identical' if row['tokens_equal'] else 'DIFFER'}",
            fontsize=9,
        )
        ax.set_xlabel("token index", fontsize=8)
        ax.set_ylabel("inter-token ms", fontsize=8)
    for ax in list(axes.flat)[len(rows) :]:
        ax.axis("off")
    _save(fig, out, f"Inter-token latency around a failure\n{subtitle}", tight=True)


def soak(samples: list[dict], events: list[dict], out: Path, subtitle: str) -> None:
    """Requests completed and each node's RSS over the soak, with the injected faults marked."""
    fig, (done, rss) = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True)
    t = [s["t_s"] for s in samples]
    done.plot(t, [s["completed"] for s in samples], color="C0")
    done.set_ylabel("requests completed")
    colors = {"kill": "C3", "stop": "C1", "died": "C7", "straggle": "C2", "hole": "C4", "loss": "C5"}
    for e in events:
        done.axvline(e["t_s"], color=colors.get(e["action"], "C1"), lw=0.5, alpha=0.6)
    for name in sorted({k for s in samples for k in s["rss_mib"]}):
        rss.plot(t, [s["rss_mib"].get(name) for s in samples], label=name, lw=1)
    rss.set_ylabel("RSS MiB")
    legend = "red: kill, orange: freeze, grey: died"
    if any(e["action"] in ("straggle", "hole", "loss") for e in events):
        legend += ", green: straggler, purple: black hole, brown: loss burst"
    rss.set_xlabel(f"seconds ({legend})")
    rss.legend(fontsize=7, ncol=4)
    _save(fig, out, f"Soak\n{subtitle}", tight=True)


def lossy(rows: list[dict], out: Path, subtitle: str) -> None:
    """Speed-quality curve of each miss policy over its threshold sweep, one panel per injected-miss
    rate: perplexity (and, from the cluster runs, token agreement) against decode tokens/s, or against
    substitutions per token when there were no cluster runs."""
    rates = sorted({r["inject_wrong"] for r in rows})
    clustered = all("cluster" in r for r in rows)
    panels = 2 if clustered else 1
    fig, axes = plt.subplots(panels, len(rates), figsize=(5.2 * len(rates), 4 * panels), squeeze=False)
    for col, rate in enumerate(rates):
        mine = [r for r in rows if r["inject_wrong"] == rate]
        for row_i, (key, label) in enumerate(
            [("perplexity", "perplexity (held-out)"), ("agreement", "token agreement")][:panels]
        ):
            ax = axes[row_i][col]
            for i, policy in enumerate(
                sorted({r["policy"] for r in mine}, key=["reload", "buddy", "importance"].index)
            ):
                pts = [r for r in mine if r["policy"] == policy]
                xs = [
                    r["cluster"]["decode_tokens_per_s"]["mean"] if clustered else r["substitutions_per_token"]
                    for r in pts
                ]
                ys = [r[key] for r in pts]
                ax.plot(xs, ys, "o-" if len(pts) > 1 else "s", color=f"C{i}", label=policy)
                for x, y, r in zip(xs, ys, pts, strict=True):
                    if r["value"] is not None:
                        ax.annotate(
                            f"{r['value']:g}", (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7
                        )
            ax.set(xlabel="decode tokens/s" if clustered else "substitutions per token", ylabel=label)
            ax.set_title(f"injected misses {rate:g}", fontsize=9)
            ax.legend(fontsize=8)
    title = (
        f"lossy miss policies: quality vs speed (labels: buddy TAE percentile, importance alpha)\n{subtitle}"
    )
    _save(fig, out, title, 9, tight=True)


def lookahead(report: dict, out: Path, subtitle: str) -> None:
    """Issue 13: decode tokens/s and timely recall per system; hedging's recall vs extra loads (each
    panel only where the report has its part: `lookahead.systems=[]`, `lookahead.hedging=false`)."""
    rows, hedging = report["rows"], report["hedging"]
    panels = [p for p, present in (("speed", rows), ("hedge", hedging)) if present] or ["speed"]
    widths = {"speed": 3, "hedge": 2}
    fig, axes = plt.subplots(
        1,
        len(panels),
        figsize=(2.6 * sum(widths[p] for p in panels) + 0.5, 4.6),
        gridspec_kw={"width_ratios": [widths[p] for p in panels]},
        squeeze=False,
    )
    ax = dict(zip(panels, axes[0], strict=True))
    if "speed" in ax:
        speed = ax["speed"]
        labels = [f"{r['system']}\n{r['precision']}" for r in rows]
        x = range(len(rows))
        speeds, spread = [r["decode_tokens_per_s"] for r in rows], [r["decode_sd"] for r in rows]
        bars = speed.bar(x, speeds, yerr=spread, color="C0", capsize=3)
        timely = [r.get("timely_recall") for r in rows]
        _label_bars(speed, bars, [None if t is None else f"in time\n{t:.3f}" for t in timely])
        speed.set_xticks(list(x), labels, fontsize=7, rotation=35, ha="right")
        speed.set(ylabel="decode tokens/s", title="decode speed and timely recall per system")
    if "hedge" in ax:
        _lookahead_hedging(ax["hedge"], hedging)
    _save(fig, out, subtitle, fontsize=9)


def _lookahead_hedging(hedge, hedging: list[dict]) -> None:
    for precision in sorted({h["precision"] for h in hedging}):
        points = [h for h in hedging if h["precision"] == precision]
        extra, recall = [100 * h["extra_loads"] for h in points], [h["recall_with_hedges"] for h in points]
        hedge.plot(extra, recall, "o-", label=precision)
        for h in points:
            hedge.annotate(f"{h['margin']:g}", (100 * h["extra_loads"], h["recall_with_hedges"]), fontsize=7)
    if hedging:  # issue 13's goal: recall >= 0.999 for <= 10 % extra loads
        hedge.axhline(0.999, color="grey", ls="--", lw=0.8)
        hedge.axvline(10, color="grey", ls="--", lw=0.8)
        hedge.legend(fontsize=8)
    hedge.set_xlabel("extra expert loads (%)")
    hedge.set(ylabel="recall with hedges", title="hedged prefetch (labels: margin; dashed: the goal)")


def prefill(report: dict, out: Path, subtitle: str) -> None:
    """TTFT per prefill configuration, one bar per prompt length, the single process's as dashed lines;
    beside it, where measured, the shadow's recall of the first decode tokens with its own prompt K/V
    and with main's."""
    rows, reference, kv = report["rows"], report["reference_ttft_s"], report.get("prompt_kv")
    left = max(4.5, 1.2 * len(rows) + 1.5)  # inches: eight configurations' labels side by side
    fig, axes = plt.subplots(
        1, 2 if kv else 1, figsize=(left + 5 if kv else left, 4.6), squeeze=False,
        gridspec_kw={"width_ratios": [left, 5]} if kv else None,
    )  # fmt: skip
    ttft = axes[0][0]
    width = 0.8 / len(reference)
    for i, n in enumerate(reference):
        offset = (i - (len(reference) - 1) / 2) * width
        xs = [j + offset for j in range(len(rows))]
        ttft.bar(xs, [r[n]["ttft_s"] * 1e3 for r in rows], width, color=f"C{i}", label=f"{n} prompt tokens")
        ttft.axhline(reference[n] * 1e3, color=f"C{i}", ls="--", lw=1, label=f"one process, {n} tokens")
    labels = [
        f"{r['mini_batch'] or 'one batch'}\n{r['placement']}"
        + ("" if r["bit_exact"] else "\ncomputed per\nmini-batch\n(not exact)")
        for r in rows
    ]
    ttft.set_xticks(range(len(rows)), labels, fontsize=8)
    ttft.set_xlabel("prefill.mini_batch, prefill.placement")
    ttft.set(ylabel="TTFT ms (median)", title="time to first token")
    ttft.legend(fontsize=7)
    if kv:
        recall = axes[0][1]
        for key, label, style in (
            ("False", "shadow's own prompt K/V", "o-"),
            ("True", "main's prompt K/V", "s--"),
        ):
            points = [(int(t), r) for t, r in kv["recall_per_token"][key].items() if r is not None]
            recall.plot([t for t, _ in points], [r for _, r in points], style, label=label)
        recall.set(xlabel="decode token", ylabel="recall")
        recall.set_title(f"alignment.prefill_kv: {kv['precision']} shadow, token alignment only", fontsize=9)
        recall.legend(fontsize=8)
    _save(fig, out, f"Batched prefill\n{subtitle}", tight=True)


def dataplane(report: dict, out: Path, subtitle: str) -> None:
    """Issue 13: the wire's round trips beside a remote decode layer's overhead, plain and CURVE; and,
    where the report has them, the stages of a decode layer beside the one-process experts call."""
    wire, over = report["wire_us"], report["layers"]["overhead_us_per_layer"]
    stages = report["layers"].get("stages_us_per_layer")
    fig, axes = plt.subplots(1, 2 if stages else 1, figsize=(15 if stages else 8, 5), squeeze=False)
    ax = axes[0][0]
    groups = ("plain", "CURVE")
    spaced = f"raw, each after {report.get('spaced_gap_ms', 1):g} ms idle"
    bars = {
        "raw ZeroMQ round trip": [wire["raw_plain"]["median"], wire["raw_curve"]["median"]],
        spaced: [wire[f"raw_{g}_spaced"]["median"] for g in ("plain", "curve")]
        if "raw_plain_spaced" in wire
        else None,
        "round trip through odmoe's codec": [wire["codec_plain"]["median"], wire["codec_curve"]["median"]],
        "decode layer: cluster - one process": [over["security_off"], over["security_on"]],
    }
    bars = {label: values for label, values in bars.items() if values is not None}  # spaced: where measured
    width = 0.8 / len(bars)
    for i, (label, values) in enumerate(bars.items()):
        xs = [g + (i - (len(bars) - 1) / 2) * width for g in range(len(groups))]
        drawn = ax.bar(xs, values, width, label=label, color=f"C{i}")
        ax.bar_label(drawn, fmt="%.0f", fontsize=8)
    raw = bars["raw ZeroMQ round trip"]
    for g, r in enumerate(raw):
        ax.hlines(2 * r, g - 0.45, g + 0.45, colors="k", linestyles="dashed")
    ax.plot([], [], "--", color="k", label="goal: 2 x raw round trip")
    ax.set_ylim(0, 1.5 * max(max(v) for v in bars.values()))  # room for the legend above the bars
    ax.set_xticks(range(len(groups)), [f"security {'off' if g == 'plain' else 'on'} ({g})" for g in groups])
    ax.set_ylabel("µs")
    ax.set_title(
        f"data plane: one decode layer's call ({report['row_bytes']} B row)\n{subtitle}", fontsize=10
    )
    ax.legend(fontsize=8, loc="upper left")
    if stages:
        _dataplane_stages(axes[0][1], report["layers"], stages, report.get("fanout_computing_us"))
    _save(fig, out)


def placement(report: dict, out: Path, subtitle: str) -> None:
    """Issue 17: start-up of the same cluster spawned by the launcher and placed through Ray."""
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    ways = list(report["ways"])
    for i, way in enumerate(ways):
        values = report["ways"][way]["start_s_all"]
        ax.bar(i, report["ways"][way]["start_s"], 0.6, color=f"C{i}", alpha=0.7)
        ax.plot([i] * len(values), values, "o", color="k", markersize=4)
    medians = [report["ways"][way]["start_s"] for way in ways]
    _label_bars(ax, ax.patches, [f"{s:.1f} s" for s in medians], fontsize=None)  # patches: the bars
    ax.set_xticks(range(len(ways)), [f"role={w}" for w in ways])
    ax.set_ylabel("seconds from the call to every node serving")
    ray_s = report["ray_cluster_start_s"]
    ray_note = f"; the Ray cluster itself: {ray_s:.1f} s, once" if ray_s is not None else ""
    ax.set_title(
        f"start-up, {report['nodes']} nodes (bar: median, dots: rounds{ray_note})\n{subtitle}", fontsize=9
    )
    _save(fig, out)


def gpu(report: dict, out: Path, subtitle: str) -> None:
    """Suite gpu: decode tokens/s and TTFT per system, device memory per node, bus bandwidth."""
    systems = report["systems"]
    names = list(systems)
    fig, (speed, ttft, memory, bus) = plt.subplots(1, 4, figsize=(16, 4.2))
    means = [statistics.mean(s["decode_tokens_per_s"]) for s in systems.values()]
    _named_bars(speed, names, means, "{:.1f}", "C0", "decode tokens/s", rotation=20)
    ttfts = [statistics.mean(s["ttft_s"]) for s in systems.values()]
    _named_bars(ttft, names, ttfts, "{:.2f}", "C1", "TTFT (s)", rotation=20)
    bottom = [0.0] * len(names)
    nodes = sorted({node for s in systems.values() for node in s["device_peak_bytes"]})
    for i, node in enumerate(nodes):
        heights = [s["device_peak_bytes"].get(node, 0) / 2**30 for s in systems.values()]
        memory.bar(range(len(names)), heights, bottom=bottom, label=node, color=f"C{i % 10}")
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    memory.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
    memory.set_ylabel("peak device memory (GiB, CUDA counter)")
    memory.legend(fontsize=6)
    odmoe = systems.get("odmoe", {})
    rates = {
        "bus peak\n(pinned copy_)": report.get("bus_peak_bytes_per_s"),
        "odmoe\nper copy": odmoe.get("load_bytes_per_s"),
        "odmoe over\nrequests": odmoe.get("request_bytes_per_s"),
    }
    values = [(v or 0.0) / 1e9 for v in rates.values()]
    _named_bars(bus, list(rates), values, "{:.1f}", "C2", "host-to-device GB/s")
    _save(fig, out, f"{report.get('gpu') or report['device']}: {subtitle}", fontsize=9)


def _dataplane_stages(ax, layers: dict, stages: dict, floor: dict | None = None) -> None:
    """Stacked: where a cluster's decode layer goes (main's stats), beside one process's experts call
    and, when measured, the floor with real compute (the same exchange with no odmoe code on it)."""
    rows = {"one process:\nexperts call": {"experts call": layers["reference_experts_us_per_layer"]}}
    if floor:
        rows["floor: real compute,\nno odmoe code"] = {
            "echo: compute": floor["compute_us"],
            "wire, wake-ups (raw sends, no codec)": floor["median"] - floor["compute_us"],
        }
    for system, st in stages.items():
        compute = layers["worker_compute_us_per_expert"][system]
        rows[f"cluster,\n{system.replace('_', ' ')}"] = {
            "main: split, place, encode": st["prepare"],
            "worker: compute": compute,
            "worker: decode, checks": st["worker"] - compute,
            "main sends; wire, wake-ups; worker encodes, sends": st["round_trip"] - st["worker"],
            "main: decode answers": st["take"],
            "main: combine": st["combine"],
        }
    labels = list(rows)
    colours = {}
    for y, label in enumerate(labels):
        left = 0.0
        for part, value in rows[label].items():
            colour = colours.setdefault(part, f"C{len(colours)}")
            ax.barh(
                y,
                value,
                left=left,
                color=colour,
                label=part if part not in ax.get_legend_handles_labels()[1] else None,
            )
            left += value
        ax.text(left, y, f" {left:.0f}", va="center", fontsize=8)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("µs per decode layer (medians over requests)")
    ax.set_title("where a decode layer goes", fontsize=10)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)


def serving(report: dict, out: Path, subtitle: str) -> None:
    """Throughput and latencies by closed-loop concurrency, and by open-loop arrival rate."""
    loads = report["loads"]
    closed = [x for x in loads if x["name"].startswith("closed")]
    opened = [x for x in loads if x["name"].startswith("open")]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    c = [int(x["name"].split("=")[1]) for x in closed]
    ax = axes[0]
    ax.plot(c, [x["tokens_per_s"] for x in closed], "o-", label="odmoe (batched, exact)")
    if closed:
        ax.plot(c, [closed[0]["tokens_per_s"] * k for k in c], ":", color="grey", label="linear in users")
    ax.set(xlabel="concurrent users (closed loop)", ylabel="total output tokens/s", xticks=c)
    ax.legend(fontsize=8)
    ax = axes[1]
    for key, style in (
        ("ttft_p50_ms", "o-"),
        ("ttft_p99_ms", "o--"),
        ("itl_p50_ms", "s-"),
        ("itl_p99_ms", "s--"),
    ):
        ax.plot(c, [x[key] for x in closed], style, label=key.replace("_ms", "").replace("_", " "))
    ax.set(xlabel="concurrent users (closed loop)", ylabel="ms", yscale="log", xticks=c)
    ax.legend(fontsize=8)
    ax = axes[2]
    if opened:
        r = [float(x["name"].split()[1].rstrip("/s")) for x in opened]
        for key, style in (("ttft_p50_ms", "o-"), ("ttft_p99_ms", "o--"), ("itl_p50_ms", "s-")):
            ax.plot(r, [x[key] for x in opened], style, label=key.replace("_ms", "").replace("_", " "))
        ax.set(xlabel="arrival rate, requests/s (open loop, Poisson)", ylabel="ms", yscale="log", xticks=r)
        ax.legend(fontsize=8)
    differ = sum(x["differ"] for x in loads)
    title = (
        f"serving: up to {report['max_running']} requests decode together; requests whose tokens "
        f"differ from running alone: {differ}\n{subtitle}"
    )
    _save(fig, out, title, 9)


def cache(report: dict, out: Path, subtitle: str) -> None:
    """Decode tokens/s, hit rate, bytes loaded per token, and the shadow's recall in time with main's
    stall by cache budget, per system."""
    rows = report["rows"]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    stall = axes[3].twinx()  # the shadow's part: what arrived in time, and what main waited for
    systems = [s for s in dict.fromkeys(r["system"] for r in rows) if s != "resident_workers"]
    resident = next((r for r in rows if r["system"] == "resident_workers"), None)
    for i, system in enumerate(systems):
        mine = sorted((r for r in rows if r["system"] == system), key=lambda r: r["budget"])
        b = [r["budget"] * 100 for r in mine]
        style = {"color": f"C{i}", "label": system}
        axes[0].plot(b, [r["decode_tokens_per_s"] for r in mine], "o-", **style)
        axes[1].plot(b, [r["hit_rate"] or 0.0 for r in mine], "o-", **style)
        axes[2].plot(b, [r["bytes_per_token"] / 2**20 for r in mine], "o-", **style)
        if system.startswith("odmoe"):
            # 0 (or none) where the caches held every expert and main skipped the shadow: a gap there
            axes[3].plot(b, [r.get("timely_recall") or math.nan for r in mine], "o-", **style)
            stall.plot(b, [r.get("stall_ms_per_token") or 0.0 for r in mine], "x:", color=f"C{i}")
    if resident:
        axes[0].axhline(resident["decode_tokens_per_s"], color="grey", ls=":", label="resident workers")
    axes[0].set(xlabel="cache budget, % of every expert's bytes", ylabel="decode tokens/s")
    axes[1].set(xlabel="cache budget, %", ylabel="experts computed from a cache", ylim=(0, 1.02))
    axes[2].set(xlabel="cache budget, %", ylabel="MiB loaded per generated token")
    axes[3].set(xlabel="cache budget, %", ylabel="shadow's recall in time (o)", ylim=(0, 1.02))
    stall.set(ylabel="main's stall, ms per token (x)")
    for ax in axes:
        ax.legend(fontsize=8)
    differ = sum(r["differ"] for r in rows)
    title = f"expert cache: requests whose tokens differ from transformers: {differ}\n{subtitle}"
    _save(fig, out, title, 9)


def security(report: dict, out: Path, subtitle: str) -> None:
    """Suite security: each request's decode tokens/s and TTFT, each start's connect time, on and off."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    modes = list(report["rows"])
    panels = (
        (report["rows"], "decode_tokens_per_s", 1, "decode tokens/s, each request"),
        (report["rows"], "ttft_s", 1e3, "time to first token, ms (client)"),
        (report["starts"], "connect_s", 1e3, "main's connect, ms, each start"),
    )
    for ax, (runs, key, scale, label) in zip(axes, panels, strict=True):
        ax.boxplot([[r[key] * scale for r in runs[m] if r.get(key)] for m in modes], widths=0.5)
        ax.set_xticks(range(1, len(modes) + 1), [f"security {m}" for m in modes])
        ax.set(ylabel=label)
    title = f"security's cost; requests whose tokens differ: {report['tokens_differ']}\n{subtitle}"
    _save(fig, out, title, 9, tight=True)


def eval_harness(report: dict, out: Path, subtitle: str) -> None:
    """Suite eval: each task's scores through the harness per runner, the runs' seconds, and prompt
    scoring's tokens/s on the cluster and in one process."""
    fig, (scores, seconds, scoring) = plt.subplots(1, 3, figsize=(15, 4.4))
    runners = ("hf", "local-completions", "odmoe-completions")
    names, values = [], {r: [] for r in runners}
    for task, result in report["tasks"].items():
        for metric, (hf, local) in result["scores"].items():
            names.append(f"{task}\n{metric.split(',')[0]}")
            ours = report["odmoe_completions"][task]["scores"][metric][1]
            for runner, value in zip(runners, (hf, local, ours), strict=True):
                values[runner].append(value)
    for i, runner in enumerate(runners):
        bars = scores.bar([x + (i - 1) * 0.27 for x in range(len(names))], values[runner], 0.27, label=runner)
        _label_bars(scores, bars, [f"{v:.3f}" for v in values[runner]], 6)
    scores.set_xticks(range(len(names)), names, fontsize=8)
    scores.set(ylabel="score")
    scores.legend(fontsize=8)
    harness = report["harness_seconds"]
    _named_bars(seconds, list(harness), list(harness.values()), "{:.0f}", "C0", "the harness's run, s")
    rates = {k: v for k, v in report["scoring"].items() if isinstance(v, float)}
    names = ["\n".join(textwrap.wrap(k, 14)) for k in rates]
    _named_bars(scoring, names, list(rates.values()), "{:.0f}", "C2", "prompt scoring, prompt tokens/s")
    _save(fig, out, f"lm-eval through odmoe; every score equal to hf's: {report['identical']}\n{subtitle}", 9)


def memory(report: dict, out: Path, subtitle: str) -> None:
    """Steady and peak resident memory per role over the checkpoint's size (the defaults), and the
    disk path's decode tokens/s by the share of the experts the workers' memory holds."""
    disk = report["disk_path"]
    fig, axes = plt.subplots(1, 2 if disk else 1, figsize=(12 if disk else 6.5, 4.4), squeeze=False)
    axes = axes[0]
    rows = [r for r in report["rows"] if r["system"] == "defaults"]
    sizes = [r["checkpoint_bytes"] / 2**30 for r in rows]
    for role, color in (("main", "C0"), ("shadow", "C1"), ("worker", "C2")):
        for key, style in (("steady", "o-"), ("peak", "x:")):
            ys = []
            for r in rows:
                values = [n[key] for name, n in r["nodes"].items() if name.rstrip("0123456789") == role]
                ys.append(max(values) / 2**30 if values else 0.0)
            label = f"{role}{' (each)' if role == 'worker' else ''}, {key}"
            axes[0].plot(sizes, ys, style, color=color, label=label)
    if sizes:
        axes[0].plot(sizes, sizes, "--", color="grey", label="the checkpoint")
    axes[0].set(xlabel="checkpoint, GiB (bf16)", ylabel="resident memory, GiB (VmRSS / VmHWM)")
    axes[0].legend(fontsize=7)
    if disk:
        axes[1].plot(
            [d["fraction"] for d in disk], [d["decode_tokens_per_s"] for d in disk], "o-", label="decode"
        )
        axes[1].set(xlabel="the experts' share the workers' memory holds", ylabel="decode tokens/s")
        axes[1].invert_xaxis()
        axes[1].legend(fontsize=8)
    title = (
        f"memory per node (defaults){' and the disk path' if disk else ''}; tokens identical to one process: "
        f"{report['identical']}\n{subtitle}"
    )
    _save(fig, out, title, 9)


def network(rows: list[dict], out: Path, subtitle: str) -> None:
    """Suite network: tokens/s of each case against the healthy cluster's, and beside it the longest
    stall, the time to detect and the time to recover of each case (none drawn where none applies)."""
    fig, (speed, times) = plt.subplots(1, 2, figsize=(max(11, 2 * len(rows)), 4.4))  # room for each label
    labels = ["\n".join(textwrap.wrap(r["case"], 14)) for r in rows]
    x = range(len(rows))
    bars = speed.bar(x, [r["vs_healthy"] for r in rows], color="C0")
    _label_bars(
        speed,
        bars,
        [f"{r['tokens_per_s']:.1f} tok/s" + ("" if r["different"] == 0 else "\nDIFFER") for r in rows],
    )
    speed.axhline(1.0, color="grey", lw=0.8, ls="--")
    speed.set_xticks(list(x), labels, fontsize=8)
    speed.set_ylabel("tokens/s vs healthy")
    speed.set_title("throughput (label: tokens/s; every token checked)", fontsize=9)
    width = 0.27
    for k, (key, name) in enumerate(
        [("longest_stall_s", "longest stall"), ("detect_s", "detect"), ("recover_s", "recover")]
    ):
        values = [r[key] if r[key] is not None else 0.0 for r in rows]
        drawn = times.bar([i + (k - 1) * width for i in x], values, width, label=name, color=f"C{k + 1}")
        _label_bars(times, drawn, [None if r[key] is None else f"{r[key]:.2f}" for r in rows])
    times.set_xticks(list(x), labels, fontsize=8)
    times.set_ylabel("seconds")
    times.legend(fontsize=8)
    times.set_title("longest stall of a stream; time to detect and to recover", fontsize=9)
    _save(fig, out, f"Network faults, every node in a namespace\n{subtitle}", tight=True)
