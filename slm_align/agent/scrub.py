"""Replace personal data in text with placeholders before feedback leaves the device.

``scrub(text) -> (text, n_replacements)`` replaces, in this order (earlier kinds win where they overlap):

- ``<EMAIL>``: e-mail addresses;
- ``<IBAN>``: IBAN-like strings (2 capital letters, 2 check digits, then 4-character groups, 15-34 characters,
  with at least 8 digits), contiguous or grouped by single spaces;
- ``<CARD>``: runs of 13-19 digits (single spaces or dashes allowed between them) that pass the Luhn check;
- ``<IP>``: IPv4 addresses;
- ``<PHONE>``: ``+CC`` international numbers of 7-15 digits, and national numbers of 9-15 digits written as
  ``(555) 123-4567`` / ``555-123-4567`` / ``555 123 4567`` or with a trunk ``0`` (``030 1234567``,
  ``020 7946 0958``, ``06-12345678``).

Plain numbers are kept: years, counts, prices, versions, dates and short codes do not match.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import NamedTuple

_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"

EMAIL = re.compile(r"(?<![\w.%+-])[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b")
IBAN = re.compile(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,3})?\b")
CARD = re.compile(r"(?<![\d+-])\d(?:[ -]?\d){12,18}(?!\d)")
IPV4 = re.compile(rf"(?<![\d.]){_OCTET}(?:\.{_OCTET}){{3}}(?!\d|\.\d)")
PHONE = re.compile(r"(?<![\w+])(?:"
                   r"\+\d{1,3}(?:[ -]?\(?\d{1,5}\)?){1,6}"          # international: +49 30 1234567, +1 (555) 123-4567
                   r"|(?:\(\d{3}\) ?|\b\d{3}[ -])\d{3}[ -]\d{4}"     # North American: (555) 123-4567, 555-123-4567
                   r"|\(?\b0\d{1,4}\)?(?:[ -]?\d{2,8}){1,4}"         # trunk 0: 030 1234567, (020) 7946 0958
                   r")(?!\d)")

MIN_INTERNATIONAL_DIGITS = 7
MIN_NATIONAL_DIGITS = 9
MAX_PHONE_DIGITS = 15


def _digits(text: str) -> str:
    return "".join(ch for ch in text if ch.isdigit())


def luhn_ok(digits: str) -> bool:
    """The Luhn checksum of a digit string (the check digit last) is valid."""
    total = 0
    for position, ch in enumerate(reversed(digits)):
        value = int(ch) * (2 if position % 2 else 1)
        total += value - 9 if value > 9 else value
    return total % 10 == 0


def _is_card(match: str) -> bool:
    digits = _digits(match)
    return 13 <= len(digits) <= 19 and len(set(digits)) > 1 and luhn_ok(digits)


def _is_iban(match: str) -> bool:
    compact = match.replace(" ", "")
    return 15 <= len(compact) <= 34 and len(_digits(compact)) >= 8


def _is_phone(match: str) -> bool:
    least = MIN_INTERNATIONAL_DIGITS if match.startswith("+") else MIN_NATIONAL_DIGITS
    return least <= len(_digits(match)) <= MAX_PHONE_DIGITS


def _always(match: str) -> bool:
    return True


class Rule(NamedTuple):
    """One kind of personal data: where it may be, whether a candidate really is one, and its placeholder."""

    pattern: re.Pattern
    accept: Callable[[str], bool]
    placeholder: str


RULES: tuple[Rule, ...] = (
    Rule(EMAIL, _always, "<EMAIL>"),
    Rule(IBAN, _is_iban, "<IBAN>"),
    Rule(CARD, _is_card, "<CARD>"),
    Rule(IPV4, _always, "<IP>"),
    Rule(PHONE, _is_phone, "<PHONE>"),
)


def _apply(rule: Rule, text: str) -> tuple[str, int]:
    count = 0

    def replace(match: re.Match) -> str:
        nonlocal count
        if not rule.accept(match.group()):
            return match.group()
        count += 1
        return rule.placeholder

    return rule.pattern.sub(replace, text), count


def scrub(text: str) -> tuple[str, int]:
    """``text`` with personal data replaced by placeholders, and the number of replacements."""
    total = 0
    for rule in RULES:
        text, count = _apply(rule, text)
        total += count
    return text, total
