"""``slm-align export``: a run, a merged directory or any model source -> a parity-checked GGUF,
ONNX, onnxruntime-genai or ExecuTorch artifact.

The artifact is built in a scratch directory beside its final name, verified against the PyTorch
model, and only then renamed into place with its manifest (``model-Q8_0.gguf`` +
``model-Q8_0.gguf.json``, or ``onnx-w8/`` / ``genai-w8/`` / ``executorch-fp32/`` with
``manifest.json`` inside). A genai folder is the ONNX export with its ``genai_config.json`` written
before verification, which runs through onnxruntime-genai itself; an ExecuTorch folder's
``model.pte`` is verified through ExecuTorch's Python runtime. A failed verification publishes
nothing unless ``force``.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from slm_align.atomic import publish_directory, write_json_atomic, write_text_atomic
from slm_align.errors import UserError
from slm_align.export.executorch import check_executorch_architecture, check_executorch_quant, write_executorch
from slm_align.export.genai import check_genai_architecture, genai_tokenizer_report, write_genai_config
from slm_align.export.merge import current_merged, merged_dir, merged_stage
from slm_align.export.model_card import CARD, card_blocked, gguf_card, onnx_card
from slm_align.export.modelfile import build_modelfile, check_system_prompt, default_parameters, modelfile_path
from slm_align.export.onnx import check_onnx_quant, host_preset, write_onnx
from slm_align.export.parity import perplexity_change, verification_summary
from slm_align.modeling.accelerator import resolve_device
from slm_align.modeling.models import DEFAULT_MODEL_DIR
from slm_align.ondevice.devices.host import default_threads
from slm_align.ondevice.gguf.architectures import check_gguf_config
from slm_align.ondevice.gguf.writer import QUANTIZER_TYPES, check_gguf_type, quantize_gguf, write_gguf
from slm_align.ondevice.templates.chat import chosen_chat_template, default_chat_template
from slm_align.progress import stage_lines
from slm_align.runs import (
    MANIFEST,
    StageResult,
    artifact_digest,
    artifact_manifest,
    check_out_dir,
    file_checksums,
    make_manifest,
    read_manifest,
)

TARGETS = ("gguf", "onnx", "genai", "executorch")
# w8: the ONNX scheme that passes on real weights; ExecuTorch programs are fp32 only.
DEFAULT_QUANT = {"gguf": "Q8_0", "onnx": "w8", "genai": "w8", "executorch": "fp32"}
# What a refusal probes next, lowest precision first (the types
# benchmarks/quantization.py measures).
PRECISION_LADDER = {"gguf": ("IQ4_XS", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "F16", "F32"),
                    "onnx": ("int4", "w8", "fp32"), "genai": ("int4", "w8", "fp32"),  # int8 (dynamic) probes w8
                    "executorch": ("fp32",)}
EXACT_TYPES = {"F32", "F16", "fp32"}  # verified by greedy equality; the rest by top-1 agreement
GREEDY_REPORTED = EXACT_TYPES | {"Q8_0"}  # greedy measured and reported (Q8_0: not required, see parity.verify)


class VerificationFailed(UserError):
    """The artifact does not behave like the PyTorch model; nothing was published."""

    exit_code = 1


@dataclass
class ExportRequest:
    """What to export and how; one field per ``slm-align export`` flag."""

    source: str
    """Run directory, merged/HF model directory, .gguf file or hub id."""
    target: str = "gguf"
    """gguf (llama.cpp), onnx (onnxruntime), genai (an onnxruntime-genai folder: the ONNX
    export + its config) or executorch (an fp32 ``model.pte`` with the XNNPACK delegate
    and a static KV cache)."""
    quant: Optional[str] = None
    """GGUF type (F32, F16, Q8_0, Q4_K_M, ...) or ONNX fp32/w8/int8/int4; default: GGUF the
    device's, else Q8_0; ONNX and genai w8 (the scheme that passes on real weights; a device changes
    only the int8 preset)."""
    device: Optional[str] = None
    """Device profile name: picks the quantization, the int8 preset and the thread count."""
    out: Optional[Path] = None
    """Output directory (default RUN/export for a run, ./export otherwise)."""
    verify: bool = True
    """Check parity with the PyTorch model before publishing (recorded when off)."""
    overwrite: bool = False
    """Replace an existing artifact of the same name."""
    force: bool = False
    """Publish even when verification fails (recorded)."""
    calibrate: bool = False
    """GGUF types from llama.cpp's quantizer: an importance matrix from the run's held-out texts
    (never its training or evaluation items) weighs the rounding."""
    min_agreement: float = 0.9
    """Lowest top-1 agreement with PyTorch that a low-bit artifact may have."""
    ort_format: bool = False
    """ONNX: also convert the graph to the ORT format of onnxruntime's mobile builds."""
    threads: Optional[int] = None
    """Threads for quantization and verification (default: the device's, else all cores)."""
    preset: Optional[str] = field(default=None)
    """ONNX int8 preset (arm64, avx2, avx512, avx512_vnni); default from the
    device, else this host's."""
    system: Optional[str] = None
    """GGUF: the system prompt of the Ollama Modelfile written beside the artifact."""
    torch_device: str = "auto"
    """Where the PyTorch side of the parity check runs (auto, cpu, cuda, cuda:N, mps)."""
    chat_template: Optional[str] = None
    """"chatml" or a Jinja file: written into the artifact in place of the model's own
    (recorded in the manifest)."""
    stage: Optional[str] = None
    """A run's policy to export: ``sft`` (the prior), ``rl``, ``dpo`` or ``kto`` (that stage on the
    merged prior), into ``RUN/export-STAGE`` by default; None: the run's latest, into ``RUN/export``."""


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


