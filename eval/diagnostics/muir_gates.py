"""Gate diagnostics of a trained Muir or GDN-2 model (Muir Fig. 10, Tables 3, 19, 21):

    python -m mixerlab.eval.diagnostics.muir_gates --run runs/<run> [--step N] [--batches 8] [--batch_size 8]

(a) SVD rank truncation: gate m's projection (the product W↓[:, m] W_m↑, ``gate_factors``) in every layer →
    its best rank-r approximation, bias kept, one gate at a time; ΔNLL(r) = NLL(r) − NLL(unchanged) on the
    validation batches, r ∈ {0, 1, 2, 4, …, r_m} (r = 0: bias only; r = r_m: the full product refactored).
(b) Gate freezing: gate m of every layer → its mean over the validation tokens (every token with
    segment_id > 0, all batches; per layer, head and channel), the same constant at every token; one gate at a
    time. Gates as named in Muir Fig. 3b: f = log α_t (the log-decay λ_t, so α is frozen to its geometric
    mean), b = erase gate b_t, g = output-gate pre-activation g_t, w = write gate w_t, q = readout gain γ_t
    (dynamic γ only). ΔNLL = NLL(frozen) − NLL(unchanged), ± paired SE over rows.
(c) Erase rate μ_t = ⟨k_t, b_t ⊙ k_t⟩ (k_t the L2-normalised key, b_t the erase gate, as fed to the op) per
    layer and head over the valid tokens: mean, std, quantiles (Muir Table 3's μ̄ is the mean).

The core functions take a model (``models.decoder.Decoder``) and batches (dicts as ``training.data.eval_batches``
returns); only ``main`` loads a run (``eval.checkpoint.load_run``).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from flax import nnx

from mixerlab.eval import report
from mixerlab.eval.diagnostics.gate_factors import gate_names, max_rank, truncate_gate
from mixerlab.eval.diagnostics.gate_hooks import GATE_FIELDS
from mixerlab.eval.diagnostics.nll import GateEvaluator, delta_nll, mean_nll

QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


def default_ranks(full: int) -> list[int]:
    ranks, r = [0], 1
    while r < full:
        ranks.append(r)
        r *= 2
    return ranks + [full]


def truncation_sweep(model, batches, *, evaluator=None, base=None, ranks=None, gates=None) -> list[dict]:
    """ΔNLL of every (gate, kept rank r); ``ranks`` default ``default_ranks(r_m)`` per gate; a rank above a
    gate's r_m is evaluated (once) at r_m."""
    evaluator = evaluator or GateEvaluator(model)
    base = base or evaluator.evaluate(batches)
    rows = []
    for gate in gates or gate_names(model):
        full = max_rank(model, gate)
        for r in dict.fromkeys(min(r, full) for r in (ranks or default_ranks(full))):
            clone = nnx.clone(model)
            truncate_gate(clone, gate, r)
            rows_r = evaluator.evaluate(batches, state=nnx.split(clone)[1])
            delta, se = delta_nll(base, rows_r)
            rows.append({"gate": gate, "rank": r, "full_rank": full, "nll": mean_nll(rows_r), "delta_nll": delta,
                         "se": se})
    return rows


def freeze_sweep(model, batches, *, evaluator=None, captured=None, gates=None) -> list[dict]:
    """ΔNLL of freezing each gate (all layers) to its validation-token mean."""
    evaluator = evaluator or GateEvaluator(model)
    captured = captured or evaluator.evaluate(batches)
    rows = []
    for gate in gates or gate_names(model):
        frozen = evaluator.evaluate(batches, frozen=(captured["gate_mean"], (GATE_FIELDS[gate],)))
        delta, se = delta_nll(captured, frozen)
        rows.append({"gate": gate, "field": GATE_FIELDS[gate], "nll": mean_nll(frozen), "delta_nll": delta,
                     "se": se})
    return rows


def erase_rate_stats(erase_rate: dict) -> list[dict]:
    """Per layer and head: mean, std, min, max and ``QUANTILES`` of μ over the valid tokens."""
    rows = []
    for layer in sorted(erase_rate):
        mu = erase_rate[layer]
        for head in range(mu.shape[1]):
            x = mu[:, head]
            q = np.quantile(x, QUANTILES)
            rows.append({"layer": layer, "head": head, "mean": float(x.mean()), "std": float(x.std()),
                         "min": float(x.min()), "max": float(x.max()),
                         **{f"q{int(p * 100):02d}": float(v) for p, v in zip(QUANTILES, q)}})
    return rows


def gate_diagnostics(model, batches, *, ranks=None) -> dict:
    """(a), (b) and (c) on ``batches``; one capture pass gives the baseline NLL, gate means and μ."""
    if not batches:
        raise ValueError("gate_diagnostics: no validation batches")
    evaluator = GateEvaluator(model)
    captured = evaluator.evaluate(batches)
    return {"nll": mean_nll(captured), "tokens": float(captured["row_count"].sum()),
            "truncation": truncation_sweep(model, batches, evaluator=evaluator, base=captured, ranks=ranks),
            "freezing": freeze_sweep(model, batches, evaluator=evaluator, captured=captured),
            "erase_rate": erase_rate_stats(captured["erase_rate"]),
            "erase_rate_mean": float(np.mean(np.concatenate([x.ravel() for x in captured["erase_rate"].values()])))}


