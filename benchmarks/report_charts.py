"""The charts and the Markdown summary of benchmarks/report.py, from the results of its runs
(each the JSON a benchmark wrote with --json, bench_json.py). Every figure and the summary
carry one label: CPU, ISA, threads and git commit. matplotlib with the Agg backend."""
import json
from pathlib import Path

COLORS = {"ours": "#1f77b4", "transformers": "#ff7f0e", "minimal": "#2ca02c"}
CONTENDERS = ("ours", "transformers", "minimal")
FIGURES = ("step_time.png", "attention_speedup.png", "kernels.png", "long_context.png")


def isa_text(meta: dict, isas) -> str:
    """'avx512' or 'avx512 + avx2 (forced)': the ISAs of a figure, the forced ones marked."""
    return " + ".join(isa if isa == meta["best_isa"] else f"{isa} (forced)" for isa in isas)


def label(meta: dict, isas) -> str:
    return (f"CPU {meta['cpu']} | ISA {isa_text(meta, isas)} | {meta['threads']} threads | "
            f"commit {meta['commit']}")


def of(results, name: str) -> list:
    """The successful results of the runs called `name`."""
    return [r for r in results if r["run"] == name and r["data"]]


# -- rows ------------------------------------------------------------------------
def step_rows(results) -> list:
    """One row per training-step result: configuration, dtype, ISA, ms per contender,
    ratios peer / ours and (dense model) MFU."""
    rows = []
    for r in of(results, "train_step fp32") + of(results, "train_step bf16") + of(results, "moe"):
        d, c = r["data"], r["data"]["config"]
        config = (f"MoE {c['experts']}x top{c['topk']} {c['layers']}L h{c['hidden']} "
                  f"s{c['seq']} b{c['batch']}" if d["benchmark"] == "moe" else
                  f"GPT {c['layers']}L h{c['hidden']} s{c['seq']} b{c['batch']}")
        rows.append({"config": config, "dtype": d["dtype"], "isa": r["isa"],
                     "ms": d["ms_per_step"], "ratios": d["ratios"], "mfu": d.get("mfu")})
    return rows


def fused_rows(results, attention: bool) -> list:
    """bench_fused's lines of our kernels against their plain path, each with its ISA: the
    attention lines, or the others."""
    runs = of(results, "fused") + of(results, "fused long")
    return [dict(row, isa=r["isa"]) for r in runs for row in r["data"]["rows"]
            if row["auto"] is not None and (row.get("kernel") == "attention") == attention]


def variant(row) -> str:
    """What an attention line adds to plain causal attention: a sliding window, sinks, or
    nothing ("causal"). Each variant is its own line of the chart and says so in the table."""
    if row.get("window"):
        return f"window {row['window']}"
    return "sinks" if row.get("sinks") else "causal"


# -- charts ----------------------------------------------------------------------
def save(fig, path: Path, title: str, text: str) -> None:
    """Title, the label at the foot, and the PNG (the label in its metadata too)."""
    fig.suptitle(title, fontsize=12)
    fig.text(0.01, 0.01, text, fontsize=8, color="#444444")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=90, metadata={"Title": title, "Description": text})


def chart_steps(rows, path: Path, text: str) -> None:
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(rows)), 4.8))
    width = 0.8 / len(CONTENDERS)
    for i, row in enumerate(rows):
        for j, name in enumerate(n for n in CONTENDERS if n in row["ms"]):
            x, ms = i + (j - 1) * width, row["ms"][name]
            ax.bar(x, ms, width, color=COLORS[name], label=name if i == 0 else None)
            if name in row["ratios"]:
                ax.text(x, ms, f"{row['ratios'][name]:.2f}x", ha="center", va="bottom",
                        fontsize=8)
    ax.set_xticks(range(len(rows)),
                  [f"{r['config']}\n{r['dtype']} | {r['isa']}" for r in rows], fontsize=8)
    ax.set_ylabel("ms per training step (lower is better)")
    ax.legend(title="above a peer: ours is N x faster", fontsize=8, title_fontsize=8)
    save(fig, path, "Training step: ours against the peers", text)
    plt.close(fig)


