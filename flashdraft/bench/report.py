"""From results to the comparison table, the JSON summary, the CSV and the chart."""
import csv
import json
import statistics
from pathlib import Path

from flashdraft.bench.results import Result, Turn


def uniform_source(results: list[Result]) -> tuple[list[Result], str]:
    """Use the servers' own timings only when every answer carried them; otherwise measure all on the client."""
    turns = [t for r in results for t in r.turns]
    sources = {t.source for t in turns}
    if "client" in sources and "server" in sources:
        results = [Result(r.system, r.prompt_id, r.category, r.run, [t.measured_by_client() for t in r.turns],
                          r.error) for r in results]
        return results, "client"
    return results, (sources.pop() if len(sources) == 1 else "none")


def tps(tokens: int, ms: float) -> float:
    return 1e3 * tokens / ms if ms > 0 else 0.0


def median_spread(values: list[float]) -> tuple[float, float]:
    """Median and half the range (0 for one value)."""
    if not values:
        return 0.0, 0.0
    return statistics.median(values), (max(values) - min(values)) / 2


def first_difference(a: Result, b: Result) -> tuple[int, str] | None:
    """Position of the first difference between two answers: in tokens when both have ids, else in characters."""
    offset_tok, offset_chr = 0, 0
    for ta, tb in zip(a.turns, b.turns):
        if ta.token_ids is not None and tb.token_ids is not None:
            if ta.token_ids != tb.token_ids or ta.text != tb.text:
                ids = [i for i, (x, y) in enumerate(zip(ta.token_ids, tb.token_ids)) if x != y]
                pos = ids[0] if ids else min(len(ta.token_ids), len(tb.token_ids))
                return offset_tok + pos, "token"
        elif ta.text != tb.text:
            pos = next((i for i, (x, y) in enumerate(zip(ta.text, tb.text)) if x != y),
                       min(len(ta.text), len(tb.text)))
            return offset_chr + pos, "character"
        offset_tok += len(ta.token_ids or [])
        offset_chr += len(ta.text)
    if len(a.turns) != len(b.turns):
        return offset_tok, "turn"
    return None


def pooled(turns: list[Turn]) -> dict:
    steps = sum(t.verify_steps for t in turns)
    draft_n = sum(t.draft_n for t in turns)
    accepted = sum(t.draft_n_accepted for t in turns)
    return dict(draft_n=draft_n, draft_n_accepted=accepted, verify_steps=steps,
                mean_acceptance_length=1 + accepted / steps if steps else None,
                acceptance_rate=accepted / draft_n if draft_n else None)


def histogram(turns: list[Turn]) -> list[int]:
    out: list[int] = []
    for t in turns:
        if len(t.acceptance_histogram) > len(out):
            out += [0] * (len(t.acceptance_histogram) - len(out))
        for k, c in enumerate(t.acceptance_histogram):
            out[k] += c
    return out


def pair_stats(base: Result, res: Result) -> dict:
    bt, st = base.turns, res.turns
    b_tok, b_ms = sum(t.tokens for t in bt), sum(t.decode_ms for t in bt)
    s_tok, s_ms = sum(t.tokens for t in st), sum(t.decode_ms for t in st)
    b_tps, s_tps = tps(b_tok, b_ms), tps(s_tok, s_ms)
    return dict(prompt_id=res.prompt_id, category=res.category, run=res.run,
                base_tokens=b_tok, base_ms=b_ms, tokens=s_tok, ms=s_ms, base_tps=b_tps, tps=s_tps,
                speedup=s_tps / b_tps if b_tps > 0 else 0.0,
                base_ttft_ms=statistics.mean(t.ttft_ms for t in bt), ttft_ms=statistics.mean(t.ttft_ms for t in st),
                difference=first_difference(base, res), turns=st)


def group_row(name: str, kind: str, category: str, pairs: list[dict], greedy: bool) -> dict:
    runs = sorted({p["run"] for p in pairs})
    by_run = [[p for p in pairs if p["run"] == r] for r in runs]
    base_tps = [tps(sum(p["base_tokens"] for p in ps), sum(p["base_ms"] for p in ps)) for ps in by_run]
    sys_tps = [tps(sum(p["tokens"] for p in ps), sum(p["ms"] for p in ps)) for ps in by_run]
    ratio = [s / b if b > 0 else 0.0 for s, b in zip(sys_tps, base_tps)]
    mean_sp = [statistics.mean(p["speedup"] for p in ps) for ps in by_run]
    tokens = [sum(p["tokens"] for p in ps) for ps in by_run]
    base_tokens = [sum(p["base_tokens"] for p in ps) for ps in by_run]
    same = sum(p["difference"] is None for p in pairs)
    row = dict(name=name, kind=kind, category=category, prompts=len({p["prompt_id"] for p in pairs}), runs=len(runs),
               tokens=statistics.median(tokens), base_tokens=statistics.median(base_tokens))
    for key, values in (("base_tps", base_tps), ("tps", sys_tps), ("speedup", ratio),
                        ("mean_speedup", mean_sp),
                        ("base_ttft_ms", [statistics.mean(p["base_ttft_ms"] for p in ps) for ps in by_run]),
                        ("ttft_ms", [statistics.mean(p["ttft_ms"] for p in ps) for ps in by_run])):
        row[key], row[key + "_spread"] = median_spread(values)
    if kind == "prompt":
        row.pop("mean_speedup"), row.pop("mean_speedup_spread")
    row.update(pooled([t for p in pairs for t in p["turns"]]))
    row.update(same=same, compared=len(pairs), equal=same == len(pairs), mismatch=greedy and same < len(pairs))
    return row


