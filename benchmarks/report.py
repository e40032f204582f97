"""Turn a results JSON into PNG plots and the markdown tables of benchmarks/README.md."""

from __future__ import annotations

import json
import os

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
MiB = 1 << 20


def _fmt_ratio(x):
    return "—" if x is None else f"{x:.2f}×"


def throughput_table(res: dict) -> str:
    names = [n for n in res["meta"]["contenders"] if n not in res["contenders"]["errors"]]
    keys = ("dhp/tp", "dhp/fsdp2", "dhp/zero3")
    lines = ["Vision tokens/s from the median step time (median step s); ratios from medians (from minimums):", "",
             "| vision patches / image | " + " | ".join(f"{n}" for n in names)
             + " | DHP/TP | DHP/FSDP2 | DHP/ZeRO-3 |", "|" + "---|" * (len(names) + 4)]
    for length, runs in res["sweep"].items():
        cells = [f"{runs[n]['vision_tokens_per_s']:.0f} ({runs[n]['step_time_median_s']:.2f})" for n in names]
        r, rm = res["ratios"][length], res.get("ratios_min", {}).get(length, {})
        lines.append(f"| {length} | " + " | ".join(cells) + " | "
                     + " | ".join(f"{_fmt_ratio(r.get(k))} ({_fmt_ratio(rm.get(k))})" for k in keys) + " |")
    return "\n".join(lines)


def memory_table(res: dict) -> str:
    names = [n for n in res["meta"]["contenders"] if n not in res["contenders"]["errors"]]
    length = list(res["sweep"])[-1]
    runs = res["sweep"][length]
    lines = [f"Per rank (worst rank), vision length {length}, global batch {res['meta']['batch']}:", "",
             "| contender | activations MiB (vision / text) | model MiB (error) | params+grads+optimizer MiB | "
             "peak RSS MiB | CUDA peak MiB | collectives per step (calls, MiB sent by rank 0) |",
             "|---|---|---|---|---|---|---|"]
    val = {(v["contender"], str(v["length"])): v for v in res["memory_model"]["validation"]}
    for n in names:
        r = runs[n]
        st = res["contenders"]["state_max"][n]
        calls = sum(c["calls"] for c in r["collectives_rank0"].values())
        sent = sum(c["bytes"] for c in r["collectives_rank0"].values()) / MiB
        v = val.get((n, str(length)))
        model = f"{v['model'] / MiB:.1f} ({100 * v['rel_err']:+.1f}%)" if v else "—"
        lines.append(f"| {n} | {r['activation_max'] / MiB:.1f} ({r['vision_act_max'] / MiB:.1f} / "
                     f"{r['text_act_max'] / MiB:.1f}) | {model} | {st / MiB:.1f} | {max(r['peak_rss_per_rank']) / MiB:.0f} "
                     f"| {max(r['cuda_peak_per_rank']) / MiB:.0f} | {calls}, {sent:.1f} |")
    return "\n".join(lines)


def sp_table(res: dict) -> str:
    sp = res["sp_scaling"]
    lines = [f"One image of {sp['length']} patches, DHP engine, vision activation bytes on the busiest rank:", "",
             "| SP | vision activations MiB | × SP=1 | ideal 1/SP | within 10% |", "|---|---|---|---|---|"]
    for k, row in sp["rows"].items():
        lines.append(f"| {k} | {row['vision_bytes'] / MiB:.2f} | {row['fraction']:.3f} | {1 / int(k):.3f} | "
                     f"{'yes' if row['within_10pct'] else 'no'} |")
    return "\n".join(lines)