def plot(result: dict, path: str, title: str) -> str:
    fig, (ax_rank, ax_freeze, ax_mu) = report.new_figure(3, width=4.6)
    for gate in dict.fromkeys(r["gate"] for r in result["truncation"]):
        rows = [r for r in result["truncation"] if r["gate"] == gate]
        ax_rank.errorbar([max(r["rank"], 0.5) for r in rows], [r["delta_nll"] for r in rows],
                         yerr=[r["se"] for r in rows], marker="o", ms=3, label=gate)
    ax_rank.set_yscale("symlog", linthresh=1e-4)
    ax_rank.set(xscale="log", xlabel="kept rank r (0 plotted at 0.5)", ylabel="ΔNLL (nats; symlog, linear below 1e-4)",
                title="SVD gate-rank truncation")
    ax_rank.legend(fontsize=8)
    fr = result["freezing"]
    ax_freeze.bar([r["gate"] for r in fr], [r["delta_nll"] for r in fr], yerr=[r["se"] for r in fr])
    ax_freeze.set(ylabel="ΔNLL (nats)", title="gate frozen to its token mean")
    er = result["erase_rate"]
    labels = [f"L{r['layer']}h{r['head']}" for r in er]
    ax_mu.errorbar(range(len(er)), [r["q50"] for r in er],
                   yerr=[[r["q50"] - r["q05"] for r in er], [r["q95"] - r["q50"] for r in er]], fmt="o", ms=3,
                   label="median, 5–95%")
    ax_mu.plot(range(len(er)), [r["mean"] for r in er], "x", label="mean")
    ax_mu.set_xticks(range(len(er)))
    ax_mu.set_xticklabels(labels, rotation=90, fontsize=6)
    ax_mu.set(ylabel="μ = ⟨k, b ⊙ k⟩", title="erase rate per layer/head")
    ax_mu.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    return report.save_figure(fig, path)


def print_tables(result: dict) -> None:
    rows = [[r["gate"], r["rank"], r["full_rank"], r["nll"], r["delta_nll"], r["se"]] for r in result["truncation"]]
    print(report.table(["gate", "rank r", "r_m", "NLL", "ΔNLL", "± SE"], rows,
                       f"(a) SVD gate-rank truncation (base NLL {result['nll']:.5f}, {result['tokens']:.0f} tokens)"))
    print()
    rows = [[r["gate"], r["field"], r["nll"], r["delta_nll"], r["se"]] for r in result["freezing"]]
    print(report.table(["gate", "Gates field", "NLL", "ΔNLL", "± SE"], rows,
                       "(b) gate frozen to its mean over the validation tokens (all layers)"))
    print()
    rows = [[r["layer"], r["head"], r["mean"], r["std"], r["q05"], r["q25"], r["q50"], r["q75"], r["q95"]]
            for r in result["erase_rate"]]
    print(report.table(["layer", "head", "mean", "std", "q05", "q25", "q50", "q75", "q95"], rows,
                       f"(c) erase rate μ = ⟨k, b⊙k⟩ (all layers and heads: mean {result['erase_rate_mean']:.4f})"))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="run directory (train.output_dir of a Muir/GDN-2 run)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    p.add_argument("--batches", type=int, default=None, help="validation batches (default train.eval_batches)")
    p.add_argument("--batch_size", type=int, default=None, help="rows per batch (default train.batch_size)")
    p.add_argument("--ranks", default=None, help="comma-separated kept ranks (default 0,1,2,4,…,r_m)")
    p.add_argument("--out", default=None, help="output directory (default <run>/diagnostics)")
    p.add_argument("--png", default=None, help="plot path (default <out>/muir_gates.png)")
    a = p.parse_args(argv)
    from mixerlab.eval.checkpoint import load_run  # the only dependency on checkpoints
    from mixerlab.training import data as data_lib

    run = load_run(a.run, step=a.step)
    cfg = run.cfg
    batches = data_lib.eval_batches(cfg.data, run.tokenizer, batch_size=a.batch_size or cfg.train.batch_size,
                                    max_batches=a.batches or cfg.train.eval_batches)
    ranks = report.parse_int_list(a.ranks, "--ranks") if a.ranks else None
    result = gate_diagnostics(run.model, batches, ranks=ranks)
    result["setup"] = {"run": a.run, "step": run.step, "mixers": list(cfg.layer_mixers), "batches": len(batches),
                       "batch_size": len(batches[0]["inputs"]) if batches else 0, "val_path": cfg.data.val_path,
                       "freezing_rule": "gate := mean over valid validation tokens (segment_id > 0), per layer, "
                                        "head and channel; f frozen as log α"}
    print(f"run {a.run} step {run.step}: {result['setup']['batches']} validation batches × "
          f"{result['setup']['batch_size']} rows of {cfg.data.seq_len} tokens from {cfg.data.val_path}")
    print_tables(result)
    out = a.out or os.path.join(a.run, "diagnostics")
    out_json = report.write_json(os.path.join(out, "muir_gates.json"), result)
    png = plot(result, a.png or os.path.join(out, "muir_gates.png"), f"{a.run} step {run.step}")
    print(f"\nwrote {out_json} and {png}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
