"""The RULER tasks we implement: names, default parameters, prompt wording and metric.

Six tasks of RULER (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context Language
Models?"), named as in the paper's table of tasks:

=========  ======================================  ==========  =============  ==========================
name       RULER config                            haystack    value          needles
=========  ======================================  ==========  =============  ==========================
s_niah_1   niah_single_1 (passkey retrieval)       repeat      7-digit number 1 key, 1 value
s_niah_2   niah_single_2                           essay       7-digit number 1 key, 1 value
s_niah_3   niah_single_3                           essay       UUID           1 key, 1 value
mv_niah    niah_multivalue                         essay       7-digit number 1 key, 4 values (all asked)
mq_niah    niah_multiquery                         essay       7-digit number 4 keys, 1 value each, 4 asked
vt         vt (variable tracking)                  repeat      5-digit number 1 chain of 4 hops
=========  ======================================  ==========  =============  ==========================

Every task is scored with RULER's ``string_match_all`` (RULER uses ``string_match_part`` only for its QA tasks).
Options (``num_values`` etc.) can be overridden per call; ``resolve_options`` checks names, types and ranges.
"""
from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any, Mapping

HAYSTACKS = ("repeat", "essay")
STRING_KINDS = ("numbers", "words", "uuids")
METRICS = ("string_match_all", "string_match_part")

# Tokens of generation budget per expected answer (our tokenizer: a 7-digit number is 3-4 tokens, a UUID 26-32,
# a 5-letter variable name 2-4; each answer also needs a separator). Plus a fixed slack.
ANSWER_TOKEN_BUDGET = {"numbers": 6, "words": 10, "uuids": 36, "variables": 6}
GENERATION_SLACK = 8


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    name: str
    family: str  # "niah" | "vt"
    metric: str
    defaults: Mapping[str, Any]
    description: str


def _niah(name, description, *, haystack, value_type, num_keys=1, num_values=1, num_queries=1):
    return TaskSpec(name=name, family="niah", metric="string_match_all", description=description,
                    defaults=MappingProxyType(dict(haystack=haystack, key_type="words", value_type=value_type,
                                                   num_keys=num_keys, num_values=num_values,
                                                   num_queries=num_queries, tokens_to_generate=None)))


TASKS: Mapping[str, TaskSpec] = MappingProxyType({
    "s_niah_1": _niah("s_niah_1", "single needle (passkey): repeated noise haystack, numeric value",
                      haystack="repeat", value_type="numbers"),
    "s_niah_2": _niah("s_niah_2", "single needle: essay haystack, numeric value",
                      haystack="essay", value_type="numbers"),
    "s_niah_3": _niah("s_niah_3", "single needle: essay haystack, UUID value",
                      haystack="essay", value_type="uuids"),
    "mv_niah": _niah("mv_niah", "multi-value: one key with several values, all must be returned",
                     haystack="essay", value_type="numbers", num_values=4),
    "mq_niah": _niah("mq_niah", "multi-query: several keys, the values of all of them must be returned",
                     haystack="essay", value_type="numbers", num_keys=4, num_queries=4),
    "vt": TaskSpec(name="vt", family="vt", metric="string_match_all",
                   description="variable tracking: chains of VAR X = VAR Y; return every variable equal to a value",
                   defaults=MappingProxyType(dict(haystack="repeat", num_chains=1, num_hops=4,
                                                  tokens_to_generate=None))),
})

# Options that must be integers >= 1 (tokens_to_generate may also be None: derived from the answers).
_POSITIVE_INTS = ("num_keys", "num_values", "num_queries", "num_chains", "num_hops", "tokens_to_generate")
_CHOICES = {"haystack": HAYSTACKS, "key_type": STRING_KINDS, "value_type": STRING_KINDS}


def get_task(name: str) -> TaskSpec:
    if name not in TASKS:
        raise ValueError(f"task: unknown RULER task {name!r}; valid tasks: {', '.join(TASKS)}")
    return TASKS[name]


