"""RL rollouts sampled by llama.cpp, the engine the device runs, instead of by PyTorch.

The policy's base (the merged SFT prior) is written once as a GGUF (F32, F16 or Q8_0); before each
rollout the current LoRA is written as a llama.cpp adapter GGUF (a few hundred KB to a few MB) and
swapped in on the loaded base, which is never reloaded. Each token is drawn from llama.cpp's own
logits at the run's temperature, and its log-probability there is kept: the trainer scores the same
ids in fp32 and :mod:`slm_align.rl.sampler_correction` weighs each token by how much the two engines
disagree.

Why our own loop over llama.cpp's logits and not ``Llama.create_completion``: the correction needs the
exact distribution each token was drawn from (pure temperature sampling, no top-k/top-p, no repeat
penalty), and its log-probability in full precision; the prompt's KV cache is shared by a group's
completions (llama.cpp keeps it; each completion rewinds to the prompt's end).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from slm_align.errors import UserError
from slm_align.export.gguf import write_gguf
from slm_align.export.gguf_adapter import write_lora_gguf
from slm_align.generation import Samples
from slm_align.modeling import save_tokenizer

BASE_TYPES = ("F32", "F16", "Q8_0")
"""Types the base GGUF is written in: F32 (no mismatch but rounding), F16 (the issue's "near zero"),
Q8_0 (what a phone runs; the mismatch the report prints)."""


def save_policy_base(policy, tokenizer, source, folder: Path) -> Path:
    """The policy's base weights (LoRA layers unwrapped, adapters left out) and its tokenizer as a
    plain model directory that the GGUF writer reads."""
    base = policy.get_base_model()
    state = {name.replace(".base_layer", ""): tensor for name, tensor in base.state_dict().items()
             if ".lora_" not in name}
    base.save_pretrained(folder, state_dict=state, safe_serialization=True)
    save_tokenizer(tokenizer, source, folder)
    return folder


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """(V,) log-probabilities of (V,) logits, in float64."""
    shifted = logits.astype(np.float64) - float(logits.max())
    return shifted - np.log(np.exp(shifted).sum())


def draw(logp: np.ndarray, rng: np.random.Generator) -> int:
    """A token drawn from (V,) log-probabilities by inverting their cumulative sum at one uniform number
    (``Generator.choice`` checks and normalises ``p`` each call: 10x slower on a 49k vocabulary)."""
    cumulative = np.cumsum(np.exp(logp))
    return int(min(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"), len(logp) - 1))


class LlamaSampler:
    """Completions of the current policy drawn by llama.cpp (see the module's doc)."""

    def __init__(self, policy, tokenizer, source, folder: Path, base_type: str = "F16", threads: int = 1,
                 n_ctx: int = 2048):
        try:
            import llama_cpp
        except ImportError:
            raise UserError("rl.sampler = llama_cpp needs llama-cpp-python: pip install 'slm-align[agent]'") from None
        if base_type not in BASE_TYPES:
            raise UserError(f"rl.sampler_base {base_type}: choose one of {', '.join(BASE_TYPES)}")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.base_dir = save_policy_base(policy, tokenizer, source, self.folder / "base")
        self.base_gguf = write_gguf(self.base_dir, self.folder / f"base-{base_type}.gguf", base_type)
        self._llama_cpp = llama_cpp
        self.llm = llama_cpp.Llama(model_path=str(self.base_gguf), n_ctx=n_ctx, n_threads=threads,
                                   n_threads_batch=threads, n_batch=512, logits_all=False, verbose=False)
        self.vocab = self.llm.n_vocab()
        self._adapter = None

    def refresh(self, policy) -> None:
        """Write the policy's LoRA as an adapter GGUF and apply it in place of the last one."""
        adapter_dir = self.folder / "adapter"
        policy.save_pretrained(adapter_dir)
        path = write_lora_gguf(adapter_dir, self.base_dir, self.folder / "adapter.gguf", "F32")
        lib = self._llama_cpp
        adapter = lib.llama_adapter_lora_init(self.llm.model, str(path).encode())
        if not adapter:
            raise UserError(f"llama.cpp could not load the policy's adapter {path}")
        adapters = (lib.llama_adapter_lora_p_ctypes * 1)(adapter)
        scales = (ctypes.c_float * 1)(1.0)
        lib.llama_set_adapters_lora(self.llm.ctx, adapters, 1, scales)
        if self._adapter is not None:
            lib.llama_adapter_lora_free(self._adapter)
        self._adapter = adapter

    def _logits(self) -> np.ndarray:
        """(V,) the logits after the last evaluated token, copied."""
        return np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.vocab,)).copy()

    def _complete(self, prompt: list[int], prompt_logits: np.ndarray, max_new_tokens: int, temperature: float,
                  eos: int, rng: np.random.Generator) -> tuple[list[int], list[float]]:
        """One completion after ``prompt`` (evaluated already): its ids and their log-probabilities."""
        self.llm.n_tokens = len(prompt)  # rewind to the prompt's end: its KV cache stays
        logits = prompt_logits
        ids: list[int] = []
        logprobs: list[float] = []
        for _ in range(max_new_tokens):
            logp = log_softmax(logits / temperature)
            token = draw(logp, rng)
            ids.append(token)
            logprobs.append(float(logp[token]))
            if token == eos or len(ids) == max_new_tokens:
                break
            self.llm.eval([token])
            logits = self._logits()
        return ids, logprobs

    def sample(self, tokenizer, prompts: list[str], max_new_tokens: int, temperature: float,
               seed: Optional[int]) -> Samples:
        """One completion per prompt, laid out as :func:`slm_align.generation.sample` lays them out
        (left-padded prompts, completions through their first EOS), with llama.cpp's log-probabilities."""
        rng = np.random.default_rng(seed)
        eos = tokenizer.eos_token_id
        encoded = [tokenizer(p, add_special_tokens=True)["input_ids"] or [eos] for p in prompts]
        drawn = []
        last_prompt: Optional[list[int]] = None
        prompt_logits = None
        for ids in encoded:
            if ids != last_prompt:  # a group's completions share the prompt's evaluation
                self.llm.reset()
                self.llm.eval(ids)
                prompt_logits = self._logits()
                last_prompt = ids
            drawn.append(self._complete(ids, prompt_logits, max_new_tokens, temperature, eos, rng))
        return layout(tokenizer, prompts, encoded, drawn, eos)

    def close(self) -> None:
        if self._adapter is not None:
            self._llama_cpp.llama_adapter_lora_free(self._adapter)
            self._adapter = None
        self.llm.close()


def layout(tokenizer, prompts: list[str], encoded: list[list[int]], drawn: list[tuple[list[int], list[float]]],
           eos: int) -> Samples:
    """The completions as :class:`Samples`: (B, P) left-padded prompts, (B, T) right-padded completions
    with their mask (through the first EOS) and log-probabilities (0 past the end), T the longest."""
    pad = tokenizer.pad_token_id
    width = max(len(ids) for ids in encoded)
    length = max(len(ids) for ids, _ in drawn)
    prompt_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in encoded])
    prompt_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded])
    completion_ids = torch.tensor([ids + [pad] * (length - len(ids)) for ids, _ in drawn])
    completion_mask = torch.tensor([[1] * len(ids) + [0] * (length - len(ids)) for ids, _ in drawn])
    logprobs = torch.tensor([lp + [0.0] * (length - len(lp)) for _, lp in drawn], dtype=torch.float32)
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids, _ in drawn]
    truncated = [ids[-1] != eos for ids, _ in drawn]
    return Samples(list(prompts), texts, prompt_ids, prompt_mask, completion_ids, completion_mask, truncated,
                   logprobs)
