"""Replace personal data and secrets in text with placeholders before feedback leaves the device.

``scrub(text, context="") -> (text, n_replacements)``. Two detectors run, the first always:

1. **The regex floor** (this module, standard library only, so it runs on a phone). In this order
   (earlier kinds win where they overlap):

   - ``<SECRET>``: PEM private-key blocks (``-----BEGIN ... PRIVATE KEY-----`` to its ``END`` line, the
     body included; a block cut short loses its base64 lines); the value of a URL's credentials
     (``https://user:<SECRET>@host``) and of secret-looking query parameters (``?key=``, ``&token=``,
     ``access_token``, ``X-Amz-Signature``, ``sig``, ``password``...: ``?key=<SECRET>``); what follows
     ``password is`` / ``passphrase was`` in prose (``my password is <SECRET>``; a short list of ordinary
     words such as ``incorrect``, ``required``, ``too`` is kept); API keys and tokens (``sk-...``,
     ``ghp_...``, ``github_pat_...``, ``glpat-...`` and GitLab's other prefixes, ``AKIA...``,
     ``xox?-...``, ``AIza...``, ``hf_...``, JSON web tokens, ``Bearer ...``); labelled values
     (``api_key=...``, ``token: ...``, ``password=...``, ``aws_secret_access_key = ...``,
     ``"client_secret": "..."``); runs of 32 or more letters and digits (both present) and base64 runs of
     40 or more characters (upper and lower case and a digit; ``/`` and ``+`` allowed: AWS secret access
     keys) that look like keys or hashes;
   - ``<EMAIL>``: e-mail addresses;
   - ``<IBAN>``: IBAN-like strings in either case (2 letters, 2 check digits, then 4-character groups,
     15-34 characters, with at least 8 digits), contiguous or grouped by single spaces;
   - ``<CARD>``: 13-19 digits that pass the Luhn check, contiguous or with single spaces or dashes, or
     in groups of four (Amex: 4-6-5) split by dots, runs of spaces or tabs, or one line break;
   - ``<SSN>``: US social security numbers written ``123-45-6789`` or ``123 45 6789`` (the spaced form
     only where it is a valid number: no area 000 or 666, no group 00, no serial 0000), and any
     nine digits (``123456789``, ``123.45.6789``) after a label (``SSN``, ``social security number``,
     ``ITIN``) in the same line, or in a value whose ``context`` is such a label;
   - ``<IP>``: IPv6 addresses (full, compressed, or with an IPv4 tail), then IPv4 addresses;
   - ``<PHONE>``: ``+CC`` international numbers of 7-15 digits, national numbers of 9-15 digits written
     as ``(555) 123-4567`` / ``555-123-4567`` / ``415/555-0132`` / ``555 123 4567`` / ``555.123.4567``
     or with a trunk ``0`` (``030 1234567``, ``020 7946 0958``, ``06-12345678``), bare North American
     ten-digit numbers (``5551234567``) and seven-digit local numbers ``555-0132`` (a range of round
     numbers such as ``250-1000`` is kept).

2. **Yelp's detect-secrets** (``pip install "slm-align[scrub]"``; used when importable): the regular
   expressions of its vendor plugins (Slack webhooks, Discord, SendGrid, Stripe, Twilio, Telegram,
   Mailchimp, Azure storage, npm, PyPI, OpenAI, IBM, Cloudant, SoftLayer, basic-auth URLs, private-key
   headers...) become ``<SECRET>`` after the floor has run. Its high-entropy and keyword plugins are left
   out: on prose they flag ordinary words (``the``, ``password``); so are its Artifactory plugin (it
   matches upper-case words such as ``APPLICATIONS``) and its IP plugin (the floor's ``<IP>`` does that).
   ``detectors()`` says which run. Presidio was not taken: it needs spaCy models from a model hub.

``context`` is text beside ``text`` that is read, not scrubbed: the key of a tool-call argument.
Under a secret label (``password``, ``api_key``, ``client_secret``, ``token``...) the whole value is
``<SECRET>``; under an SSN label nine digits are ``<SSN>``.

Plain numbers are kept: years, counts, prices, versions, dates, times, short codes, calculator results
and nine-digit numbers without an SSN label (``123456789`` alone is kept). Not caught: names, street
addresses, dates of birth, passport and licence numbers, PINs, passwords that are not labelled as such,
and other personal data without a fixed shape.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from collections.abc import Callable
from typing import NamedTuple

_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
PLACEHOLDER = re.compile(r"<[A-Z]+>")

# Names under which a value is a secret: in ``name=value`` text, and as the key of a tool-call argument. A prefix
# (``aws_``, ``client_``) is at most 40 characters: unbounded, the lazy scan from every word made a long run of
# ``555-`` quadratic (8 s for 16 KB).
_SECRET_LABEL = (r"[\w-]{0,40}?(?:secret(?:[_-]?(?:access[_-]?)?key)?|passw(?:or)?d|passphrase|api[_-]?key"
                 r"|access[_-]?key|private[_-]?key|token|credentials?)")
SECRET_LABEL = re.compile(rf"(?i:{_SECRET_LABEL}|pwd)")

MAX_PEM_CHARS = 8192
"""Longest private-key body looked for (an RSA-4096 PEM is about 3,300 characters): unbounded, each BEGIN line
scanned to the end of the text for its END, quadratic in a text of many BEGIN lines."""
_PEM_LINE = r"(?:\r?\n|\\n)(?:\r?\n|\\n)?(?:[A-Za-z0-9+/=]{16,}|[A-Za-z-]+: [^\n\\]*)"  # base64, or Proc-Type: ...
PEM = re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----"
                 rf"(?:[\s\S]{{0,{MAX_PEM_CHARS}}}?-----END [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----|(?:{_PEM_LINE})*)")
URL_USERINFO = re.compile(r"(?i:\b[a-z][a-z0-9+.-]{0,30}://[^\s/:@<>]+:)(?P<secret>[^\s/@<>]+)(?=@)")
URL_PARAM = re.compile(r"(?i:[?&#;][\w.-]{0,40}?(?:key|token|secret|passw(?:or)?d|pwd|sig|signature|credential"
                       r"|auth|session(?:id)?|sid)=)(?P<secret>[^&#\s\"'<>]+)")
PASSWORD_SAID = re.compile(r"(?i:\b(?:password|passwd|passcode|passphrase|pass[ -]word)s?\b"
                           r"(?:[^\S\n]+(?:for|to|of|on)\b[^.\n]{0,40}?)?"
                           r"[^\S\n]+(?:is|was|will[^\S\n]+be)[^\S\n]*[:-]?[^\S\n]*[\"'“‘]?)"
                           r"(?P<secret>[^\s\"'”’<]+?)(?=[\"'”’]?[.,;:!?)]*(?:\s|$))"
                           r"(?!\s+(?i:characters?|chars?|letters?|digits?|symbols?|long)\b)")
SECRET = re.compile(r"(?:\b(?:sk|pk|rk)[-_](?:live_|test_|proj-)?[A-Za-z0-9_-]{16,}"
                    r"|\bgh[pousr]_[A-Za-z0-9]{20,}|\bgithub_pat_\w{20,}|\b(?:A3T[A-Z0-9]|AKIA|ASIA|ABIA|ACCA)[0-9A-Z]{16}\b"
                    r"|\bgl(?:pat|dt|ft|soat|rt|cbt|imt|ptt|agent|oas)-[A-Za-z0-9_-]{20,}"
                    r"|\bxox[abprs]-[A-Za-z0-9-]{10,}|\bAIza[0-9A-Za-z_-]{35}|\bhf_[A-Za-z0-9]{30,}"
                    r"|\beyJ[\w-]{8,}\.[\w-]{8,}\.[\w-]{8,}"
                    r"|\bBearer\s+[A-Za-z0-9._~+/-]{16,}=*"
                    rf"|(?i:(?P<kq>[\"'])?\b(?:{_SECRET_LABEL}|pwd)\b(?(kq)(?P=kq))\s*[:=]\s*"
                    r"(?P<vq>[\"'])?(?!<[A-Z]+>)[^\s\"']{6,}(?(vq)(?P=vq)?))"
                    r"|(?<![\w-])(?=[\w-]*\d)(?=[\w-]*[A-Za-z])[A-Za-z0-9_-]{32,}(?![\w-])"
                    r"|(?<![\w./+=:-])(?=[A-Za-z0-9/+]*[A-Z])(?=[A-Za-z0-9/+]*[a-z])(?=[A-Za-z0-9/+]*\d)"
                    r"[A-Za-z0-9/+]{40,}={0,2}(?![\w/+=]))")
EMAIL = re.compile(r"(?<![\w.%+-])[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b")
IBAN = re.compile(r"\b[A-Za-z]{2}\d{2}(?: ?[A-Za-z0-9]{4}){2,7}(?: ?[A-Za-z0-9]{1,3})?\b")
CARD = re.compile(r"(?<![\d+-])\d(?:[ -]?\d){12,18}(?!\d)")
# Groups of four (Amex 4-6-5) split by a dot, a dash, runs of spaces or tabs, or one line break.
_GAP = r"(?:[ \t]{0,3}(?:\r?\n|[.-])?[ \t]{0,3})"
CARD_GROUPED = re.compile(rf"(?<![\d.])(?:\d{{4}}(?:{_GAP}\d{{4}}){{2,3}}(?:{_GAP}\d{{1,4}})?"
                          rf"|\d{{4}}{_GAP}\d{{6}}{_GAP}\d{{5}})(?!\d|\.\d)")
SSN = re.compile(r"(?<![\d-])\d{3}-\d{2}-\d{4}(?![\d-])")
SSN_SPACED = re.compile(r"(?<![\w+-])(?<!\d )\d{3} \d{2} \d{4}(?!\w| \d)")
_SSN_WORD = r"\b(?:ssn|ss#|social[ -]?security|itin)(?:[ -]?(?:no|number|num|#))?"
SSN_LABEL = re.compile(rf"(?i:{_SSN_WORD})")
_NINE_DIGITS = r"(?<![\d.-])\d{3}[ .-]?\d{2}[ .-]?\d{4}(?![\d]|[.-]\d)"
SSN_LABELLED = re.compile(rf"(?i:{_SSN_WORD}(?![a-z])[^\d\n]{{0,40}}?)(?P<secret>{_NINE_DIGITS})")
SSN_ANY = re.compile(_NINE_DIGITS)
IPV6 = re.compile(r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}(?:[0-9A-Fa-f]{1,4}|\d{1,3}(?:\.\d{1,3}){3})?(?![\w:.])")
IPV4 = re.compile(rf"(?<![\d.]){_OCTET}(?:\.{_OCTET}){{3}}(?!\d|\.\d)")
PHONE = re.compile(r"(?<![\w+])(?:\+\d{1,3}(?:[ "
                   r"-]?\(?\d{1,5}\)?){1,6}"          # international: +49 30 1234567, +1 (555) 123-4567
                   r"|(?:\(\d{3}\) ?|\b\d{3}[ ./-])\d{3}[ .-]\d{4}"  # North American: (555) 123-4567, 415/555-0132
                   r"|\b[2-9]\d{9}\b"                                 # North American, bare: 5551234567
                   r"|\(?\b0\d{1,4}\)?(?:[ -]?\d{2,8}){1,4}"         # trunk 0: 030 1234567, (020) 7946 0958
                   r")(?!\d)")
LOCAL_PHONE = re.compile(r"(?<![\w+./-])[2-9]\d{2}-\d{4}(?![\w-]|[.:/]\d)")  # 555-0132

MIN_INTERNATIONAL_DIGITS = 7
MIN_NATIONAL_DIGITS = 9
MAX_PHONE_DIGITS = 15

# Words that follow "password is" in ordinary prose rather than a password.
_NOT_A_PASSWORD = frozenset("""
a an the not no too very also still now only just always never being been set stored saved changed hashed
encrypted shown hidden sent updated reset expired missing empty required needed mandatory optional correct
incorrect invalid valid wrong weak strong secure insecure safe unsafe long short case case-sensitive same
different your my his her their our its this that it what which something anything nothing secret private
at in on of for to by with from as if and or but please displayed visible unknown blank
""".split())


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


def _is_grouped_card(match: str) -> bool:
    """A card in groups: a real issuer's first digit (2-6), at most one line break, and not a row of
    round numbers or years (``1000  2000  3000  4000``)."""
    groups = re.findall(r"\d+", match)
    rows_of_numbers = all(len(g) == 4 and (g.endswith("0") or 1900 <= int(g) <= 2099) for g in groups)
    return (_is_card(match) and match[0] in "23456" and match.count("\n") <= 1 and not rows_of_numbers)


def _is_ssn(match: str) -> bool:
    digits = _digits(match)
    return digits[:3] not in ("000", "666") and digits[3:5] != "00" and digits[5:] != "0000"


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


def _is_local_phone(match: str) -> bool:
    """``555-0132`` is a phone; ``250-1000`` (both ends round, rising) is a range."""
    low, high = (int(part) for part in match.split("-"))
    return not (low % 10 == 0 and high % 10 == 0 and low < high)


def _is_password(value: str) -> bool:
    word = value.lower()
    return not (word in _NOT_A_PASSWORD or (word.isalpha() and word.endswith(("ed", "ly", "ing"))))


def _always(match: str) -> bool:
    return True


class Rule(NamedTuple):
    """One kind of personal data: where it may be, whether a candidate really is
    one, and its placeholder. Where the pattern has a group named ``secret``, only that group is
    replaced (``?key=<SECRET>``); otherwise the whole match."""

    pattern: re.Pattern
    accept: Callable[[str], bool]
    placeholder: str


FLOOR_SECRETS: tuple[Rule, ...] = (
    Rule(PEM, _always, "<SECRET>"),
    Rule(URL_USERINFO, _always, "<SECRET>"),
    Rule(URL_PARAM, _always, "<SECRET>"),
    Rule(PASSWORD_SAID, _is_password, "<SECRET>"),
    Rule(SECRET, _always, "<SECRET>"),
)

RULES_AFTER_SECRETS: tuple[Rule, ...] = (
    Rule(EMAIL, _always, "<EMAIL>"),
    Rule(IBAN, _is_iban, "<IBAN>"),
    Rule(CARD, _is_card, "<CARD>"),
    Rule(CARD_GROUPED, _is_grouped_card, "<CARD>"),
    Rule(SSN, _always, "<SSN>"),
    Rule(SSN_SPACED, _is_ssn, "<SSN>"),
    Rule(SSN_LABELLED, _always, "<SSN>"),
    Rule(IPV6, _is_ipv6, "<IP>"),
    Rule(IPV4, _always, "<IP>"),
    Rule(PHONE, _is_phone, "<PHONE>"),
    Rule(LOCAL_PHONE, _is_local_phone, "<PHONE>"),
)

RULES: tuple[Rule, ...] = FLOOR_SECRETS + RULES_AFTER_SECRETS
"""The regex floor, in the order it runs."""

# detect-secrets plugins left out: prose-hostile (entropy, keyword), false positives on upper-case words
# (Artifactory), or done by the floor under its own placeholder (public IPs).
_LEFT_OUT_PLUGINS = frozenset({"ArtifactoryDetector", "IPPublicDetector"})


def _not_over_a_placeholder(match: str) -> bool:
    return PLACEHOLDER.search(match) is None


@functools.lru_cache(maxsize=1)
def library_rules() -> tuple[tuple[Rule, ...], str | None]:
    """The regex-based plugins of Yelp's detect-secrets as ``<SECRET>`` rules, and its name and version;
    ``((), None)`` when it is not installed (the floor alone runs)."""
    try:
        from detect_secrets.__version__ import VERSION
        from detect_secrets.core.plugins.util import get_mapping_from_secret_type_to_class
        from detect_secrets.plugins.base import RegexBasedDetector
    except ImportError:
        return (), None
    rules = []
    for _, plugin in sorted(get_mapping_from_secret_type_to_class().items()):
        if not issubclass(plugin, RegexBasedDetector) or plugin.__name__ in _LEFT_OUT_PLUGINS:
            continue
        rules.extend(Rule(pattern, _not_over_a_placeholder, "<SECRET>") for pattern in plugin().denylist)
    return tuple(rules), f"detect-secrets {VERSION}"


def detectors() -> list[str]:
    """Which detectors ``scrub`` runs here: the regex floor always, detect-secrets where installed."""
    _, library = library_rules()
    return ["regex floor"] + ([library] if library else [])


MAX_LIBRARY_TOKEN_CHARS = 256
"""Longest run of non-space characters detect-secrets' patterns look at. Some of them are quadratic in the
length of what they scan (``//.+/:_authToken``: 17 s for 60 KB of slashes), so they run word by word and skip
words longer than this; the floor, which runs on the whole text, still sees those."""
_WORD = re.compile(r"\S+")


def _apply_by_word(rules: tuple[Rule, ...], text: str) -> tuple[str, int]:
    """:func:`_apply` of each rule to each word of ``text`` of at most :data:`MAX_LIBRARY_TOKEN_CHARS`."""
    count = 0

    def replace(match: re.Match) -> str:
        nonlocal count
        word = match.group()
        if len(word) > MAX_LIBRARY_TOKEN_CHARS:
            return word
        for rule in rules:
            word, found = _apply(rule, word)
            count += found
        return word

    return _WORD.sub(replace, text), count


def _apply(rule: Rule, text: str) -> tuple[str, int]:
    count = 0
    grouped = "secret" in rule.pattern.groupindex

    def replace(match: re.Match) -> str:
        nonlocal count
        start, end = match.span("secret") if grouped and match.group("secret") is not None else match.span()
        if not rule.accept(match.string[start:end]):
            return match.group()
        count += 1
        return match.string[match.start():start] + rule.placeholder + match.string[end:match.end()]

    return rule.pattern.sub(replace, text), count


def scrub(text: str, context: str = "") -> tuple[str, int]:
    """``text`` with personal data replaced by placeholders, and the number of replacements.

    ``context`` (the key of a tool-call argument) is read, not scrubbed: under a secret label the whole
    value is ``<SECRET>``; under an SSN label nine digits in it are ``<SSN>``."""
    if context and SECRET_LABEL.fullmatch(context.strip()) and text.strip() \
            and not PLACEHOLDER.fullmatch(text.strip()):
        return "<SECRET>", 1
    extra = (Rule(SSN_ANY, _always, "<SSN>"),) if context and SSN_LABEL.search(context) else ()
    total = 0
    for rule in FLOOR_SECRETS:
        text, count = _apply(rule, text)
        total += count
    text, count = _apply_by_word(library_rules()[0], text)
    total += count
    for rule in extra + RULES_AFTER_SECRETS:
        text, count = _apply(rule, text)
        total += count
    return text, total
