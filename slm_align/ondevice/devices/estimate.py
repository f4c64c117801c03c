"""Will a model fit on a device, and how fast will it decode?

Memory = weights + KV cache + runtime overhead:

- weights: the artifact's own size when it already has the asked-for type, else parameters x bits
  per weight (:data:`~slm_align.ondevice.devices.quant.BITS_PER_WEIGHT`), with the output head at
  Q6_K as llama.cpp quantizes it;
- KV cache (f16): 2 x layers x kv_heads x head_dim x context x 2 bytes, sliding-window layers (Gemma
  3) included at the full context: llama-cpp-python allocates a full-size SWA cache, and our ONNX
  loop keeps every past token;
- overhead: a fixed :data:`FIXED_OVERHEAD_BYTES` (runtime library, interpreter, tokenizer) plus
  llama.cpp's compute buffer, which is dominated by one prompt micro-batch's float32 logits and
  activations: 4 bytes x ubatch x (vocab + 8 x hidden).

Decode time per token = streaming time + fixed cost. Every generated token reads all weights and
the KV cache once: (weight bytes + KV bytes at the context) / (efficiency x bandwidth). On top,
each layer costs a fixed time per token whatever its size (graph building, kernel dispatch, cache
hand-over): :data:`LAYER_OVERHEAD_S` per runtime, measured with ``slm-align bench`` on the
bundled 2.5M model, whose weights stream in a fraction of that time. The fixed cost dominates
only for tiny models; at 100M+ parameters streaming does. The efficiency is calibrated on the
profiles' published reference points: the geometric mean of measured / (bandwidth / bytes per
token) over the device's own points when it has at least :data:`MIN_DEVICE_POINTS`, else over
every device's points. The verdict compares memory with the app's budget (RAM x app share):
"fits" up to 70 %, "tight" up to 100 %.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Iterable, Optional

from slm_align.errors import UserError
from slm_align.ondevice.devices.facts import ModelFacts
from slm_align.ondevice.devices.profiles import DeviceProfile, ReferencePoint, load_all_profiles
from slm_align.ondevice.devices.quant import (
    BITS_PER_WEIGHT,
    GGUF_TYPES,
    canonical_quant,
    smaller_types,
)

# runtime library, Python interpreter, tokenizer and sampler state
FIXED_OVERHEAD_BYTES = 80 * 2**20
COMPUTE_BYTES_PER_VALUE = 4         # llama.cpp keeps logits and activations in float32
# context assumed when none is asked for (capped at the model's own)
DEFAULT_CONTEXT = 4096
FITS_SHARE = 0.70
TIGHT_SHARE = 1.00
MIN_DEVICE_POINTS = 2               # fewer own points than this: calibrate on every device's points
DEFAULT_EFFICIENCY = 0.8            # used only when no profile has any reference point
HEAD_BITS = BITS_PER_WEIGHT["Q6_K"]  # llama.cpp keeps the output head at Q6_K below that type
# Fixed decode cost per layer and token, by runtime (x86 host, 2 threads, bundled 6-layer model:
# llama.cpp ~0.45 ms/token of which ~0.15 ms streaming; our onnxruntime loop ~2.1 ms/token).
LAYER_OVERHEAD_S = {"gguf": 0.05e-3, "onnx": 0.3e-3}

Pool = list[tuple[DeviceProfile, ReferencePoint]]


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes the model needs on the device, by part."""

    weights: float   # weights at the chosen type
    kv_cache: float  # f16 KV cache at the context
    compute: float   # compute buffer of one prompt micro-batch
    fixed: float     # runtime, interpreter and tokenizer

    @property
    def total(self) -> float:
        return self.weights + self.kv_cache + self.compute + self.fixed


@dataclass(frozen=True)
class Efficiency:
    """Share of the profile's bandwidth that decode achieves, and what it was calibrated on."""

    value: float  # measured / bandwidth-bound estimate
    basis: str    # device, all devices, or default
    points: int   # reference points behind the value


@dataclass(frozen=True)
class FitReport:
    """The answer to 'will it run on my device, and how fast?'."""

    device: str
    model: str
    quant: str
    context: int
    memory: MemoryEstimate
    budget_bytes: float
    share_of_budget: float
    verdict: str
    max_context: int
    recommended_quant: Optional[str]
    tokens_per_second: float
    efficiency: Efficiency
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dict(asdict(self), memory=dict(asdict(self.memory), total=self.memory.total))