def compare(results: list[Result], baseline: str, system: str, greedy: bool) -> dict:
    base = {(r.prompt_id, r.run): r for r in results if r.system == baseline and r.ok}
    pairs = [pair_stats(base[(r.prompt_id, r.run)], r) for r in results
             if r.system == system and r.ok and (r.prompt_id, r.run) in base]
    order = list(dict.fromkeys(p["prompt_id"] for p in pairs))
    rows = [group_row(pid, "prompt", next(p["category"] for p in pairs if p["prompt_id"] == pid),
                      [p for p in pairs if p["prompt_id"] == pid], greedy) for pid in order]
    categories = list(dict.fromkeys(p["category"] for p in pairs))
    if len(categories) > 1:
        rows += [group_row(c, "category", c, [p for p in pairs if p["category"] == c], greedy) for c in categories]
    if pairs:
        rows.append(group_row("overall", "overall", "", pairs, greedy))
    mismatches = [dict(prompt_id=p["prompt_id"], run=p["run"], position=p["difference"][0], unit=p["difference"][1])
                  for p in pairs if p["difference"] is not None]
    return dict(system=system, baseline=baseline, rows=rows, mismatches=mismatches,
                acceptance_histogram=histogram([t for p in pairs for t in p["turns"]]))


def summarize(results: list[Result], systems: list[str], greedy: bool, settings: dict,
              aborted: str | None = None) -> dict:
    results, source = uniform_source(results)
    errors = [dict(system=r.system, prompt_id=r.prompt_id, run=r.run, error=r.error) for r in results if r.error]
    return dict(baseline=systems[0], systems=systems, timing_source=source, greedy=greedy, settings=settings,
                comparisons=[compare(results, systems[0], s, greedy) for s in systems[1:]],
                errors=errors, aborted=aborted, results=len(results))


def display(name: str) -> str:
    return {"dflash": "DFlash", "baseline": "baseline"}.get(name, name)


def short(summary: dict, name: str) -> str:
    """Column label: base / DFlash in process, #1 #2 ... (the --url order) across servers."""
    if name == summary["baseline"]:
        return "base"
    return "DFlash" if name == "dflash" else f"#{summary['systems'].index(name) + 1}"


def fmt(value: float | None, spec: str, spread: float = 0.0, suffix: str = "") -> str:
    if value is None:
        return "-"
    out = f"{value:{spec}}{suffix}"
    return out + (f" ±{spread:{spec}}" if spread else "")


def table_rows(summary: dict, comp: dict) -> list[list[str]]:
    a, b = short(summary, comp["baseline"]), short(summary, comp["system"])
    head = ["prompt", "tokens", f"{a} tok/s", f"{b} tok/s", "speedup (Σtok/Σtime)", "speedup (mean of prompts)",
            "accept len", "accept rate", f"TTFT {a} ms", f"TTFT {b} ms", "same text"]
    out = [head]
    for r in comp["rows"]:
        name = {"prompt": r["name"], "category": f"[{r['name']}] {r['prompts']} prompts",
                "overall": f"OVERALL {r['prompts']} prompts"}[r["kind"]]
        if r["kind"] == "prompt":
            same = "yes" if r["equal"] else ("MISMATCH" if r["mismatch"] else "differs")
        else:
            same = f"{r['same']}/{r['compared']}" + (" MISMATCH" if r["mismatch"] else "")
        out.append([name, f"{r['tokens']:.0f}", fmt(r["base_tps"], ".1f", r["base_tps_spread"]),
                    fmt(r["tps"], ".1f", r["tps_spread"]), fmt(r["speedup"], ".2f", r["speedup_spread"], "x"),
                    fmt(r.get("mean_speedup"), ".2f", r.get("mean_speedup_spread", 0.0), "x"),
                    fmt(r["mean_acceptance_length"], ".2f"),
                    fmt(None if r["acceptance_rate"] is None else 100 * r["acceptance_rate"], ".1f", suffix="%"),
                    fmt(r["base_ttft_ms"], ".0f", r["base_ttft_ms_spread"]), fmt(r["ttft_ms"], ".0f", r["ttft_ms_spread"]),
                    same])
    return out


