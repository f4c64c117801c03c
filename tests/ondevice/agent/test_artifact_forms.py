"""A round as it ships is judged as one artifact: ``evaluate-agent`` takes a base with its adapters
(``BASE.gguf+ADAPTER.gguf``), an adapter export's manifest or a bundle folder, and answers exactly as
the merged model does; an adapter passed alone is refused as an adapter, in one line, with the fix."""

import json

import pytest

from slm_align.errors import UserError
from slm_align.ondevice.agent.artifact_forms import resolve_artifact
from slm_align.ondevice.agent.task_eval import evaluate_artifacts
from slm_align.ondevice.gguf.adapter_check import chain_digest
from slm_align.ondevice.gguf.adapter_writer import write_lora_gguf
from slm_align.ondevice.gguf.writer import write_gguf
from slm_align.runs import make_manifest, sha256_file
from tests.helpers import decisive_models, random_lora, run_cli

pytest.importorskip("llama_cpp")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
QUESTIONS = ["What is 12 + 30?", "Tell me about the fox.", "What is 7 * 6?", "Say hello.",
             "What is 100 / 4?", "Where did the fox go?"]


@pytest.fixture(scope="module")
def round_files(tmp_path_factory, tokenizer):
    """A decisive tiny Llama exported as base-F32.gguf, a LoRA on it exported as an adapter GGUF with
    the manifest `export --target gguf-adapter` writes, the same LoRA merged into the weights and
    exported as one GGUF, and task rows."""
    root = tmp_path_factory.mktemp("forms")
    model_dir = decisive_models(root / "models", tokenizer, ["llama"])["llama"]
    lora = random_lora(model_dir, TARGETS, seed=3)
    lora.save_pretrained(root / "lora")
    merged = lora.merge_and_unload()
    merged.save_pretrained(root / "merged")
    tokenizer.save_pretrained(root / "merged")
    export = root / "export"
    export.mkdir()
    base = write_gguf(model_dir, export / "base-F32.gguf")
    adapter = write_lora_gguf(root / "lora", model_dir, export / "adapter-sft-F32.gguf", base_gguf=base)
    metrics = {"target": "gguf-adapter", "quant": "F32", "adapter_type": "F32",
               "base": {"path": base.name, "sha256": sha256_file(base), "exported": True},
               "adapters": [{"path": adapter.name, "stage": "sft", "sha256": sha256_file(adapter), "scale": 1.0}],
               "sha256": chain_digest(sha256_file(base), [sha256_file(adapter)]),
               "verification": {"passed": True}}
    manifest = export / (adapter.name + ".json")
    manifest.write_text(json.dumps(make_manifest("export", {"source": {"kind": "dir", "path": str(model_dir)}},
                                                 metrics, 0.0)))
    tasks = root / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"prompt": q, "answer": "42"}) + "\n" for q in QUESTIONS))
    return {"base": base, "adapter": adapter, "manifest": manifest, "tasks": tasks,
            "merged": write_gguf(root / "merged", root / "merged-F32.gguf")}


def replies(report: dict) -> list[list[str]]:
    return [[result["reply"] for result in artifact["results"]] for artifact in report["artifacts"]]


def test_base_plus_adapters_manifest_and_bundle_answer_as_the_merged_model(round_files, capsys, tmp_path):
    code, _, _ = run_cli(capsys, "bundle", round_files["adapter"], "--out", tmp_path / "bundle")
    assert code == 0
    joined = f"{round_files['base']}+{round_files['adapter']}"
    forms = [round_files["merged"], joined, round_files["manifest"], tmp_path / "bundle", round_files["base"]]
    report = evaluate_artifacts(round_files["tasks"], forms, max_tokens=12, max_tool_rounds=0)
    merged, *shipped, base = replies(report)
    assert all(form == merged for form in shipped)  # every form of the round answers as the merged weights
    assert base != merged  # and the adapter matters: the base alone answers otherwise
    assert sum(a != b for a, b in zip(base, merged)) >= len(QUESTIONS) // 2
    successes = [artifact["successes"] for artifact in report["artifacts"]]
    assert successes[1:4] == [successes[0]] * 3


def test_the_cli_takes_the_manifest_and_refuses_an_adapter_alone_as_an_adapter(round_files, capsys, tmp_path):
    code, out, _ = run_cli(capsys, "evaluate-agent", round_files["tasks"], "--artifact", round_files["manifest"],
                           "--max-new-tokens", "6", "--max-tool-rounds", "0", "--json")
    assert code == 0 and json.loads(out)["artifacts"][0]["episodes"] == len(QUESTIONS)
    code, out, err = run_cli(capsys, "evaluate-agent", round_files["tasks"], "--artifact", round_files["adapter"])
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "is a LoRA adapter, not a model" in err and str(round_files["manifest"]) in err
    assert "damaged" not in err


def test_a_damaged_file_and_wrong_joins_are_refused_in_one_line(round_files, tmp_path):
    with pytest.raises(UserError, match="only the first path is the base"):
        resolve_artifact(f"{round_files['base']}+{round_files['merged']}")
    with pytest.raises(UserError, match="is a LoRA adapter, not a model"):
        resolve_artifact(f"{round_files['adapter']}+{round_files['adapter']}")
    with pytest.raises(UserError, match="not a .gguf file"):
        resolve_artifact(f"{round_files['base']}+{tmp_path / 'missing.gguf'}")
    folder = tmp_path / "copy"
    folder.mkdir()
    changed = folder / round_files["adapter"].name
    changed.write_bytes(round_files["adapter"].read_bytes()[:-1] + b"\x01")
    (folder / round_files["base"].name).symlink_to(round_files["base"])
    manifest = folder / round_files["manifest"].name
    manifest.write_text(round_files["manifest"].read_text())
    with pytest.raises(UserError, match="does not match the sha256 .* changed after export"):
        resolve_artifact(manifest)
    not_ours = tmp_path / "other.json"
    not_ours.write_text(json.dumps({"metrics": {"target": "gguf"}}))
    with pytest.raises(UserError, match="not an adapter export's manifest"):
        resolve_artifact(not_ours)


def test_serve_refuses_a_chain_given_as_one_artifact(round_files):
    pytest.importorskip("starlette")
    from slm_align.ondevice.agent.server.app import create_app

    with pytest.raises(UserError, match="serve takes the base GGUF and each adapter set as --adapter"):
        create_app(round_files["manifest"])
