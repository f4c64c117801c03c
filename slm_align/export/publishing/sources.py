"""What an export reads: where its source is and what it is (a run, a model directory, a .gguf or
hub model), the HF checkpoint it converts, and what its manifest records of it.

Each kind of source is one small class (:class:`Origin`): what it is called, whether ``--stage``
applies, how it gives a plain HF checkpoint, its architecture, and what the export's inputs record
of it. :func:`locate` builds one from the user's source string, :func:`origin_of` from a
manifest's record; nothing else asks an origin what kind it is."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar, Optional

from slm_align.errors import UserError
from slm_align.export.converters.merge import (
    current_merged,
    merged_dir,
    merged_stage,
    policy_identity,
)
from slm_align.modeling.models import DEFAULT_MODEL_DIR
from slm_align.runs import MANIFEST, read_manifest


def is_run(path: Path) -> bool:
    return (path / "sft" / MANIFEST).is_file()


def _config_type(folder: Path) -> Optional[str]:
    """config.json's model_type in ``folder``, read without loading weights."""
    return json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")


class Origin:
    """One exported source. Subclasses say what differs; the defaults are a model that is not a
    run (no stage, no policy identity, no held-out texts)."""

    kind: ClassVar[str]
    """What the manifest's ``source.kind`` calls it."""

    @classmethod
    def from_record(cls, record: dict) -> Origin:
        return cls(**{key: value for key, value in record.items() if key != "kind"})

    def record(self) -> dict:
        """What the export's inputs (and so its manifest and its reuse digest) hold of it."""
        raise NotImplementedError

    def at_stage(self, stage: str, source: str) -> Origin:
        """This origin exporting the run's ``stage``; refused in one line when it is not a run."""
        raise UserError(f"--stage {stage} picks a policy of a run; {source} is not a run "
                        "directory (no sft/manifest.json): drop --stage")

    def checkpoint(self, scratch: Path) -> Path:
        """A plain HF directory of the model (saved into ``scratch`` when it is not one)."""
        raise NotImplementedError

    def model_type(self) -> Optional[str]:
        """The architecture (config.json's model_type), read without loading weights."""
        raise NotImplementedError

    def exported_stage(self) -> Optional[str]:
        """The run's stage the artifact holds (``sft``, ``rl``, ``dpo``, ``kto``); None: no run."""
        return None

    def identity(self) -> Optional[dict]:
        """What a run's export is made of, by content; None for a model that is not a run."""
        return None

    def local_path(self) -> Optional[Path]:
        """The local run or directory exported (a model card reads its records); None otherwise."""
        return None

    def calibration_run(self) -> Optional[Path]:
        """The run whose held-out texts calibrate the quantizer; None: nothing to calibrate on."""
        return None

    def gone(self) -> bool:
        """Whether a local file it names is no longer there."""
        return False


@dataclass(frozen=True)
class RunOrigin(Origin):
    """A run directory: its merged policy (the latest aligned stage, or ``stage``)."""

    run: str
    stage: Optional[str] = None
    kind: ClassVar[str] = "run"

    def record(self) -> dict:
        if self.stage is None:
            return {"kind": self.kind, "run": self.run}
        return {"kind": self.kind, "run": self.run, "stage": self.stage}

    def at_stage(self, stage: str, source: str) -> Origin:
        merged_stage(Path(self.run), stage)  # a stage the run has not finished: refused
        return replace(self, stage=stage)

    def checkpoint(self, scratch: Path) -> Path:
        return current_merged(Path(self.run), self.stage)

    def model_type(self) -> Optional[str]:
        return origin_of(read_manifest(Path(self.run) / "sft")["inputs"]["model"]).model_type()

    def exported_stage(self) -> Optional[str]:
        return self.stage or merged_stage(Path(self.run)) or "sft"

    def identity(self) -> Optional[dict]:
        """Its SFT and exported stage's identities, so a stage trained again is exported again."""
        run = Path(self.run)
        return policy_identity(run, merged_stage(run, self.stage))

    def local_path(self) -> Optional[Path]:
        if self.stage is not None:
            return merged_dir(Path(self.run), self.stage)  # its card is that stage's
        return Path(self.run)

    def calibration_run(self) -> Optional[Path]:
        return Path(self.run)


