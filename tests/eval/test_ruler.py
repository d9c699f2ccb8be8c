"""RULER-style evaluation: generators obey their rules, scoring is RULER's, the runner and CLI plumb through."""
import functools
import json
import random
import re
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mixerlab.eval.ruler import cli, haystack, randstrings, report, scoring
from mixerlab.eval.ruler.generators import generate_sample
from mixerlab.eval.ruler.run import build_samples, evaluate, predict
from mixerlab.eval.ruler.tasks import TASKS
from mixerlab.training.tokenizer import load_tokenizer

NIAH_TASKS = ("s_niah_1", "s_niah_2", "s_niah_3", "mv_niah", "mq_niah")
NEEDLE = re.compile(r"One of the special magic (?:numbers|uuids|words) for (\S+) is: (\S+)\.")
VT_ASSIGN = re.compile(r"VAR ([A-Z]{5}) = (?:VAR ([A-Z]{5})|(\d+))")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("hf", "data/embedded/tokenizer.json")


def context_of(prompt: str) -> str:
    """The text between the template's first line and the question."""
    head, rest = prompt.split("\n", 1)
    if rest.startswith("\n"):  # VT: a blank line after the instruction
        rest = rest[1:]
    return rest.rsplit("\n", 1)[0]


def measured_depth(tok, context: str, needle: str) -> float:
    """Fraction of the haystack's tokens (every needle removed) that come before ``needle``."""
    strip = lambda text: NEEDLE.sub("", VT_ASSIGN.sub("", text))
    return len(tok.encode(strip(context[:context.index(needle)]))) / len(tok.encode(strip(context)))


# ------------------------------------------------------------------------------------------------ scoring
def test_string_match_all_counts_the_fraction_of_references():
    refs = ["1234567", "7654321", "1111111"]
    assert scoring.sample_match_all("They are 1234567 and 7654321.", refs) == 2 / 3
    assert scoring.sample_match_all("1111111, 7654321, 1234567", refs) == 1.0
    assert scoring.sample_match_all("", refs) == 0.0
    assert scoring.sample_match_all("key: BRIGHT-fox", ["bright-FOX"]) == 1.0  # case-insensitive, like RULER
    # Task score: mean over samples, in percent, rounded to 2 decimals: (2/3 + 1/2) / 2 = 58.333...
    assert scoring.string_match_all(["1234567 7654321", "x"], [refs, ["x", "y"]]) == 58.33


def test_string_match_part_needs_any_one_reference():
    assert scoring.sample_match_part("the answer is Paris", ["London", "paris"]) == 1.0
    assert scoring.sample_match_part("the answer is Rome", ["London", "paris"]) == 0.0
    assert scoring.string_match_part(["Paris", "Rome", "x and y"], [["paris"], ["london"], ["x", "z"]]) == 66.67
    # the two metrics differ on partial matches: part gives 1 where all gives 1/2
    assert scoring.string_match_all(["x and y"], [["x", "z"]]) == 50.0


def test_postprocess_and_bad_references():
    assert scoring.postprocess_prediction("  1234567\x00tail\x1f \n") == "1234567\ntail"
    with pytest.raises(ValueError, match="non-empty list of answer strings"):
        scoring.sample_match_all("abc", "abc")
    with pytest.raises(ValueError, match="non-empty list"):
        scoring.sample_match_part("abc", [])
    with pytest.raises(ValueError, match="equally long"):
        scoring.string_match_all(["a"], [["a"], ["b"]])


# ------------------------------------------------------------------------------------------------ generators
@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("length", [256, 512])
def test_length_fills_the_budget_without_exceeding_it(tok, task, length):
    s = generate_sample(task, tokenizer=tok, length=length, depth=0.5, seed=3)
    total = len(tok.encode(s.prompt)) + s.max_new_tokens
    assert total == s.metadata["total_tokens"]
    assert length - 24 <= total <= length
    # the generation budget holds the expected answers
    assert len(tok.encode(" " + ", ".join(s.answers))) <= s.max_new_tokens


