"""Replace personal data and secrets in text with placeholders before feedback leaves the device.

``scrub(text) -> (text, n_replacements)`` replaces, in this order (earlier
kinds win where they overlap):

- ``<SECRET>``: API keys and tokens (``sk-...``, ``ghp_...``, ``AKIA...``, ``xox?-...``,
  ``AIza...``, ``hf_...``, JSON web tokens, ``Bearer ...``, ``api_key=...`` / ``token: ...``
  / ``password=...``), and long runs of letters and digits (32 or more, both present) that
  look like keys or hashes;
- ``<EMAIL>``: e-mail addresses;
- ``<IBAN>``: IBAN-like strings in either case (2 letters, 2 check digits, then 4-character groups,
  15-34 characters, with at least 8 digits), contiguous or grouped by single spaces;
- ``<CARD>``: runs of 13-19 digits (single spaces or dashes allowed between them)
  that pass the Luhn check;
- ``<SSN>``: US social security numbers written ``123-45-6789``;
- ``<IP>``: IPv6 addresses (full, compressed, or with an IPv4 tail), then IPv4 addresses;
- ``<PHONE>``: ``+CC`` international numbers of 7-15 digits, national numbers of 9-15 digits written
  as ``(555) 123-4567`` / ``555-123-4567`` / ``555 123 4567`` / ``555.123.4567`` or with a trunk
  ``0`` (``030 1234567``, ``020 7946 0958``, ``06-12345678``), and bare North American ten-digit
  numbers (``5551234567``).

Plain numbers are kept: years, counts, prices, versions, dates, times and short codes do not match.
Not caught: names, street addresses and other personal data without a fixed shape.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from typing import NamedTuple

_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"

SECRET = re.compile(r"(?:\b(?:sk|pk|rk)[-_](?:live_|test_|proj-)?[A-Za-z0-9_-]{16,}"
                    r"|\bgh[pousr]_[A-Za-z0-9]{20,}|\bgithub_pat_\w{20,}|\bAKIA[0-9A-Z]{16}\b"
                    r"|\bxox[abprs]-[A-Za-z0-9-]{10,}|\bAIza[0-9A-Za-z_-]{35}|\bhf_[A-Za-z0-9]{30,}"
                    r"|\beyJ[\w-]{8,}\.[\w-]{8,}\.[\w-]{8,}"
                    r"|\bBearer\s+[A-Za-z0-9._~+/-]{16,}=*"
                    r"|(?i:\b(?:api[_-]?key|access[_-]?token|token|secret|password|passwd)\b\s*[:=]\s*[\"']?[^\s\"']{6,})"
                    r"|(?<![\w-])(?=[\w-]*\d)(?=[\w-]*[A-Za-z])[A-Za-z0-9_-]{32,}(?![\w-]))")
EMAIL = re.compile(r"(?<![\w.%+-])[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b")
IBAN = re.compile(r"\b[A-Za-z]{2}\d{2}(?: ?[A-Za-z0-9]{4}){2,7}(?: ?[A-Za-z0-9]{1,3})?\b")
SSN = re.compile(r"(?<![\d-])\d{3}-\d{2}-\d{4}(?![\d-])")
IPV6 = re.compile(r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}(?:[0-9A-Fa-f]{1,4}|\d{1,3}(?:\.\d{1,3}){3})?(?![\w:.])")
CARD = re.compile(r"(?<![\d+-])\d(?:[ -]?\d){12,18}(?!\d)")
IPV4 = re.compile(rf"(?<![\d.]){_OCTET}(?:\.{_OCTET}){{3}}(?!\d|\.\d)")
PHONE = re.compile(r"(?<![\w+])(?:\+\d{1,3}(?:[ "
                   r"-]?\(?\d{1,5}\)?){1,6}"          # international: +49 30 1234567, +1 (555) 123-4567
                   r"|(?:\(\d{3}\) ?|\b\d{3}[ .-])\d{3}[ .-]\d{4}"   # North American: (555) 123-4567, 555.123.4567
                   r"|\b[2-9]\d{9}\b"                                 # North American, bare: 5551234567
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


def _is_ipv6(match: str) -> bool:
    try:
        ipaddress.IPv6Address(match)
    except ValueError:
        return False
    return any(ch.isalnum() for ch in match)


def _is_phone(match: str) -> bool:
    least = MIN_INTERNATIONAL_DIGITS if match.startswith("+") else MIN_NATIONAL_DIGITS
    return least <= len(_digits(match)) <= MAX_PHONE_DIGITS


def _always(match: str) -> bool:
    return True


class Rule(NamedTuple):
    """One kind of personal data: where it may be, whether a candidate really is
    one, and its placeholder."""

    pattern: re.Pattern
    accept: Callable[[str], bool]
    placeholder: str


RULES: tuple[Rule, ...] = (
    Rule(SECRET, _always, "<SECRET>"),
    Rule(EMAIL, _always, "<EMAIL>"),
    Rule(IBAN, _is_iban, "<IBAN>"),
    Rule(CARD, _is_card, "<CARD>"),
    Rule(SSN, _always, "<SSN>"),
    Rule(IPV6, _is_ipv6, "<IP>"),
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
