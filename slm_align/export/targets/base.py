"""An export target: what it converts, how it is verified, what it publishes; and the registry that
maps ``--target NAME`` to one.

The publish sequence (scratch, verify, atomic rename, reuse by inputs hash) is not here: every
target runs in :func:`~slm_align.runs.publish_artifact` through
:class:`~slm_align.export.publishing.model_export.ModelExport`, which asks the target only what
differs. Adding a target is one file with one subclass plus one :func:`register` line in
``targets/__init__.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from slm_align.errors import UserError
from slm_align.export.publishing.model_export import export_model
from slm_align.export.publishing.request import ExportRequest
from slm_align.runs import StageResult


class ExportTarget:
    """The defaults of a target that writes a folder (ONNX-like): subclasses set the names and
    override what their format does differently."""

    name: str = ""
    """``--target NAME``."""
    default_quant: str = ""
    """The type exported when neither ``--quant`` nor the device names one."""
    ladder: tuple[str, ...] = ()
    """The types a refusal probes next, lowest precision first."""
    gguf_run_target: Optional[str] = None
    """What a run trained from a .gguf ships as instead of this target (``bundle --device``)."""

    def run(self, request: ExportRequest, reuse: bool = False) -> StageResult:
        """Export, verify and publish ``request``: the model export skeleton, asking this target."""
        return export_model(request, self, reuse=reuse)

    def device_quant(self, profile) -> Optional[str]:
        """The type a device profile picks for this target (None: the target's default)."""
        return None

    def check_quant(self, quant: str, preset: str) -> tuple[str, str]:
        """(type, int8 preset) as the target names them; one line for what it cannot make."""
        raise NotImplementedError

    def check_system(self, system: Optional[str]) -> None:
        """``--system`` fills an Ollama Modelfile, which only a GGUF export writes."""
        if system is not None:
            raise UserError("--system sets the system prompt of the Ollama Modelfile, which only "
                            "--target gguf writes")

    def check_config(self, config: dict) -> None:
        """Refuse, before any work, a model directory (config.json) the target cannot convert."""

    def check_architecture(self, model_type: Callable[[], Optional[str]]) -> None:
        """Refuse, before any work, an architecture the target's runtime cannot run (read on
        demand)."""

    def calibrates(self, quant: str) -> bool:
        """Whether ``--calibrate`` (an importance matrix) weighs the rounding of ``quant``."""
        return False

    def artifact_name(self, quant: str) -> str:
        return f"{self.name}-{quant}"

    def onnx_preset(self, preset: str) -> Optional[str]:
        """The int8 preset the manifest records (None: the format has none)."""
        return None

    def build(self, checkpoint: Path, scratch: Path, quant: str, settings: dict) -> Path:
        """Write the artifact of ``checkpoint`` inside ``scratch`` and return its path there.
        ``settings``: ``preset``, ``threads``, ``template`` (None: the checkpoint's own),
        ``ort_format``, ``importance``."""
        raise NotImplementedError

    def open_backend(self, artifact: Path, threads: int, n_ctx: int):
        """The runtime verification decodes ``artifact`` with (all positions' logits kept)."""
        from slm_align.ondevice.agent.open_artifact import open_backend

        return open_backend(artifact, threads=threads, n_ctx=n_ctx, all_logits=True)

    def check_backend(self, report: dict, backend, tokenizer, artifact: Path) -> None:
        """Checks of the runtime's own beside parity (added to ``report``, ``passed`` updated)."""

    def companions(self, export, built: Path, metrics: dict) -> dict[Path, str]:
        """What goes with the artifact: a folder holds its model card (written into ``built`` now);
        the files written beside it once it is published are returned by path. Each recorded in
        ``metrics``."""
        from slm_align.export.publishing.model_card import CARD, onnx_card

        metrics["model_card"] = {"path": CARD, "note": None}
        card = onnx_card(export.final.name, metrics, export.source_path())
        (built / CARD).write_text(card, encoding="utf-8")
        return {}


REGISTRY: dict[str, ExportTarget] = {}
"""``--target`` name -> its target, in registration order."""


def register(target: ExportTarget) -> ExportTarget:
    """Make ``target`` reachable as ``--target NAME``; a name registered twice is a programming
    error."""
    if target.name in REGISTRY:
        raise ValueError(f"export target {target.name} is registered twice")
    REGISTRY[target.name] = target
    return target


def target_named(name: str) -> ExportTarget:
    """The registered target ``name``, or one line naming the choices."""
    if name not in REGISTRY:
        names = list(REGISTRY)
        raise UserError(f"--target {name}: choose {', '.join(names[:-1])} or {names[-1]}")
    return REGISTRY[name]
