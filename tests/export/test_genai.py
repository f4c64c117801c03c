"""onnxruntime-genai folders (issue 23, item 1): our ONNX export plus genai_config.json loads
in onnxruntime-genai's Python API, tokenizes as our tokenizer does, and decodes greedily as
PyTorch does (fp32: exactly)."""

import json

import pytest

from slm_align.errors import UserError
from slm_align.export.converters.genai import genai_config, genai_greedy, genai_tokens, write_genai_config
from slm_align.export.publishing.stage import ExportRequest, run_export
from slm_align.ondevice.agent.settings import SamplingParams
from tests.helpers import torch_greedy

og = pytest.importorskip("onnxruntime_genai")
PROMPTS = ["Once upon a time", "The fox went to the river and"]
NEW_TOKENS = 24


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3_text"])
def test_a_genai_folder_tokenizes_and_decodes_greedily_as_pytorch(tiny_models, tmp_path, arch):
    from transformers import AutoTokenizer

    folder = run_export(ExportRequest(str(tiny_models[arch]), "onnx", "fp32", out=tmp_path)).stage_dir
    write_genai_config(folder, SamplingParams(temperature=0).to_dict())
    tokenizer = AutoTokenizer.from_pretrained(tiny_models[arch])
    for prompt in PROMPTS:
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert genai_tokens(folder, prompt) == ids
        genai = genai_greedy(folder, ids, NEW_TOKENS)
        assert genai == torch_greedy(tiny_models[arch], ids, NEW_TOKENS)[:len(genai)] and len(genai) >= 1


def test_the_config_carries_the_sampling_defaults_and_refuses_other_architectures():
    config = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "num_attention_heads": 2,
              "num_hidden_layers": 1, "eos_token_id": [3, 4], "max_position_embeddings": 64}
    written = genai_config(config, SamplingParams().to_dict())
    assert written["search"]["do_sample"] and written["search"]["top_k"] == 40
    assert written["model"]["eos_token_id"] == written["model"]["pad_token_id"] == 3
    assert written["model"]["decoder"]["head_size"] == 4
    json.dumps(written)
    with pytest.raises(UserError, match="gpt_neox is not supported"):
        genai_config(dict(config, model_type="gpt_neox"), SamplingParams().to_dict())


def test_export_target_genai_of_a_run_through_the_cli_publishes_a_verified_folder(tiny_models, stories, tmp_path,
                                                                                    capsys):
    from transformers import AutoTokenizer

    from tests.helpers import finished_sft_run, run_cli

    run, _ = finished_sft_run(tmp_path / "run", tiny_models["llama"], stories, steps=2)
    code, out, err = run_cli(capsys, "export", run, "--target", "genai", "--quant", "fp32", "--threads", "1",
                             "--json")
    assert code == 0, err
    folder = run / "export" / "genai-fp32"
    assert json.loads(out)["dir"] == str(folder)
    for name in ("genai_config.json", "model.onnx", "tokenizer.json", "chat_template.jinja", "manifest.json"):
        assert (folder / name).is_file(), name
    assert not list((run / "export").glob(".*partial"))
    metrics = json.loads((folder / "manifest.json").read_text())["metrics"]
    verification = metrics["verification"]
    assert metrics["target"] == "genai" and metrics["quant"] == "fp32"
    assert verification["passed"] and verification["genai_tokenizer_match"]
    assert verification["greedy_exact"] == verification["prompts"] == 4 and verification["agreement"] == 1.0
    assert json.loads((folder / "genai_config.json").read_text())["model"]["type"] == "llama"
    assert "onnxruntime-genai" in (folder / "README.md").read_text()
    tokenizer = AutoTokenizer.from_pretrained(run / "merged")
    ids = tokenizer(PROMPTS[1])["input_ids"]
    assert genai_tokens(folder, PROMPTS[1]) == ids
    genai = genai_greedy(folder, ids, NEW_TOKENS)  # genai's own search, as an app runs it
    assert len(genai) >= 1 and genai == torch_greedy(run / "merged", ids, NEW_TOKENS)[:len(genai)]
    code, _, err = run_cli(capsys, "bundle", folder, "--out", tmp_path / "app")
    assert code == 0, err
    described = json.loads((tmp_path / "app" / "bundle.json").read_text())
    assert (described["runtime"], described["target"], described["artifact"]) == \
        ("onnxruntime-genai", "genai", "model/genai-fp32")
    assert "generate_next_token" in (tmp_path / "app" / "README.md").read_text()
    assert genai_greedy(tmp_path / "app" / "model" / "genai-fp32", ids, NEW_TOKENS) == genai


