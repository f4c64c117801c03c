"""The tokenizer part of a GGUF file we write: which vocabulary goes in, and how.

In order of preference:

1. the model directory carries ``tokenizer.gguf`` (the model came from a GGUF file, see
   :func:`slm_align.modeling.models.save_tokenizer`): its ``tokenizer.*`` fields are copied byte for
   byte, so the export tokenises exactly as the source did. Only the chat template may change (an
   override, or the directory's own);
2. ``tokenizer.json`` is SentencePiece-style BPE (byte fallback, "▁" for spaces: Gemma, Llama 2):
   written as llama.cpp's ``llama`` tokenizer with token types, ``add_space_prefix``, and scores
   that make llama.cpp's best-scored-piece-first merging follow the merge order the HF tokenizer
   applies;
3. otherwise byte-level BPE (``gpt2``): tokens, merges, and the pre-tokenizer under the name
   llama.cpp knows.

Special token ids, add-BOS/EOS flags and the chat template come from the directory's tokenizer
files, the flags written explicitly because llama.cpp's defaults differ between tokenizer models.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from slm_align.errors import UserError
from slm_align.ondevice.gguf.tokenizer import SIDECAR, add_tokenizer_fields

# The pre-tokenizer regexes llama.cpp knows by name, recognised by a fragment only that regex has.
_PRE_TOKENIZERS = ((r"\p{N}{1,3}", "llama-bpe"), (r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| "
                                                  r"?[^\s\p{L}\p{N}]+", "qwen2"))
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# Score of a multi-character piece no merge produces: HF never forms it, so
# llama.cpp should form it last.
_UNMERGED_SCORE = -1e9


def pre_tokenizer_name(tokenizer_json: dict) -> str:
    """The name llama.cpp gives this tokenizer's pre-tokenizer (it decides how
    text is split before BPE)."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [part.get("type") for part in parts]
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits"):
        return "smollm"
    if kinds and kinds[0] == "Split":
        pattern = parts[0].get("pattern", {}).get("Regex", "")
        for fragment, name in _PRE_TOKENIZERS:
            if fragment in pattern:
                return name
    raise UserError("GGUF export does not know this tokenizer's pre-tokenizer "
                    f"({' + '.join(map(str, kinds))}); llama.cpp would split text differently from "
                    "the trained model. Export to ONNX instead")


def add_vocab(writer, model_dir: Path, vocab_size: int, chat_template: str | None) -> None:
    """Write the model's tokenizer into ``writer`` (see the module doc for which one)."""
    sidecar = model_dir / SIDECAR
    if sidecar.is_file():
        template = chat_template if chat_template is not None else _directory_chat_template(model_dir)
        add_tokenizer_fields(writer, sidecar, vocab_size, template)
        return
    tokenizer_json = _tokenizer_json(model_dir)
    if tokenizer_json.get("model", {}).get("byte_fallback"):
        _add_sentencepiece_vocab(writer, model_dir, tokenizer_json, vocab_size, chat_template)
    else:
        _add_byte_level_vocab(writer, model_dir, tokenizer_json, vocab_size, chat_template)


def _directory_chat_template(model_dir: Path) -> str | None:
    """The chat template transformers saved beside the tokenizer (its own file, or in
    tokenizer_config.json)."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    config = model_dir / "tokenizer_config.json"
    template = json.loads(config.read_text(encoding="utf-8")).get("chat_template") if config.is_file() else None
    return template if isinstance(template, str) else None


def _tokenizer_json(model_dir: Path) -> dict:
    try:
        tokenizer_json = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError) as exc:
        raise UserError(f"{model_dir}: no tokenizer.json to convert ({exc}); GGUF export needs the "
                        "model's fast tokenizer saved beside the weights") from None
    if tokenizer_json.get("model", {}).get("type") != "BPE":
        raise UserError(f"{model_dir}: GGUF export converts BPE tokenizers (byte-level or "
                        f"SentencePiece-style), not {tokenizer_json.get('model', {}).get('type')}; "
                        f"export to ONNX instead")
    return tokenizer_json


def _special_vocab(model_dir: Path, n_vocab: int | None = None, load_merges: bool = False):
    """gguf-py's reading of the directory's special token ids, add flags, chat template
    (and merges if asked)."""
    import gguf

    return gguf.SpecialVocab(model_dir, load_merges=load_merges, n_vocab=n_vocab)


def _add_special(writer, model_dir: Path, n_vocab: int, chat_template: str | None,
                 merges: bool) -> None:
    """Special ids, template, add-BOS/EOS flags, and the merges when ``merges``
    (byte-level BPE needs them)."""
    special_vocab = _special_vocab(model_dir, n_vocab, load_merges=merges)
    if "bos" not in special_vocab.special_token_ids and "eos" in special_vocab.special_token_ids:
        special_vocab.special_token_ids["bos"] = special_vocab.special_token_ids["eos"]
    if chat_template is not None:
        special_vocab.chat_template = chat_template
    special_vocab.add_to_gguf(writer, quiet=True)
    adds_bos, adds_eos = _adds_bos_eos(model_dir)
    if "bos" not in special_vocab.add_special_token:
        # say it explicitly: readers default differently
        writer.add_add_bos_token(adds_bos)
    if "eos" not in special_vocab.add_special_token:
        writer.add_add_eos_token(adds_eos)


def _adds_bos_eos(model_dir: Path) -> tuple[bool, bool]:
    """Whether the HF tokenizer puts BOS before and EOS after a text when asked
    to add special tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer("a")["input_ids"]
    adds_bos = tokenizer.bos_token_id is not None and ids[:1] == [tokenizer.bos_token_id]
    adds_eos = tokenizer.eos_token_id is not None and ids[-1:] == [tokenizer.eos_token_id]
    return bool(adds_bos), bool(adds_eos)


