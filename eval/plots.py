"""PNG plots of the language-model evaluations (matplotlib, Agg backend)."""
from __future__ import annotations


def plot_perplexity_report(report: dict, png_path: str, title: str = "") -> str:
    """Left: NLL by position bucket for each length multiplier (full context) and with the context restarting
    every training length; right: NLL along the streamed documents. Either panel is left out when its section
    is missing from ``report`` (the dict written by ``eval.perplexity``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ext, stream = report.get("length_extrapolation"), report.get("streaming")
    panels = [p for p in (ext, stream) if p]
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(6.5 * max(1, len(panels)), 4.2), dpi=120,
                             squeeze=False)
    axes = list(axes[0])
    if ext:
        ax = axes.pop(0)
        width = ext["bucket_tokens"]
        centers = [s + width / 2 for s in ext["bucket_start"]]
        rows = sorted(ext["lengths"], key=lambda r: -r["length"])  # longest first, thickest: all stay visible
        for i, row in enumerate(rows):
            n = sum(1 for s in ext["bucket_start"] if s < row["length"])
            line_width = 1.2 + 1.6 * (len(rows) - 1 - i) / max(1, len(rows) - 1)
            ax.plot(centers[:n], ext["nll_full_context"][:n], lw=line_width,
                    label=f"{row['multiplier']:g}x ({row['length']} tokens): ppl {row['perplexity']:.2f}, "
                          f"Δtail {row['delta_tail']:+.3f}")
        ax.plot(centers, ext["nll_train_window"], "k--", lw=1.0, label=f"context restarting every {ext['seq_len']}")
        ax.axvline(ext["seq_len"], color="gray", ls=":", lw=1.0)
        ax.set_xlabel(f"position (buckets of {width} tokens)")
        ax.set_ylabel("NLL (nats/token)")
        ax.set_title(f"length extrapolation, {ext['documents']} documents")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if stream:
        ax = axes.pop(0)
        width = stream["bucket_tokens"]
        ax.plot([s + width / 2 for s in stream["bucket_start"]], stream["nll_by_position"], "o-", ms=3)
        ax.set_xlabel(f"stream position (buckets of {width} tokens)")
        ax.set_ylabel("NLL (nats/token)")
        ax.set_title(f"streaming through decode, {stream['tokens']} tokens in chunks of {stream['chunk']}")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return png_path