def _device_settings(request: ExportRequest) -> tuple[str, str, int]:
    """(quant, onnx preset, threads) from the flags, the device profile, then the defaults."""
    quant = request.quant
    preset = request.preset
    threads = request.threads
    if request.device is not None:
        from slm_align.ondevice.devices import load_profile

        profile = load_profile(request.device)
        quant = quant or (profile.gguf_quant if request.target == "gguf" else None)  # ONNX: w8
        preset = preset or profile.onnx_preset
        threads = threads or profile.threads
    return quant or DEFAULT_QUANT[request.target], preset or host_preset(), threads or default_threads()


def _validate(request: ExportRequest) -> tuple[str, str, int]:
    if request.target not in TARGETS:
        raise UserError(f"--target {request.target}: choose gguf, gguf-adapter, onnx, genai or executorch")
    if not 0.0 <= request.min_agreement <= 1.0:
        raise UserError(f"--min-agreement {request.min_agreement}: must be between 0 and 1")
    check_system_prompt(request.system, request.target)
    if request.chat_template is not None:
        chosen_chat_template(request.chat_template)  # a missing or broken file: refused before any work
    if request.verify:
        resolve_device(request.torch_device)  # a device that is not there: refused before any work
    quant, preset, threads = _device_settings(request)
    if request.target == "gguf":
        return check_gguf_type(quant), preset, threads
    if request.target == "executorch":
        return check_executorch_quant(quant), preset, threads
    quant, preset = check_onnx_quant(quant, preset)
    return quant, preset, threads


def _is_run(path: Path) -> bool:
    return (path / "sft" / MANIFEST).is_file()