@dataclass(frozen=True)
class LooRow:
    """One reference point predicted by a calibration that did not see it."""

    device: str
    model: str
    quant: str
    measured: float
    predicted: float

    @property
    def ratio(self) -> float:
        return self.predicted / self.measured

    def to_dict(self) -> dict:
        return dict(asdict(self), ratio=self.ratio)


def weight_bytes(facts: ModelFacts, quant: str) -> float:
    """Weights at ``quant``: the artifact's measured bytes when it already has that
    type, else parameters x bits.

    llama.cpp's quantizer keeps the output head (the tied embedding in tied models) at Q6_K
    when the rest goes lower, which matters for small models with large vocabularies; that
    matrix is counted at Q6_K then.
    """
    if facts.weight_bytes is not None and facts.quant == quant:
        return float(facts.weight_bytes)
    bits = BITS_PER_WEIGHT[quant]
    head = min((facts.vocab_size or 0) * (facts.hidden_size or 0), facts.parameters)
    if quant not in GGUF_TYPES or bits >= HEAD_BITS:
        return facts.parameters * bits / 8
    return ((facts.parameters - head) * bits + head * HEAD_BITS) / 8


def kv_bytes(facts: ModelFacts, context: int) -> float:
    """f16 KV cache at ``context`` tokens (0 when the model's layer and head sizes are unknown)."""
    return float((facts.kv_bytes_per_token or 0) * context)


def compute_bytes(facts: ModelFacts, ubatch: int) -> float:
    """Compute buffer: float32 logits and widest activations of one prompt micro-batch."""
    return COMPUTE_BYTES_PER_VALUE * ubatch * ((facts.vocab_size or 0) + 8 * (facts.hidden_size or 0))


def memory_needed(facts: ModelFacts, profile: DeviceProfile, quant: str, context: int) -> MemoryEstimate:
    return MemoryEstimate(weights=weight_bytes(facts, quant), kv_cache=kv_bytes(facts, context),
                          compute=compute_bytes(facts, profile.ubatch), fixed=FIXED_OVERHEAD_BYTES)


def verdict(share: float) -> str:
    if share <= FITS_SHARE:
        return "fits"
    if share <= TIGHT_SHARE:
        return "tight"
    return "does not fit"


def bandwidth_bound_tokens_per_second(facts: ModelFacts, profile: DeviceProfile, quant: str,
                                      context: int) -> float:
    """Decode speed if every byte of weights and KV cache streamed at the
    profile's full bandwidth."""
    return profile.bandwidth_gbs * 1e9 / (weight_bytes(facts, quant) + kv_bytes(facts, context))


def runtime_of(facts: ModelFacts, profile: DeviceProfile) -> str:
    """The runtime that will decode: the artifact's own, else the device's preferred one."""
    return facts.format if facts.format in LAYER_OVERHEAD_S else profile.runtime


def decode_tokens_per_second(facts: ModelFacts, profile: DeviceProfile, quant: str, context: int,
                             efficiency: float) -> float:
    """Tokens/s from streaming at ``efficiency`` x bandwidth plus the
    runtime's fixed cost per layer."""
    streaming = 1.0 / (efficiency * bandwidth_bound_tokens_per_second(facts, profile, quant, context))
    return 1.0 / (streaming + (facts.layers or 0) * LAYER_OVERHEAD_S[runtime_of(facts, profile)])


