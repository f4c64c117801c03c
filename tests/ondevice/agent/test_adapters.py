"""LoRA adapter GGUFs in the runtime: applied to the base they were made for, refused on another
before llama.cpp loads them, swapped without reloading the base, and named in every preference
record."""

import io
import re
import sys

import numpy as np
import pytest

from slm_align.errors import UserError
from slm_align.modeling.models import build_tiny_model
from slm_align.ondevice.agent.llama_backend import LlamaCppBackend
from slm_align.ondevice.agent.runtime import Agent
from slm_align.ondevice.agent.settings import SamplingParams
from slm_align.ondevice.agent.store import PreferenceStore
from slm_align.ondevice.gguf.adapter_check import chain_digest
from slm_align.ondevice.gguf.adapter_writer import write_lora_gguf
from slm_align.ondevice.gguf.writer import write_gguf
from slm_align.runs import sha256_file
from tests.helpers import run_cli, save_lora

pytest.importorskip("llama_cpp")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TEXT = "Once upon a time there was a little fox who lived in the forest."
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_models, tokenizer):
    """The tiny Llama's F32 GGUF, two adapters made for it, and another Llama base of the same shapes."""
    root = tmp_path_factory.mktemp("adapters")
    base = write_gguf(tiny_models["llama"], root / "base.gguf")
    loras = [save_lora(tiny_models["llama"], root / f"lora{seed}", TARGETS, seed) for seed in (1, 2)]
    adapters = [write_lora_gguf(lora, tiny_models["llama"], root / f"adapter{seed}.gguf", base_gguf=base)
                for seed, lora in zip((1, 2), loras)]
    other = build_tiny_model("llama", vocab_size=len(tokenizer), seed=7)
    other.save_pretrained(root / "other")
    tokenizer.save_pretrained(root / "other")
    return {"base": base, "a": adapters[0], "b": adapters[1], "other": write_gguf(root / "other", root / "other.gguf")}


def moved(first, second, scale) -> bool:
    """Whether two logit arrays differ by more than a tenth of ``scale``'s largest |logit|."""
    return float(np.abs(first - second).max()) > 0.1 * float(np.abs(scale).max())


def logits(backend):
    backend.reset()
    return backend.feed_all(backend.tokenize(TEXT))


def test_swapping_adapters_changes_the_answer_without_reloading_the_base(files):
    backend = LlamaCppBackend(files["base"], n_ctx=128, all_logits=True, threads=1, adapters=[files["a"]])
    model = backend.llm._model
    with_a = logits(backend)
    assert backend.set_adapters([files["b"]]) == [{"file": "adapter2.gguf", "sha256": sha256_file(files["b"])}]
    with_b = logits(backend)
    backend.set_adapters([])
    alone = logits(backend)
    backend.set_adapters([files["a"]])
    again = logits(backend)
    assert backend.llm._model is model  # one base, loaded once
    assert moved(with_a, with_b, alone) and moved(with_a, alone, alone)
    assert np.array_equal(again, with_a)  # the swap back reuses the loaded adapter, and the cache was dropped
    fresh = LlamaCppBackend(files["base"], n_ctx=128, all_logits=True, threads=1)
    assert np.array_equal(alone, logits(fresh))


def test_two_adapters_apply_together_in_order(files):
    """Both at once differ from the first alone (the chain against PyTorch's merged policy is in
    tests/export/test_adapter_export.py)."""
    backend = LlamaCppBackend(files["base"], n_ctx=128, all_logits=True, threads=1, adapters=[files["a"], files["b"]])
    both = logits(backend)
    assert [a["file"] for a in backend.adapters] == ["adapter1.gguf", "adapter2.gguf"]
    backend.set_adapters([files["a"]])
    assert moved(both, logits(backend), both)


@pytest.mark.parametrize("base, expected", [("other", "was made for base sha256"),
                                            ("a", "is a LoRA adapter, not a model")])
def test_an_adapter_for_another_base_is_refused_in_one_line(files, base, expected):
    with pytest.raises(UserError, match=expected) as refused:
        Agent.load(files[base], adapters=[files["a"]])
    assert "\n" not in str(refused.value)
    agent = Agent.load(files["base"], adapters=[files["a"]])
    with pytest.raises(UserError, match="not found"):
        agent.set_adapters([files["a"].with_name("missing.gguf")])
    assert agent.adapters[0]["file"] == "adapter1.gguf"  # a refused swap leaves the adapters as they were


def test_chat_refuses_a_mismatched_adapter_with_exit_2(files, capsys, tmp_path):
    db = tmp_path / "chat.db"
    code, out, err = run_cli(capsys, "chat", files["other"], "--adapter", files["a"], "--store", db)
    assert code == 2 and out == "" and err.count("\n") == 1 and re.search("made for base sha256", err)
    assert not db.exists()


def test_every_preference_record_names_the_adapters_that_answered(files, tmp_path):
    store = PreferenceStore(tmp_path / "prefs.db")
    agent = Agent.load(files["base"], adapters=[files["a"]], store=store, sampling=GREEDY)
    base_sha, a_sha, b_sha = (sha256_file(files[name]) for name in ("base", "a", "b"))
    first = agent.chat("Tell me a story.")
    agent.set_adapters([files["b"]])
    second = agent.chat("Tell me another one.")
    agent.set_adapters([])
    third = agent.chat("And one more.")
    turns = {turn.id: turn for turn in store.turns()}
    assert turns[first.turn_id].model_id == chain_digest(base_sha, [a_sha])
    assert turns[first.turn_id].sampling["adapters"] == [{"file": "adapter1.gguf", "sha256": a_sha}]
    assert turns[second.turn_id].model_id == chain_digest(base_sha, [b_sha])
    assert turns[second.turn_id].sampling["adapters"] == [{"file": "adapter2.gguf", "sha256": b_sha}]
    assert turns[third.turn_id].model_id == base_sha and "adapters" not in turns[third.turn_id].sampling


def test_chat_command_applies_adapters(files, capsys, monkeypatch, tmp_path):
    db = tmp_path / "chat.db"
    monkeypatch.setattr(sys, "stdin", io.StringIO("Tell me a story.\n"))
    code, out, _ = run_cli(capsys, "chat", files["base"], "--adapter", files["a"], "--adapter", files["b"],
                           "--store", db, "--json", "--max-new-tokens", "4", "--temperature", "0")
    assert code == 0
    [turn] = PreferenceStore(db).turns()
    assert [a["file"] for a in turn.sampling["adapters"]] == ["adapter1.gguf", "adapter2.gguf"]