def _locate(source: str, target: str) -> dict:
    """Where ``source`` is and what it is, refused in one line when it cannot be
    exported; writes nothing."""
    path = Path(source).expanduser()
    if path.is_dir() and _is_run(path):
        return {"kind": "run", "run": str(path.resolve())}
    from slm_align.modeling.models import load_tokenizer, resolve_source

    resolved = resolve_source(source)
    if resolved.kind != "dir":
        return {"kind": resolved.kind, "ref": resolved.ref}
    if not (Path(resolved.ref) / "tokenizer.json").is_file():
        raise UserError(f"{resolved.ref} has no tokenizer.json; save the model's fast tokenizer beside the weights "
                        "(tokenizer.save_pretrained) before exporting")
    load_tokenizer(resolved)  # a broken tokenizer is refused here, in one line
    config = json.loads((Path(resolved.ref) / "config.json").read_text(encoding="utf-8"))
    if target == "gguf":
        check_gguf_config(config)
    return {"kind": "dir", "path": resolved.ref}


def _checkpoint(origin: dict, scratch: Path) -> Path:
    """A plain HF directory for ``origin``: the run merged (its ``stage``), the directory itself, or a
    .gguf/hub model saved."""
    if origin["kind"] == "run":
        return current_merged(Path(origin["run"]), origin.get("stage"))
    if origin["kind"] == "dir":
        return Path(origin["path"])
    from slm_align.modeling.models import ModelSource, load_model, load_tokenizer, save_tokenizer

    source = ModelSource(origin["kind"], origin["ref"])
    checkpoint = scratch / "checkpoint"
    load_model(source).save_pretrained(checkpoint, safe_serialization=True)
    save_tokenizer(load_tokenizer(source), source, checkpoint)
    return checkpoint


def _default_out(source: str, stage: Optional[str] = None) -> Path:
    """``RUN/export`` (``RUN/export-STAGE`` for a stage named: stages never replace each other's
    artifacts), else ``./export``."""
    path = Path(source).expanduser()
    if not (path.is_dir() and _is_run(path)):
        return Path("export")
    return path / ("export" if stage is None else f"export-{stage}")


def _check_stage(request: ExportRequest, origin: dict) -> dict:
    """``origin`` with the run's ``stage`` to export; ``--stage`` on what is not a run, or a stage
    the run has not finished, refused in one line before any work."""
    if request.stage is None:
        return origin
    if origin["kind"] != "run":
        raise UserError(f"--stage {request.stage} picks a policy of a run; {request.source} is not a run "
                        "directory (no sft/manifest.json): drop --stage")
    merged_stage(Path(origin["run"]), request.stage)
    return dict(origin, stage=request.stage)


def artifact_name(target: str, quant: str) -> str:
    return f"model-{quant}.gguf" if target == "gguf" else f"{target}-{quant}"


def _model_type(origin: dict) -> Optional[str]:
    """The architecture (config.json's model_type) of what ``origin`` exports, read
    without loading weights."""
    if origin["kind"] == "run":
        return _model_type(read_manifest(Path(origin["run"]) / "sft")["inputs"]["model"])
    if origin["kind"] in ("dir", "bundled"):
        path = Path(origin.get("path") or origin["ref"] or DEFAULT_MODEL_DIR) / "config.json"
        return json.loads(path.read_text(encoding="utf-8")).get("model_type")
    if origin["kind"] == "gguf":
        from slm_align.modeling.models import gguf_config

        return gguf_config(Path(origin["ref"])).model_type
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(origin["ref"]).model_type


def _build(target: str, quant: str, preset: str, threads: int, checkpoint: Path, scratch: Path,
           template: Optional[str], ort_format: bool, importance: Optional[dict] = None) -> Path:
    """Write the artifact inside ``scratch``; returns its path there."""
    if target == "executorch":
        built = scratch / "artifact"
        write_executorch(checkpoint, built)
        if template is not None:
            (built / "chat_template.jinja").write_text(template, encoding="utf-8")
        return built
    if target != "gguf":
        built = scratch / "artifact"
        write_onnx(checkpoint, built, quant, preset, ort_format)
        if template is not None:
            (built / "chat_template.jinja").write_text(template, encoding="utf-8")
        if target == "genai":
            from slm_align.ondevice.agent.settings import SamplingParams

            write_genai_config(built, SamplingParams().to_dict())
        return built
    built = scratch / artifact_name(target, quant)
    if quant in QUANTIZER_TYPES:
        full = write_gguf(checkpoint, scratch / "f32.gguf", "F32", chat_template=template)
        quantize_gguf(full, built, quant, threads, importance)
        full.unlink()
        return built
    return write_gguf(checkpoint, built, quant, chat_template=template)


