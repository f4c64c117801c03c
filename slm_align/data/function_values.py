"""Values for the function-calling task family: each drawn value has the canonical form a call
carries, the words a request says it in, and every value a right call may carry.

A parameter of the library (``assets/functions/domains/*.json``) names its generator in ``gen``:

- ``pool:NAME``: a string from the pool NAME of ``assets/functions/values.json`` (an entry is a
  string, or ``{"value", "say", "same"}``: said one of the ``say`` ways, any of ``same`` allowed,
  as BFCL lists "NYC" beside "New York");
- ``int:LO:HI[:STEP]`` and ``num:LO:HI:DECIMALS``: an integer or a number (small integers are
  sometimes spelled out: "five");
- ``enum``: one of the schema's ``enum`` strings, said as the parameter's ``say`` map says or with
  spaces for underscores;
- ``bool``: said with the parameter's ``say`` pair (the phrase for true, then for false);
- ``time``: a clock time, called ``HH:MM`` (24-hour) and said "6:30 pm", "18:30" or "6 pm";
- ``date``: a day of 2027, called ``YYYY-MM-DD`` and said "March 14, 2027", "14 March 2027" or as
  called;
- ``digits:N``: a string of N digits (a postcode);
- ``list:LO:HI:ITEM``: LO to HI distinct items drawn by the generator ITEM (or by ``enum`` over the
  items' enum), said "a, b and c".

Hand-written because no library draws paired (call value, request words) values; stdlib only.
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from importlib import resources
from typing import Any

_NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                 "ten", "eleven", "twelve")
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September",
           "October", "November", "December")
YEAR = 2027
"""The year of every generated date (said in the request, so no call depends on today's date)."""


@dataclass(frozen=True)
class Value:
    """One drawn value: ``value`` is what a right call carries, ``said`` the words of the request,
    ``allowed`` every value a right call may carry (``value`` first)."""

    value: Any
    said: str
    allowed: tuple


@functools.cache
def pools() -> dict:
    """The value pools of ``assets/functions/values.json``."""
    text = resources.files("slm_align").joinpath("assets/functions/values.json").read_text(encoding="utf-8")
    return {name: pool for name, pool in json.loads(text).items() if not name.startswith("_")}


def draw(param: dict, rng: random.Random) -> Value:
    """A value for the parameter schema ``param`` by its ``gen`` (see the module's docstring)."""
    kind, _, rest = param["gen"].partition(":")
    drawers = {"pool": _pool, "int": _int, "num": _num, "enum": _enum, "bool": _bool, "time": _time,
               "date": _date, "list": _list, "digits": _digits}
    if kind not in drawers:
        raise ValueError(f"unknown value generator {param['gen']!r}")
    return drawers[kind](param, rest, rng)


def _pool(param: dict, name: str, rng: random.Random) -> Value:
    entry = rng.choice(pools()[name])
    if isinstance(entry, str):
        return Value(entry, entry, (entry,))
    allowed = (entry["value"], *(same for same in entry["same"] if same != entry["value"]))
    return Value(entry["value"], rng.choice(entry["say"]), allowed)


def _int(param: dict, bounds: str, rng: random.Random) -> Value:
    low, high, *step = (int(part) for part in bounds.split(":"))
    value = rng.randrange(low, high + 1, step[0] if step else 1)
    said = str(value)
    if value < len(_NUMBER_WORDS) and rng.random() < 0.3:
        said = _NUMBER_WORDS[value]
    return Value(value, said, (value,))


def _num(param: dict, bounds: str, rng: random.Random) -> Value:
    low, high, decimals = bounds.split(":")
    value = round(rng.uniform(float(low), float(high)), int(decimals))
    said = f"{value:.{int(decimals)}f}"
    return Value(value, said, (value,))


def _enum(param: dict, rest: str, rng: random.Random) -> Value:
    value = rng.choice(param["enum"])
    phrases = param.get("say", {}).get(value, [value.replace("_", " ")])
    return Value(value, rng.choice(phrases), (value,))


def _bool(param: dict, rest: str, rng: random.Random) -> Value:
    value = rng.random() < 0.5
    said = param["say"][0 if value else 1]
    return Value(value, said, (value,))


def _time(param: dict, rest: str, rng: random.Random) -> Value:
    hour = rng.randint(5, 22)
    minute = rng.choice((0, 0, 5, 10, 15, 20, 30, 30, 45, 50))
    value = f"{hour:02d}:{minute:02d}"
    twelve = (hour - 1) % 12 + 1
    suffix = "am" if hour < 12 else "pm"
    forms = [value, f"{twelve}:{minute:02d} {suffix}", f"{twelve}:{minute:02d}{suffix.upper()}"]
    if minute == 0:
        forms.append(f"{twelve} {suffix}")
    return Value(value, rng.choice(forms), (value,))


def _date(param: dict, rest: str, rng: random.Random) -> Value:
    month = rng.randint(1, 12)
    day = rng.randint(1, 28)
    value = f"{YEAR}-{month:02d}-{day:02d}"
    forms = [f"{_MONTHS[month - 1]} {day}, {YEAR}", f"{day} {_MONTHS[month - 1]} {YEAR}", value]
    return Value(value, rng.choice(forms), (value,))


def _digits(param: dict, count: str, rng: random.Random) -> Value:
    value = "".join(rng.choice("0123456789") for _ in range(int(count)))
    return Value(value, value, (value,))


def _list(param: dict, rest: str, rng: random.Random) -> Value:
    low, high, item_gen = rest.split(":", 2)
    item = dict(param.get("items", {}), gen=item_gen)
    count = rng.randint(int(low), int(high))
    drawn: dict = {}
    for _ in range(50 * count):
        if len(drawn) == count:
            break
        one = draw(item, rng)
        drawn.setdefault(json.dumps(one.value), one)
    values = list(drawn.values())
    return Value([one.value for one in values], spoken_list([one.said for one in values]),
                 ([one.value for one in values],))


def spoken_list(words: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    if len(words) < 2:
        return "".join(words)
    return ", ".join(words[:-1]) + " and " + words[-1]
