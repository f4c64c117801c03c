"""RL rollouts sampled by llama.cpp, the engine the device runs, instead of by PyTorch.

The base is the user's own GGUF when the run started from one (``rl.sampler_base = "source"``: the file
itself, with the SFT adapter applied first, as ``export --target gguf-adapter`` ships it), otherwise the
policy's base (the merged SFT prior) written once as a GGUF (F32, F16, Q8_0 or Q4_K_M). Before each
rollout the current LoRA is written as a llama.cpp adapter GGUF (a few hundred KB to a few MB) and
swapped in on the loaded base, which is never reloaded. Agent episodes run through the runtime's own
backend on the same base (:mod:`slm_align.rl.llama_episodes`). Each token is drawn from llama.cpp's own
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
import importlib.util
from pathlib import Path
from typing import Optional, get_args

import numpy as np
import torch

from slm_align.config import ModelSettings, RLSettings
from slm_align.data.encoding import opening_ids
from slm_align.errors import UserError
from slm_align.modeling.generation import Samples, draw_tokens
from slm_align.modeling.models import resolve_source, save_tokenizer
from slm_align.ondevice.agent.llama_batch import LlamaBatchDecoder, decode_entries, row_logits
from slm_align.ondevice.agent.llama_open import open_llama
from slm_align.ondevice.gguf.adapter_writer import write_lora_gguf
from slm_align.ondevice.gguf.architectures import check_gguf_config
from slm_align.ondevice.gguf.writer import QUANTIZER_TYPES, quantize_gguf, write_gguf
from slm_align.progress import counted
from slm_align.rl.llama_episodes import EPISODE_CONTEXT, ExactLlamaBackend, ExactLlamaDecoder

BASE_TYPES = get_args(RLSettings.model_fields["sampler_base"].annotation)
"""Types the base GGUF is written in: F32 (no mismatch but rounding), F16 (near zero), Q8_0 and Q4_K_M
(what phones run: the mismatch is the quantization's, measured every iteration; Q4_K_M by llama.cpp's
quantizer from the F16 file)."""


CONTEXT_STEP = 64
"""Positions per sequence of the sampler's context are a multiple of this (a context is made again only when a
rollout outgrows it)."""


def check_sampler(settings: RLSettings, model: ModelSettings) -> None:
    """Refuse, in one line before any stage runs, ``rl.sampler = "llama_cpp"`` without llama-cpp-python or
    for a model whose base our GGUF writer cannot write for llama.cpp (a GGUF source loads there already)."""
    if settings.sampler != "llama_cpp":
        return
    if importlib.util.find_spec("llama_cpp") is None:
        raise UserError("rl.sampler = llama_cpp needs llama-cpp-python: pip install 'slm-align[agent]', or set "
                        "rl.sampler = torch")
    source = resolve_source(model.source)
    if source.kind == "gguf":
        return
    from transformers import AutoConfig

    name, options = source.pretrained_args()
    try:
        config = AutoConfig.from_pretrained(name, trust_remote_code=model.trust_remote_code, **options).to_dict()
    except OSError:  # not readable here (an uncached hub id): loading the model says why, in one line
        return
    try:
        check_gguf_config(config)
    except UserError as refused:
        raise UserError(f"rl.sampler = llama_cpp: {refused}; or set rl.sampler = torch") from None


def save_policy_base(policy, tokenizer, source, folder: Path) -> Path:
    """The policy's base weights (LoRA layers unwrapped, adapters left out) and its tokenizer as a
    plain model directory that the GGUF writer reads."""
    base = policy.get_base_model()
    state = {
        name.replace(".base_layer", ""): tensor
        for name, tensor in base.state_dict().items()
        if ".lora_" not in name
    }
    base.save_pretrained(folder, state_dict=state, safe_serialization=True)
    save_tokenizer(tokenizer, source, folder)
    return folder


def draw(
    logits: torch.Tensor, temperature: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of (B, V) logits, drawn from softmax(logits / T), and its log-probability there: (B,)
    ids and (B,) log-probabilities (float64).

    The draw every stage samples with, :func:`slm_align.modeling.generation.draw_tokens`: its running sums and its
    uniform numbers are float64, so a tail token after a mass of 1 - 1e-9 keeps its share (a float32 sum
    reaches 1.0 before it, and a float32 uniform number never comes within 6e-8 of 1). ``torch.multinomial``
    on a 262k vocabulary took 200 ms for 32 rows."""
    tokens, logprobs = draw_tokens(logits.float(), temperature, generator=generator)
    return tokens, logprobs.double()


