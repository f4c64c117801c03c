"""Model cards: merge and export write README.md in the Hugging Face format, with only
what the run measured."""

import json
import re
import shutil

import pytest
import yaml

from slm_align.data.readers import fingerprint
from slm_align.export.publishing.model_card import MARKER, base_model
from slm_align.export.publishing.parity import perplexity_change
from slm_align.modeling.models import DEFAULT_MODEL_DIR
from tests.helpers import export_bundled, finished_sft_run, run_cli


def card_parts(path):
    """(YAML header as a dict, body) of a README.md model card."""
    match = re.match(r"\A---\n(.*?)\n---\n(.*)\Z", path.read_text(), re.DOTALL)
    assert match, "no YAML front matter"
    return yaml.safe_load(match.group(1)), match.group(2)


@pytest.fixture(scope="module")
def aligned_run(tmp_path_factory, stories):
    """A quickstart-like run on the bundled model: SFT, the gate, GRPO, the closing evaluation;
    merged, then exported to a verified Q8_0 GGUF."""
    from slm_align.cli import main

    run, _ = finished_sft_run(tmp_path_factory.mktemp("card") / "run", DEFAULT_MODEL_DIR, stories, steps=3)
    args = ["train", "--out", run, "--algo", "grpo", "--reward", "length_window", "--steps", "2",
            "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "8", "--force",
            "--report-prompts", "4", "--json"]
    with pytest.raises(SystemExit) as exit_info:
        main([str(arg) for arg in args])
    assert exit_info.value.code == 0
    with pytest.raises(SystemExit) as exit_info:
        main(["merge", "--run", str(run), "--json"])
    assert exit_info.value.code == 0
    with pytest.raises(SystemExit) as exit_info:
        main(["export", str(run), "--quant", "Q8_0", "--json"])
    assert exit_info.value.code == 0
    return run


def test_merged_card_header_names_license_data_and_stages(aligned_run, stories):
    header, body = card_parts(aligned_run / "merged" / "README.md")
    assert header["license"] == "apache-2.0"  # the bundled model is the project's own
    assert "base_model" not in header  # the bundled model has no hub id: none is invented
    assert header["library_name"] == "transformers" and header["pipeline_tag"] == "text-generation"
    assert header["datasets"] == [f"sha256:{fingerprint(stories)}"]
    assert header["tags"] == ["slm-align", "lora", "sft", "grpo", "safetensors"]
    assert MARKER in body and f"`{stories.name}`" in body
    assert json.loads((aligned_run / "merged" / "manifest.json").read_text())["files"]["README.md"]


def test_card_figures_are_the_runs_records(aligned_run):
    _, body = card_parts(aligned_run / "merged" / "README.md")
    gate = json.loads((aligned_run / "headroom.json").read_text())
    for figure in gate["figures"]:
        assert f"| {figure['name']} | {figure['value']:.3f} | {figure['comparison']} {figure['threshold']:g} |" in body
    assert f"Verdict: **{gate['verdict']}**" in body
    comparison = json.loads((aligned_run / "eval" / "report.json").read_text())["comparisons"][0]
    low, high = comparison["delta_ci95"]
    assert f"| {comparison['policy']} | {comparison['baseline']} | {comparison['delta']:+.3f} [{low:.3f}, {high:.3f}]" \
           in body
    rl = json.loads((aligned_run / "rl" / "manifest.json").read_text())["metrics"]
    assert f"ratio_guard {rl['envelope']['ratio_guard']}" in body and f"skipped {rl['guard']['skipped']}" in body
    assert f"{rl['heldout_reward_sft']:.3f} (SFT) -> {rl['heldout_reward_rl']:.3f} (RL)" in body


def test_gguf_card_has_the_quantization_and_its_verification(aligned_run):
    header, body = card_parts(aligned_run / "export" / "README.md")
    metrics = json.loads((aligned_run / "export" / "model-Q8_0.gguf.json").read_text())["metrics"]
    verification = metrics["verification"]
    assert header["library_name"] == "gguf" and {"gguf", "Q8_0", "grpo"} <= set(header["tags"])
    assert f"| `model-Q8_0.gguf` | Q8_0 | {metrics['bytes'] / 1e6:.1f} MB | `{metrics['sha256'][:16]}` |" in body
    assert f"top-1 agreement {verification['agreement']:.3f} over {verification['agreement_positions']} tokens" in body
    assert f"held-out {perplexity_change(verification)}" in body
    for command in ("llama-cli -m model-Q8_0.gguf", "slm-align chat model-Q8_0.gguf",
                    "slm-align serve model-Q8_0.gguf",
                    "ollama create my-model -f model-Q8_0.Modelfile"):
        assert command in body
    assert metrics["model_card"] == {"path": "README.md", "note": None}


