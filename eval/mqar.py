"""MQAR capacity sweep: mixer x n x seed, a table, a JSON record and a capacity plot.

    python -m mixerlab.eval.mqar --config configs/eval/mqar_vla.yaml \\
        --mixers softmax,linear_attention,deltanet,gdn2,muir,vla --n 4,8,16,24,32,48 --seeds 42 --out runs/eval/mqar_vla
    python -m mixerlab.eval.mqar --config configs/eval/mqar_zoology.yaml --layout zoology --pairs 64:4,128:8,256:16 \\
        --mixers softmax,gdn2 --out runs/eval/mqar_zoology
    ... train.steps=500 task.seq_len=128     (trailing section.key=value overrides, as in train.py)
    python -m mixerlab.eval.mqar --merge runs/a/results.json runs/b/results.json --out runs/eval/merged

--merge draws one table and capacity plot from the results.json of several sweeps (e.g. one process per
mixer, run side by side on one GPU by tools/gpu_mqar_sweep.sh); it trains nothing. Cells are the mean over
seeds, "± sample std [min, max]" when there are several; a column also names its step count when the merged
runs differ in train.steps. Different seed lists per n: one sweep per list, then --merge
(tools/gpu_mqar_paper.sh does this).

--label NAME records the (single) mixer under NAME, e.g. an ablation of vla beside vla itself:
    ... --mixers vla --label "vla, A fixed" mixers.vla.penalty_update=fixed
task.ood_key_range=[64,127] also evaluates every run on held-out rows whose keys come from [64, 127) (VLA
paper, Table 13); the table of those accuracies follows the main one.

Mixers: registered names, or hybrids as a '+'-joined layer pattern (gdn2+softmax). Without --mixers the
config's own model.mixer / model.layer_pattern is used; without --seeds its train.seed.
Outputs in --out: results.json (every run: accuracies, lag buckets, losses, timings; the resolved config and
task), capacity.png (accuracy vs n, mean and min-max over seeds), learning_curves.png, table.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from mixerlab.eval.report import write_json
from mixerlab.eval.synthetic import report
from mixerlab.eval.synthetic.sweep import mqar_settings, run_sweep
from mixerlab.eval.synthetic.task import load_eval_config
from mixerlab.training import storage


def _int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{flag}: got {text!r}; expected comma-separated integers, e.g. 4,8,16") from None


def _pairs(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        parts = item.split(":")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise SystemExit(f"--pairs: got {item!r}; expected T:n items such as 64:4,128:8")
        out.append((int(parts[0]), int(parts[1])))
    return out


def config_mixers(cfg) -> str:
    return "+".join(cfg.model.layer_pattern) if cfg.model.layer_pattern else cfg.model.mixer


def build_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="eval config YAML (configs/eval/*.yaml)")
    p.add_argument("--mixers", help="comma-separated mixer names or '+'-joined hybrids; default: the config's")
    p.add_argument("--seeds", help="comma-separated seeds (model init and data); default: train.seed")
    p.add_argument("--out", help="output directory (default: train.output_dir)")
    p.add_argument("--verbose", action="store_true", help="print every held-out evaluation inside each run")
    p.add_argument("--label", help="name the (single) mixer's runs this in results, table and plots "
                                   "(e.g. an ablation of the same mixer)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides (task.* included)")
    return p


def prepare(args, extra_overrides=()):
    """(config, task, mixers, seeds, out) for a sweep; errors name the flag or key."""
    overrides = list(args.overrides) + list(extra_overrides)
    try:
        cfg, task = load_eval_config(args.config, overrides)
    except ValueError as e:  # ConfigError is a ValueError
        raise SystemExit(f"error: {e}") from None
    mixers = [m.strip() for m in args.mixers.split(",") if m.strip()] if args.mixers else [config_mixers(cfg)]
    if getattr(args, "label", None) and len(mixers) != 1:
        raise SystemExit(f"error: --label names one mixer's runs; got --mixers {','.join(mixers)}")
    seeds = _int_list(args.seeds, "--seeds") if args.seeds else [None]
    out = args.out or cfg.train.output_dir
    storage.makedirs(out, "--out")
    return cfg, task, mixers, seeds, out


def run_and_report(args, cfg, task, mixers, settings, seeds, out, *, overrides, title, capacity_plot: bool):
    """Runs the sweep, rewriting results.json after every run; then the table and plots."""
    start = time.perf_counter()
    json_path = storage.join(out, "results.json")
    records: list[dict] = []
    meta = dict(config=cfg.to_dict(), task=dataclasses.asdict(task), mixers=mixers,
                settings=[s.label for s in settings], seeds=[cfg.train.seed if s is None else s for s in seeds])

    def save(record):
        if getattr(args, "label", None):
            record = {**record, "mixer": args.label, "mixer_entry": record["mixer"]}
        records.append(record)
        report.write_json(json_path, records=records, total_s=time.perf_counter() - start, **meta)

    print(f"{title}: {len(mixers)} mixer(s) x {len(settings)} setting(s) x {len(seeds)} seed(s), "
          f"{cfg.train.steps} steps of batch {cfg.train.batch_size}; writing {out}", flush=True)
    try:
        run_sweep(args.config, mixers, settings, seeds, overrides, on_record=save, verbose_runs=args.verbose,
                  log=lambda m: print(m, flush=True))
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    text = tables_text(records, title)
    total = time.perf_counter() - start
    storage.write_text(storage.join(out, "table.md"), text, "--out")
    print(f"\n{text}\ntotal {total:.1f} s")
    paths = [json_path, storage.join(out, "table.md")]
    if capacity_plot:
        paths.append(report.plot_capacity(records, storage.join(out, "capacity.png"), title=title))
    paths.append(report.plot_learning_curves(records, storage.join(out, "learning_curves.png"), title=title))
    print("wrote " + ", ".join(paths))
    return records


def tables_text(records: list[dict], title: str) -> str:
    """table.md: the held-out accuracy table, then the OOD-key table when any run has one."""
    text = (f"{title}; held-out per-query-token accuracy (mean ± sample std [min,max] over seeds)\n\n"
            f"{report.accuracy_table(records)}\n")
    if any(r.get("ood_accuracy") is not None for r in records):
        keys = next(r["task"]["ood_key_range"] for r in records if r.get("ood_accuracy") is not None)
        text += (f"\nthe same models on held-out rows with out-of-distribution keys from {list(keys)} "
                 f"(task.ood_key_range)\n\n{report.accuracy_table(records, 'ood_accuracy')}\n")
    return text


def merge(paths: list[str], out: str, title: str = "MQAR") -> list[dict]:
    """One table.md, results.json and capacity.png from the results.json files of several sweeps."""
    records, sources = [], []
    for path in paths:
        try:
            payload = json.loads(storage.read_text(path, "--merge"))
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"error: --merge: cannot read {path}: {e}") from None
        if not isinstance(payload.get("results"), list):
            raise SystemExit(f"error: --merge: {path} has no 'results' list (not a results.json of eval.mqar)")
        records += payload["results"]
        sources.append({"path": path, "command": payload.get("command"), "environment": payload.get("environment")})
    if not records:
        raise SystemExit(f"error: --merge: no runs in {', '.join(paths)}")
    storage.makedirs(out, "--out")
    text = tables_text(records, title)
    storage.write_text(storage.join(out, "table.md"), text, "--out")
    write_json(storage.join(out, "results.json"), {"merged_from": sources, "results": records})
    paths_out = [storage.join(out, "results.json"), storage.join(out, "table.md"),
                 report.plot_capacity(records, storage.join(out, "capacity.png"), title=title)]
    if any(r.get("history") for r in records):
        paths_out.append(report.plot_learning_curves(records, storage.join(out, "learning_curves.png"),
                                                     title=title))
    print(f"{len(records)} runs from {len(paths)} file(s)\n{text}")
    print("wrote " + ", ".join(paths_out))
    return records


def sweep_parser() -> argparse.ArgumentParser:
    p = build_parser(__doc__)
    p.add_argument("--layout", choices=["vla_contiguous", "zoology"], help="default: the config's task.layout")
    p.add_argument("--n", help="vla_contiguous: comma-separated key-value pair counts (default: task.num_kv_pairs)")
    p.add_argument("--pairs", help="zoology: comma-separated T:n pairs (default: task.seq_len:task.num_kv_pairs)")
    return p


def main(argv=None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--merge" in argv:
        m = argparse.ArgumentParser(prog="python -m mixerlab.eval.mqar --merge", description="merge sweep results")
        m.add_argument("--merge", nargs="+", required=True, metavar="RESULTS_JSON")
        m.add_argument("--out", required=True, help="output directory of the merged table and plots")
        m.add_argument("--title", default="MQAR vla_contiguous")
        margs = m.parse_args(argv)
        return merge(margs.merge, margs.out, margs.title)
    args = sweep_parser().parse_args(argv)
    layout_override = [f"task.layout={args.layout}"] if args.layout else []
    cfg, task, mixers, seeds, out = prepare(args, layout_override)
    if task.kind != "mqar":
        raise SystemExit(f"error: task.kind: got {task.kind!r} in {args.config}; eval.mqar runs MQAR "
                         f"(use eval.copy_task for copy)")
    if task.layout == "zoology":
        pairs = _pairs(args.pairs) if args.pairs else [(task.resolved_seq_len(), task.num_kv_pairs)]
        settings = mqar_settings("zoology", pairs=pairs)
    else:
        ns = _int_list(args.n, "--n") if args.n else [task.num_kv_pairs]
        settings = mqar_settings("vla_contiguous", ns=ns)
    return run_and_report(args, cfg, task, mixers, settings, seeds, out,
                          overrides=list(args.overrides) + layout_override, title=f"MQAR {task.layout}",
                          capacity_plot=True)


if __name__ == "__main__":
    main(sys.argv[1:])