def format_table(summary: dict) -> str:
    blocks = []
    for comp in summary["comparisons"]:
        rows = table_rows(summary, comp)
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        runs = max((r["runs"] for r in comp["rows"]), default=0)
        names = {short(summary, n): display(n) for n in (comp["baseline"], comp["system"])}
        title = (", ".join(f"{k} = {v}" for k, v in names.items() if k != v)
                 + ("; " if any(k != v for k, v in names.items()) else "")
                 + f"decode tok/s from {summary['timing_source']} timings; speedup is {short(summary, comp['system'])} "
                 "over base; accept len = mean tokens per verify step (bonus included)")
        if runs > 1:
            title += f"; median of {runs} runs ± half the range"
        lines = [title]
        sep = "  ".join("-" * w for w in widths)
        kinds = ["head"] + [r["kind"] for r in comp["rows"]]
        for i, r in enumerate(rows):
            if i > 0 and kinds[i] != "prompt" and kinds[i - 1] == "prompt":
                lines.append(sep)
            lines.append("  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths))))
            if i == 0:
                lines.append(sep)
        if not comp["rows"]:
            lines.append("(no prompt was answered by both)")
        hist = comp["acceptance_histogram"]
        if sum(hist):
            top = max(k for k, c in enumerate(hist) if c)
            lines.append(f"acceptance length histogram (tokens per verify step: share of steps; block size "
                         f"{len(hist) - 1}): " + ", ".join(f"{k}: {100 * c / sum(hist):.1f}%"
                                                            for k, c in enumerate(hist[:top + 1]) if k > 0))
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def warnings(summary: dict, limit: int = 5) -> list[str]:
    out = []
    for comp in summary["comparisons"]:
        if summary["greedy"] and len(comp["mismatches"]) > limit:
            out.append(f"WARNING: MISMATCH at temperature 0 on {len(comp['mismatches'])} answers of "
                       f"{display(comp['system'])}; the first {limit}:")
        for m in comp["mismatches"][:limit]:
            if summary["greedy"]:
                out.append(f"WARNING: MISMATCH at temperature 0: {display(comp['system'])} differs from "
                           f"{display(comp['baseline'])} on {m['prompt_id']} (run {m['run'] + 1}), first at "
                           f"{m['unit']} {m['position']}")
    for e in summary["errors"]:
        out.append(f"error: {e['system']} on {e['prompt_id']} (run {e['run'] + 1}): {e['error']}")
    return out


CSV_FIELDS = ["system", "baseline", "kind", "name", "category", "prompts", "runs", "tokens", "base_tokens",
              "base_tps", "base_tps_spread", "tps", "tps_spread", "speedup", "speedup_spread", "mean_speedup",
              "mean_speedup_spread", "mean_acceptance_length", "acceptance_rate", "draft_n", "draft_n_accepted",
              "verify_steps", "base_ttft_ms", "base_ttft_ms_spread", "ttft_ms", "ttft_ms_spread", "same", "compared",
              "equal", "mismatch"]


def write_csv(summary: dict, path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for comp in summary["comparisons"]:
            for r in comp["rows"]:
                w.writerow({**r, "system": comp["system"], "baseline": comp["baseline"]})


def write_chart(summary: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    comps = summary["comparisons"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw=dict(width_ratios=[3, 2]))
    if comps:
        names = [r["name"] for r in comps[0]["rows"] if r["kind"] == "prompt"]
        series = [(display(summary["baseline"]), {r["name"]: r["base_tps"] for r in comps[0]["rows"]})]
        series += [(display(c["system"]), {r["name"]: r["tps"] for r in c["rows"]}) for c in comps]
        width = 0.8 / len(series)
        for i, (label, values) in enumerate(series):
            ax1.bar([x + i * width for x in range(len(names))], [values.get(n, 0.0) for n in names], width, label=label)
        if len(names) <= 40:
            ax1.set_xticks([x + 0.4 - width / 2 for x in range(len(names))], names, rotation=45, ha="right",
                           fontsize=8)
        ax1.legend(loc="best", fontsize=8, framealpha=0.8)
    ax1.set_ylabel("decode tok/s")
    ax1.set_title("decode speed per prompt")
    for c in comps:
        hist = c["acceptance_histogram"]
        if sum(hist):
            ax2.bar(range(1, len(hist)), [h / sum(hist) for h in hist[1:]], alpha=0.6, label=display(c["system"]))
            ax2.set_xticks(range(1, len(hist)))
    ax2.set_xlabel("tokens committed per verify step (acceptance length)")
    ax2.set_ylabel("share of verify steps")
    ax2.set_title("acceptance length histogram")
    if any(sum(c["acceptance_histogram"]) for c in comps):
        ax2.legend(loc="best", fontsize=8)
    else:
        ax2.text(0.5, 0.5, "no per-step acceptance data", ha="center", va="center", transform=ax2.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(summary: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "summary.json", out / "table.csv", out / "chart.png"]
    paths[0].write_text(json.dumps(summary, indent=1))
    write_csv(summary, paths[1])
    write_chart(summary, paths[2])
    return paths