def _padded(tokens: list, types: list, vocab_size: int) -> None:
    """Embedding rows beyond the tokenizer get unused padding tokens, so that
    llama.cpp's vocabulary fits them."""
    import gguf

    for index in range(len(tokens), vocab_size):
        tokens.append(f"[PAD{index}]")
        types.append(gguf.TokenType.UNUSED)


def _add_byte_level_vocab(writer, model_dir: Path, tokenizer_json: dict, vocab_size: int,
                          chat_template: str | None) -> None:
    """Byte-level BPE: tokens, types (special tokens as CONTROL), merges, pre-tokenizer,
    special ids, template."""
    import gguf

    try:
        vocab = gguf.BpeVocab(model_dir)
    except (FileNotFoundError, ValueError) as exc:
        raise UserError(f"{model_dir}: no byte-level BPE tokenizer.json to convert ({exc}); GGUF "
                        "export needs the model's fast tokenizer saved beside the "
                        "weights") from None
    added = {item["id"]: item for item in tokenizer_json.get("added_tokens", [])}
    tokens = []
    types = []
    for index, (text, _score, kind) in enumerate(vocab.all_tokens()):
        tokens.append(text)
        types.append(_added_token_type(added[index]) if index in added else kind)
    _padded(tokens, types, vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer_name(tokenizer_json))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    _add_special(writer, model_dir, len(tokens), chat_template, merges=True)


def _merge_scores(tokenizer_json: dict) -> dict[str, float]:
    """HF applies merges by rank, llama.cpp by the merged piece's score: a piece scores minus the
    rank of the first merge that makes it (ranks stay exact in float32 below 2**24)."""
    scores: dict[str, float] = {}
    for rank, merge in enumerate(tokenizer_json["model"].get("merges", [])):
        pair = merge.split(" ", 1) if isinstance(merge, str) else merge
        scores.setdefault("".join(pair), -float(rank))
    return scores


def _added_token_type(item: dict) -> int:
    """llama.cpp's type for an added token of a byte-level BPE, as its converter decides: CONTROL
    when special or looking special (``<|...|>``), else USER_DEFINED (Qwen2.5's ``<tool_call>``).
    gguf-py's BpeVocab calls every added token CONTROL, which llama.cpp would then not match in text
    tokenised without special tokens."""
    import gguf

    text = item["content"]
    if item.get("special") or (text.startswith("<|") and text.endswith("|>")):
        return gguf.TokenType.CONTROL
    return gguf.TokenType.USER_DEFINED


def _sentencepiece_pieces(tokenizer_json: dict) -> tuple[list[str], list[int]]:
    """Pieces by id, with llama.cpp's token types: special added tokens CONTROL, other added tokens
    USER_DEFINED, ``<0xXX>`` BYTE, the unknown token UNKNOWN, the rest NORMAL."""
    import gguf

    by_id = {index: text for text, index in tokenizer_json["model"]["vocab"].items()}
    added = {item["id"]: item for item in tokenizer_json.get("added_tokens", [])}
    by_id.update({index: item["content"] for index, item in added.items()})
    unk = tokenizer_json["model"].get("unk_token")
    tokens = []
    types = []
    for index in range(max(by_id) + 1):
        text = by_id.get(index, f"[PAD{index}]")
        tokens.append(text)
        if index in added:
            types.append(gguf.TokenType.CONTROL if added[index].get("special")
                         else gguf.TokenType.USER_DEFINED)
        elif index not in by_id:
            types.append(gguf.TokenType.UNUSED)
        elif _BYTE_TOKEN.fullmatch(text):
            types.append(gguf.TokenType.BYTE)
        else:
            types.append(gguf.TokenType.UNKNOWN if text == unk else gguf.TokenType.NORMAL)
    return tokens, types


def _piece_score(text: str, kind: int, merge_scores: dict[str, float]) -> float:
    import gguf

    if text in merge_scores:
        return merge_scores[text]
    if kind in (gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED, gguf.TokenType.UNKNOWN):
        return -1000.0  # as llama.cpp's converter scores them; they never take part in merging
    return 0.0 if len(text) == 1 or kind == gguf.TokenType.BYTE else _UNMERGED_SCORE


def _adds_space_prefix(tokenizer_json: dict) -> bool:
    """Whether the tokenizer puts "▁" before the text: a Prepend normalizer, or a
    Metaspace that prepends."""
    normalizer = tokenizer_json.get("normalizer") or {}
    if any(step.get("type") == "Prepend" for step in normalizer.get("normalizers", [normalizer])):
        return True
    pre = tokenizer_json.get("pre_tokenizer") or {}
    for part in pre.get("pretokenizers", [pre]):
        default = "always" if part.get("add_prefix_space", True) else "never"
        if part.get("type") == "Metaspace" and part.get("prepend_scheme", default) != "never":
            return True
    return False


def _add_sentencepiece_vocab(writer, model_dir: Path, tokenizer_json: dict, vocab_size: int,
                             chat_template: str | None) -> None:
    """SentencePiece-style BPE as llama.cpp's ``llama`` tokenizer: pieces,
    scores, types, space prefix."""
    tokens, types = _sentencepiece_pieces(tokenizer_json)
    merge_scores = _merge_scores(tokenizer_json)
    scores = [_piece_score(text, kind, merge_scores) for text, kind in zip(tokens, types)]
    _padded(tokens, types, vocab_size)
    scores.extend([-1000.0] * (len(tokens) - len(scores)))
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_add_space_prefix(_adds_space_prefix(tokenizer_json))
    _add_special(writer, model_dir, len(tokens), chat_template, merges=False)
