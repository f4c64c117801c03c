"""The tokenizer of a GGUF file, rebuilt as llama.cpp runs it, and carried
beside models saved from it.

A ``.gguf`` file keeps its tokenizer as ``tokenizer.*`` metadata, and that metadata is the ground
truth: llama.cpp tokenises with it at inference. transformers' own GGUF conversion is lossy (on
Gemma 3 270M it splits "The capital of France is" into 11 pieces where llama.cpp gives 6), so we
build the fast tokenizer ourselves:

- ``llama`` (SentencePiece BPE). llama.cpp repeatedly merges the adjacent pair whose concatenation
  is the best-scored vocabulary piece; a BPE whose merges are every (left, right) split of every
  piece, ranked by the piece's score, does the same. Spaces become "▁", a "▁" is prepended to each
  text fragment when ``add_space_prefix`` is set, and characters outside the vocabulary fall back
  to ``<0xXX>`` byte tokens;
- ``gpt2`` (byte-level BPE): the file's merges, and the pre-tokenizer regexes llama.cpp uses for
  ``tokenizer.ggml.pre`` (the names in :data:`PRE_TOKENIZER_REGEXES`).

In both, CONTROL, USER_DEFINED and UNKNOWN tokens are added tokens matched on the raw text, as
llama.cpp's special-token partition does. BOS/EOS/unk/pad ids, the add-BOS/EOS flags and the chat
template come from the file.

:func:`load_gguf_tokenizer` checks the result against llama.cpp itself (vocab only) on
:data:`PROBE_TEXTS` and every special token string, with and without special tokens added; any
difference is a one-line UserError at load time, before any training. When llama-cpp-python is not
installed the check is skipped.

:func:`write_sidecar` copies the file's ``tokenizer.*`` key/values, byte for byte, into a vocab-only
``tokenizer.gguf`` beside a saved model, so that GGUF export can write the source's exact tokenizer
back (:func:`add_tokenizer_fields`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from slm_align.atomic import write_bytes_atomic
from slm_align.errors import UserError
from slm_align.ondevice.gguf.fields import _STRING, Field, read_fields

SIDECAR = "tokenizer.gguf"
CHAT_TEMPLATE_KEY = "tokenizer.chat_template"
# gguf.TokenType values (llama.cpp's llama_token_type), spelled out so that
# reading needs no gguf import.
NORMAL = 1
UNKNOWN = 2
CONTROL = 3
USER_DEFINED = 4
UNUSED = 5
BYTE = 6
_SPECIAL_TYPES = (UNKNOWN, CONTROL, USER_DEFINED)

# The pre-tokenizer regexes of llama.cpp's llama-vocab.cpp for the
# tokenizer.ggml.pre names we reproduce.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
PRE_TOKENIZER_REGEXES = {"gpt-2": (_GPT2,), "llama-bpe": (_LLAMA3,), "llama3": (_LLAMA3,),
                         "llama-v3": (_LLAMA3,), "qwen2": (_QWEN2,), "smollm": (r"\p{N}", _GPT2)}
# llama.cpp emits a whole pre-tokenized word when it is a token (ignore_merges) and adds
# BOS by default for these.
_LLAMA3_NAMES = ("llama-bpe", "llama3", "llama-v3")

PROBE_TEXTS = (
    "The capital of France is",
    "Hello world! How are you doing today?",
    "Café naïve façade: déjà vu, Ångström, Øre, straße, İstanbul, ﬁne",
    "東京は日本の首都です。你好，世界！한국어 텍스트",
    "Ελληνικά, Русский язык, العربية, हिन्दी, ไทย",
    "Emoji: 🦙❤️👍🏽 👩‍👩‍👧‍👦 🇫🇷 ✨",
    "def f(x):\n    return x ** 2  # square\n\n\tif a != b:\n\t\tprint('ok', {\"k\": [1, 2]})",
    "  two leading spaces, trailing spaces   ",
    "a  b   c    d\n\ne\n\n\nf\r\ng\t\th",
    " \n \n\n  \t \u00a0 \u3000 end",
    "0 12 345 6789 1234567890 3.14159 1,000,000 -42 2024-01-01",
    "I'm, you're, it's, we'll, they've, she'd, DON'T, O'Neil's",
    "<0x41> ▁ <unk> < | > [INST] {{ }} ###",
    "x" * 3 + "-" * 40 + "=" * 17 + "\n" * 40 + " " * 40 + "\t" * 35 + ".",
)


@dataclass(frozen=True)
class GgufVocab:
    """What llama.cpp reads from ``tokenizer.*``: the model, the pieces and the
    special-token settings."""

    model: str
    pre: str | None
    tokens: list
    types: list
    scores: list | None
    merges: list | None
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_template: str | None

    def describe(self) -> str:
        return f"model {self.model}, pre {self.pre or 'none'}"


def _value(fields: dict, name: str, default=None):
    field = fields.get(f"tokenizer.ggml.{name}")
    return default if field is None else field.value


def _token_id(fields: dict, name: str, default: int | None, n_tokens: int) -> int | None:
    """A special token id as llama.cpp resolves it: the file's id, else the
    model's default, if in range."""
    token_id = _value(fields, name, default)
    return token_id if token_id is not None and 0 <= token_id < n_tokens else None


