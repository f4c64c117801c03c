"""Device bundles (issue 23, item 3): one directory and a zip with the artifact, tokenizer, chat template, sampling
defaults, tool schemas, the export manifest with its verification, and a README naming the runtime and its calls."""

import hashlib
import json
import zipfile

import pytest
from transformers import AutoTokenizer

from slm_align.devices import list_profiles, load_profile
from slm_align.export.bundle import device_choice
from slm_align.export.stage import ExportRequest, run_export
from tests.helpers import run_cli

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


def test_a_gguf_bundle_holds_what_an_app_needs(gguf, tiny_models, tmp_path, capsys):
    code, stdout, stderr = run_cli(capsys, "bundle", gguf, "--device", "android-mid", "--out", tmp_path / "app",
                                   "--json")
    assert code == 0, stderr
    bundle = tmp_path / "app"
    described = json.loads((bundle / "bundle.json").read_text())
    assert json.loads(stdout)["path"] == str(bundle)
    assert {p.name for p in bundle.iterdir()} == FILES | {"model"}
    assert (bundle / "model" / gguf.name).read_bytes() == gguf.read_bytes()
    manifest = json.loads((bundle / "export-manifest.json").read_text())
    assert described["model_id"] == manifest["metrics"]["sha256"] == hashlib.sha256(gguf.read_bytes()).hexdigest()
    assert (described["runtime"], described["target"], described["quant"], described["device"]) == \
        ("llama.cpp", "gguf", "Q8_0", "android-mid")
    assert json.loads((bundle / "verification.json").read_text())["passed"] is True
    assert (bundle / "chat_template.jinja").read_text() == \
        AutoTokenizer.from_pretrained(tiny_models["llama"]).chat_template
    assert (bundle / "tokenizer.json").read_bytes() == (tiny_models["llama"] / "tokenizer.json").read_bytes()
    assert {tool["function"]["name"] for tool in json.loads((bundle / "tools.json").read_text())} == \
        {"calculator", "current_time"}
    assert json.loads((bundle / "sampling.json").read_text())["temperature"] > 0
    readme = (bundle / "README.md").read_text()
    assert "llama.cpp" in readme and "llama_model_load_from_file" in readme and described["model_id"] in readme
    for name, digest in described["files"].items():
        assert hashlib.sha256((bundle / name).read_bytes()).hexdigest() == digest
    with zipfile.ZipFile(tmp_path / "app.zip") as archive:
        zipped = set(archive.namelist())
    assert zipped == {"app/" + p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file()}


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
