"""RULER-style long-context evaluation (Hsieh et al. 2024): S-NIAH-1/2/3, MV-NIAH, MQ-NIAH and VT.

Modules, one job each:
  tasks.py       task names, default options, prompt wording, metric
  randstrings.py random keys, values and variable names (unique, absent from the haystack)
  haystack.py    the repeated-noise and essay (embedded corpus) haystacks, cut into pieces
  generators.py  generate_sample(task, tokenizer=, length=, depth=, seed=, ...) -> Sample
  scoring.py     RULER's string_match_all / string_match_part and prediction post-processing
  run.py         build the grid, generate with any generate_fn, score
  report.py      aggregates, markdown tables, JSON, heatmap PNG
  cli.py         python -m mixerlab.eval.ruler
See docs/evaluation.md (RULER section).
"""
from mixerlab.eval.ruler.generators import Sample, generate_sample
from mixerlab.eval.ruler.scoring import string_match_all, string_match_part
from mixerlab.eval.ruler.tasks import TASKS

__all__ = ["Sample", "generate_sample", "string_match_all", "string_match_part", "TASKS"]
