"""Parity of an exported artifact with the PyTorch model it came from.

Three checks, all recorded in the export manifest:

- tokenizer: the artifact's tokenizer gives the same ids as the HF tokenizer
  on every verification text;
- greedy (F32/F16 GGUF, fp32 ONNX): greedy decoding of each prompt matches PyTorch token for token
  for ``tokens`` steps (EOS does not stop either side). A divergence is tolerated only at a near
  tie: where PyTorch's own logits for the two tokens differ by less than ``tie_tolerance`` (rounding
  to F16 can flip a tie; it cannot flip a clear choice). Each tolerated tie is reported. Q8_0's
  greedy decoding is measured and reported too, but not required: on the real Gemma 3 270M it
  diverged on 3 of 4 prompts (first at token 25);
- agreement (every type): the share of positions of a held-out text where the artifact's top-1
  next token equals PyTorch's, teacher-forced. Quantized types (Q8_0 included) pass when it
  reaches ``min_agreement``. The perplexity of that text under the artifact and under PyTorch is
  reported beside it (not gated).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np

from slm_align.ondevice.agent.backend import Backend
from slm_align.ondevice.agent.decode import greedy
from slm_align.progress import counted

# The runtime's context while verifying: every check fits in it (the held-out text and the
# prompts with their greedy steps are a few hundred tokens), and llama.cpp keeps the logits of
# every position, context x vocabulary floats: at Gemma 3's own context (32768) and vocabulary
# (262144) that would be 32 GiB.
VERIFY_CONTEXT = 512
USER_MESSAGES = ("Tell me a short story about a brave mouse.", "What should I name my new puppy?")
RAW_TEXTS = ("Once upon a time, there was a little girl named Lily.",
             "The sun was warm and the birds")
HELDOUT_TEXT = (
    "Once upon a time, in a small village by the sea, there lived an old fisherman and his clever "
    "cat. Every morning they rowed out before the sun came up, and every evening they shared what "
    "they had caught with the children of the village. One day a storm came, and the boat did not "
    "come back. The children waited on the beach all night. In the morning they saw a small light "
    "far away on the water. It was the cat, sitting on the bow, and the fisherman was rowing "
    "slowly home. \"We were lost,\" he said, \"but she always knows the way.\" From then on, the "
    "children called her the captain, and she liked that very much."
)


@dataclass
class ParityReport:
    """What verification measured; ``passed`` decides whether the artifact is published."""

    tokenizer_match: bool
    prompts: int = 0
    greedy_tokens: int = 0
    greedy_exact: int = 0
    ties: list = field(default_factory=list)
    divergences: list = field(default_factory=list)
    agreement: float = float("nan")
    agreement_positions: int = 0
    perplexity: float = float("nan")
    torch_perplexity: float = float("nan")
    min_agreement: float = 0.0
    passed: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def verification_prompts(tokenizer) -> list[list[int]]:
    """Chat-rendered user turns (when the model has a template) and raw story
    openings, as HF token ids."""
    prompts = [tokenizer(text)["input_ids"] for text in RAW_TEXTS]
    if tokenizer.chat_template:
        for message in USER_MESSAGES:
            prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": message}],
                                                         add_generation_prompt=True, tokenize=True))
    return prompts


def _token_batch(model, ids: Sequence[int]):
    """(1, T) token ids on the model's device."""
    import torch

    from slm_align.modeling.accelerator import device_of

    return torch.tensor([list(ids)], device=device_of(model))


def _torch_logits(model, ids: Sequence[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(_token_batch(model, ids)).logits[0].float().cpu().numpy()


def torch_greedy(model, prompt: Sequence[int], steps: int) -> list[int]:
    """PyTorch's greedy continuation with the KV cache, EOS ignored (the same rule
    as the artifact's side)."""
    import torch

    with torch.no_grad():
        out = model(_token_batch(model, prompt), use_cache=True)
        tokens = []
        for _ in range(steps):
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            out = model(_token_batch(model, [token]), past_key_values=out.past_key_values,
                        use_cache=True)
    return tokens


def _compare_greedy(model, backend: Backend, prompt: list[int], steps: int, tie_tolerance: float,
                    report) -> None:
    expected = torch_greedy(model, prompt, steps)
    got = greedy(backend, prompt, steps, stop_at_eos=False)
    report.greedy_tokens += steps
    mismatch = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), None)
    if mismatch is None:
        report.greedy_exact += 1
        return
    logits = _torch_logits(model, prompt + expected[:mismatch])[-1]
    gap = float(logits[expected[mismatch]] - logits[got[mismatch]])
    entry = {"prompt": report.prompts - 1, "position": mismatch, "torch_logit_gap": gap}
    (report.ties if gap < tie_tolerance else report.divergences).append(entry)


