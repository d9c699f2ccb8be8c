"""The figure of docs/benchmarks/train_h200.md: step time before/after per model, and the first 200 losses of
the Transformer with the dense cuDNN path and with flash attention (from the raw files in docs/benchmarks/raw).

    python tools/plot_train_h200.py   # -> docs/images/train_h200.png
"""
from __future__ import annotations

import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RAW = "docs/benchmarks/raw"
# Step times in seconds before this change (main e01431b, measured on the H200; docs/benchmarks/train_h200.md).
BEFORE = {"Transformer 166M\n32×4096": None, "GDN-2 166M\n32×4096": 0.910, "Muir 166M\n32×4096": 0.956,
          "softmax 125M\n8×4096": 0.512}


def _losses(name):
    rows = [json.loads(line) for line in open(os.path.join(RAW, name))]
    return {r["step"]: r["loss"] for r in rows if r.get("split", "train") == "train" and "loss" in r}


def main():
    a = json.load(open(os.path.join(RAW, "train_h200_a_2026-12-01.json")))
    b = json.load(open(os.path.join(RAW, "train_h200_b_2026-12-01.json")))
    c = json.load(open(os.path.join(RAW, "train_h200_125m_2026-12-01.json")))
    after = {"Transformer 166M\n32×4096": a["transformer_166m"]["step_s"],
             "GDN-2 166M\n32×4096": b["gdn2_166m"]["step_s"], "Muir 166M\n32×4096": b["muir_166m"]["step_s"],
             "softmax 125M\n8×4096": c["softmax_125m"]["step_s"]}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    names = list(BEFORE)
    x = range(len(names))
    ax1.bar([i - 0.2 for i in x], [BEFORE[n] or 0 for n in names], 0.4, label="before (e01431b)", color="tab:gray")
    ax1.bar([i + 0.2 for i in x], [after[n] for n in names], 0.4, label="after", color="tab:blue")
    ax1.text(-0.2, 0.02, "OOM", ha="center", rotation=90)
    ax1.set_xticks(list(x), names, fontsize=8)
    ax1.set_ylabel("seconds per step (one H200, bf16)")
    ax1.legend()
    ax1.set_title("Training step time")
    dense, flash = (_losses(f"train_h200_losses_{n}_2026-12-01.jsonl") for n in ("cudnn_dense", "flash"))
    steps = sorted(set(dense) & set(flash))
    ax2.plot(steps, [dense[s] for s in steps], label="cuDNN, dense T×T document mask", lw=2.2, color="tab:gray")
    ax2.plot(steps, [flash[s] for s in steps], label="flash attention (Pallas, segment ids)", lw=1.0,
             color="tab:blue")
    ax2.set_xlabel("step")
    ax2.set_ylabel("train loss")
    ax2.set_title("Transformer 166M, 8×4096: first 200 losses")
    ax2.legend()
    fig.tight_layout()
    os.makedirs("docs/images", exist_ok=True)
    fig.savefig("docs/images/train_h200.png", dpi=110)
    print("docs/images/train_h200.png")


if __name__ == "__main__":
    main()
