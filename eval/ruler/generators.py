"""RULER sample generators: a task, a target length in tokens, a needle depth and a seed -> one ``Sample``.

``generate_sample(task, tokenizer=..., length=..., depth=..., seed=...)`` does, in this order:

1. resolves the task's options (``tasks.resolve_options``: number of keys/values/queries or chains/hops, ...);
2. draws the needles from ``random.Random(seed)``: NIAH keys and values (``One of the special magic numbers for
   {key} is: {value}.``, shuffled as RULER does), or VT chains (``VAR A = 12345``, ``VAR B = VAR A``, ...);
3. gives every needle a depth: ``depth`` itself when ``spread`` is 0 (all needles side by side at that depth,
   a VT chain in its order), else a uniform draw in a window of width ``spread`` centred on ``depth`` (moved
   inside [0, 1]); ``spread=1`` is RULER's own placement (anywhere). A depth is the fraction of the haystack's
   tokens before the needle; the needle goes to the piece boundary nearest to it;
4. finds, by bisection, the largest number of haystack words for which the prompt's token count (the
   tokenizer's, on the whole prompt) plus ``tokens_to_generate`` is at most ``length`` — RULER's definition of
   a sample's length (input plus generation budget). Needles sit between pieces (sentences); the last piece
   may be cut after any word.

Length, depth and option errors name the parameter and what is valid.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
import random
from typing import Any, Callable, Mapping

from mixerlab.eval.ruler import haystack as hs
from mixerlab.eval.ruler import tasks
from mixerlab.eval.ruler.randstrings import UniqueDrawer
from mixerlab.training.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class Sample:
    task: str
    prompt: str
    answers: list[str]
    max_new_tokens: int
    metadata: dict[str, Any]  # task, length, depth, spread, seed, prompt/total tokens, needle_depths, options


@dataclasses.dataclass(frozen=True)
class _Content:
    """What a task family decides before the haystack is sized."""
    needle_groups: list[list[str]]  # each group's needles keep their order in the context (a VT chain)
    answers: list[str]
    make_prompt: Callable[[str], str]  # context -> full prompt


# ------------------------------------------------------------------------------------------------ checks
def _check_fraction(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}: must be a number in [0, 1], got {value!r}")
    return float(value)


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: must be an integer >= {minimum}, got {value!r}")
    return value


# ------------------------------------------------------------------------------------------------ content
def _niah_content(opts: Mapping[str, Any], rng: random.Random, drawer: UniqueDrawer) -> _Content:
    keys, values, needles = [], [], []
    for _ in range(opts["num_keys"]):
        keys.append(drawer.draw(opts["key_type"]))
        values.append([drawer.draw(opts["value_type"]) for _ in range(opts["num_values"])])
        needles.extend(tasks.niah_needle(opts["value_type"], keys[-1], v) for v in values[-1])
    rng.shuffle(needles)
    asked = rng.sample(range(opts["num_keys"]), opts["num_queries"])
    answers = [v for i in asked for v in values[i]]
    query = tasks.join_queries([keys[i] for i in asked])
    make = lambda context: tasks.niah_prompt(opts["value_type"], context=context, query=query,
                                             num_answers=len(answers))
    return _Content([[n] for n in needles], answers, make)


def _vt_content(opts: Mapping[str, Any], rng: random.Random, drawer: UniqueDrawer) -> _Content:
    chains, first_vars, first_value = [], None, None
    for _ in range(opts["num_chains"]):
        names = [drawer.draw("variables") for _ in range(opts["num_hops"] + 1)]
        value = drawer.draw("vt_values")
        chains.append([f"VAR {names[0]} = {value}"]
                      + [f"VAR {names[j + 1]} = VAR {names[j]}" for j in range(opts["num_hops"])])
        if first_vars is None:
            first_vars, first_value = names, value
    make = lambda context: tasks.vt_prompt(context=context, query=first_value, num_v=len(first_vars))
    return _Content(chains, list(first_vars), make)


_CONTENT = {"niah": _niah_content, "vt": _vt_content}


# ------------------------------------------------------------------------------------------------ placement
def _needle_fractions(groups: list[list[str]], depth: float, spread: float, rng: random.Random) -> list[list[float]]:
    lo = min(max(depth - spread / 2, 0.0), 1.0 - spread)
    return [sorted(lo + spread * rng.random() if spread > 0 else depth for _ in group) for group in groups]


def _boundary(cum: list[int], n: int, fraction: float) -> int:
    """The boundary k in 0..n (k pieces before it) whose token fraction cum[k]/cum[n] is nearest ``fraction``."""
    if cum[n] == 0:
        return 0
    target = fraction * cum[n]
    k = bisect.bisect_left(cum, target, 0, n + 1)
    if k > n:
        return n
    if k > 0 and target - cum[k - 1] <= cum[k] - target:
        return k - 1
    return k


def _prefix(pieces: list[hs.Piece], counts: list[int], words: int,
            tokenizer: Tokenizer) -> tuple[list[hs.Piece], list[int]]:
    """The haystack's first ``words`` words: whole pieces, then the head of the next piece (RULER also cuts its
    essay haystack at a word count); with each piece's token count."""
    out, out_counts = [], []
    for piece, count in zip(pieces, counts):
        piece_words = piece.text.split()
        if words >= len(piece_words):
            out.append(piece)
            out_counts.append(count)
            words -= len(piece_words)
            continue
        if words > 0:
            head = hs.Piece(" ".join(piece_words[:words]), piece.sep)
            out.append(head)
            out_counts.append(len(tokenizer.encode(head.render())))
        break
    return out, out_counts