def _check_calibrate(request: ExportRequest, quant: str, origin: dict) -> None:
    """``--calibrate`` needs a run (its held-out texts) and a type llama.cpp's quantizer
    makes; one line if not."""
    if not request.calibrate:
        return
    if request.target != "gguf" or quant not in QUANTIZER_TYPES:
        raise UserError(f"--calibrate weighs llama.cpp's quantizer ({', '.join(QUANTIZER_TYPES)}); "
                        f"{request.target} {quant} takes no calibration: drop --calibrate")
    if origin["kind"] != "run":
        raise UserError(f"--calibrate reads a run's held-out texts; {request.source} "
                        "is not a run directory")


def _importance(request: ExportRequest, origin: dict, quant: str, checkpoint: Path) -> dict:
    """The importance matrix from the run's held-out texts (``matrix`` None without --calibrate)."""
    if not request.calibrate:
        return {"matrix": None, "texts": 0}
    from slm_align.export.calibration import run_importance

    matrix, texts = run_importance(Path(origin["run"]), checkpoint)
    return {"matrix": matrix, "texts": texts}


def _open_artifact(target: str, artifact: Path, threads: int):
    """The backend verification runs ``artifact`` on: onnxruntime-genai's decoder for a genai
    folder, ExecuTorch's runtime for a .pte."""
    from slm_align.export.parity import VERIFY_CONTEXT

    if target == "executorch":
        from slm_align.ondevice.agent.executorch_backend import ExecutorchBackend

        return ExecutorchBackend(artifact, threads=threads, n_ctx=VERIFY_CONTEXT)
    if target == "genai":
        from slm_align.ondevice.agent.genai_backend import GenaiBackend

        return GenaiBackend(artifact, threads=threads, n_ctx=VERIFY_CONTEXT)
    from slm_align.ondevice.agent.open_artifact import open_backend

    return open_backend(artifact, threads=threads, n_ctx=VERIFY_CONTEXT, all_logits=True)


def _verify(checkpoint: Path, artifact: Path, quant: str, threads: int, min_agreement: float,
            torch_device: str = "auto", target: str = "gguf") -> dict:
    """Parity with PyTorch (:func:`~slm_align.export.parity.verify`); a genai folder also needs
    genai's own tokenizer to split the verification texts and chats as the model's tokenizer does
    (:func:`~slm_align.export.genai.genai_tokenizer_report`)."""
    from slm_align.export.parity import HELDOUT_TEXT, RAW_TEXTS, USER_MESSAGES, verify
    from slm_align.modeling.models import load_model, load_tokenizer, resolve_source

    source = resolve_source(str(checkpoint))
    model = load_model(source).to(resolve_device(torch_device))
    tokenizer = load_tokenizer(source)
    backend = _open_artifact(target, artifact, threads)
    report = verify(model, tokenizer, backend, exact=quant in EXACT_TYPES, min_agreement=min_agreement,
                    greedy=quant in GREEDY_REPORTED).to_dict()
    if target == "genai":
        from transformers import AutoTokenizer

        chats = [[{"role": "user", "content": message}] for message in USER_MESSAGES]
        report.update(genai_tokenizer_report(backend.model, tokenizer, list(RAW_TEXTS) + [HELDOUT_TEXT], chats,
                                             AutoTokenizer.from_pretrained(artifact)))
        report["passed"] = report["passed"] and report["genai_tokenizer_match"]
    return report


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def _publish(built: Path, final: Path, manifest: dict) -> None:
    """Manifest first (inside an ONNX dir, beside a GGUF file), then the
    artifact renamed into place."""
    if built.is_dir():
        write_json_atomic(artifact_manifest(built), dict(manifest, files=file_checksums(built)))
    else:
        write_json_atomic(artifact_manifest(final), manifest)
    publish_directory(built, final, replace=True)