def vocab_from_fields(fields: dict[str, Field]) -> GgufVocab:
    """The tokenizer settings, with llama.cpp's defaults (llama-vocab.cpp) for the
    keys a file leaves out."""
    model = _value(fields, "model")
    tokens = _value(fields, "tokens")
    if model is None or not tokens:
        raise UserError("the GGUF file has no tokenizer (tokenizer.ggml.model and tokens); it "
                        "cannot be trained or exported with its own tokenizer")
    pre = _value(fields, "pre")
    spm = model == "llama"
    n_tokens = len(tokens)
    return GgufVocab(
        model=model, pre=pre, tokens=tokens,
        types=_value(fields, "token_type", [NORMAL] * n_tokens), scores=_value(fields, "scores"),
        merges=_value(fields, "merges"),
        bos_id=_token_id(fields, "bos_token_id", 1 if spm else 11, n_tokens),
        eos_id=_token_id(fields, "eos_token_id", 2 if spm else 11, n_tokens),
        unk_id=_token_id(fields, "unknown_token_id", 0 if spm else None, n_tokens),
        pad_id=_token_id(fields, "padding_token_id", None, n_tokens),
        add_bos=bool(_value(fields, "add_bos_token", spm or pre in _LLAMA3_NAMES)),
        add_eos=bool(_value(fields, "add_eos_token", False)),
        add_space_prefix=bool(_value(fields, "add_space_prefix", spm)),
        chat_template=fields[CHAT_TEMPLATE_KEY].value if CHAT_TEMPLATE_KEY in fields else None,
    )


def _cannot(vocab: GgufVocab, why: str) -> UserError:
    return UserError(f"this GGUF's tokenizer ({vocab.describe()}) cannot be reproduced exactly: "
                     f"{why}; convert from the HF checkpoint instead")


def _spm_merges(vocab: GgufVocab) -> list[tuple[str, str]]:
    """Every (left, right) split of every piece whose halves are pieces, best-scored piece first.

    This is llama.cpp's SentencePiece rule (merge the adjacent pair whose concatenation is the
    highest-scoring piece) as a BPE merge list, the way transformers' SentencePieceExtractor
    derives merges from scores.
    """
    ids = {token: index for index, token in enumerate(vocab.tokens)}
    scores = vocab.scores or [0.0] * len(vocab.tokens)
    ranked = []
    for index, piece in enumerate(vocab.tokens):
        for cut in range(1, len(piece)):
            if piece[:cut] in ids and piece[cut:] in ids:
                ranked.append((-scores[index], index, cut))
    ranked.sort()
    return [(vocab.tokens[index][:cut], vocab.tokens[index][cut:]) for _, index, cut in ranked]


def _vocab_ids(vocab: GgufVocab) -> dict[str, int]:
    ids = {}
    for index, token in enumerate(vocab.tokens):
        if token in ids:
            raise _cannot(vocab, f"token {token!r} appears twice (ids {ids[token]} and {index})")
        ids[token] = index
    return ids


