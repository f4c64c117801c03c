"""Device bundles (issue 23, item 3): one directory and a zip with the artifact, tokenizer, chat
template, sampling defaults, tool schemas, the export manifest with its verification, and a README
naming the runtime and its calls."""

import hashlib
import json
import shutil
import zipfile
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from slm_align.export.packaging.bundle import device_choice
from slm_align.export.publishing.stage import ExportRequest, run_export
from slm_align.ondevice.devices import list_profiles, load_profile
from slm_align.runs import artifact_manifest
from tests.helpers import finished_sft_run, run_cli, tree_digest

FILES = {"tokenizer.json", "chat_template.jinja", "sampling.json", "tools.json", "export-manifest.json",
         "verification.json", "README.md", "bundle.json"}


@pytest.fixture(scope="module")
def gguf(tmp_path_factory, tiny_models):
    out = tmp_path_factory.mktemp("bundle") / "export"
    return run_export(ExportRequest(str(tiny_models["llama"]), "gguf", "Q8_0", out=out)).stage_dir


def test_every_profile_picks_its_target_and_quantization():
    for name in list_profiles():
        profile = load_profile(name)
        expected = "w8"  # ONNX's scheme that holds on real weights
        if profile.runtime == "gguf":
            expected = profile.gguf_quant
        assert device_choice(name) == (profile.runtime, expected)


def bundled_files(bundle: Path) -> set[str]:
    return {p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file()}


