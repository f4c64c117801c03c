"""Run directories: atomic files, stage manifests, the "already done with these inputs" check,
:func:`run_stage`, the one skeleton every training stage runs in (done? work dir, resume, barrier,
publish, manifest), and :func:`publish_artifact`, the one skeleton every artifact is published
through (reuse by inputs hash, scratch, verify, atomic rename)."""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import time
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Optional, Protocol, Sequence

from slm_align.atomic import publish_directory, scratch_directory, write_json_atomic, write_text_atomic
from slm_align.errors import UserError

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class StageResult:
    """Where a stage's artifacts are, whether it was skipped as already done, and its metrics.

    ``primary`` is False on the non-zero ranks of a data-parallel run, which report nothing.
    """

    stage_dir: Path
    skipped: bool
    metrics: dict
    primary: bool = True

    def summary(self) -> dict:
        return {"stage": self.stage_dir.name, "dir": str(self.stage_dir), "skipped": self.skipped,
                "metrics": self.metrics}


def digest(data: Any) -> str:
    """Stable sha256 of a JSON-serialisable value (used to recognise identical stage inputs)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def versions() -> dict[str, Optional[str]]:
    """Versions of the packages that decide a stage's result."""
    found: dict[str, Optional[str]] = {}
    for name in ("slm-align", "torch", "transformers", "peft", "accelerate"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


@lru_cache(maxsize=256)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sha256_file(path: Path) -> str:
    """sha256 of a file's bytes (remembered for an unchanged file within one process)."""
    stat = Path(path).stat()
    return _sha256(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


def _files(path: Path) -> list[Path]:
    """An artifact's files in a stable order: the file itself, or every file below a
    directory but its manifest."""
    path = Path(path)
    if not path.is_dir():
        return [path]
    return sorted(p for p in path.rglob("*")
                  if p.is_file() and p.relative_to(path).as_posix() != MANIFEST)


def artifact_manifest(artifact: Path) -> Path:
    """Where an exported artifact's manifest is: inside an ONNX directory, beside a GGUF file."""
    artifact = Path(artifact)
    return artifact / MANIFEST if artifact.is_dir() else artifact.with_name(artifact.name + ".json")


def file_checksums(directory: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of every file in ``directory`` except its manifest."""
    return {p.relative_to(directory).as_posix(): sha256_file(p) for p in _files(directory)}


MODEL_CARD = "README.md"
"""The model card an export writes into an artifact directory: it describes the artifact (its sha256
included), so it is not part of what the digest identifies."""


def artifact_digest(path: Path) -> str:
    """One sha256 for a file, or for a directory's files (their digests in path order), manifest
    and model card excluded."""
    files = [file for file in _files(path) if file != Path(path) / MODEL_CARD]
    if len(files) == 1 and files[0] == Path(path):
        return sha256_file(path)
    return hashlib.sha256("".join(f"{p.relative_to(path).as_posix()}:{sha256_file(p)}\n"
                                  for p in files).encode()).hexdigest()


def verify_checksums(stage_dir: Path, manifest: dict) -> None:
    """Every file the manifest lists is present with its recorded sha256, or one
    line saying which is not."""
    for name, expected in (manifest.get("files") or {}).items():
        file = Path(stage_dir) / name
        if not file.is_file() or sha256_file(file) != expected:
            state = "is missing" if not file.is_file() else "does not match the checksum in its manifest"
            raise UserError(f"{file} {state}: the stage output was changed or damaged; remove "
                            f"{stage_dir} and run the stage again")


def read_manifest(stage_dir: Path) -> Optional[dict]:
    """A finished stage's manifest, after checking that the files it describes are intact."""
    path = Path(stage_dir) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{path} is corrupt; remove the stage directory {stage_dir} "
                        "and run the stage again") from None
    verify_checksums(stage_dir, manifest)
    return manifest


ALIGNED_STAGES = ("rl", "dpo", "kto")
"""The stages that train an adapter on top of the merged SFT prior."""

RL_LAST = "rl-last"
"""A policy besides the stages': the RL stage's last iteration (``rl/adapter-last``, kept with the watchdog on),
for a run whose watchdog published an earlier iteration as ``rl/adapter``."""

LAST_ADAPTER = "adapter-last"
"""The folder in the RL stage that holds its last iteration's adapter."""


def policy_stage(policy: str) -> str:
    """The stage directory a policy's adapter lies in: ``rl`` for :data:`RL_LAST`, else the policy's own."""
    return "rl" if policy == RL_LAST else policy


def policy_adapter(run: Path, policy: str) -> Path:
    """A policy's adapter folder: ``RUN/rl/adapter-last`` for :data:`RL_LAST`, else ``RUN/STAGE/adapter``."""
    folder = LAST_ADAPTER if policy == RL_LAST else "adapter"
    return Path(run) / policy_stage(policy) / folder


def aligned_stages(run: Path) -> list[str]:
    """The run's finished aligned stages that hold an adapter, oldest first (by their
    manifest's write time)."""
    found = []
    for stage in ALIGNED_STAGES:
        if (Path(run) / stage / "adapter").is_dir() and read_manifest(Path(run) / stage) is not None:
            found.append((Path(run, stage, MANIFEST).stat().st_mtime_ns, stage))
    return [stage for _, stage in sorted(found)]


def check_out_dir(out: Path) -> Path:
    """``out`` can be a directory: it is one, or its nearest existing ancestor is (a file
    in the way is refused)."""
    out = Path(out)
    for path in (out, *out.parents):
        if path.exists():
            if not path.is_dir():
                raise UserError(f"--out {out}: {path} is a file, not a directory; pass a "
                                "directory (new or existing)")
            break
    return out


def check_out_file(out: Path, inputs: Sequence[Path] = (), overwrite: bool = False) -> Path:
    """``out`` can take a new file: not a directory, not one of ``inputs`` nor inside one (an export
    folder), in a folder that exists, and not an existing file unless ``overwrite``. Checked before
    any work, so a refused command writes nothing."""
    out = Path(out)
    resolved = out.resolve()
    for given in inputs:
        source = Path(given).resolve()
        if resolved == source or source in resolved.parents:
            raise UserError(f"--out {out} is an input of this command ({given}); pass another path")
    if out.is_dir():
        raise UserError(f"--out {out} is a directory; pass a file path")
    if not out.parent.is_dir():
        what = "is a file" if out.parent.exists() else "does not exist"
        raise UserError(f"--out {out}: folder {out.parent} {what}; "
                        "pass a path in an existing folder")
    if out.exists() and not overwrite:
        raise UserError(f"--out {out} exists; pass --overwrite "
                        "to replace it or choose another path")
    return out


WHERE = "where"
"""An inputs key for where the inputs lie (file paths): recorded for readers of the manifest, left
out of the stage's identity (:func:`inputs_digest`), so a run moved or copied elsewhere, or reached
by another path, is reused as it is. Files are named by their bytes elsewhere in the inputs."""


def inputs_digest(inputs: dict) -> str:
    """The stage's identity: the digest of its inputs without :data:`WHERE`."""
    return digest({key: value for key, value in inputs.items() if key != WHERE})


def completed(stage_dir: Path, inputs: dict) -> Optional[dict]:
    """The stage's manifest when it already completed with exactly these
    inputs; None when it never ran.

    A completed stage with other inputs is a UserError: its artifacts are
    never overwritten silently.
    """
    check_out_dir(Path(stage_dir).parent)
    manifest = read_manifest(stage_dir)
    if manifest is None:
        if Path(stage_dir).exists():
            raise UserError(f"{stage_dir} exists but holds no manifest; move it away "
                            "or choose another --out")
        return None
    if manifest.get("inputs_hash") != inputs_digest(inputs):
        raise UserError(f"{stage_dir} was made from other inputs or settings; choose another --out "
                        "or remove that directory to redo the stage")
    return manifest


def make_manifest(stage: str, inputs: dict, metrics: dict, started: float) -> dict:
    return {"stage": stage, "inputs": inputs, "inputs_hash": inputs_digest(inputs),
            "metrics": metrics, "versions": versions(), "seconds": round(time.time() - started, 2),
            "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def partial_dir(stage_dir: Path) -> Path:
    """Where a stage works until it completes (checkpoints for --resume live there)."""
    stage_dir = Path(stage_dir)
    return stage_dir.with_name(stage_dir.name + ".partial")


def publish(partial: Path, stage_dir: Path, manifest: dict, keep: tuple[str, ...] = ()) -> Path:
    """Write the manifest, drop scratch files not in ``keep``, and rename the
    partial dir into place."""
    if keep:
        for child in Path(partial).iterdir():
            if child.name not in keep and child.name != MANIFEST:
                shutil.rmtree(child) if child.is_dir() else child.unlink()
    write_json_atomic(Path(partial) / MANIFEST, dict(manifest, files=file_checksums(Path(partial))))
    return publish_directory(Path(partial), Path(stage_dir))


def prepare_partial(partial: Path, inputs: dict, resume: bool) -> Optional[str]:
    """Create a stage's work dir, or check a leftover one; returns the Trainer
    checkpoint to resume from.

    The work dir appears with its inputs record already inside (built beside it and renamed), so a
    process killed at any moment leaves either no work dir or one that ``--resume`` can check.
    """
    marker = partial / "inputs.json"
    if partial.exists():
        if not resume:
            raise UserError(f"an interrupted run is in {partial}; pass --resume to continue it, "
                            "or remove that directory to start over")
        if not marker.is_file() or json.loads(marker.read_text())["inputs_hash"] != inputs_digest(inputs):
            raise UserError(f"{partial} was started with other inputs or settings; "
                            "cannot resume it with these")
        return last_complete_checkpoint(partial / "checkpoints")
    staging = partial.with_name(partial.name + ".new")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    write_json_atomic(staging / "inputs.json",
                      {"inputs_hash": inputs_digest(inputs), "inputs": inputs})
    publish_directory(staging, partial)
    return None


def last_complete_checkpoint(checkpoints: Path) -> Optional[str]:
    """The newest Trainer checkpoint that was written to the end; half-written ones (a
    kill mid-save) are removed.

    The Trainer writes ``trainer_state.json`` last, and not atomically, so a checkpoint is complete
    exactly when that file parses.
    """
    if not checkpoints.is_dir():
        return None
    found = sorted((d for d in checkpoints.iterdir()
                    if d.is_dir() and d.name.startswith("checkpoint-")
                    and d.name.split("-")[-1].isdigit()), key=lambda d: int(d.name.split("-")[-1]))
    while found:
        newest = found.pop()
        try:
            json.loads((newest / "trainer_state.json").read_text(encoding="utf-8"))
            return str(newest)
        except (OSError, ValueError):
            shutil.rmtree(newest)
    return None


def keep_first_lines(path: Path, count: int) -> None:
    """Cut a JSONL log back to its first ``count`` complete lines (a killed run may have logged past
    its checkpoint, or half a line)."""
    if not path.is_file():
        return
    lines = [line for line in path.read_text(encoding="utf-8").splitlines(keepends=True)
             if line.endswith("\n")]
    write_text_atomic(path, "".join(lines[:count]))


def stage_identity(stage_dir: Path) -> Optional[str]:
    """What a later stage records of a finished stage it builds on: one digest of its manifest's
    inputs and of its files' checksums, so that the record names the content, not where the run
    lies (a run moved, copied or reached by another path is still recognised); None when the
    stage has not finished."""
    manifest = read_manifest(stage_dir)
    if manifest is None:
        return None
    return digest({"inputs_hash": manifest["inputs_hash"], "files": manifest.get("files")})


class StageWorld(Protocol):
    """The processes a stage runs on (``slm_align.envelope.world.World``): one, or
    the ranks of a launch."""

    main: bool

    def on_main(self, work: Callable[[], Any]) -> Any:
        """``work()`` on rank 0, its result shared with every rank."""

    def barrier(self) -> None:
        """Wait for every rank."""


class Stage(Protocol):
    """One stage of a run, in the shape of a torchtune recipe; :func:`run_stage` runs it.

    ``inputs()`` is everything that decides the result (equal inputs: the stage need not run
    again); ``setup()`` loads the models and data and may refuse (before any work dir exists);
    ``train(partial, checkpoint)`` trains in the work dir, continuing from its checkpoint when
    there is one (a Trainer checkpoint path for Trainer stages; others keep their own in
    ``partial``); ``save(partial)`` writes the artifacts on rank 0 and returns the metrics
    (None on the other ranks).
    """

    name: str
    """The stage's folder under the run (sft, reward, rl, dpo, kto)."""
    keep: tuple[str, ...]
    """What the published folder holds besides the manifest (scratch files are dropped)."""
    world: StageWorld

    def inputs(self) -> dict: ...

    def setup(self) -> None: ...

    def train(self, partial: Path, checkpoint: Optional[str]) -> None: ...

    def save(self, partial: Path) -> Optional[dict]: ...


def run_stage(stage: Stage, run: Path, resume: bool = False) -> StageResult:
    """Run ``stage`` into ``run/NAME``: reuse it when it completed with the same inputs, else
    set it up, prepare (or, with ``resume``, check) its work dir ``NAME.partial``, train,
    save, and publish the work dir with its manifest. Rank 0 alone decides and writes; the
    other ranks train and wait."""
    started = time.time()
    stage_dir = Path(run) / stage.name
    world = stage.world
    inputs = stage.inputs()
    done = world.on_main(functools.partial(completed, stage_dir, inputs))
    if done is not None:
        return StageResult(stage_dir, skipped=True, metrics=done["metrics"])
    stage.setup()
    partial = partial_dir(stage_dir)
    checkpoint = world.on_main(functools.partial(prepare_partial, partial, inputs, resume))
    stage.train(partial, checkpoint)
    metrics = stage.save(partial)
    if not world.main:  # the other ranks of a data-parallel run: rank 0 publishes
        world.barrier()
        return StageResult(stage_dir, skipped=False, metrics={}, primary=False)
    publish(partial, stage_dir, make_manifest(stage.name, inputs, metrics, started),
            keep=stage.keep)
    world.barrier()
    return StageResult(stage_dir, skipped=False, metrics=metrics)


class Artifact:
    """One artifact :func:`publish_artifact` publishes at ``final`` (an export target's file or
    folder, an adapter chain, a merged model, a bundle, an applied update); subclasses say what it
    is made of (``inputs``), how it is built (``build``), checked (``verify``) and placed
    (``place``)."""

    final: Path
    """Where it is published; the scratch folder is made beside it (same filesystem: the rename is
    atomic)."""
    stage = "export"
    """The manifest's ``stage`` field."""
    started: Optional[float] = None
    """When the command began (the manifest's ``seconds`` count from it; None: from publishing)."""
    exists_advice = "pass --overwrite to replace it or choose another --out"
    """What the one-line refusal of an existing ``final`` tells the user to do."""

    def inputs(self) -> dict:
        """Everything that decides the artifact's bytes: its manifest records their digest, and an
        artifact whose recorded digest is this one is reused as it is (file times play no part)."""
        return {}

    def taken(self) -> bool:
        """Whether publishing would replace something (``final``, or a link there)."""
        return self.final.exists() or self.final.is_symlink()

    def build(self, scratch: Path) -> Path:
        """Write the artifact inside ``scratch``; returns its path there."""
        raise NotImplementedError

    def verify(self, built: Path) -> dict:
        """Check ``built``; raise (a UserError) to publish nothing, else return the manifest's
        metrics."""
        return {}

    def place(self, built: Path, manifest: Optional[dict]) -> None:
        """Publish ``built`` at ``final``: the manifest first (inside a folder, with every file's
        checksum; beside a file), then one atomic rename over what was there."""
        if manifest is not None and built.is_dir():
            write_json_atomic(built / MANIFEST, dict(manifest, files=file_checksums(built)))
        elif manifest is not None:
            write_json_atomic(artifact_manifest(self.final), manifest)
        publish_directory(built, self.final, replace=True)


def reusable(final: Path, inputs: dict) -> Optional[dict]:
    """The manifest of the artifact at ``final`` when it was made from exactly ``inputs`` (its
    recorded inputs hash is theirs) and is still there, its files intact; None otherwise. The one
    reuse rule of every artifact."""
    path = artifact_manifest(final)
    if not (Path(final).exists() and path.is_file()):
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("inputs_hash") != inputs_digest(inputs):
        return None
    try:
        verify_checksums(final, manifest)  # a damaged folder is made again, never reused
    except UserError:
        return None
    return manifest


def publish_artifact(artifact: Artifact, overwrite: bool = False, reuse: bool = False,
                     manifest: bool = True) -> StageResult:
    """Reuse ``artifact`` when ``reuse`` and its recorded inputs hash equals the new one
    (:func:`reusable`); else refuse an existing one unless ``overwrite``, build it in a scratch
    folder beside ``final``, verify it, and publish it by atomic rename (with its manifest unless
    ``manifest`` is off). A failed build or verification, or a crash before the rename, leaves what
    was at ``final`` whole; the scratch folder is removed in every case but a killed process."""
    started = artifact.started or time.time()
    inputs = artifact.inputs()
    found = reusable(artifact.final, inputs) if reuse else None
    if found is not None:
        return StageResult(artifact.final, skipped=True, metrics=found.get("metrics", {}))
    if artifact.taken() and not overwrite:
        raise UserError(f"{artifact.final} exists; {artifact.exists_advice}")
    with scratch_directory(artifact.final) as scratch:
        built = artifact.build(scratch)
        metrics = artifact.verify(built)
        record = make_manifest(artifact.stage, inputs, metrics, started) if manifest else None
        artifact.place(built, record)
    return StageResult(artifact.final, skipped=False, metrics=metrics)