def next_token_nll(logits: np.ndarray, ids: Sequence[int]) -> np.ndarray:
    """Negative log-likelihood of each of ``ids[1:]`` under the logits of the position before it."""
    shifted = logits[:-1].astype(np.float64)
    peak = shifted.max(-1)
    log_total = peak + np.log(np.exp(shifted - peak[:, None]).sum(-1))
    return log_total - shifted[np.arange(len(shifted)), np.asarray(ids[1:])]


def artifact_logits(backend: Backend, ids: Sequence[int]) -> np.ndarray:
    """The artifact's logits at every position of ``ids``, from a fresh cache."""
    backend.reset()
    return backend.feed_all(list(ids))


def compare_logits(reference: np.ndarray, artifact: np.ndarray, ids: Sequence[int]) -> dict:
    """Top-1 agreement of ``artifact`` with ``reference`` and both perplexities over
    ``ids``, teacher-forced."""
    return {"agreement": float((artifact.argmax(-1) == reference.argmax(-1)).mean()),
            "perplexity": float(np.exp(next_token_nll(artifact, ids).mean())),
            "torch_perplexity": float(np.exp(next_token_nll(reference, ids).mean()))}


def top1_agreement(model, backend: Backend, ids: Sequence[int]) -> float:
    """Share of positions where the artifact's argmax equals PyTorch's,
    teacher-forced over ``ids``."""
    return compare_logits(_torch_logits(model, ids), artifact_logits(backend, ids),
                          ids)["agreement"]


def perplexity_change(verification: dict) -> str:
    """The held-out perplexity under PyTorch and under the artifact, e.g. 'perplexity 28.38 ->
    32.27, +13.7%' ("" for a record without them: one written before they were measured)."""
    before = verification.get("torch_perplexity")
    after = verification.get("perplexity")
    if before is None or after is None:
        return ""
    return f"perplexity {before:.2f} -> {after:.2f}, {100 * (after - before) / before:+.1f}%"


def verification_summary(verification: dict) -> str:
    """What verification found, on one line: tokenizer, greedy decoding (when run), top-1 agreement
    and the held-out perplexity change, e.g. 'tokenizer identical, greedy 4/4 prompts identical for
    32 tokens, top-1 agreement 0.998 over 120 tokens, held-out perplexity 28.38 -> 28.40, +0.1%'."""
    v = verification
    greedy_text = ""
    if v["prompts"]:
        ties = f" ({len(v['ties'])} near-tie)" if v["ties"] else ""
        greedy_text = f"greedy {v['greedy_exact']}/{v['prompts']} prompts identical for 32 tokens{ties}, "
    perplexity = perplexity_change(v)
    return (f"tokenizer {'identical' if v['tokenizer_match'] else 'DIFFERENT'}, {greedy_text}top-1 "
            f"agreement {v['agreement']:.3f} over {v['agreement_positions']} tokens"
            + (f", held-out {perplexity}" if perplexity else ""))


def verify(model, tokenizer, backend: Backend, exact: bool, steps: int = 32, min_agreement: float = 0.9,
           tie_tolerance: float = 0.05, greedy: bool = False) -> ParityReport:
    """Run the checks; ``exact`` asks for greedy equality (F32/F16, fp32 ONNX),
    else top-1 agreement decides.

    ``greedy`` measures and reports greedy decoding without requiring it (Q8_0: exact on toy
    weights, but on a real checkpoint with a 262k vocabulary 8-bit weights and activations flip a
    few choices in 32 tokens).
    """
    texts = list(RAW_TEXTS) + [HELDOUT_TEXT]
    report = ParityReport(tokenizer_match=all(backend.tokenize(t) == tokenizer(t)["input_ids"]
                                              for t in texts),
                          min_agreement=min_agreement)
    prompts = verification_prompts(tokenizer) if exact or greedy else []
    with counted("greedy decoding", len(prompts), "prompts") as count:
        for prompt in prompts:
            report.prompts += 1
            _compare_greedy(model, backend, prompt, steps, tie_tolerance, report)
            count.advance()
    heldout = tokenizer(HELDOUT_TEXT)["input_ids"][: backend.n_ctx]
    compared = compare_logits(_torch_logits(model, heldout), artifact_logits(backend, heldout),
                              heldout)
    report.agreement = compared["agreement"]
    report.perplexity = compared["perplexity"]
    report.torch_perplexity = compared["torch_perplexity"]
    report.agreement_positions = len(heldout)
    if exact:
        report.passed = report.tokenizer_match and not report.divergences
    else:
        report.passed = report.tokenizer_match and report.agreement >= min_agreement
    return report
