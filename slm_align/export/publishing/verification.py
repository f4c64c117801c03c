"""An export's verification: parity of the artifact, run by its target's runtime, with the PyTorch
model (:func:`~slm_align.export.publishing.parity.verify`), what a failure says, and the next-higher
type a refusal probes."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from slm_align.export.publishing.parity import perplexity_change
from slm_align.modeling.accelerator import resolve_device

EXACT_TYPES = {"F32", "F16", "fp32"}  # verified by greedy equality; the rest by top-1 agreement
# greedy measured and reported (Q8_0: not required, see parity.verify)
GREEDY_REPORTED = EXACT_TYPES | {"Q8_0"}


def verify_artifact(target, checkpoint: Path, artifact: Path, quant: str, threads: int,
                    min_agreement: float, torch_device: str = "auto") -> dict:
    """Parity with PyTorch of ``artifact`` as ``target``'s runtime decodes it, plus the target's own
    checks."""
    from slm_align.export.publishing.parity import VERIFY_CONTEXT, verify
    from slm_align.modeling.models import load_model, load_tokenizer, resolve_source

    source = resolve_source(str(checkpoint))
    model = load_model(source).to(resolve_device(torch_device))
    tokenizer = load_tokenizer(source)
    backend = target.open_backend(artifact, threads, VERIFY_CONTEXT)
    report = verify(model, tokenizer, backend, exact=quant in EXACT_TYPES,
                    min_agreement=min_agreement, greedy=quant in GREEDY_REPORTED).to_dict()
    target.check_backend(report, backend, tokenizer, artifact)
    return report


def failure(verification: dict) -> str:
    if verification.get("genai_tokenizer_match") is False:
        return ("onnxruntime-genai's tokenizer splits text or "
                "renders chats differently from the model's")
    if not verification["tokenizer_match"]:
        return "its tokenizer splits text differently from the model's"
    if verification["divergences"]:
        first = verification["divergences"][0]
        return (f"greedy decoding diverged from PyTorch on {len(verification['divergences'])} "
                f"prompt(s) (first at token {first['position']})")
    return (f"top-1 agreement {verification['agreement']:.3f} < {verification['min_agreement']} "
            f"({perplexity_change(verification)})")


def next_higher_on(ladder: tuple[str, ...], quant: str) -> Optional[str]:
    """The next type up ``ladder`` from ``quant`` (one not on it: the first above it in bits)."""
    from slm_align.ondevice.devices.quant import BITS_PER_WEIGHT, find_quant

    if quant in ladder:
        above = ladder[ladder.index(quant) + 1:]
    else:
        bits = BITS_PER_WEIGHT.get(find_quant(quant) or "", 0.0)
        above = [q for q in ladder if BITS_PER_WEIGHT.get(find_quant(q) or "", 0.0) > bits]
    return above[0] if above else None


def probe_advice(export, scratch: Path) -> str:
    """Build and verify the next-higher type in ``scratch``; what the refusal should tell the user
    to do."""
    request = export.request
    higher = next_higher_on(export.target.ladder, export.quant)
    if higher is None:
        return "No higher precision to try; --force publishes anyway"
    probe = scratch / "probe"
    probe.mkdir()
    settings = dict(export.settings(), ort_format=False, importance=None)
    built = export.target.build(export.checkpoint, probe, higher, settings)
    found = verify_artifact(export.target, export.checkpoint, built, higher, export.threads,
                            request.min_agreement, request.torch_device)
    if found["passed"]:
        return (f"--quant {higher} passes (agreement {found['agreement']:.3f}, "
                f"{perplexity_change(found)}): export with it, or --force to publish this one "
                "anyway")
    return (f"--quant {higher} fails too ({failure(found)}); try "
            "a higher precision, or --force to publish anyway")