def _spm_backend(vocab: GgufVocab):
    """SentencePiece BPE with byte fallback; spaces as "▁", prefixed per text fragment
    when the file says so."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else None
    model = models.BPE(vocab=_vocab_ids(vocab), merges=_spm_merges(vocab), unk_token=unk,
                       byte_fallback=True, fuse_unk=False)
    backend = Tokenizer(model)
    replace = normalizers.Replace(" ", "▁")
    backend.normalizer = (normalizers.Sequence([normalizers.Prepend("▁"), replace])
                          if vocab.add_space_prefix else replace)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)]
                                                 if vocab.add_space_prefix else []))
    return backend


def _bpe_merges(vocab: GgufVocab) -> list[tuple[str, str]]:
    """The file's merges, split at the first space after the first character (as
    llama.cpp splits them)."""
    merges = []
    for merge in vocab.merges or []:
        cut = merge.find(" ", 1)
        if cut < 0:
            raise _cannot(vocab, f"merge {merge!r} has no space")
        merges.append((merge[:cut], merge[cut + 1:]))
    return merges


def _bpe_backend(vocab: GgufVocab):
    """Byte-level BPE split first by llama.cpp's regexes for ``tokenizer.ggml.pre``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    regexes = PRE_TOKENIZER_REGEXES.get(vocab.pre or "")
    if regexes is None:
        raise _cannot(vocab, f"pre-tokenizer '{vocab.pre}' is not one we reproduce "
                             f"({', '.join(PRE_TOKENIZER_REGEXES)})")
    model = models.BPE(vocab=_vocab_ids(vocab), merges=_bpe_merges(vocab),
                       ignore_merges=vocab.pre in _LLAMA3_NAMES)
    backend = Tokenizer(model)
    splits = [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in regexes]
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def _add_special_tokens(backend, vocab: GgufVocab) -> None:
    """CONTROL/UNKNOWN tokens as special added tokens, USER_DEFINED as plain ones: all
    matched on the raw text."""
    from tokenizers import AddedToken

    special = []
    plain = []
    for index, kind in enumerate(vocab.types):
        if kind in _SPECIAL_TYPES and vocab.tokens[index]:
            token = AddedToken(vocab.tokens[index], special=kind != USER_DEFINED, normalized=False)
            (plain if kind == USER_DEFINED else special).append(token)
    backend.add_special_tokens(special)
    backend.add_tokens(plain)


def _post_processor(vocab: GgufVocab):
    """BOS/EOS added around the text exactly when llama.cpp adds them (``add_special``)."""
    from tokenizers import processors

    single = ["$A"]
    specials = []
    if vocab.add_bos and vocab.bos_id is not None:
        single.insert(0, vocab.tokens[vocab.bos_id])
        specials.append((vocab.tokens[vocab.bos_id], vocab.bos_id))
    if vocab.add_eos and vocab.eos_id is not None:
        single.append(vocab.tokens[vocab.eos_id])
        specials.append((vocab.tokens[vocab.eos_id], vocab.eos_id))
    pair = [part for part in single if part != "$A"]
    pair.insert(1 if single[0] != "$A" else 0, "$A $B:1")
    return processors.TemplateProcessing(single=" ".join(single), pair=" ".join(pair),
                                         special_tokens=specials)


def _role_token(vocab: GgufVocab, token_id: int | None) -> str | None:
    return None if token_id is None else vocab.tokens[token_id]


def build_tokenizer(vocab: GgufVocab):
    """A transformers fast tokenizer equal to llama.cpp's for ``vocab`` (unchecked;
    see load_gguf_tokenizer)."""
    from transformers import PreTrainedTokenizerFast

    if vocab.model == "llama":
        backend = _spm_backend(vocab)
    elif vocab.model == "gpt2":
        backend = _bpe_backend(vocab)
    else:
        raise _cannot(vocab, f"tokenizer model '{vocab.model}' is not SentencePiece (llama) or "
                      f"byte-level BPE (gpt2)")
    _add_special_tokens(backend, vocab)
    backend.post_processor = _post_processor(vocab)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=_role_token(vocab, vocab.bos_id),
        eos_token=_role_token(vocab, vocab.eos_id), unk_token=_role_token(vocab, vocab.unk_id),
        pad_token=_role_token(vocab, vocab.pad_id), chat_template=vocab.chat_template,
        clean_up_tokenization_spaces=False)


def probe_texts(vocab: GgufVocab, per_text: int = 64) -> list[str]:
    """:data:`PROBE_TEXTS`, then every special token string (``per_text`` to a
    text) between plain words."""
    specials = [vocab.tokens[i] for i, kind in enumerate(vocab.types)
                if kind in _SPECIAL_TYPES and vocab.tokens[i]]
    chunks = [specials[start:start + per_text] for start in range(0, len(specials), per_text)]
    return list(PROBE_TEXTS) + [f"Hi {' x '.join(chunk)} end" for chunk in chunks]


def _first_difference(expected: list[int], got: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b),
                min(len(expected), len(got)))


