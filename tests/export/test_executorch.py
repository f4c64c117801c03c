"""ExecuTorch programs (issue 23, item 2): ``export --target executorch`` writes an fp32
``model.pte`` (XNNPACK, static KV cache) that ExecuTorch's own Python runtime decodes greedily
exactly as PyTorch does."""

import json

import pytest

from slm_align.runs import sha256_file
from tests.helpers import run_cli, torch_greedy

pytest.importorskip("executorch.runtime")
PROMPT = "The fox went to the river and"
NEW_TOKENS = 24


def pte_greedy(program_path, prompt_ids, stop=()):
    """Greedy decoding as an app drives the program: ExecuTorch's runtime, one token and its
    position per call; NEW_TOKENS tokens, or fewer when one in ``stop`` (kept) ends the answer."""
    import torch
    from executorch.runtime import Runtime

    forward = Runtime.get().load_program(program_path).load_method("forward")
    position = 0
    for token in prompt_ids:
        logits = forward.execute([torch.tensor([[token]]), torch.tensor([position])])[0]
        position += 1
    out = []
    while len(out) < NEW_TOKENS and not (out and out[-1] in stop):
        out.append(int(logits[0, -1].argmax()))
        logits = forward.execute([torch.tensor([[out[-1]]]), torch.tensor([position])])[0]
        position += 1
    return out


def test_export_target_executorch_publishes_a_verified_program_that_decodes_as_pytorch(tiny_models, tmp_path,
                                                                                        capsys):
    from executorch.runtime import Runtime
    from transformers import AutoTokenizer

    from slm_align.export.converters.executorch import MAX_CACHE_LEN

    code, out, err = run_cli(capsys, "export", tiny_models["llama"], "--target", "executorch", "--threads", "1",
                             "--out", tmp_path / "out", "--json")
    assert code == 0, err
    folder = tmp_path / "out" / "executorch-fp32"
    assert json.loads(out)["dir"] == str(folder)
    for name in ("model.pte", "tokenizer.json", "tokenizer_config.json", "config.json", "manifest.json",
                 "README.md"):
        assert (folder / name).is_file(), name
    assert not list((tmp_path / "out").glob(".*partial"))
    manifest = json.loads((folder / "manifest.json").read_text())
    metrics = manifest["metrics"]
    verification = metrics["verification"]
    assert (metrics["target"], metrics["quant"], metrics["preset"]) == ("executorch", "fp32", None)
    assert manifest["inputs"]["target"] == "executorch"
    assert verification["passed"] and verification["tokenizer_match"] and not verification["divergences"]
    assert verification["greedy_exact"] == verification["prompts"] == 4 and verification["agreement"] == 1.0
    assert manifest["files"]["model.pte"] == sha256_file(folder / "model.pte")
    ids = AutoTokenizer.from_pretrained(tiny_models["llama"])(PROMPT)["input_ids"]
    assert pte_greedy(folder / "model.pte", ids) == torch_greedy(tiny_models["llama"], ids, NEW_TOKENS)
    program = Runtime.get().load_program(folder / "model.pte")  # what ExecuTorch's LLM runners read
    assert program.load_method("get_max_seq_len").execute([])[0] == MAX_CACHE_LEN == 512
    config = json.loads((tiny_models["llama"] / "config.json").read_text())
    assert program.load_method("get_vocab_size").execute([])[0] == config["vocab_size"]
    assert program.load_method("use_kv_cache").execute([])[0] is True
    code, _, err = run_cli(capsys, "bundle", folder, "--out", tmp_path / "app")
    assert code == 0, err
    described = json.loads((tmp_path / "app" / "bundle.json").read_text())
    assert (described["runtime"], described["target"], described["artifact"]) == \
        ("ExecuTorch", "executorch", "model/executorch-fp32")
    assert "cache_position" in (tmp_path / "app" / "README.md").read_text()
    assert pte_greedy(tmp_path / "app" / "model" / "executorch-fp32" / "model.pte", ids) == \
        torch_greedy(tiny_models["llama"], ids, NEW_TOKENS)