@pytest.mark.parametrize("task", NIAH_TASKS)
def test_niah_answers_and_needles(tok, task):
    s = generate_sample(task, tokenizer=tok, length=512, depth=0.25, seed=11)
    opts = s.metadata["options"]
    needles = NEEDLE.findall(s.prompt)
    assert len(needles) == opts["num_keys"] * opts["num_values"]
    assert len(s.answers) == opts["num_queries"] * opts["num_values"]
    for answer in s.answers:
        assert s.prompt.count(answer) == 1  # exactly once: in its needle
        assert s.prompt.lower().count(answer.lower()) == 1  # the metric is case-insensitive
    question = s.prompt.rsplit("\n", 1)[1]
    key_of = {value: key for key, value in needles}
    asked = {key_of[a] for a in s.answers}
    assert all(k in question for k in asked)
    assert len(asked) == opts["num_queries"]
    if task == "mv_niah":  # every value belongs to the one key asked
        assert sorted(s.answers) == sorted(v for _, v in needles)
    if task == "s_niah_3":
        assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", s.answers[0])
    else:
        assert all(re.fullmatch(r"[1-9]\d{6}", a) for a in s.answers)
    ending = "is" if len(s.answers) == 1 else "are"
    assert question.endswith(f"mentioned in the provided text {ending}")


@pytest.mark.parametrize("task", ["s_niah_1", "s_niah_2"])
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_single_needle_sits_at_the_requested_depth(tok, task, depth):
    s = generate_sample(task, tokenizer=tok, length=1024, depth=depth, seed=5)
    context = context_of(s.prompt)
    (key, value), = NEEDLE.findall(context)
    needle = f"One of the special magic numbers for {key} is: {value}."
    assert abs(measured_depth(tok, context, needle) - depth) <= 0.03
    assert abs(s.metadata["needle_depths"][0] - depth) <= 0.03
    if depth == 0.0:
        assert context.startswith(needle)
    if depth == 1.0:
        assert context.endswith(needle)


def test_multi_needles_spread_inside_the_window(tok):
    together = generate_sample("mv_niah", tokenizer=tok, length=1024, depth=0.5, seed=2)
    spread = generate_sample("mv_niah", tokenizer=tok, length=1024, depth=0.5, seed=2, spread=0.4)
    for s, lo, hi in ((together, 0.47, 0.53), (spread, 0.27, 0.73)):
        context = context_of(s.prompt)
        depths = [measured_depth(tok, context, f"One of the special magic numbers for {k} is: {v}.")
                  for k, v in NEEDLE.findall(context)]
        assert len(depths) == 4 and all(lo <= d <= hi for d in depths), depths
    assert max(spread.metadata["needle_depths"]) - min(spread.metadata["needle_depths"]) > 0.05


def test_spread_one_can_reach_the_edges(tok):
    depths = [d for seed in range(6) for d in generate_sample("mq_niah", tokenizer=tok, length=512, depth=0.0,
                                                               seed=seed, spread=1.0).metadata["needle_depths"]]
    assert min(depths) < 0.2 and max(depths) > 0.8


@pytest.mark.parametrize("chains,hops", [(1, 4), (2, 3)])
def test_vt_chains_resolve_to_the_answers(tok, chains, hops):
    s = generate_sample("vt", tokenizer=tok, length=512, depth=0.5, seed=7, num_chains=chains, num_hops=hops,
                        spread=0.5)
    context = context_of(s.prompt)
    value_of, seen = {}, set()
    for name, source, number in VT_ASSIGN.findall(context):
        assert name not in seen  # one assignment per variable
        assert source == "" or source in seen  # a chain reads in its order
        seen.add(name)
        value_of[name] = number or value_of[source]
    assert len(value_of) == chains * (hops + 1)
    query = re.search(r"assigned the value (\d+) in the text above", s.prompt).group(1)
    assert sorted(n for n, v in value_of.items() if v == query) == sorted(s.answers)
    assert len(s.answers) == hops + 1
    assert f"{hops + 1} variables are assigned the value {query}" in s.prompt
    assert len(set(value_of.values())) == chains  # chains do not share a value


