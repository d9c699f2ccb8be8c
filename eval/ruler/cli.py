"""``python -m mixerlab.eval.ruler``: RULER-style evaluation of a training run's checkpoint.

    python -m mixerlab.eval.ruler --run runs/base --tasks s_niah_1,s_niah_2,s_niah_3,mv_niah,mq_niah,vt \\
        --lengths 256,512,1024 --depths 0,0.25,0.5,0.75,1 --samples 4 --out runs/eval/ruler

The checkpoint is loaded with ``eval.checkpoint.load_run`` and continued with ``eval.generate.greedy_generate``
(the model's decode path). Writes results.json, samples.jsonl, summary.md and heatmap.png to ``--out`` and
prints the task x length and length x depth tables.
"""
from __future__ import annotations

import argparse
import functools
import sys
from typing import Any, Callable, Sequence

import yaml

from mixerlab.eval.ruler import haystack, report, tasks
from mixerlab.eval.ruler.run import evaluate


def _list_of(kind: Callable[[str], Any], flag: str):
    def parse(text: str) -> list:
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"{flag}: give a comma-separated list, got {text!r}")
        try:
            return [kind(x) for x in items]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag}: {text!r} is not a comma-separated list of "
                                             f"{kind.__name__}s") from None
    return parse


def _task_list(text: str) -> list[str]:
    names = list(tasks.TASKS) if text.strip() == "all" else _list_of(str, "--tasks")(text)
    for n in names:
        if n not in tasks.TASKS:
            raise argparse.ArgumentTypeError(f"--tasks: unknown task {n!r}; valid tasks: {', '.join(tasks.TASKS)} "
                                             f"(or 'all')")
    return names


def _task_option(text: str) -> tuple[str, str, Any]:
    key, sep, value = text.partition("=")
    task, dot, option = key.strip().partition(".")
    if not sep or not dot or not task or not option:
        raise argparse.ArgumentTypeError(f"--set: {text!r} must look like TASK.OPTION=VALUE "
                                         f"(e.g. mv_niah.num_values=8)")
    return task, option, yaml.safe_load(value)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mixerlab.eval.ruler", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="training run directory (holds config.yaml and checkpoints/)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    p.add_argument("--tasks", type=_task_list, default=list(tasks.TASKS),
                   help=f"comma-separated, or 'all' (default): {','.join(tasks.TASKS)}")
    p.add_argument("--lengths", type=_list_of(int, "--lengths"), default=[256, 512, 1024],
                   help="target lengths in tokens: prompt + generation budget (default 256,512,1024)")
    p.add_argument("--depths", type=_list_of(float, "--depths"), default=[0.0, 0.25, 0.5, 0.75, 1.0],
                   help="needle depths in [0, 1] (default 0,0.25,0.5,0.75,1)")
    p.add_argument("--samples", type=int, default=4, help="samples per task, length and depth (default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--spread", type=float, default=0.0,
                   help="multi-needle tasks: needles drawn in a window this wide around the depth "
                        "(0: side by side at the depth; 1: anywhere, as RULER)")
    p.add_argument("--set", dest="options", type=_task_option, action="append", default=[],
                   metavar="TASK.OPTION=VALUE", help="task option, e.g. mv_niah.num_values=8, vt.num_hops=2")
    p.add_argument("--essay_path", default=haystack.DEFAULT_ESSAY_PATH,
                   help=f"Parquet file, directory or glob with a 'text' column (default {haystack.DEFAULT_ESSAY_PATH})")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--out", default="runs/eval/ruler", help="output directory (default runs/eval/ruler)")
    return p


def load_backend(run: str, step: int | None):
    """The run's loaded checkpoint and a ``generate_fn`` bound to its model."""
    from mixerlab.eval.checkpoint import load_run
    from mixerlab.eval.generate import greedy_generate

    loaded = load_run(run, step=step)
    return loaded, functools.partial(greedy_generate, loaded.model)


def main(argv: Sequence[str] | None = None, backend=load_backend) -> dict[str, Any]:
    args = parser().parse_args(argv)
    options: dict[str, dict[str, Any]] = {}
    for task, option, value in args.options:
        options.setdefault(task, {})[option] = value
    loaded, generate_fn = backend(args.run, args.step)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)
    results = evaluate(loaded.tokenizer, generate_fn, task_names=args.tasks, lengths=args.lengths,
                       depths=args.depths, num_samples=args.samples, seed=args.seed, spread=args.spread,
                       task_options=options, essay_path=args.essay_path, batch_size=args.batch_size, log=log)
    results["config"].update(run=args.run, step=getattr(loaded, "step", None),
                             title=f"RULER: {args.run} (step {getattr(loaded, 'step', None)})")
    paths = report.write_outputs(results, args.out)
    summary = results["summary"]
    print(report.task_length_table(summary))
    print()
    print(report.length_depth_table(summary))
    for w in report.depth_warnings(summary):
        print(f"warning: {w}")
    print()
    for name, path in paths.items():
        print(f"wrote {path}")
    return results
