"""onnxruntime backend: optimum's decoder graph with the KV cache, driven by our own numpy loop.

The graph takes ``input_ids``, ``attention_mask``, (``position_ids``) and
``past_key_values.N.key/value`` and returns ``logits`` and ``present.N.key/value``; we keep the
presents as the next step's past. Text goes through the ``tokenizers`` library with the artifact's
``tokenizer.json``, exactly as the trained model's fast tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np

from slm_align.errors import UserError
from slm_align.ondevice.agent.decode import numpy_generate
from slm_align.ondevice.devices.host import default_threads

_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_text(value) -> Optional[str]:
    """Special tokens are saved either as strings or as AddedToken dicts."""
    return value.get("content") if isinstance(value, dict) else value


def _empty_cache_dim(dim):
    """One axis of an empty past-key/value input: batch 1, every other named (dynamic) axis
    0, fixed axes as given."""
    if dim == "batch_size":
        return 1
    if isinstance(dim, str):
        return 0
    return dim


class OnnxBackend:
    """One decoder session and its cache. Not thread-safe: one conversation at a time."""

    kind = "onnx"

    def __init__(self, artifact: Path, threads: Optional[int] = None, n_ctx: Optional[int] = None):
        import onnxruntime as ort
        from tokenizers import Tokenizer

        artifact = Path(artifact)
        model_file = next((artifact / name for name in ("model.onnx", "model.ort") if (artifact / name).is_file()),
                          None)
        if model_file is None or not (artifact / "tokenizer.json").is_file():
            raise UserError(f"{artifact} is not an ONNX export (needs model.onnx and tokenizer.json); "
                            "create one with `slm-align export --target onnx`")
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads or default_threads()  # onnxruntime's own: every physical core
        self.session = ort.InferenceSession(str(model_file), options, providers=["CPUExecutionProvider"])
        self.tokenizer = Tokenizer.from_file(str(artifact / "tokenizer.json"))
        self._read_settings(artifact, n_ctx)
        self._inputs = {i.name: i for i in self.session.get_inputs()}
        self._past_names = [name for name in self._inputs if name.startswith("past_key_values.")]
        self._outputs = [o.name for o in self.session.get_outputs()]
        self.reset()

    def _read_settings(self, artifact: Path, n_ctx: Optional[int]) -> None:
        config = _read_json(artifact / "config.json")
        tokenizer_config = _read_json(artifact / "tokenizer_config.json")
        template_file = artifact / "chat_template.jinja"
        self.chat_template = (template_file.read_text(encoding="utf-8") if template_file.is_file()
                              else tokenizer_config.get("chat_template"))
        self.chat_template_origin = "artifact" if self.chat_template else None
        self.bos_token = _token_text(tokenizer_config.get("bos_token"))
        self.eos_token = _token_text(tokenizer_config.get("eos_token"))
        eos = _read_json(artifact / "generation_config.json").get("eos_token_id", config.get("eos_token_id"))
        if isinstance(eos, list):
            eos_ids = eos
        elif eos is not None:
            eos_ids = [eos]
        else:
            eos_ids = []
        self.eos_ids = set(eos_ids)
        if self.eos_token is not None and self.tokenizer.token_to_id(self.eos_token) is not None:
            self.eos_ids.add(self.tokenizer.token_to_id(self.eos_token))
        self.n_ctx = int(n_ctx or config.get("max_position_embeddings") or 2048)
        self.vocab_size = int(config.get("vocab_size") or self.tokenizer.get_vocab_size())

    # text
    def tokenize(self, text: str, add_special: bool = True, special: bool = True) -> list[int]:
        """The tokenizer's ids; without ``special``, special-token text is encoded
        as the characters it is."""
        self.tokenizer.encode_special_tokens = not special
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special).ids
        finally:
            self.tokenizer.encode_special_tokens = False

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    # cache
    def reset(self) -> None:
        """Forget the cache: the next ``feed`` starts a new sequence."""
        self.tokens: list[int] = []
        self._past = {}
        for name in self._past_names:
            meta = self._inputs[name]
            shape = [_empty_cache_dim(dim) for dim in meta.shape]
            self._past[name] = np.zeros(shape, dtype=_DTYPES.get(meta.type, np.float32))

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def rewind(self, keep: int) -> None:
        """Keep the cache of the first ``keep`` tokens only (a new prompt that
        shares them reuses it)."""
        if keep < len(self.tokens):
            self.tokens = self.tokens[:keep]
            self._past = {name: past[:, :, :keep] for name, past in self._past.items()}

    def generate(self, prompt: Sequence[int], params, grammar: Optional[str] = None) -> Iterator[int]:
        """Sampled continuation of ``prompt``, reusing the cache of a shared prefix
        (``grammar`` is llama.cpp's)."""
        return numpy_generate(self, prompt, params)

    def feed_all(self, ids: Sequence[int]) -> np.ndarray:
        """Append ``ids`` to the sequence; the logits at each of their positions,
        shape (len(ids), vocab)."""
        if not ids:
            raise ValueError("feed needs at least one token")
        if self.n_past + len(ids) > self.n_ctx:
            raise UserError(f"context window of {self.n_ctx} tokens exceeded; "
                            "start a new conversation")
        length = self.n_past + len(ids)
        position = self.n_past
        feeds = {"input_ids": np.asarray([ids], dtype=np.int64),
                 "attention_mask": np.ones((1, length), dtype=np.int64), **self._past}
        if "position_ids" in self._inputs:
            feeds["position_ids"] = np.arange(position, length, dtype=np.int64)[None, :]
        results = dict(zip(self._outputs, self.session.run(None, feeds)))
        for name in self._past_names:
            self._past[name] = results[name.replace("past_key_values.", "present.")]
        self.tokens.extend(int(i) for i in ids)
        return results["logits"][0].astype(np.float32, copy=False)

    def feed(self, ids: Sequence[int]) -> np.ndarray:
        """Append ``ids``; the logits for the next token, shape (vocab,)."""
        self._last_logits = self.feed_all(ids)[-1]
        return self._last_logits

    def last_logits(self) -> np.ndarray:
        """The logits of the last ``feed``: inside ``generate``, those its
        last token was drawn from."""
        return self._last_logits