@pytest.mark.parametrize("args, message", [(["gemma3_text", "--target", "executorch"],
                                             "gemma3_text is not supported"),
                                           (["llama", "--target", "executorch", "--quant", "int4"],
                                            "only fp32 programs are built")])
def test_bad_architecture_or_quant_is_refused_in_one_line_before_any_work(tiny_models, tmp_path, capsys, args,
                                                                          message):
    code, _, err = run_cli(capsys, "export", tiny_models[args[0]], *args[1:], "--out", tmp_path / "out")
    assert code == 2
    assert err.strip().count("\n") == 0 and message in err
    assert not (tmp_path / "out").exists()


def test_a_model_torch_export_cannot_take_is_refused_in_one_line_and_nothing_is_kept(tiny_models, tmp_path, capsys,
                                                                                   monkeypatch):
    import slm_align.export.converters.executorch as executorch

    def fail(model, max_cache_len):
        raise RuntimeError("Unsupported: data-dependent control flow\n  a long trace")

    monkeypatch.setattr(executorch, "_exported_program", fail)
    code, _, err = run_cli(capsys, "export", tiny_models["llama"], "--target", "executorch", "--out", tmp_path / "out")
    assert code == 2
    assert err.strip().count("\n") == 0 and "llama did not export (Unsupported: data-dependent" in err
    assert list((tmp_path / "out").iterdir()) == []


def assert_exact_program(result) -> None:
    """A published fp32 program whose verification decoded every prompt exactly as
    PyTorch, as its manifest says."""
    verification = result.metrics["verification"]
    assert (result.stage_dir / "model.pte").is_file()
    assert verification["passed"] and verification["greedy_exact"] == verification["prompts"] == 4
    assert verification["agreement"] == 1.0 and verification["ties"] == [] and not verification["divergences"]
    manifest = json.loads((result.stage_dir / "manifest.json").read_text())
    assert manifest["metrics"]["verification"] == verification
    assert manifest["files"]["model.pte"] == sha256_file(result.stage_dir / "model.pte")


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gpt_neox", "gpt2"])
def test_other_architectures_are_published_only_when_they_decode_exactly_as_pytorch(tiny_models, tmp_path, arch):
    from slm_align.export.publishing.stage import ExportRequest, run_export

    result = run_export(ExportRequest(str(tiny_models[arch]), "executorch", out=tmp_path, threads=1))
    assert result.stage_dir == tmp_path / "executorch-fp32"
    assert_exact_program(result)


@pytest.mark.slow
def test_the_bundled_model_exports_to_executorch_and_decodes_greedily_as_pytorch(tmp_path):
    from transformers import AutoTokenizer

    from slm_align.export.publishing.stage import ExportRequest, run_export
    from slm_align.modeling.models import DEFAULT_MODEL_DIR

    result = run_export(ExportRequest(str(DEFAULT_MODEL_DIR), "executorch", out=tmp_path, threads=1))
    assert_exact_program(result)
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    ids = tokenizer(PROMPT)["input_ids"]
    program = pte_greedy(result.stage_dir / "model.pte", ids, stop=(tokenizer.eos_token_id,))
    assert program == torch_greedy(DEFAULT_MODEL_DIR, ids, NEW_TOKENS, stop_at_eos=True)
    assert len(program) > 8  # a real answer, not an immediate end of sequence


def test_loading_a_model_beside_executorch_writes_nothing_to_stderr(tiny_models):
    """torchao (an executorch dependency) logs at import, which transformers
    does on every model load."""
    import subprocess
    import sys

    code = ("from slm_align.modeling.models import load_model, resolve_source\n"
            f"load_model(resolve_source({str(tiny_models['llama'])!r}))\nimport torchao\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "torchao" not in done.stderr and "Failed to load" not in done.stderr, done.stderr[-2000:]