def resolve_options(spec: TaskSpec, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The task's defaults updated with ``overrides``; every name, type and range checked."""
    opts = dict(spec.defaults)
    for key, value in (overrides or {}).items():
        if key not in opts:
            raise ValueError(f"{spec.name}.{key}: unknown option for task {spec.name!r}; "
                             f"valid options: {', '.join(sorted(opts))}")
        opts[key] = value
    for key, value in opts.items():
        if key in _POSITIVE_INTS:
            if key == "tokens_to_generate" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{spec.name}.{key}: must be an integer >= 1, got {value!r}")
        elif key in _CHOICES and value not in _CHOICES[key]:
            raise ValueError(f"{spec.name}.{key}: must be one of {', '.join(_CHOICES[key])}, got {value!r}")
    if spec.family == "niah" and opts["num_queries"] > opts["num_keys"]:
        raise ValueError(f"{spec.name}.num_queries: {opts['num_queries']} queries need at least as many keys, "
                         f"but num_keys={opts['num_keys']}; valid: 1 <= num_queries <= num_keys")
    if opts["tokens_to_generate"] is None:
        opts["tokens_to_generate"] = default_tokens_to_generate(spec, opts)
    return opts


def num_answers(spec: TaskSpec, opts: Mapping[str, Any]) -> int:
    if spec.family == "niah":
        return opts["num_queries"] * opts["num_values"]
    return opts["num_hops"] + 1


def default_tokens_to_generate(spec: TaskSpec, opts: Mapping[str, Any]) -> int:
    kind = opts["value_type"] if spec.family == "niah" else "variables"
    return ANSWER_TOKEN_BUDGET[kind] * num_answers(spec, opts) + GENERATION_SLACK


# ------------------------------------------------------------------------------------------- prompt wording
# RULER's "base" (no chat wrapper) template: task template + answer prefix, so the model continues the answer.
_NIAH_NOUN = {"numbers": "number", "words": "word", "uuids": "uuid"}
NIAH_NEEDLE = "One of the special magic {nouns} for {key} is: {value}."
_NIAH_ONE = ("A special magic {noun} is hidden within the following text. Make sure to memorize it. "
             "I will quiz you about the {noun} afterwards.\n{context}\n"
             "What is the special magic {noun} for {query} mentioned in the provided text? "
             "The special magic {noun} for {query} mentioned in the provided text is")
_NIAH_MANY = ("Some special magic {nouns} are hidden within the following text. Make sure to memorize it. "
              "I will quiz you about the {nouns} afterwards.\n{context}\n"
              "What are all the special magic {nouns} for {query} mentioned in the provided text? "
              "The special magic {nouns} for {query} mentioned in the provided text are")
_VT = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
       "Question: Find all variables that are assigned the value {query} in the text above. "
       "Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
       "assigned the value {query}, they are:")


def niah_needle(value_type: str, key: str, value: str) -> str:
    return NIAH_NEEDLE.format(nouns=_NIAH_NOUN[value_type] + "s", key=key, value=value)


def join_queries(keys: list[str]) -> str:
    """RULER's query list: 'a' / 'a, and b' / 'a, b, and c'."""
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


def niah_prompt(value_type: str, *, context: str, query: str, num_answers: int) -> str:
    noun = _NIAH_NOUN[value_type]
    template = _NIAH_ONE if num_answers == 1 else _NIAH_MANY
    return template.format(noun=noun, nouns=noun + "s", context=context, query=query)


def vt_prompt(*, context: str, query: str, num_v: int) -> str:
    return _VT.format(context=context, query=query, num_v=num_v)


def template_text(spec: TaskSpec, opts: Mapping[str, Any]) -> str:
    """The fixed words of the task's prompt (no context or query): random strings must not occur in it."""
    if spec.family == "niah":
        return niah_prompt(opts["value_type"], context="", query="", num_answers=num_answers(spec, opts)) \
            + niah_needle(opts["value_type"], "", "")
    return vt_prompt(context="", query="", num_v=0) + "VAR  = "
