"""llama.cpp backend (llama-cpp-python) for GGUF artifacts: llama.cpp's tokenizer, its KV
cache, our loop on top; LoRA adapter GGUFs applied to the base and swapped without reloading it."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np

from slm_align.errors import UserError
from slm_align.ondevice.agent.call_rule import CallVocabulary, call_vocabulary, restrict, rule_acts
from slm_align.ondevice.agent.llama_open import TEMPLATE_KEY, open_llama
from slm_align.ondevice.devices.host import default_threads


class LlamaCppBackend:
    """One llama.cpp context. ``all_logits`` keeps every position's logits (for
    teacher-forced comparisons); ``adapters``: LoRA adapter GGUFs applied to the base, in order, at
    scale 1 (see :meth:`set_adapters`)."""

    kind = "gguf"

    def __init__(self, artifact: Path, threads: Optional[int] = None, n_ctx: Optional[int] = None,
                 all_logits: bool = False, adapters: Sequence[Path] = ()):
        try:
            import llama_cpp  # noqa: F401 (present: the file is opened below)
        except ImportError:
            raise UserError("GGUF artifacts need llama-cpp-python: pip "
                            "install 'slm-align[agent]'") from None
        artifact = Path(artifact)
        if not artifact.is_file():
            raise UserError(f"GGUF file {artifact} not found; create one with "
                            "`slm-align export --target gguf`")
        self.artifact = artifact
        self.adapters: list[dict] = []
        """The adapters applied now, in order: ``{"file": name, "sha256": digest}`` each."""
        self._loaded: dict[str, object] = {}
        checked = [self._check_adapter(path) for path in adapters]  # refused before llama.cpp reads a byte
        threads = threads or default_threads()  # llama.cpp's own: half the CPUs, busy or not
        try:
            self.llm = open_llama(artifact, n_ctx=n_ctx or 0, n_threads=threads, n_threads_batch=threads,
                                  n_batch=512, logits_all=all_logits, verbose=False)
        except ValueError as exc:
            raise UserError(f"llama.cpp cannot load {artifact} ({exc}); "
                            "the file is corrupt or not a GGUF model") from None
        self.all_logits = all_logits
        self.n_ctx = min(self.llm.n_ctx(), len(self.llm.input_ids))  # llama.cpp pads the context it allocates
        self.vocab_size = self.llm.n_vocab()
        meta = self.llm.metadata
        self.chat_template = self.llm.chat_templates.get(TEMPLATE_KEY)  # compiled only in our sandbox
        self.chat_template_origin = "artifact" if self.chat_template else None
        self.eos_ids = {self.llm.token_eos()}
        if "tokenizer.ggml.eot_token_id" in meta:
            self.eos_ids.add(int(meta["tokenizer.ggml.eot_token_id"]))
        self.bos_token = self._piece(self.llm.token_bos())
        self.eos_token = self._piece(self.llm.token_eos())
        if checked:
            self._apply(checked)

    def _check_adapter(self, path: Path) -> tuple[Path, str]:
        """``path`` as (path, sha256) once it is a LoRA adapter GGUF made for this base (one line if not)."""
        from slm_align.ondevice.gguf.adapter_check import check_adapter_base
        from slm_align.runs import sha256_file

        path = Path(path)
        if not path.is_file():
            raise UserError(f"adapter {path} not found; export one with `slm-align export RUN --target gguf-adapter`")
        digest = sha256_file(path)
        if digest not in self._loaded:  # a loaded one passed already: a swap back reads no header again
            check_adapter_base(path, self.artifact)
        return path, digest

    def set_adapters(self, adapters: Sequence[Path]) -> list[dict]:
        """Apply ``adapters`` (LoRA adapter GGUFs, in order, scale 1; none: the base alone) in place of
        the current ones, the base staying loaded; each is checked against the base first and loaded
        once (a swap back reuses it). The KV cache is dropped: it was computed with the old weights.
        Returns :attr:`adapters`."""
        self._apply([self._check_adapter(path) for path in adapters])
        return self.adapters

    def _apply(self, checked: list[tuple[Path, str]]) -> None:
        import ctypes

        import llama_cpp

        handles = []
        for path, digest in checked:
            if digest not in self._loaded:  # llama.cpp frees loaded adapters with the model
                handle = llama_cpp.llama_adapter_lora_init(self.llm.model, str(path).encode("utf-8"))
                if not handle:
                    raise UserError(f"llama.cpp cannot load the adapter {path}; export it again")
                self._loaded[digest] = handle
            handles.append(self._loaded[digest])
        array = (llama_cpp.llama_adapter_lora_p_ctypes * len(handles))(*handles)
        scales = (ctypes.c_float * len(handles))(*([1.0] * len(handles)))
        if llama_cpp.llama_set_adapters_lora(self.llm.ctx, array, len(handles), scales):
            raise UserError(f"llama.cpp cannot apply the adapters to {self.artifact.name}; export them again")
        self.llm.reset()
        self.adapters = [{"file": path.name, "sha256": digest} for path, digest in checked]

    def adapter_handles(self) -> list:
        """llama.cpp's handles of the adapters applied now, in order (another context on this model
        applies the same ones: :class:`~slm_align.ondevice.agent.llama_batch.LlamaBatchDecoder`)."""
        return [self._loaded[entry["sha256"]] for entry in self.adapters]

    def release_unused(self) -> None:
        """Free the llama.cpp handles of loaded adapters not applied now (a swap back loads them again)."""
        import llama_cpp

        applied = {entry["sha256"] for entry in self.adapters}
        for digest in [digest for digest in self._loaded if digest not in applied]:
            llama_cpp.llama_adapter_lora_free(self._loaded.pop(digest))

    def _piece(self, token: int) -> Optional[str]:
        return None if token < 0 else self.detokenize([token])

    def tokenize(self, text: str, add_special: bool = True, special: bool = True) -> list[int]:
        """llama.cpp's tokenizer; with ``special`` special-token text (``<|im_end|>``)
        becomes the special token."""
        return self.llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.llm.detokenize(list(ids), special=True).decode("utf-8", errors="replace")

    def reset(self) -> None:
        self.llm.reset()

    @property
    def n_past(self) -> int:
        return self.llm.n_tokens

    def feed_all(self, ids: Sequence[int]) -> np.ndarray:
        """Append ``ids``; the logits at each of their positions (needs ``all_logits=True``)."""
        if not self.all_logits:
            raise ValueError("feed_all needs a backend opened with all_logits=True")
        start = self.llm.n_tokens
        self._eval(ids)
        return np.array(self.llm.scores[start:self.llm.n_tokens], dtype=np.float32)

    def feed(self, ids: Sequence[int]) -> np.ndarray:
        """Append ``ids``; the logits for the next token, shape (vocab,)."""
        self._eval(ids)
        if self.all_logits:
            return np.array(self.llm.scores[self.llm.n_tokens - 1], dtype=np.float32)
        return self.last_logits()

    def last_logits(self) -> np.ndarray:
        """The logits of the last position evaluated: inside ``generate``, those its
        last token was drawn from."""
        import llama_cpp

        row = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)  # only the last position has logits
        return np.ctypeslib.as_array(row, shape=(self.vocab_size,)).copy()

    def generate(self, prompt: Sequence[int], params, grammar: Optional[str] = None) -> Iterator[int]:
        """llama.cpp's own sampler chain (and grammar); the cache of a shared prefix is reused;
        ``params.call_threshold`` applies the call rule first in the chain (:class:`CallRuleProcessor`)."""
        if len(prompt) >= self.n_ctx:
            raise UserError(f"context window of {self.n_ctx} tokens exceeded; "
                            "start a new conversation")
        from llama_cpp import LlamaGrammar, LogitsProcessorList

        self.llm.set_seed(params.seed)
        rule = None
        if params.call_threshold is not None:
            rule = LogitsProcessorList([CallRuleProcessor(len(prompt), params.call_threshold, call_vocabulary(self))])
        return self.llm.generate(list(prompt), top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
                                 temp=params.temperature, repeat_penalty=params.repeat_penalty,
                                 frequency_penalty=params.frequency_penalty, presence_penalty=params.presence_penalty,
                                 grammar=LlamaGrammar.from_string(grammar, verbose=False) if grammar else None,
                                 logits_processor=rule)

    def _eval(self, ids: Sequence[int]) -> None:
        if not ids:
            raise ValueError("feed needs at least one token")
        if self.llm.n_tokens + len(ids) > self.n_ctx:
            raise UserError(f"context window of {self.n_ctx} tokens exceeded; "
                            "start a new conversation")
        self.llm.eval(list(ids))


class CallRuleProcessor:
    """The call rule (:mod:`~slm_align.ondevice.agent.call_rule`) as llama-cpp-python's logits processor: it
    sees the context's ids and the candidates' logits in id order (the first sampler of the chain)."""

    def __init__(self, prompt_length: int, threshold: float, vocabulary: CallVocabulary):
        self.prompt_length = prompt_length
        self.threshold = threshold
        self.vocabulary = vocabulary

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        if not rule_acts(self.threshold, self.vocabulary, input_ids[self.prompt_length:].tolist()):
            return scores
        scores = np.array(scores)
        restrict(scores, self.threshold, self.vocabulary)
        return scores