def big_model_table(res: dict) -> str:
    mm = res["memory_model"]
    lines = [f"Largest single-image vision length (patches) per rank budget {mm['budget_gib']} GiB "
             f"({mm['gpus']}× {mm['gpu_gib']} GB minus {mm['reserve_gib']} GiB reserve), bf16 params/grads/"
             "activations, fp32 master + Adam m, v; flash attention:", "",
             "| model | act. ckpt | DHP (SP8+TP8) | DHP + text SP (SP8+TP8+SP) | uniform TP8 | ZeRO-3 | "
             "DHP / ZeRO-3 | DHP + text SP / ZeRO-3 | state GiB DHP / TP / ZeRO-3 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in mm["big_models"]:
        ratio = r["dhp"] / r["zero3"] if r["zero3"] else float("inf")
        ratio_sp = r["dhp_text_sp"] / r["zero3"] if r["zero3"] else float("inf")
        lines.append(f"| {r['model']} | {'yes' if r['activation_checkpointing'] else 'no'} | {r['dhp']:,} | "
                     f"{r['dhp_text_sp']:,} | {r['tp']:,} | {r['zero3']:,} | {ratio:.1f}× | {ratio_sp:.1f}× | "
                     f"{r['dhp_state_gib']} / {r['tp_state_gib']} / {r['zero3_state_gib']} |")
    lines += ["", "The text-SP column is the memory model with the text activations of "
              "`text.sequence_parallel: true` as measured by `benchmarks/text_sp.py` (see 'Text sequence "
              "parallelism, measured' below)."]
    return "\n".join(lines)


def overhead_text(res: dict) -> str:
    o = res.get("ray_overhead") or {}
    if "skipped" in o or "error" in o:
        return f"Ray overhead: not measured ({o.get('skipped') or o.get('error')})."
    return (f"Ray plugin overhead (DHP SP{o['config']['ranks']}+TP{o['config']['ranks']}, length "
            f"{o['config']['length']}, {o['config']['steps']} steps, plain → Ray → plain): per-step median "
            f"{o['ray_step_median_s']:.3f} s under `DisaggregatedTrainer.fit()` vs {o['plain_step_median_s']:.3f} s "
            f"plain = {o['step_time_ratio_ray_over_plain']:.3f}× (medians; plain-vs-plain spread "
            f"{100 * o.get('plain_vs_plain_median_spread', 0):.0f}%), **{o.get('ratio_min', float('nan')):.3f}×** from "
            f"minimum step times; time to the first step "
            f"{o['ray_to_first_step_s']:.1f} s (Ray) vs {o['plain_to_first_step_s']:.1f} s (plain spawn).")


def targets_text(res: dict) -> str:
    lines = []
    for t in res["targets"]:
        lines.append(f"- **{t['name']}**: {'HIT' if t['hit'] else 'MISS'} — {t['detail']}")
    return "\n".join(lines)


def markdown(res: dict, stem: str) -> str:
    m = res["meta"]
    parts = [f"### `{stem}` ({m['date']}, {m['hardware']}, {m['ranks']} ranks, {m['backend']})", "",
             f"Command: `{m['command']}`; load average before/after: {m['loadavg_before']} / {m['loadavg_after']}.",
             "", throughput_table(res), "", memory_table(res), "", sp_table(res), "", big_model_table(res), "",
             overhead_text(res), "", "Targets:", "", targets_text(res), "",
             f"![throughput](results/{stem}-throughput.png) ![memory](results/{stem}-memory.png)"]
    errs = res["contenders"]["errors"]
    if errs:
        parts += ["", "Contenders that could not run: " + "; ".join(f"{k}: `{v}`" for k, v in errs.items())]
    return "\n".join(parts)


def plots(res: dict, out_prefix: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = [int(x) for x in res["sweep"]]
    names = [n for n in res["meta"]["contenders"] if n not in res["contenders"]["errors"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    for n in names:
        ax.plot(lengths, [res["sweep"][str(x)][n]["vision_tokens_per_s"] for x in lengths], marker="o", label=n)
    ax.set(xscale="log", xlabel="vision patches per image", ylabel="vision tokens / s",
           title=f"{res['meta']['shape']} on {res['meta']['hardware']}, {res['meta']['ranks']} ranks")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_prefix + "-throughput.png", dpi=110)
    plt.close(fig)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for n in names:
        a1.plot(lengths, [res["sweep"][str(x)][n]["activation_max"] / MiB for x in lengths], marker="o", label=n)
    a1.set(xlabel="vision patches per image", ylabel="saved activations per rank (MiB)", title="measured (exact)")
    a1.legend()
    sp = res["sp_scaling"]["rows"]
    ks = list(sp)
    a2.bar(ks, [sp[k]["vision_bytes"] / MiB for k in ks], color="tab:blue", label="measured")
    a2.plot(ks, [sp[ks[0]]["vision_bytes"] / MiB / int(k) for k in ks], "k--", marker="x", label="1/SP")
    a2.set(xlabel="vision SP degree", ylabel="vision activations, busiest rank (MiB)", title="one image, DHP")
    a2.legend()
    fig.tight_layout()
    fig.savefig(out_prefix + "-memory.png", dpi=110)
    plt.close(fig)


def update_readme(readme: str, section: str) -> None:
    text = open(readme).read() if os.path.exists(readme) else f"{BEGIN}\n{END}\n"
    if BEGIN not in text:
        text += f"\n{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(readme, "w") as f:
        f.write(f"{head}{BEGIN}\n{section}\n{END}{tail}")


def main(path: str) -> None:
    with open(path) as f:
        res = json.load(f)
    stem = os.path.splitext(os.path.basename(path))[0]
    prefix = os.path.splitext(path)[0]
    plots(res, prefix)
    update_readme(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(path))), "README.md"),
                  markdown(res, stem))


if __name__ == "__main__":
    import sys

    main(sys.argv[1])