def test_essay_haystack_is_corpus_text(tok):
    s = generate_sample("s_niah_2", tokenizer=tok, length=512, depth=0.5, seed=9)
    context = context_of(s.prompt)
    (key, value), = NEEDLE.findall(context)
    text = context.replace(f"One of the special magic numbers for {key} is: {value}. ", "")
    docs = haystack.load_essay_documents()
    assert len(text) > 1000 and text in " ".join(docs + docs)


def test_unique_drawer_skips_repeats_nested_and_forbidden_strings(monkeypatch):
    numbers = iter(["1234567", "1234567", "9999999", "23456", "12345678", "7654321"])
    names = iter(["ASCII", "MEMOR", "QWXYZ"])
    monkeypatch.setitem(randstrings.DRAWERS, "numbers", lambda rng: next(numbers))
    monkeypatch.setitem(randstrings.DRAWERS, "variables", lambda rng: next(names))
    drawer = randstrings.UniqueDrawer(random.Random(0), "plain ascii text, 9999999 bytes. Memorize it.")
    # a repeat, a forbidden one, one nested in an earlier one and one holding an earlier one are skipped;
    # the forbidden text is matched case-insensitively (the metric is case-insensitive)
    assert [drawer.draw("numbers"), drawer.draw("numbers")] == ["1234567", "7654321"]
    assert drawer.draw("variables") == "QWXYZ"


def test_niah_needles_are_shuffled(tok):
    in_order = 0
    for seed in range(6):
        s = generate_sample("mv_niah", tokenizer=tok, length=512, depth=0.5, seed=seed)
        in_order += [v for _, v in NEEDLE.findall(s.prompt)] == s.answers
    assert in_order < 6


def test_determinism_by_seed(tok):
    for task in TASKS:
        a = generate_sample(task, tokenizer=tok, length=256, depth=0.5, seed=42)
        b = generate_sample(task, tokenizer=tok, length=256, depth=0.5, seed=42)
        c = generate_sample(task, tokenizer=tok, length=256, depth=0.5, seed=43)
        assert a == b
        assert a.answers != c.answers and a.prompt != c.prompt


def test_option_overrides_scale_answers_and_budget(tok):
    s = generate_sample("mv_niah", tokenizer=tok, length=512, depth=0.5, seed=1, num_values=6)
    assert len(s.answers) == 6 and len(NEEDLE.findall(s.prompt)) == 6
    assert len(tok.encode(" " + ", ".join(s.answers))) <= s.max_new_tokens
    assert s.max_new_tokens > generate_sample("mv_niah", tokenizer=tok, length=512, depth=0.5, seed=1).max_new_tokens
    s = generate_sample("s_niah_2", tokenizer=tok, length=512, depth=0.5, seed=1, tokens_to_generate=20)
    assert s.max_new_tokens == 20