def test_sections_without_records_are_left_out(capsys, tmp_path, stories):
    """An SFT-only run: no gate, evaluation or envelope section (nothing
    measured, nothing written)."""
    run, _ = finished_sft_run(tmp_path / "run", DEFAULT_MODEL_DIR, stories, steps=1)
    code, _, err = run_cli(capsys, "merge", "--run", run)
    assert code == 0, err
    header, body = card_parts(run / "merged" / "README.md")
    assert header["tags"] == ["slm-align", "lora", "sft", "safetensors"]
    assert "## Training" in body
    for section in ("## Headroom gate",
                    "## Evaluation", "## Safety envelope", "## Files and quantization"):
        assert section not in body


def test_an_export_of_a_plain_model_has_only_the_artifacts_figures(tmp_path):
    export_bundled(tmp_path, ("gguf", "F32"), ("gguf", "Q8_0"))
    header, body = card_parts(tmp_path / "README.md")
    assert "datasets" not in header and header["tags"] == ["slm-align", "gguf", "F32", "Q8_0"]
    assert "`model-F32.gguf` | F32" in body and "`model-Q8_0.gguf` | Q8_0" in body  # both files of the directory
    assert "not verified (--no-verify)" in body and "## Training" not in body


def test_a_readme_the_user_wrote_is_kept(tmp_path):
    (tmp_path / "README.md").write_text("# my notes\n")
    export_bundled(tmp_path, ("gguf", "F32"))
    assert (tmp_path / "README.md").read_text() == "# my notes\n"
    metrics = json.loads((tmp_path / "model-F32.gguf.json").read_text())["metrics"]
    assert "slm-align did not write it" in metrics["model_card"]["note"]


def test_a_local_base_carries_its_hub_id_and_license(tmp_path):
    base = tmp_path / "SmolLM2-135M"
    shutil.copytree(DEFAULT_MODEL_DIR, base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps(dict(config, _name_or_path="HuggingFaceTB/SmolLM2-135M")))
    (base / "README.md").write_text("---\nlicense: mit\nlanguage: en\n---\n# SmolLM2\n")
    assert base_model({"kind": "dir", "ref": str(base)}) == {"name": "HuggingFaceTB/SmolLM2-135M",
                                                              "hub_id": "HuggingFaceTB/SmolLM2-135M", "license": "mit"}
    assert base_model({"kind": "hub", "ref": "Qwen/Qwen2.5-0.5B"})["hub_id"] == "Qwen/Qwen2.5-0.5B"
    assert base_model({"kind": "gguf", "ref": str(tmp_path / "m.gguf")}) == {"name": "m.gguf", "hub_id": None,
                                                                             "license": None}


def test_onnx_export_carries_its_card_inside(tmp_path):
    artifact = export_bundled(tmp_path, ("onnx", "fp32"))["onnx"]
    header, body = card_parts(artifact / "README.md")
    assert header["library_name"] == "onnx" and header["tags"] == ["slm-align", "onnx", "fp32"]
    assert f"| `{artifact.name}` | fp32 |" in body and f"slm-align chat {artifact.name}" in body
    assert "README.md" in json.loads((artifact / "manifest.json").read_text())["files"]  # checksummed with the rest


def test_the_card_inside_an_onnx_export_is_not_part_of_its_digest(tmp_path):
    from slm_align.ondevice.agent.loading import artifact_id
    from slm_align.runs import artifact_digest, artifact_manifest

    artifact = export_bundled(tmp_path, ("onnx", "fp32"))["onnx"]
    assert (artifact / "README.md").is_file()
    recorded = json.loads(artifact_manifest(artifact).read_text())["metrics"]["sha256"]
    assert artifact_id(artifact) == artifact_digest(artifact) == recorded  # the runtime loads it
    (artifact / "model.onnx").write_bytes((artifact / "model.onnx").read_bytes() + b"\0")
    assert artifact_digest(artifact) != recorded  # the weights still are