def max_context(facts: ModelFacts, profile: DeviceProfile, quant: str) -> int:
    """Largest context whose KV cache still fits the app budget next to the weights and overhead."""
    free = profile.budget_bytes - memory_needed(facts, profile, quant, 0).total
    if free <= 0:
        return 0
    limit = facts.context_length or DEFAULT_CONTEXT
    per_token = facts.kv_bytes_per_token
    return limit if not per_token else min(limit, int(free // per_token))


def preferred_quant(profile: DeviceProfile) -> str:
    """The weight type the profile recommends: its GGUF type, else ONNX's w8 (the scheme that holds
    on real weights; dynamic int8 is refused on the real Gemma 3 270M,
    benchmarks/quantization.py)."""
    if profile.runtime == "gguf":
        return canonical_quant(profile.gguf_quant)
    return "w8"


def recommend_quant(facts: ModelFacts, profile: DeviceProfile, context: int) -> Optional[str]:
    """The profile's preferred type, downgraded until it fits (else until it is
    tight); None if nothing does."""
    shares = {q: memory_needed(facts, profile, q, context).total / profile.budget_bytes
              for q in smaller_types(preferred_quant(profile), profile.runtime)}
    for limit in (FITS_SHARE, TIGHT_SHARE):
        for quant, share in shares.items():
            if share <= limit:
                return quant
    return None


def reference_facts(point: ReferencePoint) -> ModelFacts:
    """A reference point's model as :class:`ModelFacts` (its published file size, when
    given, is the weights)."""
    return ModelFacts(source=point.model, format="reference", parameters=point.parameters,
                      layers=point.layers, kv_heads=point.kv_heads, head_dim=point.head_dim,
                      quant=canonical_quant(point.quant),
                      weight_bytes=None if point.size_gb is None else int(point.size_gb * 1e9))


def measured_over_bound(profile: DeviceProfile, point: ReferencePoint) -> float:
    """How much of the bandwidth bound a reference point achieved."""
    facts = reference_facts(point)
    return point.tokens_per_second / bandwidth_bound_tokens_per_second(facts, profile, facts.quant, point.context)


def geometric_mean(values: Iterable[float]) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


def reference_pool(profiles: Optional[list[DeviceProfile]] = None) -> Pool:
    """Every (profile, reference point) pair of the known profiles."""
    profiles = load_all_profiles() if profiles is None else profiles
    return [(profile, point) for profile in profiles for point in profile.reference]


def efficiency_for(profile: DeviceProfile, pool: Pool) -> Efficiency:
    """Calibrated efficiency: the device's own points when it has enough, else
    every device's points."""
    if len(profile.reference) >= MIN_DEVICE_POINTS:
        ratios = [measured_over_bound(profile, point) for point in profile.reference]
        return Efficiency(geometric_mean(ratios), "device", len(ratios))
    if pool:
        return Efficiency(geometric_mean(measured_over_bound(p, point) for p, point in pool),
                          "all devices", len(pool))
    return Efficiency(DEFAULT_EFFICIENCY, "default", 0)


def _notes(facts: ModelFacts, context: int, efficiency: Efficiency) -> list[str]:
    notes = []
    if facts.kv_bytes_per_token is None:
        notes.append("KV cache not counted: the model's layer and head sizes are unknown")
    if facts.context_length and context > facts.context_length:
        notes.append(f"context {context} exceeds the model's trained context "
                     f"{facts.context_length}")
    if not facts.parameters_exact:
        notes.append("parameter count derived from config.json")
    if efficiency.basis != "device":
        notes.append(f"speed calibrated on {efficiency.basis} ({efficiency.points} reference "
                     "points); add measured points to the profile for a device-specific figure")
    return notes


def estimate_fit(facts: ModelFacts, profile: DeviceProfile, quant: Optional[str] = None,
                 context: Optional[int] = None, pool: Optional[Pool] = None) -> FitReport:
    """Memory, verdict, largest context, recommended type and decode speed of
    ``facts`` on ``profile``."""
    if context is not None and context < 1:
        raise UserError(f"--ctx {context}: must be at least 1 token")
    context = context or min(DEFAULT_CONTEXT, facts.context_length or DEFAULT_CONTEXT)
    recommended = recommend_quant(facts, profile, context)
    quant = canonical_quant(quant) if quant else (recommended or preferred_quant(profile))
    memory = memory_needed(facts, profile, quant, context)
    efficiency = efficiency_for(profile, reference_pool() if pool is None else pool)
    share = memory.total / profile.budget_bytes
    return FitReport(
        device=profile.name, model=facts.source, quant=quant, context=context, memory=memory,
        budget_bytes=profile.budget_bytes, share_of_budget=share, verdict=verdict(share),
        max_context=max_context(facts, profile, quant), recommended_quant=recommended,
        tokens_per_second=decode_tokens_per_second(facts, profile, quant, context,
                                                   efficiency.value),
        efficiency=efficiency, notes=_notes(facts, context, efficiency))


def leave_one_out(profiles: Optional[list[DeviceProfile]] = None) -> list[LooRow]:
    """Predict every reference point with a calibration that leaves that point out."""
    pool = reference_pool(profiles)
    rows = []
    for index, (profile, point) in enumerate(pool):
        rest = pool[:index] + pool[index + 1:]
        without = profile.model_copy(update={"reference": [p for p in profile.reference
                                                           if p is not point]})
        facts = reference_facts(point)
        efficiency = efficiency_for(without, rest)
        predicted = decode_tokens_per_second(facts, profile, facts.quant, point.context,
                                             efficiency.value)
        rows.append(LooRow(profile.name, point.model, facts.quant, point.tokens_per_second,
                           predicted))
    return rows
