"""Which base GGUF a llama.cpp LoRA adapter GGUF belongs to, checked from the two headers alone
(torch-free: the runtime refuses a mismatched pair before llama.cpp loads either).

An adapter we write (``slm_align.ondevice.gguf.adapter_writer``) records the sha256 of the base GGUF
it was made for under :data:`BASE_SHA256_KEY`; :func:`check_adapter_base` checks that hash, the
architecture and every adapted tensor's shape. :func:`chain_digest` names a base with adapters
applied: the id the runtime records a turn under and an adapter export's manifest records.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional, Sequence

from slm_align.errors import UserError
from slm_align.ondevice.gguf.fields import read_header
from slm_align.runs import sha256_file

BASE_SHA256_KEY = "slm_align.base.sha256"


def check_adapter_base(adapter: Path, base_gguf: Path, check_hash: bool = True) -> None:
    """Refuse, in one line, a base GGUF the adapter GGUF was not made for: another architecture, an
    adapted tensor missing or of another shape, or (``check_hash``, where the adapter records one) a
    file other than the one it was written against."""
    fields, adapter_shapes = read_header(Path(adapter), prefix="")
    value = {key: field.value for key, field in fields.items() if not isinstance(field.value, list)}
    if value.get("general.type") != "adapter" or value.get("adapter.type") != "lora":
        raise UserError(f"{adapter} is not a LoRA adapter GGUF; export one with `slm-align export "
                        "RUN --target gguf-adapter`")
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shape in adapter_shapes.items():
        weight, _, part = name.rpartition(".lora_")
        pairs.setdefault(weight, {})[part] = shape
    targets = {name: (pair["b"][0], pair["a"][1]) for name, pair in pairs.items()
               if {"a", "b"} <= set(pair)}
    check_fits(targets, value.get("general.architecture"), Path(base_gguf), str(adapter))
    recorded = value.get(BASE_SHA256_KEY)
    if check_hash and recorded and recorded != sha256_file(Path(base_gguf)):
        raise UserError(f"adapter {adapter} was made for base sha256 {recorded[:12]}, {base_gguf} "
                        f"is {sha256_file(Path(base_gguf))[:12]}; pass the base GGUF it was "
                        "exported with")


def check_fits(targets: dict[str, tuple[int, int]], arch: Optional[str], base_gguf: Path,
               adapter: str = "the adapter") -> None:
    """Refuse a base GGUF of another architecture or without a tensor of each adapted weight's
    ``(out, in)`` shape (``targets``, by GGUF name)."""
    fields, shapes = read_header(base_gguf, prefix="general.architecture")
    base_arch = fields["general.architecture"].value if fields else None
    if base_arch != arch:
        raise UserError(f"{adapter} is for a {arch} base, {base_gguf} is {base_arch}; pass the "
                        "base GGUF it was made for")
    for name, shape in targets.items():
        if shapes.get(name) != shape:
            found = "x".join(map(str, shapes[name])) if name in shapes else "no such tensor"
            raise UserError(f"{adapter} adapts {name} as {shape[0]}x{shape[1]}, {base_gguf} has "
                            f"{found}; pass the base GGUF it was made for")


def chain_digest(base_sha256: str, adapter_sha256s: Sequence[str]) -> str:
    """The id of a base with adapters applied in order: the base's own sha256 when there are none,
    else the sha256 of the text of one lowercase hex sha256 per line (base first, then each adapter,
    ``\\n`` after each)."""
    if not adapter_sha256s:
        return base_sha256
    return hashlib.sha256("".join(f"{digest}\n" for digest in (base_sha256, *adapter_sha256s)).encode()).hexdigest()
