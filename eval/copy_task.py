"""Copy task (VLA paper §5.2, Table 7: T = 64, ``x1…x31 SEP x1…x31 PAD``, loss on the copied half): mixer x seed.

    python -m mixerlab.eval.copy_task --config configs/eval/copy.yaml --mixers softmax,linear_attention,deltanet,vla \\
        --seeds 42 --out runs/eval/copy
    ... --seq-len 64,128 train.steps=300    (several lengths; trailing section.key=value overrides)

Prints the table of final held-out per-token accuracy and writes results.json, table.md and
learning_curves.png (held-out accuracy at every task.eval_every steps: the VLA paper's Tab. 7 reports the
step at which each model reaches 1.000).
"""
from __future__ import annotations

import sys

from mixerlab.eval.mqar import _int_list, build_parser, prepare, run_and_report
from mixerlab.eval.synthetic.sweep import Setting


def main(argv=None) -> list[dict]:
    p = build_parser(__doc__)
    p.add_argument("--seq-len", help="comma-separated sequence lengths (default: task.seq_len, 64)")
    args = p.parse_args(argv)
    cfg, task, mixers, seeds, out = prepare(args, ["task.kind=copy"])
    lengths = _int_list(args.seq_len, "--seq-len") if args.seq_len else [task.resolved_seq_len()]
    settings = [Setting(f"T={t}", float(t), ("task.kind=copy", f"task.seq_len={t}")) for t in lengths]
    return run_and_report(args, cfg, task, mixers, settings, seeds, out, overrides=list(args.overrides),
                          title="copy", capacity_plot=False)


if __name__ == "__main__":
    main(sys.argv[1:])
