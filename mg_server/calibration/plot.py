"""The calibration plot, drawn from the profile alone: per prompt set, trigger rate vs sequence
determinism over the tau sweep (the frontier, chosen tau marked), and the margin histograms of
stable vs flipped steps (log counts, chosen tau as a line)."""

from __future__ import annotations

from pathlib import Path


def write(prof: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on a server
    import matplotlib.pyplot as plt

    names = list(prof["sets"])
    tau = prof["tau"]
    fig, axes = plt.subplots(1, 1 + len(names), figsize=(5.5 * (1 + len(names)), 4.6))
    ax = axes[0]
    for k, name in enumerate(names):
        rows = [r for r in prof["sets"][name]["sweep"] if r["tau"] != "inf"]
        x = [100 * r["trigger"] for r in rows]
        y = [100 * r["determinism"] for r in rows]
        line, = ax.plot(x, y, marker="o", ms=3, label=name)
        for r, xi, yi in zip(rows, x, y):
            if r["tau"] == tau:
                ax.plot([xi], [yi], marker="*", ms=14, color=line.get_color())
                ax.annotate(f"{name}: tau {tau:.3g}, trigger {xi:.1f} %", (xi, yi), textcoords="offset points",
                            xytext=(-150, -18 - 14 * k), fontsize=8, color=line.get_color())
    ax.set_xlabel("verifier trigger rate (% of steps)")
    ax.set_ylabel("sequence determinism (%)")
    ax.set_title(f"{prof['model']}: tau sweep (* = chosen)", fontsize=10)
    ax.set_xscale("symlog", linthresh=1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)

    for ax, name in zip(axes[1:], names):
        s = prof["sets"][name]
        h = s["margin_histogram"]
        edges = h["edges"]
        widths = [b - a for a, b in zip(edges, edges[1:])]
        ax.bar(edges[:-1], h["stable"], width=widths, align="edge", alpha=0.6,
               label=f"stable ({s['steps'] - s['flips']})")
        ax.bar(edges[:-1], h["flipped"], width=widths, align="edge", alpha=0.9, color="tab:red",
               label=f"flipped ({s['flips']})")
        ax.axvline(tau, color="k", ls="--", lw=1, label=f"tau {tau:.3g}")
        ax.set_yscale("log")
        ax.set_xlabel(f"fast-path margin (logits; last bin: >= {edges[-2]:g})")
        ax.set_ylabel("steps")
        ax.set_title(f"{name}: flip rate {100 * s['flip_rate']:.2f} % of {s['steps']} steps", fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(f"{prof['sglang']['device']} {prof['dtype']}, SGLang {prof['sglang']['version']}, "
                 f"batch sizes {prof['batch_sizes']}, {prof['max_tokens']} tokens", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