@dataclass(frozen=True)
class DirOrigin(Origin):
    """An HF model directory, exported as it is."""

    path: str
    kind: ClassVar[str] = "dir"

    @classmethod
    def from_record(cls, record: dict) -> Origin:
        return cls(record.get("path") or record["ref"])  # a stage's model record names it "ref"

    def record(self) -> dict:
        return {"kind": self.kind, "path": self.path}

    def checkpoint(self, scratch: Path) -> Path:
        return Path(self.path)

    def model_type(self) -> Optional[str]:
        return _config_type(Path(self.path))

    def local_path(self) -> Optional[Path]:
        return Path(self.path)


@dataclass(frozen=True)
class BundledOrigin(Origin):
    """The bundled model, as a run's SFT manifest records it (no path: the package may lie
    elsewhere)."""

    ref: Optional[str] = None
    kind: ClassVar[str] = "bundled"

    def record(self) -> dict:
        return {"kind": self.kind, "ref": self.ref}

    def checkpoint(self, scratch: Path) -> Path:
        return Path(self.ref or DEFAULT_MODEL_DIR)

    def model_type(self) -> Optional[str]:
        return _config_type(Path(self.ref or DEFAULT_MODEL_DIR))


@dataclass(frozen=True)
class _LoadedOrigin(Origin):
    """A model that is not an HF directory: loaded and saved as one into the scratch folder."""

    ref: str

    def record(self) -> dict:
        return {"kind": self.kind, "ref": self.ref}

    def checkpoint(self, scratch: Path) -> Path:
        from slm_align.modeling.models import (
            ModelSource,
            load_model,
            load_tokenizer,
            save_tokenizer,
        )

        source = ModelSource(self.kind, self.ref)
        saved = scratch / "checkpoint"
        load_model(source).save_pretrained(saved, safe_serialization=True)
        save_tokenizer(load_tokenizer(source), source, saved)
        return saved


@dataclass(frozen=True)
class GgufOrigin(_LoadedOrigin):
    """A .gguf file."""

    kind: ClassVar[str] = "gguf"

    def model_type(self) -> Optional[str]:
        from slm_align.modeling.models import gguf_config

        return gguf_config(Path(self.ref)).model_type

    def gone(self) -> bool:
        return not Path(self.ref).is_file()


@dataclass(frozen=True)
class HubOrigin(_LoadedOrigin):
    """A hub id."""

    kind: ClassVar[str] = "hub"

    def model_type(self) -> Optional[str]:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.ref).model_type


ORIGINS: dict[str, type[Origin]] = {
    kind.kind: kind for kind in (RunOrigin, DirOrigin, BundledOrigin, GgufOrigin, HubOrigin)}
"""Each origin class by the kind its record names."""


def origin_of(record: dict) -> Origin:
    """The origin a manifest records: an export's ``inputs.source`` or a stage's
    ``inputs.model``."""
    return ORIGINS[record["kind"]].from_record(record)


def locate(source: str, check_config) -> Origin:
    """Where ``source`` is and what it is, refused in one line when it cannot be exported
    (``check_config`` sees a model directory's config.json); writes nothing."""
    path = Path(source).expanduser()
    if path.is_dir() and is_run(path):
        return RunOrigin(str(path.resolve()))
    from slm_align.modeling.models import load_tokenizer, resolve_source

    resolved = resolve_source(source)
    if resolved.kind != DirOrigin.kind:
        return ORIGINS[resolved.kind](resolved.ref)
    if not (Path(resolved.ref) / "tokenizer.json").is_file():
        raise UserError(f"{resolved.ref} has no tokenizer.json; save the model's fast tokenizer "
                        "beside the weights (tokenizer.save_pretrained) before exporting")
    load_tokenizer(resolved)  # a broken tokenizer is refused here, in one line
    check_config(json.loads((Path(resolved.ref) / "config.json").read_text(encoding="utf-8")))
    return DirOrigin(resolved.ref)


def check_stage(stage: Optional[str], source: str, origin: Origin) -> Origin:
    """``origin`` exporting the run's ``stage``; ``--stage`` on what is not a run, or a stage the
    run has not finished, refused in one line before any work."""
    if stage is None:
        return origin
    return origin.at_stage(stage, source)


def default_out(source: str, stage: Optional[str] = None) -> Path:
    """``RUN/export`` (``RUN/export-STAGE`` for a stage named: stages never replace each other's
    artifacts), else ``./export``."""
    path = Path(source).expanduser()
    if not (path.is_dir() and is_run(path)):
        return Path("export")
    return path / ("export" if stage is None else f"export-{stage}")
