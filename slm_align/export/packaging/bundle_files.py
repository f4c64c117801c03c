"""The files every device bundle carries beside the model: the chat template and tokenizer of the
artifact, the sampling defaults and the default tools' schemas (shared by
:mod:`slm_align.export.packaging.bundle` and :mod:`slm_align.export.packaging.adapter_bundle`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

from slm_align.ondevice.gguf.fields import read_fields


def _gguf_template(artifact: Path) -> Optional[str]:
    """The chat template a GGUF file embeds, if any (from its header alone: a 250 MB base reads in
    well under a second)."""
    field = read_fields(artifact, "tokenizer.chat_template").get("tokenizer.chat_template")
    return None if field is None else str(field.value)


def _folder_template(folder: Path) -> Optional[str]:
    """The chat template of an exported folder (chat_template.jinja, else tokenizer_config.json)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    config = folder / "tokenizer_config.json"
    if config.is_file():
        return json.loads(config.read_text(encoding="utf-8")).get("chat_template")
    return None


def chat_template_of(artifact: Path) -> Optional[str]:
    """The chat template written into the artifact (None: a base model without one)."""
    if artifact.is_dir():
        return _folder_template(artifact)
    return _gguf_template(artifact)


def _source_folder(manifest: dict) -> Optional[Path]:
    """The checkpoint folder the artifact was exported from, when it is still there."""
    origin = manifest.get("inputs", {}).get("source", {})
    if origin.get("kind") == "run":
        return Path(origin["run"]) / "merged"
    if origin.get("kind") == "dir":
        return Path(origin["path"])
    return None


def tokenizer_file(artifact: Path, manifest: dict) -> Optional[Path]:
    """tokenizer.json of the artifact folder, else of the checkpoint it came from
    (a GGUF embeds its own)."""
    candidates = [artifact / "tokenizer.json"] if artifact.is_dir() else []
    source = _source_folder(manifest)
    if source is not None:
        candidates.append(source / "tokenizer.json")
    return next((path for path in candidates if path.is_file()), None)


def write_json(path: Path, data) -> None:
    """``data`` as indented, key-sorted JSON."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _sampling_defaults() -> dict:
    """The runtime's sampling defaults (sampling.json)."""
    from slm_align.ondevice.agent.settings import SamplingParams

    return SamplingParams().to_dict()


def _tool_schemas() -> list[dict]:
    """The default tools' schemas (tools.json)."""
    from slm_align.ondevice.tools.builtin import default_tools

    return default_tools().specs()


def write_app_files(bundle: Path, template: Optional[str], tokenizer: Optional[Path]) -> None:
    """The chat template and tokenizer (when there are), sampling defaults and tool schemas."""
    if template is not None:
        (bundle / "chat_template.jinja").write_text(template, encoding="utf-8")
    if tokenizer is not None:
        shutil.copy2(tokenizer, bundle / "tokenizer.json")
    write_json(bundle / "sampling.json", _sampling_defaults())
    write_json(bundle / "tools.json", _tool_schemas())