@pytest.mark.parametrize("quant", ["int4", "w8"])
def test_a_quantized_genai_folder_is_published_on_top1_agreement(tiny_models, tmp_path, quant):
    from slm_align.export.publishing.parity import top1_agreement
    from slm_align.modeling.models import load_model, load_tokenizer, resolve_source
    from slm_align.ondevice.agent.genai_backend import GenaiBackend

    result = run_export(ExportRequest(str(tiny_models["llama"]), "genai", quant, out=tmp_path, threads=1))
    verification = result.metrics["verification"]
    assert result.stage_dir == tmp_path / f"genai-{quant}"
    assert verification["passed"] and verification["genai_tokenizer_match"]
    assert verification["agreement"] >= verification["min_agreement"] == 0.9
    source = resolve_source(str(tiny_models["llama"]))
    ids = load_tokenizer(source)(PROMPTS[1] + " " + PROMPTS[0])["input_ids"]
    measured = top1_agreement(load_model(source), GenaiBackend(result.stage_dir, threads=1), ids)
    assert measured >= 0.9


def test_architectures_genai_cannot_run_are_refused_before_any_work(tiny_models, tmp_path, capsys):
    from tests.helpers import run_cli

    code, _, err = run_cli(capsys, "export", tiny_models["gpt_neox"], "--target", "genai", "--out", tmp_path / "out")
    assert code == 2
    assert err.strip().count("\n") == 0 and "gpt_neox is not supported" in err
    assert not (tmp_path / "out").exists()


def test_a_base_model_whose_tokenizer_settings_hold_nulls_loads_in_genai_tokenizer(tiny_models, tmp_path):
    import shutil

    import onnxruntime_genai as og
    from transformers import AutoTokenizer

    base = tmp_path / "base"
    shutil.copytree(tiny_models["llama"], base)
    (base / "chat_template.jinja").unlink(missing_ok=True)
    settings = json.loads((base / "tokenizer_config.json").read_text())
    (base / "tokenizer_config.json").write_text(json.dumps(dict(settings, chat_template=None)))  # as from a .gguf
    result = run_export(ExportRequest(str(base), "genai", "fp32", out=tmp_path / "out", threads=1))
    assert result.metrics["verification"]["passed"] and result.metrics["verification"]["genai_tokenizer_match"]
    assert None not in json.loads((result.stage_dir / "tokenizer_config.json").read_text()).values()
    assert result.metrics["chat_template"] == "default"
    messages = [{"role": "user", "content": "hi"}]
    genai = og.Tokenizer(og.Model(str(result.stage_dir)))
    rendered = genai.apply_chat_template(json.dumps(messages), add_generation_prompt=True)
    expected = AutoTokenizer.from_pretrained(result.stage_dir).apply_chat_template(messages, tokenize=False,
                                                                                   add_generation_prompt=True)
    assert rendered == expected and "hi" in rendered


def test_a_tokenizer_that_adds_bos_is_accepted_with_genai_leaving_bos_to_the_caller(tiny_models, tmp_path):
    """genai 0.18's encode does not run tokenizer.json's post-processor (Gemma's adds <bos>): the
    ids it gives are the model's without that BOS, and the folder passes with genai_adds_bos False
    (the real Gemma 3 270M's case)."""
    import shutil

    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    base = tmp_path / "base"
    shutil.copytree(tiny_models["llama"], base)
    tokenizer = Tokenizer.from_file(str(base / "tokenizer.json"))
    bos = tokenizer.token_to_id("<|endoftext|>")
    tokenizer.post_processor = TemplateProcessing(single="<|endoftext|> $A",
                                                  special_tokens=[("<|endoftext|>", bos)])
    tokenizer.save(str(base / "tokenizer.json"))
    settings = json.loads((base / "tokenizer_config.json").read_text())
    (base / "tokenizer_config.json").write_text(json.dumps(dict(settings, bos_token="<|endoftext|>")))
    result = run_export(ExportRequest(str(base), "genai", "fp32", out=tmp_path / "out", threads=1))
    verification = result.metrics["verification"]
    assert verification["passed"] and verification["genai_tokenizer_match"]
    assert verification["genai_adds_bos"] is False and verification["genai_chat_template_match"] is True
    assert verification["greedy_exact"] == verification["prompts"] == 4
    assert genai_tokens(result.stage_dir, PROMPTS[0])[0] != bos


def test_the_bundled_model_exports_to_genai_and_decodes_greedily_as_pytorch(tmp_path):
    from slm_align.modeling.models import DEFAULT_MODEL_DIR

    verification = run_export(ExportRequest(str(DEFAULT_MODEL_DIR), "genai", "fp32", out=tmp_path,
                                            threads=1)).metrics["verification"]
    assert verification["passed"] and verification["genai_tokenizer_match"]
    assert verification["greedy_exact"] == verification["prompts"] == 4 and verification["agreement"] == 1.0


def test_the_bundled_model_exports_to_genai_w8_the_default_scheme(tmp_path):
    """The default scheme on the bundled model, whose tied head optimum writes as a Transpose of the
    embedding: the 8-bit folder loads in onnxruntime-genai and agrees with PyTorch."""
    from slm_align.modeling.models import DEFAULT_MODEL_DIR

    result = run_export(ExportRequest(str(DEFAULT_MODEL_DIR), "genai", out=tmp_path, threads=1))
    verification = result.metrics["verification"]
    assert result.metrics["quant"] == "w8" and verification["passed"] and verification["agreement"] >= 0.9
    assert (result.stage_dir / "genai_config.json").is_file()