def _render(pieces: list[hs.Piece], counts: list[int], groups, fractions) -> tuple[str, list[float]]:
    """The context of ``pieces`` with the needles inserted; and each needle's actual depth."""
    cum = [0]
    for c in counts:
        cum.append(cum[-1] + c)
    n = len(pieces)
    inserts: dict[int, list[str]] = {}
    depths = []
    for group, fracs in zip(groups, fractions):
        for needle, f in zip(group, fracs):
            k = _boundary(cum, n, f)
            inserts.setdefault(k, []).append(needle)
            depths.append(cum[k] / cum[n] if cum[n] else 0.0)
    parts = []
    for k in range(n + 1):
        parts.extend(needle + " " for needle in inserts.get(k, ()))
        if k < n:
            parts.append(pieces[k].render())
    return "".join(parts).strip(), depths


# ------------------------------------------------------------------------------------------------ public
def generate_sample(task: str, *, tokenizer: Tokenizer, length: int, depth: float, seed: int,
                    spread: float = 0.0, essay_path: str = hs.DEFAULT_ESSAY_PATH, **options) -> Sample:
    """One sample of ``task`` whose prompt tokens plus ``tokens_to_generate`` come as close to ``length`` as
    whole haystack words allow without exceeding it. ``options`` override the task's defaults (tasks.TASKS)."""
    spec = tasks.get_task(task)
    opts = tasks.resolve_options(spec, options)
    length = _check_int("length", length, 1)
    depth = _check_fraction("depth", depth)
    spread = _check_fraction("spread", spread)
    seed = _check_int("seed", seed, 0)
    budget = opts["tokens_to_generate"]

    rng = random.Random(seed)
    if opts["haystack"] == "essay":
        source_text = hs.essay_corpus_text(essay_path)
        start_doc = rng.randrange(len(hs.load_essay_documents(essay_path)))
    else:
        source_text = hs.noise_text()
    drawer = UniqueDrawer(rng, source_text + "\n" + tasks.template_text(spec, opts))
    content = _CONTENT[spec.family](opts, rng, drawer)
    fractions = _needle_fractions(content.needle_groups, depth, spread, rng)

    answer_tokens = len(tokenizer.encode(" " + ", ".join(content.answers)))
    if answer_tokens > budget:
        raise ValueError(f"{task}.tokens_to_generate: {budget} tokens cannot hold the {len(content.answers)} "
                         f"expected answers ({answer_tokens} tokens); set it to at least {answer_tokens}")

    def build(words: int) -> tuple[str, list[float], int]:
        """Prompt with the haystack's first ``words`` words, needle depths, total tokens (prompt + budget)."""
        context, needle_depths = _render(*_prefix(pieces, counts, words, tokenizer), content.needle_groups,
                                         fractions)
        prompt = content.make_prompt(context)
        return prompt, needle_depths, len(tokenizer.encode(prompt)) + budget

    min_tokens = length
    while True:  # enough haystack to overflow ``length``
        if opts["haystack"] == "essay":
            pieces, counts = hs.essay_pieces(start_doc, tokenizer, min_tokens, essay_path)
        else:
            pieces, counts = hs.repeat_pieces(tokenizer, min_tokens)
        total_words = sum(len(p.text.split()) for p in pieces)
        if build(total_words)[2] > length:
            break
        if sum(counts) < min_tokens:  # the essay corpus ran out
            raise ValueError(f"length: {length} tokens is more than the essay haystack at essay_path="
                             f"{essay_path!r} can fill ({sum(counts)} tokens); use a shorter length or a larger "
                             f"corpus")
        min_tokens *= 2

    smallest = build(1)[2]
    if smallest > length:
        raise ValueError(f"length: {length} tokens is too short for task {task!r} with these needles: the prompt "
                         f"with a one-word haystack already needs {smallest} tokens (tokens_to_generate={budget} "
                         f"included); use length >= {smallest}, or fewer needles")
    lo, hi = 1, total_words  # build(lo) fits in ``length``, build(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if build(mid)[2] <= length:
            lo = mid
        else:
            hi = mid
    prompt, needle_depths, total = build(lo)
    metadata = dict(task=task, length=length, depth=depth, spread=spread, seed=seed,
                    prompt_tokens=total - budget, total_tokens=total, haystack=opts["haystack"],
                    haystack_words=lo, needle_depths=needle_depths, options=opts)
    return Sample(task=task, prompt=prompt, answers=list(content.answers), max_new_tokens=budget,
                  metadata=metadata)
