"""Device profiles and fit / speed estimates: will this model run on my board, and how fast?

Torch-free and transformers-free: the on-device runtime imports this. ``gguf`` is
imported only to read a .gguf.
"""

from slm_align.ondevice.devices.estimate import (
    FitReport,
    LooRow,
    MemoryEstimate,
    estimate_fit,
    leave_one_out,
    recommend_quant,
)
from slm_align.ondevice.devices.facts import ModelFacts, model_facts
from slm_align.ondevice.devices.profiles import (
    DeviceProfile,
    ReferencePoint,
    list_profiles,
    load_profile,
)
from slm_align.ondevice.devices.quant import BITS_PER_WEIGHT

__all__ = ["BITS_PER_WEIGHT", "DeviceProfile", "FitReport", "LooRow", "MemoryEstimate",
           "ModelFacts", "ReferencePoint", "estimate_fit", "leave_one_out", "list_profiles",
           "load_profile", "model_facts", "recommend_quant"]
