"""What an export reads: where its source is and what it is (a run, a model directory, a .gguf or
hub model), the HF checkpoint it converts, and what its manifest records of it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

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


def locate(source: str, check_config) -> dict:
    """Where ``source`` is and what it is, refused in one line when it cannot be exported
    (``check_config`` sees a model directory's config.json); writes nothing."""
    path = Path(source).expanduser()
    if path.is_dir() and is_run(path):
        return {"kind": "run", "run": str(path.resolve())}
    from slm_align.modeling.models import load_tokenizer, resolve_source

    resolved = resolve_source(source)
    if resolved.kind != "dir":
        return {"kind": resolved.kind, "ref": resolved.ref}
    if not (Path(resolved.ref) / "tokenizer.json").is_file():
        raise UserError(f"{resolved.ref} has no tokenizer.json; save the model's fast tokenizer "
                        "beside the weights (tokenizer.save_pretrained) before exporting")
    load_tokenizer(resolved)  # a broken tokenizer is refused here, in one line
    check_config(json.loads((Path(resolved.ref) / "config.json").read_text(encoding="utf-8")))
    return {"kind": "dir", "path": resolved.ref}


def check_stage(stage: Optional[str], source: str, origin: dict) -> dict:
    """``origin`` with the run's ``stage`` to export; ``--stage`` on what is not a run, or a stage
    the run has not finished, refused in one line before any work."""
    if stage is None:
        return origin
    if origin["kind"] != "run":
        raise UserError(f"--stage {stage} picks a policy of a run; {source} is not a run "
                        "directory (no sft/manifest.json): drop --stage")
    merged_stage(Path(origin["run"]), stage)
    return dict(origin, stage=stage)


def checkpoint(origin: dict, scratch: Path) -> Path:
    """A plain HF directory for ``origin``: the run merged (its ``stage``), the directory itself, or
    a .gguf/hub model saved."""
    if origin["kind"] == "run":
        return current_merged(Path(origin["run"]), origin.get("stage"))
    if origin["kind"] == "dir":
        return Path(origin["path"])
    from slm_align.modeling.models import ModelSource, load_model, load_tokenizer, save_tokenizer

    source = ModelSource(origin["kind"], origin["ref"])
    saved = scratch / "checkpoint"
    load_model(source).save_pretrained(saved, safe_serialization=True)
    save_tokenizer(load_tokenizer(source), source, saved)
    return saved


def default_out(source: str, stage: Optional[str] = None) -> Path:
    """``RUN/export`` (``RUN/export-STAGE`` for a stage named: stages never replace each other's
    artifacts), else ``./export``."""
    path = Path(source).expanduser()
    if not (path.is_dir() and is_run(path)):
        return Path("export")
    return path / ("export" if stage is None else f"export-{stage}")


def model_type(origin: dict) -> Optional[str]:
    """The architecture (config.json's model_type) of what ``origin`` exports, read without loading
    weights."""
    if origin["kind"] == "run":
        return model_type(read_manifest(Path(origin["run"]) / "sft")["inputs"]["model"])
    if origin["kind"] in ("dir", "bundled"):
        path = Path(origin.get("path") or origin["ref"] or DEFAULT_MODEL_DIR) / "config.json"
        return json.loads(path.read_text(encoding="utf-8")).get("model_type")
    if origin["kind"] == "gguf":
        from slm_align.modeling.models import gguf_config

        return gguf_config(Path(origin["ref"])).model_type
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(origin["ref"]).model_type


def exported_stage(origin: dict) -> Optional[str]:
    """The run's stage an artifact holds (``sft``, ``rl``, ``dpo``, ``kto``); None for no run."""
    if origin["kind"] != "run":
        return None
    return origin.get("stage") or merged_stage(Path(origin["run"])) or "sft"


def source_identity(origin: dict) -> Optional[dict]:
    """What a run's export is made of, by content (its SFT and exported stage's identities, so a
    stage trained again is exported again); None for a model that is not a run."""
    if origin["kind"] != "run":
        return None
    run = Path(origin["run"])
    return policy_identity(run, merged_stage(run, origin.get("stage")))


def source_path(origin: dict) -> Optional[Path]:
    """The local run or directory exported (a model card reads the run's records from it); None
    otherwise."""
    if origin["kind"] == "run" and origin.get("stage") is not None:
        return merged_dir(Path(origin["run"]), origin["stage"])  # its card is that stage's
    if origin["kind"] == "run":
        return Path(origin["run"])
    if origin["kind"] == "dir":
        return Path(origin["path"])
    return None
