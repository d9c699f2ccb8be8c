"""Random needle strings: keys and values (numbers, adjective-noun words, UUIDs) and variable names.

Kinds follow RULER: a number is 7 decimal digits, a word is an ``adjective-noun`` pair, a UUID is a version-4
UUID built from 128 random bits; variable-tracking names are 5 upper-case letters and their value a 5-digit
number. RULER draws its words from the ``wonderwords`` lists; we use the short lists below (ours) instead.

``UniqueDrawer`` hands out strings that are pairwise distinct, none a substring of another, and none occurring
(case-insensitively: the metric is case-insensitive) in a forbidden text (the haystack source and the
prompt's own wording), so every answer is findable in exactly one place of the prompt.
"""
from __future__ import annotations

import random
import string
import uuid
from typing import Callable

# Short everyday words (one or two tokens each with the embedded tokenizer), so that keys stay short: a
# multi-query prompt holds every key three times, which matters at the shortest lengths.
ADJECTIVES = (
    "ancient", "big", "bold", "blue", "bright", "busy", "calm", "clean", "clever", "cold", "cool", "dark", "deep",
    "dry", "eager", "early", "fancy", "fast", "flat", "fresh", "green", "hard", "high", "hot", "late", "lazy",
    "long", "low", "modest", "new", "old", "plain", "quick", "quiet", "rapid", "rare", "red", "rich", "round",
    "silent", "slow", "soft", "strong", "thick", "thin", "vivid", "weak", "wet", "wild",
)
NOUNS = (
    "apple", "bell", "bird", "boat", "book", "bread", "castle", "cat", "cedar", "chair", "coin", "comet",
    "desert", "dog", "door", "engine", "feather", "field", "fish", "flower", "forest", "fox", "hill", "house",
    "king", "lake", "lamp", "lantern", "mirror", "moon", "mountain", "otter", "planet", "queen", "rain",
    "raven", "river", "road", "rock", "ship", "snow", "star", "stone", "table", "train", "tree", "wind",
    "window",
)


def random_number(rng: random.Random, digits: int = 7) -> str:
    return str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))


def random_word(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def random_uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def random_variable(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(5))


DRAWERS: dict[str, Callable[[random.Random], str]] = {
    "numbers": random_number, "words": random_word, "uuids": random_uuid,
    "variables": random_variable, "vt_values": lambda rng: random_number(rng, 5),
}
MAX_TRIES = 10_000


class UniqueDrawer:
    """Draws strings of a kind that are new, not nested in (or around) earlier ones and absent from
    ``forbidden_text``."""

    def __init__(self, rng: random.Random, forbidden_text: str):
        self._rng = rng
        self._forbidden = forbidden_text.lower()
        self._taken: list[str] = []

    def draw(self, kind: str) -> str:
        make = DRAWERS[kind]
        for _ in range(MAX_TRIES):
            s = make(self._rng)
            low = s.lower()
            if low in self._forbidden or any(low in t or t in low for t in self._taken):
                continue
            self._taken.append(low)
            return s
        raise RuntimeError(f"could not draw a {kind} string unlike the {len(self._taken)} already drawn and absent "
                           f"from the haystack in {MAX_TRIES} tries; use fewer needles")
