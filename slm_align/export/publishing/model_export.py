"""One model exported to one target and published through :func:`~slm_align.runs.publish_artifact`.

The artifact is built in a scratch folder beside its final name, verified against the PyTorch model,
and only then renamed into place with its manifest (``model-Q8_0.gguf`` + ``model-Q8_0.gguf.json``,
or ``onnx-w8/`` / ``genai-w8/`` / ``executorch-fp32/`` with ``manifest.json`` inside). What differs
by format (types, converter, runtime, companions) is asked of the target
(:class:`~slm_align.export.targets.base.ExportTarget`). A failed verification publishes nothing
unless ``force``; an artifact made from the same inputs is reused only when the caller asks for
reuse."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from slm_align.atomic import write_text_atomic
from slm_align.errors import UserError
from slm_align.export.converters.onnx import host_preset
from slm_align.export.publishing import sources
from slm_align.export.publishing.parity import verification_summary
from slm_align.export.publishing.request import ExportRequest, VerificationFailed
from slm_align.export.publishing.sources import Origin
from slm_align.export.publishing.verification import failure, probe_advice, verify_artifact
from slm_align.modeling.accelerator import resolve_device
from slm_align.ondevice.devices.host import default_threads
from slm_align.ondevice.gguf.writer import QUANTIZER_TYPES
from slm_align.ondevice.templates.chat import chosen_chat_template, default_chat_template
from slm_align.progress import stage_lines
from slm_align.runs import Artifact, StageResult, artifact_digest, check_out_dir, publish_artifact


def _chat_template(option: Optional[str], tokenizer) -> tuple[Optional[str], str]:
    """The template written into the artifact (None: the checkpoint's own stays) and what the
    manifest records: the ``--chat-template`` given, else "default" (ChatML or Gemma's turns, for a
    model without one), else "source"."""
    if option is not None:
        chosen = chosen_chat_template(option)
        return chosen.source, chosen.origin
    if tokenizer.chat_template is None:
        return default_chat_template(tokenizer), "default"
    return None, "source"


def _size(path: Path) -> int:
    if not path.is_dir():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


class ModelExport(Artifact):
    """``request``'s model as ``target``'s artifact at ``final``, with the (quant, preset, threads)
    chosen."""

    def __init__(self, request: ExportRequest, target, settings: tuple[str, str, int],
                 origin: Origin, final: Path, started: float):
        self.request, self.target, self.origin = request, target, origin
        self.final, self.started = final, started
        self.quant, self.preset, self.threads = settings
        self.checkpoint: Optional[Path] = None

    def inputs(self) -> dict:
        inputs = {"source": self.origin.record(), "target": self.request.target,
                  "quant": self.quant, "ort_format": self.request.ort_format,
                  "calibrate": self.request.calibrate, "stage": self.origin.exported_stage()}
        identity = self.origin.identity()
        return inputs if identity is None else dict(inputs, policy=identity)

    def settings(self) -> dict:
        """What the target's converter takes beside the checkpoint, scratch and type."""
        return {"preset": self.preset, "threads": self.threads, "template": self.template,
                "ort_format": self.request.ort_format, "importance": self.importance["matrix"]}

    def template_text(self) -> Optional[str]:
        """The chat template the artifact carries: the one written into it, else the checkpoint's
        own."""
        return self.template or self.checkpoint_template

    def source_path(self) -> Optional[Path]:
        return self.origin.local_path()

    def build(self, scratch: Path) -> Path:
        from slm_align.modeling.models import load_tokenizer, resolve_source

        self.scratch = scratch
        self.checkpoint = self.origin.checkpoint(scratch)
        tokenizer = load_tokenizer(resolve_source(str(self.checkpoint)))
        self.checkpoint_template = tokenizer.chat_template
        self.template, self.template_origin = _chat_template(self.request.chat_template, tokenizer)
        what = f"{self.request.target} {self.quant} of {self.request.source}"
        with stage_lines("export", what) as stage:
            self.importance = self._importance()
            built = self.target.build(self.checkpoint, scratch, self.quant, self.settings())
            stage.figures = f"{_size(built) / 1e6:.1f} MB"
        self.export_seconds = round(time.time() - self.started, 2)
        return built

    def _importance(self) -> dict:
        """The importance matrix from the run's held-out texts (``matrix`` None without
        --calibrate)."""
        if not self.request.calibrate:
            return {"matrix": None, "texts": 0}
        from slm_align.export.converters.calibration import run_importance

        matrix, texts = run_importance(self.origin.calibration_run(), self.checkpoint)
        return {"matrix": matrix, "texts": texts}

    def verify(self, built: Path) -> dict:
        """Parity with PyTorch (a failure refused with the next-higher type's verdict unless
        ``force``); returns the manifest's metrics, the target's companions recorded."""
        request = self.request
        verification = {"skipped": True}
        if request.verify:
            checks = "tokenizer, greedy decoding and top-1 agreement against PyTorch"
            with stage_lines("export verification", checks) as checking:
                verification = verify_artifact(self.target, self.checkpoint, built, self.quant,
                                               self.threads, request.min_agreement,
                                               request.torch_device)
                verdict = "passed" if verification["passed"] else "FAILED"
                checking.figures = f"{verdict}, {verification_summary(verification)}"
        if request.verify and not verification["passed"] and not request.force:
            advice = probe_advice(self, self.scratch)
            raise VerificationFailed(f"export not published: {failure(verification)}; nothing was "
                                     f"written to {self.final}. {advice}")
        metrics = self._metrics(built, verification)
        self.companion_files = self.target.companions(self, built, metrics)
        return metrics

    def _metrics(self, built: Path, verification: dict) -> dict:
        request = self.request
        return {"target": request.target, "quant": self.quant,
                "preset": self.target.onnx_preset(self.preset), "device": request.device,
                "threads": self.threads, "bytes": _size(built), "sha256": artifact_digest(built),
                "export_seconds": self.export_seconds,
                "default_chat_template": self.template_origin == "default",
                "chat_template": self.template_origin,
                "verification": verification,
                "forced": bool(request.force and request.verify and not verification["passed"]),
                "calibration_texts": self.importance["texts"]}

    def place(self, built: Path, manifest: Optional[dict]) -> None:
        """The artifact with its manifest, then the files beside it (Modelfile, model card)."""
        super().place(built, manifest)
        for path, text in self.companion_files.items():
            write_text_atomic(path, text)


def _device_settings(request: ExportRequest, target) -> tuple[str, str, int]:
    """(quant, onnx preset, threads) from the flags, the device profile, then the defaults."""
    quant = request.quant
    preset = request.preset
    threads = request.threads
    if request.device is not None:
        from slm_align.ondevice.devices import load_profile

        profile = load_profile(request.device)
        quant = quant or target.device_quant(profile)  # ONNX: w8
        preset = preset or profile.onnx_preset
        threads = threads or profile.threads
    return quant or target.default_quant, preset or host_preset(), threads or default_threads()


def _validate(request: ExportRequest, target) -> tuple[str, str, int]:
    """(quant, preset, threads), every flag checked before any work."""
    if not 0.0 <= request.min_agreement <= 1.0:
        raise UserError(f"--min-agreement {request.min_agreement}: must be between 0 and 1")
    target.check_system(request.system)
    if request.chat_template is not None:
        chosen_chat_template(request.chat_template)  # a missing or broken file: refused now
    if request.verify:
        resolve_device(request.torch_device)  # a device that is not there: refused before any work
    quant, preset, threads = _device_settings(request, target)
    quant, preset = target.check_quant(quant, preset)
    return quant, preset, threads


def _check_calibrate(request: ExportRequest, target, quant: str, origin: Origin) -> None:
    """``--calibrate`` needs a run (its held-out texts) and a type llama.cpp's quantizer makes; one
    line if not."""
    if not request.calibrate:
        return
    if not target.calibrates(quant):
        raise UserError(f"--calibrate weighs llama.cpp's quantizer ({', '.join(QUANTIZER_TYPES)}); "
                        f"{request.target} {quant} takes no calibration: drop --calibrate")
    if origin.calibration_run() is None:
        raise UserError(f"--calibrate reads a run's held-out texts; {request.source} "
                        "is not a run directory")


def export_model(request: ExportRequest, target, reuse: bool = False) -> StageResult:
    """Export, verify and publish one artifact of ``target``; returns its path and the manifest's
    metrics (with ``reuse``, an artifact there made from the same inputs is returned as it is)."""
    started = time.time()
    settings = _validate(request, target)
    located = sources.locate(request.source, target.check_config)
    origin = sources.check_stage(request.stage, request.source, located)
    target.check_architecture(origin.model_type)
    _check_calibrate(request, target, settings[0], origin)
    out = request.out
    if out is None:
        out = sources.default_out(request.source, request.stage)
    final = check_out_dir(Path(out)) / target.artifact_name(settings[0])
    export = ModelExport(request, target, settings, origin, final, started)
    return publish_artifact(export, overwrite=request.overwrite, reuse=reuse)