class _LlamaVocab:
    """llama.cpp's tokenizer for a file, its vocabulary loaded without weights
    or a context, quietly."""

    def __init__(self, llama_cpp, path: Path):
        self.llama_cpp = llama_cpp
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise UserError(f"llama.cpp cannot read {path}; export or download the GGUF file again")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        data = text.encode("utf-8")
        buffer = (self.llama_cpp.llama_token * (len(data) + 8))()
        count = self.llama_cpp.llama_tokenize(self.vocab, data, len(data), buffer, len(buffer),
                                              add_special, True)
        return list(buffer[:count])

    def close(self) -> None:
        self.llama_cpp.llama_model_free(self.model)


def _open_llama_cpp(path: Path) -> _LlamaVocab | None:
    """llama.cpp with the file's vocabulary only, or None without llama-cpp-python;
    its load log silenced."""
    import logging

    try:
        import llama_cpp
    except ImportError:
        return None
    # llama-cpp-python prints llama.cpp's log through it
    logger = logging.getLogger("llama-cpp-python")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        return _LlamaVocab(llama_cpp, path)
    finally:
        logger.setLevel(level)


def check_against_llama_cpp(tokenizer, path: Path, vocab: GgufVocab) -> int:
    """Refuse ``tokenizer`` unless it gives llama.cpp's ids on every probe text;
    returns the texts compared.

    Compared with and without special tokens added (BOS/EOS), special token text parsed as in chat
    prompts. Returns 0 when llama-cpp-python is not installed (nothing to compare against).
    """
    llm = _open_llama_cpp(path)
    if llm is None:
        return 0
    texts = probe_texts(vocab)
    try:
        for add_special in (True, False):
            ours = tokenizer(texts, add_special_tokens=add_special)["input_ids"]
            for text, got in zip(texts, ours):
                _compare(vocab, text, llm.tokenize(text, add_special), got)
    finally:
        llm.close()
    return len(texts)


def _compare(vocab: GgufVocab, text: str, expected: list[int], got: list[int]) -> None:
    if got != expected:
        at = _first_difference(expected, got)
        raise _cannot(vocab, f"on {text[:40]!r} llama.cpp gives {expected[at:at + 4]} at token "
                             f"{at}, we would give {got[at:at + 4]}")


def load_gguf_tokenizer(path: Path):
    """The fast tokenizer of the .gguf at ``path``, proven equal to llama.cpp's
    (one-line UserError if not)."""
    path = Path(path)
    vocab = vocab_from_fields(read_fields(path))
    tokenizer = build_tokenizer(vocab)
    check_against_llama_cpp(tokenizer, path, vocab)
    return tokenizer


def write_sidecar(source: Path, directory: Path) -> Path:
    """Copy the ``tokenizer.*`` key/values of ``source`` (a .gguf, or a sidecar) verbatim
    into ``directory/tokenizer.gguf``: a GGUF v3 file with no tensors, readable by gguf-py
    and by :func:`read_fields`."""
    fields = read_fields(Path(source))
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, len(fields))
    body = header + b"".join(field.raw for field in fields.values())
    padding = b"\0" * (-len(body) % 32)  # the (empty) tensor data section starts aligned
    out = Path(directory) / SIDECAR
    write_bytes_atomic(out, body + padding)
    return out


def _typed_value(field: Field):
    """``field``'s value as gguf-py's writer packs it back to the same bytes
    (strings as their raw bytes)."""
    if field.type == _STRING:
        return field.value.encode("utf-8", "surrogateescape")
    if field.item_type == _STRING:
        return [item.encode("utf-8", "surrogateescape") for item in field.value]
    return field.value


def add_tokenizer_fields(writer, sidecar: Path, vocab_size: int, chat_template: str | None) -> None:
    """Write the sidecar's ``tokenizer.*`` fields into a gguf-py writer, byte for byte, then
    ``chat_template`` (when not None) in place of the file's own."""
    import gguf

    fields = read_fields(Path(sidecar))
    tokens = fields.get("tokenizer.ggml.tokens")
    if tokens is None or len(tokens.value) != vocab_size:
        count = 0 if tokens is None else len(tokens.value)
        raise UserError(f"{sidecar} has {count} tokens but the model has {vocab_size} embedding "
                        "rows; the sidecar does not belong to this model (delete it to export the "
                        "tokenizer.json)")
    for key, field in fields.items():
        if key == CHAT_TEMPLATE_KEY and chat_template is not None:
            continue
        item_type = None if field.item_type is None else gguf.GGUFValueType(field.item_type)
        writer.add_key_value(key, _typed_value(field), gguf.GGUFValueType(field.type),
                             sub_type=item_type)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