def _failure(verification: dict) -> str:
    if verification.get("genai_tokenizer_match") is False:
        return "onnxruntime-genai's tokenizer splits text or renders chats differently from the model's"
    if not verification["tokenizer_match"]:
        return "its tokenizer splits text differently from the model's"
    if verification["divergences"]:
        first = verification["divergences"][0]
        return (f"greedy decoding diverged from PyTorch on {len(verification['divergences'])} "
                f"prompt(s) (first at token {first['position']})")
    return (f"top-1 agreement {verification['agreement']:.3f} < {verification['min_agreement']} "
            f"({perplexity_change(verification)})")


def next_higher(target: str, quant: str) -> Optional[str]:
    """The next type up ``PRECISION_LADDER`` from ``quant`` (one not on it: the
    first above it in bits)."""
    from slm_align.ondevice.devices.quant import BITS_PER_WEIGHT, find_quant

    ladder = PRECISION_LADDER[target]
    if quant in ladder:
        above = ladder[ladder.index(quant) + 1:]
    else:
        bits = BITS_PER_WEIGHT.get(find_quant(quant) or "", 0.0)
        above = [q for q in ladder if BITS_PER_WEIGHT.get(find_quant(q) or "", 0.0) > bits]
    return above[0] if above else None


def _probe_advice(request: ExportRequest, quant: str, preset: str, threads: int, checkpoint: Path, scratch: Path,
                  template: Optional[str]) -> str:
    """Build and verify the next-higher type in ``scratch``; what the refusal
    should tell the user to do."""
    higher = next_higher(request.target, quant)
    if higher is None:
        return "No higher precision to try; --force publishes anyway"
    probe = scratch / "probe"
    probe.mkdir()
    built = _build(request.target, higher, preset, threads, checkpoint, probe, template, False)
    found = _verify(checkpoint, built, higher, threads, request.min_agreement, request.torch_device, request.target)
    if found["passed"]:
        return (f"--quant {higher} passes (agreement {found['agreement']:.3f}, {perplexity_change(found)}): "
                "export with it, or --force to publish this one anyway")
    return f"--quant {higher} fails too ({_failure(found)}); try a higher precision, or --force to publish anyway"


def _exported_stage(origin: dict) -> Optional[str]:
    """The run's stage an artifact holds (``sft``, ``rl``, ``dpo``, ``kto``); None for no run."""
    if origin["kind"] != "run":
        return None
    return origin.get("stage") or merged_stage(Path(origin["run"])) or "sft"


def _source_path(origin: dict) -> Optional[Path]:
    """The local run or directory exported (a model card reads the run's records
    from it); None otherwise."""
    if origin["kind"] == "run" and origin.get("stage") is not None:
        return merged_dir(Path(origin["run"]), origin["stage"])  # its card is that stage's
    if origin["kind"] == "run":
        return Path(origin["run"])
    if origin["kind"] == "dir":
        return Path(origin["path"])
    return None


def _gguf_companions(request: ExportRequest, final: Path, checkpoint: Path, chat_template: Optional[str],
                     metrics: dict, origin: dict) -> dict[Path, str]:
    """The files written beside a GGUF once it is published (its Ollama Modelfile, the directory's
    model card), by path; each recorded in ``metrics``."""
    modelfile = build_modelfile(final.name, chat_template, default_parameters(checkpoint), request.system)
    metrics["modelfile"] = {"path": modelfile_path(final).name, "note": modelfile.note}
    companions = {modelfile_path(final): modelfile.text}
    blocked = card_blocked(final.parent)
    metrics["model_card"] = {"path": CARD, "note": blocked}
    if blocked is None:
        companions[final.parent / CARD] = gguf_card(final.parent, _source_path(origin), (final.name, metrics))
    return companions