@pytest.mark.parametrize("task,kwargs,message", [
    ("mq_niah", dict(length=150), r"length: 150 tokens is too short for task 'mq_niah'.*use length >= \d+"),
    ("s_niah_1", dict(length=0), r"length: must be an integer >= 1"),
    ("s_niah_1", dict(depth=1.5), r"depth: must be a number in \[0, 1\], got 1.5"),
    ("s_niah_1", dict(depth=float("nan")), r"depth: must be a number in \[0, 1\]"),
    ("mv_niah", dict(spread=-0.1), r"spread: must be a number in \[0, 1\]"),
    ("s_niah_9", {}, r"task: unknown RULER task 's_niah_9'; valid tasks: s_niah_1, s_niah_2"),
    ("mv_niah", dict(num_valuez=3), r"mv_niah.num_valuez: unknown option .*valid options: .*num_values"),
    ("mv_niah", dict(num_values=0), r"mv_niah.num_values: must be an integer >= 1, got 0"),
    ("mq_niah", dict(num_queries=5), r"mq_niah.num_queries: 5 queries need at least as many keys.*num_keys=4"),
    ("vt", dict(num_hops=1.5), r"vt.num_hops: must be an integer >= 1"),
    ("s_niah_2", dict(haystack="poem"), r"s_niah_2.haystack: must be one of repeat, essay, got 'poem'"),
    ("s_niah_3", dict(tokens_to_generate=4), r"s_niah_3.tokens_to_generate: 4 tokens cannot hold.*at least \d+"),
])
def test_impossible_settings_name_the_parameter(tok, task, kwargs, message):
    args = dict(length=512, depth=0.5, seed=0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        generate_sample(task, tokenizer=tok, **args)


def test_small_essay_corpus_is_reported(tok, tmp_path):
    path = tmp_path / "tiny.parquet"
    pq.write_table(pa.table({"text": ["A short document. It has two sentences."]}), path)
    with pytest.raises(ValueError, match=r"length: 4096 tokens is more than the essay haystack at essay_path="):
        generate_sample("s_niah_2", tokenizer=tok, length=4096, depth=0.5, seed=0, essay_path=str(path))
    with pytest.raises(FileNotFoundError, match="essay_path"):
        generate_sample("s_niah_2", tokenizer=tok, length=512, depth=0.5, seed=0,
                        essay_path=str(tmp_path / "missing.parquet"))


# ------------------------------------------------------------------------------------------------ runner
GRID = dict(task_names=list(TASKS), lengths=[256], depths=[0.0, 1.0], num_samples=1, seed=4)


def oracle(tok, samples, keep: int | None = None, calls: list | None = None):
    """A fake generate_fn answering each prompt with its first ``keep`` answers, then EOS and junk."""
    answers = {tuple(tok.encode(s.prompt)): s.answers for s in samples}

    def generate(prompts, max_new_tokens, stop_tokens=()):
        if calls is not None:
            calls.append((len(prompts), max_new_tokens, tuple(stop_tokens)))
        outs = []
        for p in prompts:
            ids = tok.encode(" " + ", ".join(answers[tuple(p)][:keep]))
            junk = tok.encode(" " + ", ".join(answers[tuple(p)]))  # every answer, but after EOS
            outs.append((ids + [tok.eos_id] + junk)[:max_new_tokens])
        return outs
    return generate


def test_runner_scores_an_oracle_and_a_partial_oracle(tok):
    samples = build_samples(tok, **GRID)
    calls = []
    full = evaluate(tok, oracle(tok, samples, calls=calls), batch_size=4, **GRID)
    assert full["summary"]["by_task"] == {t: 100.0 for t in TASKS}
    assert full["summary"]["average"] == 100.0
    assert all(n == 4 and s == (tok.eos_id,) for n, _, s in calls)  # short batches are padded
    assert [r["prompt"] for r in full["records"]] == [s.prompt for s in samples]

    part = evaluate(tok, oracle(tok, samples, keep=1), **GRID)["summary"]
    # one answer of 1 / 4 / 5: the junk after EOS (every answer) must not count
    assert part["by_task"] == {"s_niah_1": 100.0, "s_niah_2": 100.0, "s_niah_3": 100.0, "mv_niah": 25.0,
                               "mq_niah": 25.0, "vt": 20.0}
    assert part["average"] == round((300 + 25 + 25 + 20) / 6, 2)
    assert part["by_task_length_depth"]["vt"]["256"] == {"0": 20.0, "1": 20.0}
    assert part["average_by_length_depth"]["256"]["0"] == round((300 + 25 + 25 + 20) / 6, 2)


def test_runner_rejects_a_bad_generate_fn(tok):
    samples = build_samples(tok, task_names=["s_niah_1"], lengths=[256], depths=[0.5], num_samples=2)
    with pytest.raises(ValueError, match="returned 1 continuations for 2 prompts"):
        predict(samples, lambda prompts, n, stop_tokens=(): [[1]], tok)
    with pytest.raises(ValueError, match="more than max_new_tokens"):
        predict(samples, lambda prompts, n, stop_tokens=(): [[1] * (n + 1)] * len(prompts), tok)
    with pytest.raises(ValueError, match="samples: must be an integer >= 1"):
        build_samples(tok, task_names=["s_niah_1"], lengths=[256], depths=[0.5], num_samples=0)
    with pytest.raises(ValueError, match="task options: 'vt' is not among the tasks"):
        build_samples(tok, task_names=["s_niah_1"], lengths=[256], depths=[0.5], num_samples=1,
                      task_options={"vt": {"num_hops": 2}})


def test_cli_writes_tables_json_and_heatmap(tok, tmp_path, capsys):
    def backend(run, step):
        samples = build_samples(tok, task_names=["s_niah_1", "vt"], lengths=[256], depths=[0.5], num_samples=2,
                                task_options={"vt": {"num_hops": 2}})
        return SimpleNamespace(tokenizer=tok, step=300, model=None), oracle(tok, samples)

    out = tmp_path / "ruler"
    results = cli.main(["--run", "runs/x", "--tasks", "s_niah_1,vt", "--lengths", "256", "--depths", "0.5",
                        "--samples", "2", "--set", "vt.num_hops=2", "--out", str(out)], backend=backend)
    assert all(len(r["answers"]) == 3 for r in results["records"] if r["task"] == "vt")
    printed = capsys.readouterr().out
    assert "| s_niah_1 | 100.0 | 100.0 |" in printed and "| 256 | 100.0 |" in printed
    saved = json.loads((out / "results.json").read_text())
    assert saved["summary"]["by_task_length"] == {"s_niah_1": {"256": 100.0}, "vt": {"256": 100.0}}
    assert saved["config"]["step"] == 300
    assert len((out / "samples.jsonl").read_text().splitlines()) == 4
    assert (out / "heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "## Length x depth" in (out / "summary.md").read_text()


@pytest.mark.parametrize("argv,message", [
    (["--tasks", "s_niah_1,nope"], "unknown task 'nope'"),
    (["--lengths", "256,big"], "--lengths: '256,big' is not a comma-separated list of ints"),
    (["--set", "num_values=3"], "must look like TASK.OPTION=VALUE"),
])
def test_cli_argument_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        cli.parser().parse_args(["--run", "x"] + argv)
    assert message in capsys.readouterr().err


def test_aggregate_and_depth_warnings_on_hand_made_records():
    def rec(task, length, depth, pred, answers, needle_depths):
        return dict(task=task, length=length, depth=depth, metric="string_match_all", prediction=pred,
                    answers=answers, needle_depths=needle_depths)

    records = [rec("a", 256, 0.0, "1 2", ["1", "2", "3"], [0.0]), rec("a", 256, 1.0, "", ["9"], [0.7]),
               rec("a", 512, 0.0, "9", ["9"], [0.02]), rec("b", 256, 0.0, "x", ["x", "y"], [0.0, 0.05])]
    summary = report.aggregate(records)
    assert summary["by_task_length_depth"]["a"]["256"] == {"0": 66.67, "1": 0.0}
    assert summary["by_task_length"] == {"a": {"256": 33.33, "512": 100.0}, "b": {"256": 50.0}}
    assert summary["by_task"] == {"a": round((2 / 3 + 0 + 1) / 3 * 100, 2), "b": 50.0}
    assert summary["average_by_length"] == {"256": round((33.33 + 50.0) / 2, 2), "512": 100.0}
    assert summary["max_depth_error"] == {"a": {"256": 0.3, "512": 0.02}, "b": {"256": 0.05}}
    assert report.depth_warnings(summary) == [
        "a at length 256: needles up to 0.30 from the asked depth (haystack too short to place them)"]
    assert "| **average** | 41.7 | 100.0 |" in report.task_length_table(summary)


# ------------------------------------------------------------------------------------------------ end to end
def test_end_to_end_on_a_tiny_random_model(tok):
    generate = pytest.importorskip("mixerlab.eval.generate")
    from mixerlab.models.decoder import build_model
    from mixerlab.training.config import load_config

    cfg = load_config("configs/tiny.yaml", ["model.mixer=softmax"])
    model = build_model(cfg, tok.vocab_size)
    results = evaluate(tok, functools.partial(generate.greedy_generate, model), task_names=["s_niah_1"],
                       lengths=[256], depths=[0.5], num_samples=2, batch_size=2)
    assert len(results["records"]) == 2
    for r in results["records"]:
        assert isinstance(r["prediction"], str) and 0.0 <= r["score"] <= 1.0
        assert r["total_tokens"] <= 256
    assert 0.0 <= results["summary"]["average"] <= 100.0