class LlamaSampler:
    """Completions of the current policy drawn by llama.cpp (see the module's doc): every completion of a
    rollout is one sequence of one llama.cpp context, and each step decodes the next token of all of
    them in one batch, so the weights are read once per step, not once per completion."""

    def __init__(
        self,
        policy,
        tokenizer,
        source,
        folder: Path,
        base_type: str = "source",
        threads: int = 1,
        n_ctx: int = 2048,
        sft_adapter: Optional[Path] = None,
    ):
        try:
            import llama_cpp
        except ImportError:
            raise UserError(
                "rl.sampler = llama_cpp needs llama-cpp-python: pip install 'slm-align[agent]'"
            ) from None
        if base_type not in BASE_TYPES:
            raise UserError(f"rl.sampler_base {base_type}: choose one of {', '.join(BASE_TYPES)}")
        self.lib = llama_cpp
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.chain: list[Path] = []
        """Adapter GGUFs applied before the policy's (the SFT adapter, on the user's own GGUF)."""
        if base_type == "source" and source.kind == "gguf":
            self.base_gguf = self.shapes_from = Path(source.ref)
            if sft_adapter is not None:
                self.chain = [write_lora_gguf(Path(sft_adapter), self.base_gguf, self.folder / "sft.gguf", "F32")]
        else:
            self.base_gguf = self._write_base(policy, tokenizer, source, base_type, threads)
        self.llm = open_llama(
            self.base_gguf,
            n_ctx=8,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
            vocab_only=False,
        )
        self.threads = threads
        self.n_ctx = n_ctx
        """Positions one completion may take (its prompt and its new tokens)."""
        self.vocab = self.llm.n_vocab()
        self._adapter = None
        self._chain_handles = [self._load(path) for path in self.chain]
        self._ctx = None
        self._sequences = 0
        self._positions = 0
        self.episodes: Optional[ExactLlamaBackend] = None
        """The runtime's backend on the same base GGUF when rollouts are agent episodes (:meth:`for_episodes`)."""
        self._episode_decoder: Optional[ExactLlamaDecoder] = None

    def _write_base(self, policy, tokenizer, source, base_type: str, threads: int) -> Path:
        """The policy's base (the merged SFT prior) as a GGUF of ``base_type`` ("source": F16), in the folder."""
        self.shapes_from = save_policy_base(policy, tokenizer, source, self.folder / "base")
        wanted = "F16" if base_type == "source" else base_type
        written = "F16" if wanted in QUANTIZER_TYPES else wanted
        gguf = write_gguf(self.shapes_from, self.folder / f"base-{written}.gguf", written)
        if written == wanted:
            return gguf
        return quantize_gguf(gguf, self.folder / f"base-{wanted}.gguf", wanted, threads)

    def _load(self, path: Path):
        """A llama.cpp handle of the adapter GGUF at ``path`` on the base."""
        handle = self.lib.llama_adapter_lora_init(self.llm.model, str(path).encode())
        if not handle:
            raise UserError(f"llama.cpp could not load the adapter {path}")
        return handle

    def for_episodes(self, chat_template: str, max_positions: int) -> ExactLlamaBackend:
        """The runtime's llama.cpp backend over the base GGUF, sampling agent episodes from now on (the
        adapter of each :meth:`refresh` swapped into it), with at most ``max_positions`` positions
        (:data:`~slm_align.rl.llama_episodes.EPISODE_CONTEXT` at most)."""
        self.episodes = ExactLlamaBackend(self.base_gguf, chat_template, self.threads,
                                          min(max_positions, EPISODE_CONTEXT))
        return self.episodes

    def episode_runner(self, count: int):
        """What runs ``count`` agent episodes: a batching decoder over :attr:`episodes`' model (every episode a
        sequence of one context, stepped together by the engine)."""
        if self._episode_decoder is None or self._episode_decoder.slots < count:
            self._close_episode_decoder()
            self._episode_decoder = ExactLlamaDecoder(LlamaBatchDecoder(self.episodes, count))
        return self._episode_decoder

    def _close_episode_decoder(self) -> None:
        if self._episode_decoder is not None:
            self._episode_decoder.decoder.close()
            self._episode_decoder = None

    def refresh(self, policy) -> None:
        """Write the policy's LoRA as an adapter GGUF and apply it in place of the last one."""
        adapter_dir = self.folder / "adapter"
        policy.save_pretrained(adapter_dir)
        path = write_lora_gguf(adapter_dir, self.shapes_from, self.folder / "adapter.gguf", "F32")
        if self.episodes is not None:
            self.episodes.swap_adapters(self.chain + [path])
            if self._episode_decoder is not None:
                self._episode_decoder.decoder.apply_adapters()
            return
        adapter = self._load(path)
        if self._adapter is not None:
            self.lib.llama_adapter_lora_free(self._adapter)
        self._adapter = adapter
        if self._ctx is not None:
            self._apply_adapter()

    def _apply_adapter(self) -> None:
        """The chain, then the policy's adapter, each at scale 1, on the context."""
        handles = self._chain_handles + [self._adapter]
        adapters = (self.lib.llama_adapter_lora_p_ctypes * len(handles))(*handles)
        scales = (ctypes.c_float * len(handles))(*([1.0] * len(handles)))
        self.lib.llama_set_adapters_lora(self._ctx, adapters, len(handles), scales)

    def _context(self, sequences: int, positions: int):
        """A context for ``sequences`` sequences of ``positions`` each (rounded up to :data:`CONTEXT_STEP`), made
        again only when a rollout needs more of either than the last one; the adapters on it, its memory cleared.
        Sized by the rollout, not by :attr:`n_ctx`: the KV cache of 32 sequences of 1,024 positions is 600 MB on
        Gemma 3 270M, of 80 positions 47 MB."""
        lib = self.lib
        positions = -(-positions // CONTEXT_STEP) * CONTEXT_STEP
        if self._ctx is None or sequences > self._sequences or positions > self._positions:
            sequences, positions = max(sequences, self._sequences), max(positions, self._positions)
            if self._ctx is not None:
                lib.llama_free(self._ctx)
            params = lib.llama_context_default_params()
            params.n_ctx = positions * sequences
            params.n_batch = max(positions, sequences)
            params.n_ubatch = min(params.n_batch, 512)
            params.n_seq_max = sequences
            params.n_threads = self.threads
            params.n_threads_batch = self.threads
            params.kv_unified = True
            self._ctx = lib.llama_init_from_model(self.llm.model, params)
            if not self._ctx:
                raise UserError(f"llama.cpp could not make a context for {sequences} sequences of {positions}")
            self._sequences, self._positions = sequences, positions
            if self._adapter is not None:
                self._apply_adapter()
        lib.llama_memory_clear(lib.llama_get_memory(self._ctx), True)
        return self._ctx

    def _decode(self, ctx, entries: list[tuple[int, int, int, bool]]) -> None:
        """Decode (token, position, sequence, wants logits) entries in one llama.cpp batch
        (:func:`~slm_align.ondevice.agent.llama_batch.decode_entries`)."""
        try:
            decode_entries(self.lib, ctx, entries)
        except UserError:
            raise UserError(
                f"llama.cpp could not decode a batch of {len(entries)} tokens; lower "
                "rl.prompts_per_step or rl.max_new_tokens"
            ) from None

    def _logits(self, ctx, positions: list[int]) -> torch.Tensor:
        """(len(positions), V) the logits at those positions of the last decoded batch, copied."""
        return torch.from_numpy(np.stack([row_logits(self.lib, ctx, position, self.vocab) for position in positions]))

    def _prompts(self, ctx, encoded: list[list[int]]) -> torch.Tensor:
        """Evaluate each distinct prompt once on the first sequence that has it, copy its cache to the
        sequences with the same prompt (a GRPO group); (B, V) each sequence's next-token logits."""
        first: dict[tuple[int, ...], int] = {}
        for sequence, ids in enumerate(encoded):
            first.setdefault(tuple(ids), sequence)
        logits: dict[int, torch.Tensor] = {}
        for ids, sequence in first.items():
            self._decode(
                ctx,
                [
                    (token, position, sequence, position == len(ids) - 1)
                    for position, token in enumerate(ids)
                ],
            )
            logits[sequence] = self._logits(ctx, [len(ids) - 1])[0]
        memory = self.lib.llama_get_memory(ctx)
        for sequence, ids in enumerate(encoded):
            source = first[tuple(ids)]
            if source != sequence:
                self.lib.llama_memory_seq_cp(memory, source, sequence, -1, -1)
        return torch.stack([logits[first[tuple(ids)]] for ids in encoded])

    def sample(
        self,
        tokenizer,
        prompts: list[str],
        max_new_tokens: int,
        temperature: float,
        seed: Optional[int],
    ) -> Samples:
        """One completion per prompt, laid out as :func:`slm_align.modeling.generation.sample` lays them out
        (left-padded prompts, completions through their first EOS), with llama.cpp's log-probabilities:
        log softmax(logits / temperature) of each drawn token, the distribution it was drawn from (:func:`draw`)."""
        eos = tokenizer.eos_token_id
        encoded = [opening_ids(tokenizer, p) or [eos] for p in prompts]
        longest = max(len(ids) for ids in encoded)
        if longest + max_new_tokens > self.n_ctx:
            raise UserError(
                f"a prompt of {longest} tokens and {max_new_tokens} new ones do not fit the llama.cpp "
                f"sampler's {self.n_ctx} positions; shorten the prompts or lower max_new_tokens"
            )
        generator = torch.Generator().manual_seed(seed if seed is not None else 0)
        ctx = self._context(len(prompts), longest + max_new_tokens)
        logits = self._prompts(ctx, encoded)
        drawn: list[tuple[list[int], list[float]]] = [([], []) for _ in prompts]
        active = list(range(len(prompts)))
        with counted("sampling", max_new_tokens, f"tokens of {len(prompts)} completions") as count:
            while active:
                tokens, chosen = draw(logits, temperature, generator)
                going = []
                for row, sequence in enumerate(active):
                    ids, logprobs = drawn[sequence]
                    ids.append(int(tokens[row]))
                    logprobs.append(float(chosen[row]))
                    if ids[-1] != eos and len(ids) < max_new_tokens:
                        going.append(sequence)
                if going:
                    self._decode(
                        ctx,
                        [
                            (drawn[s][0][-1], len(encoded[s]) + len(drawn[s][0]) - 1, s, True)
                            for s in going
                        ],
                    )
                    logits = self._logits(ctx, list(range(len(going))))
                active = going
                count.advance()
        return layout(tokenizer, prompts, encoded, drawn, eos)

    def close(self) -> None:
        if self._ctx is not None:
            self.lib.llama_free(self._ctx)
            self._ctx = None
        for handle in self._chain_handles + ([self._adapter] if self._adapter is not None else []):
            self.lib.llama_adapter_lora_free(handle)
        self._chain_handles, self._adapter = [], None
        self._close_episode_decoder()
        if self.episodes is not None:
            self.episodes.llm.close()
            self.episodes = None
        self.llm.close()


def layout(
    tokenizer,
    prompts: list[str],
    encoded: list[list[int]],
    drawn: list[tuple[list[int], list[float]]],
    eos: int,
) -> Samples:
    """The completions as :class:`Samples`: (B, P) left-padded prompts, (B, T) right-padded completions
    with their mask (through the first EOS) and log-probabilities (0 past the end), T the longest."""
    pad = tokenizer.pad_token_id
    width = max(len(ids) for ids in encoded)
    length = max(len(ids) for ids, _ in drawn)
    prompt_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in encoded])
    prompt_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded])
    completion_ids = torch.tensor([ids + [pad] * (length - len(ids)) for ids, _ in drawn])
    completion_mask = torch.tensor([[1] * len(ids) + [0] * (length - len(ids)) for ids, _ in drawn])
    logprobs = torch.tensor(
        [lp + [0.0] * (length - len(lp)) for _, lp in drawn], dtype=torch.float32
    )
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids, _ in drawn]
    truncated = [ids[-1] != eos for ids, _ in drawn]
    return Samples(
        list(prompts),
        texts,
        prompt_ids,
        prompt_mask,
        completion_ids,
        completion_mask,
        truncated,
        logprobs,
    )