def assert_holds_what_an_app_needs(bundle: Path, artifact: Path, model_dir: Path, expected: tuple, calls: str) -> dict:
    """The bundle's files as an app reads them: the artifact's copy, the tokenizer and chat
    template of ``model_dir``, sampling defaults, tool schemas, the export manifest and its
    verification, a README naming the runtime (``expected[0]``) and ``calls``, bundle.json
    (runtime, target, quant, device = ``expected``) whose digests hold, and the zip beside it with
    the same files. Returns bundle.json."""
    described = json.loads((bundle / "bundle.json").read_text())
    assert {p.name for p in bundle.iterdir()} == FILES | {"model"}
    assert (described["runtime"], described["target"], described["quant"], described["device"]) == expected
    assert described["artifact"] == f"model/{artifact.name}"
    copied = bundle / "model" / artifact.name
    if artifact.is_dir():
        assert tree_digest(copied) == tree_digest(artifact)
    else:
        assert copied.read_bytes() == artifact.read_bytes()
    manifest = json.loads((bundle / "export-manifest.json").read_text())
    assert manifest == json.loads(artifact_manifest(artifact).read_text())
    verification = json.loads((bundle / "verification.json").read_text())
    assert verification == manifest["metrics"]["verification"] and verification["passed"] is True
    assert described["verification_passed"] is True and described["model_id"] == manifest["metrics"]["sha256"]
    assert (bundle / "chat_template.jinja").read_text() == AutoTokenizer.from_pretrained(model_dir).chat_template
    assert (bundle / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    assert {tool["function"]["name"] for tool in json.loads((bundle / "tools.json").read_text())} == \
        {"calculator", "current_time"}
    assert json.loads((bundle / "sampling.json").read_text())["temperature"] > 0
    readme = (bundle / "README.md").read_text()
    assert f"Runtime: **{expected[0]}**" in readme and calls in readme and described["model_id"] in readme
    assert set(described["files"]) == bundled_files(bundle) - {"bundle.json"}
    for name, digest in described["files"].items():
        assert hashlib.sha256((bundle / name).read_bytes()).hexdigest() == digest
    with zipfile.ZipFile(bundle.with_name(bundle.name + ".zip")) as archive:
        zipped = {name: archive.read(name) for name in archive.namelist()}
    assert set(zipped) == {f"{bundle.name}/{name}" for name in bundled_files(bundle)}
    assert all(zipped[f"{bundle.name}/{name}"] == (bundle / name).read_bytes() for name in bundled_files(bundle))
    return described


def test_a_gguf_bundle_holds_what_an_app_needs(gguf, tiny_models, tmp_path, capsys):
    code, stdout, stderr = run_cli(capsys, "bundle", gguf, "--device", "android-mid", "--out", tmp_path / "app",
                                   "--json")
    assert code == 0, stderr
    assert json.loads(stdout)["path"] == str(tmp_path / "app")
    described = assert_holds_what_an_app_needs(tmp_path / "app", gguf, tiny_models["llama"],
                                               ("llama.cpp", "gguf", "Q8_0", "android-mid"),
                                               'llama_model_load_from_file("model/model-Q8_0.gguf"')
    assert described["model_id"] == hashlib.sha256(gguf.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, tiny_models, stories):
    return finished_sft_run(tmp_path_factory.mktemp("bundle-run") / "run", tiny_models["llama"], stories, steps=2)[0]


def test_a_run_with_a_device_is_exported_for_it_first_then_bundled(sft_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(sft_run, run)
    artifact = run / "export" / "model-Q8_0.gguf"  # x86-laptop's profile: gguf Q8_0
    assert not artifact.exists()
    code, stdout, stderr = run_cli(capsys, "bundle", run, "--device", "x86-laptop", "--json")
    assert code == 0, stderr
    bundle = run / "export" / "bundle-x86-laptop"  # the default: beside the artifact, named for the device
    assert json.loads(stdout)["path"] == str(bundle)
    metrics = json.loads(artifact_manifest(artifact).read_text())["metrics"]
    assert (metrics["target"], metrics["quant"]) == ("gguf", "Q8_0") and metrics["verification"]["passed"]
    assert_holds_what_an_app_needs(bundle, artifact, run / "merged", ("llama.cpp", "gguf", "Q8_0", "x86-laptop"),
                                   'llama_model_load_from_file("model/model-Q8_0.gguf"')
    exported = artifact.stat().st_mtime_ns
    code, _, stderr = run_cli(capsys, "bundle", run, "--device", "x86-laptop", "--out", tmp_path / "again")
    assert code == 0, stderr
    assert artifact.stat().st_mtime_ns == exported  # the export the run has is bundled, not made again
    assert (tmp_path / "again" / "model" / artifact.name).read_bytes() == artifact.read_bytes()


def test_an_onnx_folder_bundle_holds_what_an_app_needs(tiny_models, tmp_path, capsys):
    onnx = run_export(ExportRequest(str(tiny_models["llama"]), "onnx", "fp32", out=tmp_path / "export",
                                    threads=1)).stage_dir
    code, _, stderr = run_cli(capsys, "bundle", onnx, "--out", tmp_path / "app")
    assert code == 0, stderr
    described = assert_holds_what_an_app_needs(tmp_path / "app", onnx, tiny_models["llama"],
                                               ("onnxruntime", "onnx", "fp32", None),
                                               'OrtSession(env, "model/onnx-fp32/model.onnx"')
    assert (tmp_path / "app" / "model" / "onnx-fp32" / "model.onnx").is_file()
    assert described["tokenizer"] == "tokenizer.json"


@pytest.mark.parametrize("args, message", [
    (["nowhere"], "not found"),
    (["{gguf}", "--device", "pocket-calculator"], "pocket-calculator"),
    (["{run}"], "pass --device NAME"),
    (["{gguf}", "--out", "{existing}"], "exists; pass --overwrite"),
])
def test_bad_bundle_requests_are_one_line(gguf, tmp_path, capsys, args, message):
    (tmp_path / "run" / "sft").mkdir(parents=True)
    (tmp_path / "run" / "sft" / "manifest.json").write_text("{}")
    (tmp_path / "existing").mkdir()
    paths = {"gguf": gguf, "run": tmp_path / "run", "existing": tmp_path / "existing"}
    code, _, stderr = run_cli(capsys, "bundle", *[arg.format(**paths) for arg in args])
    assert code == 2 and message in stderr and len(stderr.strip().splitlines()) == 1
    assert not list(tmp_path.glob("*.zip")) and not list(tmp_path.glob(".*.partial"))