def run_export(request: ExportRequest) -> StageResult:
    """Export, verify and publish one artifact; returns its path and the manifest's metrics."""
    if request.target == "gguf-adapter":
        from slm_align.export.adapter_export import run_adapter_export

        return run_adapter_export(request)
    started = time.time()
    quant, preset, threads = _validate(request)
    origin = _check_stage(request, _locate(request.source, request.target))
    if request.target == "genai":
        check_genai_architecture(_model_type(origin))  # GPT-NeoX, GPT-2: refused before any work
    if request.target == "executorch":
        check_executorch_architecture(_model_type(origin))
    _check_calibrate(request, quant, origin)
    out = check_out_dir(Path(request.out) if request.out is not None else _default_out(request.source, request.stage))
    final = out / artifact_name(request.target, quant)
    if final.exists() and not request.overwrite:
        raise UserError(f"{final} exists; pass --overwrite to replace it or choose another --out")
    scratch = out / f".{final.name}.partial"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        checkpoint = _checkpoint(origin, scratch)
        from slm_align.modeling.models import load_tokenizer, resolve_source

        checkpoint_tokenizer = load_tokenizer(resolve_source(str(checkpoint)))
        template, template_origin = _chat_template(request.chat_template, checkpoint_tokenizer)
        with stage_lines("export", f"{request.target} {quant} of {request.source}") as stage:
            importance = _importance(request, origin, quant, checkpoint)
            built = _build(request.target, quant, preset, threads, checkpoint, scratch, template, request.ort_format,
                           importance["matrix"])
            stage.figures = f"{_size(built) / 1e6:.1f} MB"
        export_seconds = round(time.time() - started, 2)
        verification = {"skipped": True}
        if request.verify:
            checks = "tokenizer, greedy decoding and top-1 agreement against PyTorch"
            with stage_lines("export verification", checks) as checking:
                verification = _verify(checkpoint, built, quant, threads, request.min_agreement,
                                       request.torch_device, request.target)
                verdict = "passed" if verification["passed"] else "FAILED"
                checking.figures = f"{verdict}, {verification_summary(verification)}"
        if request.verify and not verification["passed"] and not request.force:
            advice = _probe_advice(request, quant, preset, threads, checkpoint, scratch, template)
            raise VerificationFailed(f"export not published: {_failure(verification)}; nothing was "
                                     f"written to {final}. {advice}")
        onnx_preset = preset if request.target in ("onnx", "genai") else None
        metrics = {"target": request.target, "quant": quant, "preset": onnx_preset,
                   "device": request.device, "threads": threads, "bytes": _size(built),
                   "sha256": artifact_digest(built), "export_seconds": export_seconds,
                   "default_chat_template": template_origin == "default", "chat_template": template_origin,
                   "verification": verification,
                   "forced": bool(request.force and request.verify and not verification["passed"]),
                   "calibration_texts": importance["texts"]}
        companions = {}
        if request.target == "gguf":
            chat_template = template or checkpoint_tokenizer.chat_template
            companions = _gguf_companions(request, final, checkpoint, chat_template, metrics, origin)
        else:
            metrics["model_card"] = {"path": CARD, "note": None}
            (built / CARD).write_text(onnx_card(final.name, metrics, _source_path(origin)), encoding="utf-8")
        inputs = {"source": origin, "target": request.target, "quant": quant, "ort_format": request.ort_format,
                  "calibrate": request.calibrate, "stage": _exported_stage(origin)}
        _publish(built, final, make_manifest("export", inputs, metrics, started))
        for path, text in companions.items():
            write_text_atomic(path, text)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return StageResult(final, skipped=False, metrics=metrics)
