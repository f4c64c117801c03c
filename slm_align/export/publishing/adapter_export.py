"""``slm-align export RUN --target gguf-adapter``: a run's LoRA adapters as llama.cpp LoRA adapter
GGUFs, beside the base they apply to, bound to it by hash and parity-checked as base + adapters.

The chain is the run's SFT adapter (trained on the base) and, when the run has a later aligned stage
(the latest of RL, DPO and KTO: :func:`~slm_align.export.converters.merge.merged_stage`), that
stage's adapter (trained on the merged SFT weights after merge-and-reinit). Both deltas are
additive, so ``base + dSFT + dStage`` is the merged policy: both files apply, in order, to the
ORIGINAL base.

The base is the run's own source when that was a .gguf (the user's file, referenced by path and
sha256, never copied or changed: the adapters were trained on its dequantized weights); otherwise
one ``base-<QUANT>.gguf`` (F16 unless ``--quant``) exported into the output folder and reused by
later rounds while it is byte-identical. Each adapter file records the base's sha256
(:func:`~slm_align.ondevice.gguf.adapter_check.check_adapter_base` refuses another base).

Everything is built in a scratch folder, verified (llama.cpp with the base and every adapter applied
against ``RUN/merged`` in PyTorch: :func:`~slm_align.export.publishing.parity.verify`), and only
then renamed into place (:func:`~slm_align.runs.publish_artifact`); the manifest
``adapter-<STAGE>-<TYPE>.gguf.json`` comes last, so its presence says the chain is whole. Its
``metrics.sha256`` is the chain's id (:func:`~slm_align.ondevice.gguf.adapter_check.chain_digest`),
which the runtime records as ``model_id`` for every answer base + adapters give."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from slm_align.atomic import publish_directory, write_json_atomic
from slm_align.errors import UserError
from slm_align.export.converters.merge import current_merged, merged_stage, policy_identity
from slm_align.export.publishing.parity import perplexity_change, verification_summary
from slm_align.export.publishing.sources import origin_of
from slm_align.modeling.accelerator import resolve_device
from slm_align.ondevice.devices.host import default_threads
from slm_align.ondevice.gguf.adapter_check import chain_digest
from slm_align.ondevice.gguf.adapter_writer import write_lora_gguf
from slm_align.ondevice.gguf.fields import read_fields
from slm_align.ondevice.gguf.writer import (
    QUANTIZER_TYPES,
    check_gguf_type,
    quantize_gguf,
    write_gguf,
)
from slm_align.ondevice.templates.chat import chosen_chat_template, default_chat_template
from slm_align.progress import stage_lines
from slm_align.runs import (
    MANIFEST,
    Artifact,
    StageResult,
    check_out_dir,
    policy_adapter,
    publish_artifact,
    read_manifest,
    sha256_file,
)

TARGET = "gguf-adapter"
DEFAULT_BASE_QUANT = "F16"
EXACT_FILE_TYPES = {0: "F32", 1: "F16"}
"""GGUF ``general.file_type`` values verified by greedy equality; other bases by top-1 agreement."""


class AdapterVerificationFailed(UserError):
    """Base + adapters do not behave like the PyTorch policy; nothing was published."""

    exit_code = 1


def run_adapter_export(request, reuse: bool = False) -> StageResult:
    """Export, verify and publish a run's adapter chain for the
    :class:`~slm_align.export.publishing.request.ExportRequest` ``request`` (target
    ``gguf-adapter``); returns the manifest's path and metrics (with ``reuse``, a chain there made
    from the same inputs is returned as it is)."""
    started = time.time()
    run, quant, threads = _validate(request)
    chain = adapter_chain(run, request.stage)
    source = run_source(run)
    if source.kind == "gguf" and request.chat_template is not None:
        raise UserError(f"the base is your own {Path(source.ref).name}, which is left untouched: "
                        "drop --chat-template here and pass it to `slm-align chat` instead")
    out = check_out_dir(Path(request.out) if request.out is not None else run / "export")
    exported = AdapterChain(request, run, chain, source, (quant, threads), out, started)
    result = publish_artifact(exported, overwrite=request.overwrite, reuse=reuse)
    return StageResult(exported.manifest_path, skipped=result.skipped, metrics=result.metrics)


class AdapterChain(Artifact):
    """A run's adapters (in ``chain`` order) as GGUF adapter files in ``out`` beside the base they
    bind to; ``final`` is the last adapter, its manifest ``adapter-<STAGE>-<TYPE>.gguf.json`` beside
    it."""

    def __init__(self, request, run: Path, chain: list[tuple[str, Path]], source,
                 settings: tuple[str, int], out: Path, started: float):
        self.request, self.run, self.chain, self.source, self.out = request, run, chain, source, out
        self.quant, self.threads = settings
        self.adapter_type = "F32" if self.quant == "F32" else "F16"
        self.names = [f"adapter-{stage}-{self.adapter_type}.gguf" for stage, _ in chain]
        self.final = out / self.names[-1]
        self.manifest_path = out / f"{self.names[-1]}.json"
        self.started = started

    def taken(self) -> bool:
        return self.final.exists() or self.manifest_path.exists()

    def inputs(self) -> dict:
        return {"source": {"kind": "run", "run": str(self.run)}, "target": TARGET,
                "quant": self.quant, "stages": [stage for stage, _ in self.chain],
                "policy": policy_identity(self.run, merged_stage(self.run, self.request.stage))}

    def build(self, scratch: Path) -> Path:
        """The base (unless it is the user's .gguf) and every adapter, in ``scratch``."""
        stages = " + ".join(stage for stage, _ in self.chain)
        with stage_lines("export", f"{TARGET} {stages} of {self.run}") as stage:
            self.base, self.base_built = _base(self.request, self.source, self.quant, self.threads,
                                               self.out, scratch)
            shapes_from = scratch / "checkpoint"
            if self.source.kind in ("gguf", "dir"):
                shapes_from = Path(self.source.ref)
            self.built = [write_lora_gguf(adapter_dir, shapes_from, scratch / name,
                                          self.adapter_type, base_gguf=self.base_built)
                          for (_, adapter_dir), name in zip(self.chain, self.names)]
            stage.figures = " + ".join(f"{path.stat().st_size / 1e6:.2f} MB" for path in self.built)
        self.export_seconds = round(time.time() - self.started, 2)
        return scratch

    def verify(self, built: Path) -> dict:
        """Parity of base + adapters; no file of the chain replaced by other bytes without
        --overwrite."""
        verification = _verification(self.request, self.run, self.base_built, self.built,
                                     self.quant, self.threads)
        self.placed = list(zip(self.built, [self.out / name for name in self.names]))
        if self.base != self.base_built:
            self.placed.append((self.base_built, self.base))
        _check_replaced(self.placed, self.request.overwrite)
        return _metrics(self, verification)

    def place(self, built: Path, manifest: Optional[dict]) -> None:
        """Each file renamed into place (an identical one already there stays: adapters stay bound
        to it), the manifest last: its presence says the chain is whole."""
        for path, final in self.placed:
            if not final.exists() or sha256_file(final) != sha256_file(path):
                publish_directory(path, final, replace=True)
        write_json_atomic(self.manifest_path, manifest)


def _validate(request) -> tuple[Path, str, int]:
    """(run, base quant, threads) from the flags; one line for what this target cannot take."""
    path = Path(request.source).expanduser()
    if not (path.is_dir() and (path / "sft" / MANIFEST).is_file()):
        raise UserError(f"--target {TARGET} exports a run's LoRA adapters, and {request.source} "
                        "is not a run directory (no sft/manifest.json): pass the run (`--out` of "
                        "`slm-align sft`)")
    for flag, given in (("--calibrate", request.calibrate), ("--system", request.system),
                        ("--ort-format", request.ort_format)):
        if given:
            raise UserError(f"{flag} does not apply to --target {TARGET}: drop it")
    if not 0.0 <= request.min_agreement <= 1.0:
        raise UserError(f"--min-agreement {request.min_agreement}: must be between 0 and 1")
    if request.chat_template is not None:
        chosen_chat_template(request.chat_template)
    if request.verify:
        resolve_device(request.torch_device)
    threads = request.threads
    if request.device is not None:
        from slm_align.ondevice.devices import load_profile

        threads = threads or load_profile(request.device).threads
    quant = check_gguf_type(request.quant or DEFAULT_BASE_QUANT)
    return path.resolve(), quant, threads or default_threads()


def adapter_chain(run: Path, stage: Optional[str] = None) -> list[tuple[str, Path]]:
    """``[(stage, adapter dir)]`` in the order they apply: SFT, then ``stage`` (``sft``: none; None:
    the latest aligned stage if any)."""
    chain = [("sft", run / "sft" / "adapter")]
    aligned = merged_stage(run, stage)
    if aligned is not None:
        chain.append((aligned, policy_adapter(run, aligned)))
    return chain


def run_source(run: Path):
    """The model the run's SFT started from (a :class:`~slm_align.modeling.models.ModelSource`)."""
    from slm_align.modeling.models import resolve_source

    record = read_manifest(run / "sft")["inputs"]["model"]
    if origin_of(record).gone():
        raise UserError(f"the run's base {record['ref']} is gone; "
                        "put the .gguf it was trained on back there")
    return resolve_source(record["ref"])


def _base(request, source, quant: str, threads: int, out: Path, scratch: Path) -> tuple[Path, Path]:
    """(where the base will be, the file to bind and verify now): the user's .gguf twice, or
    ``out/base-QUANT.gguf`` and its build in ``scratch`` (the same bytes when one is already there).
    """
    if source.kind == "gguf":
        return Path(source.ref), Path(source.ref)
    from slm_align.modeling.models import load_model, load_tokenizer, save_tokenizer

    model_dir = Path(source.ref)
    if source.kind == "hub":
        model_dir = scratch / "checkpoint"
        load_model(source).save_pretrained(model_dir, safe_serialization=True)
        save_tokenizer(load_tokenizer(source), source, model_dir)
    tokenizer = load_tokenizer(source)
    if request.chat_template is not None:
        template = chosen_chat_template(request.chat_template).source
    else:  # what merge_run writes into RUN/merged: the model's own, else the default
        template = tokenizer.chat_template or default_chat_template(tokenizer)
    built = scratch / f"base-{quant}.gguf"
    if quant in QUANTIZER_TYPES:
        full = write_gguf(model_dir, scratch / "f32.gguf", "F32", chat_template=template)
        quantize_gguf(full, built, quant, threads)
        full.unlink()
    else:
        write_gguf(model_dir, built, quant, chat_template=template)
    return out / built.name, built


def _check_replaced(placed: list[tuple[Path, Path]], overwrite: bool) -> None:
    """Refuse (without --overwrite) to replace an existing file of the chain (``(built, final)``
    pairs) with different bytes: adapters bound to an old base, or an earlier round's manifest,
    would break."""
    for path, final in placed:
        if final.exists() and not overwrite and sha256_file(final) != sha256_file(path):
            raise UserError(f"{final} exists with other contents; pass --overwrite to replace it "
                            "(adapters exported for it will no longer load) or choose another "
                            "--out")


def _verification(request, run: Path, base: Path, adapters: list[Path], quant: str,
                  threads: int) -> dict:
    """Parity of base + adapters in llama.cpp with ``RUN/merged`` in PyTorch; raises
    :class:`AdapterVerificationFailed` (unless ``force``) when it fails."""
    if not request.verify:
        return {"skipped": True}
    from slm_align.export.publishing.parity import VERIFY_CONTEXT, verify
    from slm_align.modeling.models import load_model, load_tokenizer, resolve_source
    from slm_align.ondevice.agent.llama_backend import LlamaCppBackend

    file_type = read_fields(base, prefix="general.file_type").get("general.file_type")
    exact = file_type is not None and file_type.value in EXACT_FILE_TYPES
    checks = "base + adapters in llama.cpp against the PyTorch policy"
    with stage_lines("export verification", checks) as checking:
        merged = resolve_source(str(current_merged(run, request.stage)))
        model = load_model(merged).to(resolve_device(request.torch_device))
        backend = LlamaCppBackend(base, threads=threads, n_ctx=VERIFY_CONTEXT, all_logits=True,
                                  adapters=adapters)
        report = verify(model, load_tokenizer(merged), backend, exact=exact,
                        min_agreement=request.min_agreement,
                        greedy=exact or quant == "Q8_0").to_dict()
        verdict = "passed" if report["passed"] else "FAILED"
        checking.figures = f"{verdict}, {verification_summary(report)}"
    if not report["passed"] and not request.force:
        raise AdapterVerificationFailed("adapters not published: base + adapters in llama.cpp "
                                        f"differ from the PyTorch policy ({_failure(report)}); "
                                        "try --quant F16, or --force to publish anyway")
    return report


def _failure(report: dict) -> str:
    if not report["tokenizer_match"]:
        return "the base's tokenizer splits text differently"
    if report["divergences"]:
        return f"greedy decoding diverged on {len(report['divergences'])} prompt(s)"
    return (f"top-1 agreement {report['agreement']:.3f} < {report['min_agreement']}, "
            f"{perplexity_change(report)}")


def _metrics(chain: AdapterChain, verification: dict) -> dict:
    """The manifest's record: the base (path, sha256, whether exported here), the ordered adapters
    (file, stage, what each was trained on, sha256, scale, size) and the chain's id."""
    base, base_built, request = chain.base, chain.base_built, chain.request
    exported = base != base_built
    base_sha = sha256_file(base_built)
    base_record = {"path": base.name if exported else str(base), "sha256": base_sha,
                   "bytes": base_built.stat().st_size, "exported": exported,
                   "quant": chain.quant if exported else None,
                   "source": {"kind": chain.source.kind, "ref": chain.source.ref}}
    adapters = [{"path": path.name, "stage": stage,
                 "trained_on": "base" if stage == "sft" else "merged sft",
                 "sha256": sha256_file(path), "bytes": path.stat().st_size, "scale": 1.0}
                for (stage, _), path in zip(chain.chain, chain.built)]
    return {"target": TARGET, "quant": chain.quant, "adapter_type": chain.adapter_type,
            "device": request.device, "threads": chain.threads, "base": base_record,
            "adapters": adapters,
            "bytes": sum(adapter["bytes"] for adapter in adapters),
            "sha256": chain_digest(base_sha, [adapter["sha256"] for adapter in adapters]),
            "export_seconds": chain.export_seconds, "verification": verification,
            "forced": bool(request.force and request.verify and not verification["passed"])}


def manifest_files(manifest: dict, folder: Path) -> tuple[Path, list[Path]]:
    """(base, adapters in order) named by an adapter export's manifest read from ``folder``."""
    base = Path(manifest["metrics"]["base"]["path"])
    adapters = [folder / adapter["path"] for adapter in manifest["metrics"]["adapters"]]
    return (base if base.is_absolute() else folder / base), adapters
