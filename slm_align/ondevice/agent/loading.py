"""Opening an exported model for the runtime: a .gguf file, an ONNX export directory, base + adapters, an adapter
export's manifest or a bundle, checked against its export manifest before any parser reads it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

from slm_align.errors import UserError
from slm_align.ondevice.agent.artifact_forms import check_chain_id, resolve_artifact
from slm_align.ondevice.agent.backend import Backend, artifact_kind
from slm_align.ondevice.agent.open_artifact import open_backend
from slm_align.ondevice.templates.artifact import use_chat_template


@dataclass
class Model:
    """An opened artifact: what an agent (or a server's every request) generates with."""

    backend: Backend
    """The llama.cpp or onnxruntime backend."""
    sha256: str
    """The artifact's sha256 (with adapters applied, the base's): see :attr:`Agent.model_id`."""
    name: str
    """The artifact's file or directory name."""


def load_model(artifact: Union[str, Path], device: Optional[str] = None, threads: Optional[int] = None,
               n_ctx: Optional[int] = None, chat_template: Optional[str] = None,
               adapters: Sequence[Union[str, Path]] = ()) -> Model:
    """Open a .gguf file, an ONNX export directory or another form of
    :func:`~slm_align.ondevice.agent.artifact_forms.resolve_artifact` (base + adapters, an adapter export's
    manifest, a bundle); ``device`` takes threads and context
    from its profile; ``chat_template`` ("chatml" or a Jinja file) replaces the model's
    own (base models have none); ``adapters``: LoRA adapter GGUFs applied to a GGUF base in order,
    each refused in one line unless it was made for this base.

    The artifact is hashed and checked against its export manifest first: a parser (llama.cpp's,
    onnxruntime's) never reads a file that changed after export.
    """
    form = resolve_artifact(artifact)
    if adapters and form.adapters:
        raise UserError(f"{artifact} already names its adapters; pass either it or a base with "
                        "adapters, not both")
    artifact, adapters = form.model, (form.adapters or tuple(Path(a) for a in adapters))
    kind = artifact_kind(artifact)
    if adapters and kind != "gguf":
        raise UserError(f"adapters apply to a GGUF base in llama.cpp; {artifact} is an ONNX export: "
                        "pass the base .gguf")
    sha256 = artifact_id(artifact)
    if device is not None:
        threads, n_ctx = device_settings(artifact, device, threads, n_ctx)
    backend = open_backend(artifact, threads=threads, n_ctx=n_ctx, adapters=list(adapters))
    use_chat_template(backend, chat_template)
    check_chain_id(form, sha256, backend)
    return Model(backend, sha256, artifact.name)


def artifact_id(artifact: Path) -> str:
    """The sha256 that identifies the model in preference records; checked
    against the export manifest."""
    from slm_align.runs import artifact_digest, artifact_manifest

    artifact = Path(artifact)
    found = artifact_digest(artifact)
    manifest = artifact_manifest(artifact)
    if manifest.is_file():
        try:
            recorded = json.loads(manifest.read_text(encoding="utf-8")).get("metrics", {}).get("sha256")
        except ValueError:
            raise UserError(f"{manifest} is corrupt; export the model again") from None
        if recorded and recorded != found:
            raise UserError(f"{artifact} does not match the checksum in {manifest.name}: the file was changed or "
                            "damaged after export; export it again")
    return found


def device_settings(artifact: Path, device: str, threads: Optional[int], n_ctx: Optional[int]) -> tuple[int, int]:
    """Threads from the device profile, and the largest context that fits its
    memory (at most 4096)."""
    from slm_align.ondevice.devices import estimate_fit, load_profile, model_facts

    profile = load_profile(device)
    if n_ctx is None:
        fit = estimate_fit(model_facts(artifact), profile)
        if fit.max_context < 256:
            raise UserError(f"{artifact} does not fit {device} with a useful context "
                            f"({fit.verdict}); export a smaller quantization (recommended: "
                            f"{fit.recommended_quant})")
        n_ctx = min(fit.max_context, 4096)
    return threads or profile.threads, n_ctx