def chart_attention(rows, path: Path, text: str) -> None:
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.8))
    lines = {}
    for row in rows:
        key = (row["isa"], row["dropout"], row.get("dtype", "float32"), variant(row))
        lines.setdefault(key, []).append(row)
    for (isa, dropout, dtype, kind), points in sorted(lines.items()):
        points.sort(key=lambda p: p["seq"])
        other = "SDPA" if not dropout else "explicit"
        ax.plot([p["seq"] for p in points], [p["speedup"] for p in points],
                marker="o" if kind == "causal" else "s",
                linestyle="-" if not dropout else "--",
                label=f"{isa}, {dtype}, {kind}, dropout {dropout}: {other} / ours")
    seqs = sorted({row["seq"] for row in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(seqs, [str(s) for s in seqs])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("sequence length")
    ax.set_ylabel("speed-up of our kernel (> 1: ours is faster)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    save(fig, path, "Causal attention forward + backward: our CPU kernel's speed-up", text)
    plt.close(fig)


def short(name: str) -> str:
    return name.replace("CPU ", "").replace(" fwd+bwd", "")


def chart_kernels(rows, isas, path: Path, text: str) -> None:
    import matplotlib.pyplot as plt
    names = list(dict.fromkeys(row["name"] for row in rows))
    fig, ax = plt.subplots(figsize=(9, max(3.5, 0.3 * len(names) * len(isas) + 1.5)))
    height = 0.8 / len(isas)
    for k, isa in enumerate(isas):
        speed = {row["name"]: row["speedup"] for row in rows if row["isa"] == isa}
        ys = [i + k * height for i, n in enumerate(names) if n in speed]
        xs = [speed[n] for n in names if n in speed]
        ax.barh(ys, xs, height, label=isa)
        for x, y in zip(xs, ys):
            ax.text(x, y, f" {x:.2f}x", va="center", fontsize=7)
    ax.set_yticks([i + height * (len(isas) - 1) / 2 for i in range(len(names))],
                  [short(n) for n in names], fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("speed-up of our kernel over the plain PyTorch path (log; > 1: ours is faster)")
    ax.legend(fontsize=8)
    save(fig, path, "Fused CPU kernels, forward + backward", text)
    plt.close(fig)


def chart_long_context(rows, path: Path, text: str, budget: float) -> None:
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4.2))
    ax.bar([f"CP {row['cp']}" for row in rows], [row["seq"] for row in rows], color="#1f77b4")
    for i, row in enumerate(rows):
        ratios = ", ".join(f"{rank['planner_over_measured']:.2f}" for rank in row["ranks"])
        ax.text(i, row["seq"], f"{row['seq']} tokens\nplanner / measured: {ratios or '-'}",
                ha="center", va="bottom", fontsize=8)
    ax.set_ylabel(f"longest sequence in {budget} GiB per rank")
    ax.margins(y=0.25)
    save(fig, path, "Long context: the longest sequence that trains", text)
    plt.close(fig)


def charts(out: Path, meta: dict, results) -> list:
    """Draw every chart the results have data for; their file names."""
    made = []
    steps, attention = step_rows(results), fused_rows(results, True)
    kernels = fused_rows(results, False)
    if steps:
        chart_steps(steps, out / FIGURES[0], label(meta, dict.fromkeys(r["isa"] for r in steps)))
        made.append(FIGURES[0])
    if attention:
        isas = list(dict.fromkeys(r["isa"] for r in attention))
        chart_attention(attention, out / FIGURES[1], label(meta, isas))
        made.append(FIGURES[1])
    if kernels:
        isas = list(dict.fromkeys(r["isa"] for r in kernels))
        chart_kernels(kernels, isas, out / FIGURES[2], label(meta, isas))
        made.append(FIGURES[2])
    for r in of(results, "long_context"):
        chart_long_context(r["data"]["rows"], out / FIGURES[3], label(meta, [r["isa"]]),
                           r["data"]["budget_gib"])
        made.append(FIGURES[3])
    return made


# -- the summary -----------------------------------------------------------------
def table(header, rows) -> list:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def step_section(results) -> list:
    rows = []
    for r in step_rows(results):
        ms, ratio = r["ms"], r["ratios"]
        rows.append([r["config"], r["dtype"], r["isa"], f"{ms['ours']:.1f}",
                     *(f"{ms[p]:.1f} ({ratio[p]:.2f}x)" if p in ms else "-"
                       for p in CONTENDERS[1:]),
                     f"{100 * r['mfu']:.1f}%" if r["mfu"] else "-"])
    return ["## Training step", "", "![Training step against the peers](step_time.png)", "",
            "Milliseconds per step, medians of interleaved repetitions; in brackets, how many "
            "times faster ours is (bench_train_step.py: transformers' GPT-2 and a nanoGPT-style "
            "GPT; bench_moe.py: transformers' Mixtral and a loop-over-experts MoE). MFU: ours "
            "against a matmul of the MLP's shape on the same threads and dtype.", "",
            *table(["configuration", "dtype", "ISA", "ours ms", "transformers ms",
                    "minimal ms", "MFU"], rows), ""]


def by_line(rows) -> list:
    """Attention rows in the order of the chart's lines: ISA (as run), dropout, variant (plain
    causal first, then windows by size, then sinks), then length."""
    order = {isa: i for i, isa in enumerate(dict.fromkeys(row["isa"] for row in rows))}
    return sorted(rows, key=lambda row: (order[row["isa"]], row["dropout"],
                                         row.get("dtype", "float32"), bool(row.get("sinks")),
                                         row.get("window") or 0, row["seq"]))


def attention_section(results) -> list:
    rows = [[row["seq"], f"b{row['batch']} h{row['heads']} d{row['head_dim']}", variant(row),
             row.get("dtype", "float32"), row["dropout"], row["isa"],
             f"{row['ms'][0]:.2f}", f"{row['ms'][1]:.2f}", f"{row['speedup']:.2f}x",
             f"{row['auto']} ({row['verdict']})"] for row in by_line(fused_rows(results, True))]
    return ["## Attention kernel", "", "![Attention speed-up against sequence length]"
            "(attention_speedup.png)", "",
            "Causal self-attention forward + backward (bench_fused.py): SDPA (with dropout: the "
            "explicit path auto takes without our kernel; with a window, SDPA with its mask; with "
            "sinks, SDPA with the sink as one more key) against our CPU kernel, and the path "
            "`auto` takes and whether it was the faster one in this run.", "",
            *table(["seq", "shape", "variant", "dtype", "dropout", "ISA", "other ms", "ours ms",
                    "speed-up", "auto"], rows), ""]


def kernels_section(results) -> list:
    rows = [[short(row["name"]), row["isa"], f"{row['ms'][0]:.2f}", f"{row['ms'][1]:.2f}",
             f"{row['speedup']:.2f}x", f"{row['auto']} ({row['verdict']})"]
            for row in fused_rows(results, False)]
    return ["## Other kernels", "", "![Fused kernels' speed-ups](kernels.png)", "",
            *table(["kernel", "ISA", "plain ms", "ours ms", "speed-up", "auto"], rows), ""]


def long_context_section(results) -> list:
    lines = []
    for r in of(results, "long_context"):
        rows = [[row["cp"], row["seq"], f"{row['planned_gib']:.3f}",
                 ", ".join(f"{k['peak_gib']:.3f} ({k['planner_over_measured']:.2f})"
                           for k in row["ranks"]) or "-"] for row in r["data"]["rows"]]
        lines += ["## Long context", "", "![Longest sequence per CP size](long_context.png)", "",
                  f"The longest sequence whose planned memory fits {r['data']['budget_gib']} "
                  f"GiB per rank ({r['data']['layers']}-layer LLaMA-style model, "
                  "bench_long_context.py), and each rank's measured peak RSS in one training "
                  "step at that length (planner / measured above the start-up baseline).", "",
                  *table(["CP", "longest sequence", "planned GiB per rank",
                          "peak RSS GiB per rank (planner / measured)"], rows), ""]
    return lines


def contention(meta: dict, results) -> list:
    """A note when the load average shows other work on the machine during the runs."""
    peak = max([max(r["load_before"], r["load_after"]) for r in results] or [0])
    if peak <= meta["threads"] + 1:
        return []
    return [f"**Shared machine:** the load average reached {peak:.1f} on this "
            f"{meta['cpu_count']}-core machine while the benchmarks ran on {meta['threads']} "
            "threads: other work ran beside them, so these timings are noisier (and the "
            "absolute times slower) than a quiet machine's; the ratios, measured interleaved "
            "in one run, suffer less.", ""]


def header(meta: dict, results) -> list:
    quick = (["`--quick`: tiny sizes and one repetition, a smoke test of the report, not a "
              "measurement.", ""] if meta["quick"] else [])
    failed = [f"**Failed:** `{r['command']}` (exit {r['rc']})" for r in results if r["rc"]]
    return ["# Benchmark report", "", label(meta, meta["isas"]), "",
            f"Made {meta['date']} by `python benchmarks/report.py"
            f"{' --quick' if meta['quick'] else ''}`; the benchmarks took "
            f"{meta['seconds']:.0f} s ({meta['seconds'] / 60:.1f} min).", "",
            *quick, *contention(meta, results), *(failed + [""] if failed else [])]


def runs_section(results) -> list:
    rows = [[f"`{r['command']}`", r["isa"], f"{r['seconds']:.0f}",
             f"{r['load_before']:.1f} -> {r['load_after']:.1f}",
             "ok" if not r["rc"] else f"exit {r['rc']}"] for r in results]
    return ["## Runs", "", *table(["command", "ISA", "seconds", "load average", "status"], rows),
            "", "## Make your own", "",
            "`python benchmarks/report.py` (under 15 minutes on 2 cores) writes this folder; "
            "`--out DIR` writes another, `--quick` runs tiny sizes in about a minute, `--isa` "
            "and `--only` choose the ISAs and the benchmarks, `--threads N` the threads. "
            "results.json holds every number.", ""]


def write_report(out: Path, meta: dict, results) -> None:
    """README.md, results.json and the charts into `out` (old charts are removed first)."""
    import matplotlib
    matplotlib.use("Agg")
    out.mkdir(parents=True, exist_ok=True)
    for name in FIGURES:
        (out / name).unlink(missing_ok=True)
    made = charts(out, meta, results)
    sections = {"step_time.png": step_section, "attention_speedup.png": attention_section,
                "kernels.png": kernels_section, "long_context.png": long_context_section}
    lines = header(meta, results)
    for name in made:
        lines += sections[name](results)
    (out / "README.md").write_text("\n".join(lines + runs_section(results)))
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
