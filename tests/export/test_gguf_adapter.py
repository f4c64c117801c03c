"""LoRA adapter GGUFs: a peft adapter written for llama.cpp applies on our base GGUF as peft applies it
in PyTorch, a base it was not made for is refused, and what llama.cpp cannot apply is refused."""

import numpy as np
import pytest

from slm_align.errors import UserError
from slm_align.modeling.models import build_tiny_model
from slm_align.ondevice.gguf.adapter_writer import check_adapter_base, write_lora_gguf
from slm_align.ondevice.gguf.writer import write_gguf
from tests.helpers import decisive_models, save_lora

pytest.importorskip("llama_cpp")

ARCHS = ["llama", "qwen2", "qwen3", "gemma3_text", "gpt_neox", "gpt2"]
_LLAMA_LIKE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Attention and MLP projections; plus the output head where it is not tied to the embeddings.
TARGETS = {"llama": _LLAMA_LIKE + ["lm_head"], "qwen2": _LLAMA_LIKE + ["lm_head"], "qwen3": _LLAMA_LIKE + ["lm_head"],
           "gemma3_text": _LLAMA_LIKE, "gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h",
                                                   "embed_out"],
           "gpt2": ["c_attn", "c_proj", "c_fc"]}
# Largest |llama.cpp - PyTorch| logit allowed, as a share of the largest |logit| (measured: F32 up to 9e-4,
# F16 up to 2e-3, on Qwen3).
RELATIVE_TOLERANCE = {"F32": 2e-3, "F16": 5e-3}
TEXT = "Once upon a time there was a little fox who lived in the forest and loved berries."


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer):
    """Tiny models whose output head is scaled up so that greedy choices are clear (as in
    test_gguf_and_onnx.py), each with its F32 and F16 GGUF."""
    root = tmp_path_factory.mktemp("adapter-bases")
    for arch in decisive_models(root, tokenizer, ARCHS):
        for file_type in RELATIVE_TOLERANCE:
            write_gguf(root / arch, root / f"{arch}-{file_type}.gguf", file_type)
    return root


def torch_logits(model_dir, adapter, ids):
    """PyTorch's logits at each position, (with, without) the saved adapter."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                      str(adapter)).eval()
    with torch.no_grad():
        with_adapter = model(torch.tensor([ids])).logits[0].numpy()
        with model.disable_adapter():
            without = model(torch.tensor([ids])).logits[0].numpy()
    return with_adapter, without


def llama_cpp_logits(base, adapter, ids):
    """llama.cpp's logits at each position with the adapter GGUF applied at scale 1."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(base), lora_path=str(adapter), logits_all=True, n_ctx=64, n_threads=2,
                verbose=False)
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float32)


def assert_applies_like_peft(base_dir, base_gguf, adapter_dir, adapter_gguf, ids, file_type):
    """llama.cpp's logits equal peft's within the type's tolerance, the adapter moves them far more
    than the difference, and the top-1 choices agree wherever PyTorch's top two are not tied within that
    difference (such ties are rare: random tiny models have a few)."""
    ours = llama_cpp_logits(base_gguf, adapter_gguf, ids)
    theirs, base = torch_logits(base_dir, adapter_dir, ids)
    tolerance = RELATIVE_TOLERANCE[file_type] * np.abs(theirs).max()
    worst = float(np.abs(ours - theirs).max())
    assert worst <= tolerance, f"max |logit diff| {worst:.4g} > {tolerance:.4g}"
    assert np.abs(theirs - base).max() > max(50 * worst, 1.0)  # the adapter matters
    top2 = np.sort(theirs, axis=-1)[:, -2:]
    tied = top2[:, 1] - top2[:, 0] <= 2 * worst
    parted = ours.argmax(-1) != theirs.argmax(-1)
    assert not (parted & ~tied).any() and tied.mean() <= 0.1
    return worst


@pytest.mark.parametrize("file_type", ["F32", "F16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_adapter_applies_in_llama_cpp_as_peft_does(tmp_path, models, tokenizer, arch, file_type):
    adapter_dir = save_lora(models / arch, tmp_path / "adapter", TARGETS[arch])
    base_gguf = models / f"{arch}-{file_type}.gguf"
    adapter = write_lora_gguf(adapter_dir, models / arch, tmp_path / "adapter.gguf", file_type, base_gguf=base_gguf)
    check_adapter_base(adapter, base_gguf)
    ids = tokenizer(TEXT)["input_ids"][:30]
    assert_applies_like_peft(models / arch, base_gguf, adapter_dir, adapter, ids, file_type)


def test_rslora_rank_and_alpha_patterns_fold_into_b(tmp_path, models, tokenizer):
    """peft's alpha / sqrt(r) with per-module ranks and alphas, where llama.cpp applies one alpha / r."""
    adapter_dir = save_lora(models / "llama", tmp_path / "adapter", TARGETS["llama"], use_rslora=True,
                            rank_pattern={"v_proj": 8, "down_proj": 2}, alpha_pattern={"o_proj": 3})
    base_gguf = models / "llama-F32.gguf"
    adapter = write_lora_gguf(adapter_dir, models / "llama", tmp_path / "adapter.gguf", base_gguf=base_gguf)
    assert_applies_like_peft(models / "llama", base_gguf, adapter_dir, adapter, tokenizer(TEXT)["input_ids"][:30],
                             "F32")


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_a_base_gguf_gives_the_same_adapter_as_its_hf_directory(tmp_path, models, arch):
    """The heads that reorder B's rows are read from the GGUF's header as from config.json."""
    from gguf import GGUFReader

    adapter_dir = save_lora(models / arch, tmp_path / "adapter", TARGETS[arch])
    base_gguf = models / f"{arch}-F32.gguf"
    from_dir = write_lora_gguf(adapter_dir, models / arch, tmp_path / "dir.gguf", base_gguf=base_gguf)
    from_gguf = write_lora_gguf(adapter_dir, base_gguf, tmp_path / "gguf.gguf")
    assert from_dir.read_bytes() == from_gguf.read_bytes()
    names = {tensor.name for tensor in GGUFReader(str(from_gguf)).tensors}
    assert {"blk.0.attn_qkv.weight.lora_b" if arch == "gpt_neox" else "blk.0.attn_q.weight.lora_b",
            "output.weight.lora_a"} <= names


@pytest.fixture(scope="module")
def llama_adapter(tmp_path_factory, models):
    """A peft adapter of the tiny Llama and its GGUF, bound to the Llama's F32 GGUF."""
    root = tmp_path_factory.mktemp("llama-adapter")
    adapter_dir = save_lora(models / "llama", root / "adapter", TARGETS["llama"])
    return adapter_dir, write_lora_gguf(adapter_dir, models / "llama", root / "adapter.gguf",
                                        base_gguf=models / "llama-F32.gguf")


def _other_base(models, tmp_path, tokenizer, kind):
    if kind == "architecture":
        return models / "qwen2-F32.gguf"
    model = build_tiny_model("llama", vocab_size=len(tokenizer), seed=1, hidden=64 if kind == "shapes" else 32)
    model.save_pretrained(tmp_path / kind)
    tokenizer.save_pretrained(tmp_path / kind)
    return write_gguf(tmp_path / kind, tmp_path / f"{kind}.gguf")


@pytest.mark.parametrize("kind, expected", [("architecture", "is for a llama base, .* is qwen2"),
                                            ("shapes", r"adapts \S+ as \d+x32, .* has \d+x64"),
                                            ("weights", "was made for base sha256")])
def test_an_adapter_refuses_a_base_it_was_not_made_for(tmp_path, models, tokenizer, llama_adapter, kind, expected):
    adapter_dir, adapter = llama_adapter
    other = _other_base(models, tmp_path, tokenizer, kind)
    with pytest.raises(UserError, match=expected) as refused:
        check_adapter_base(adapter, other)
    assert "\n" not in str(refused.value)
    if kind == "weights":  # same shapes: llama.cpp would apply it; only the recorded hash tells
        check_adapter_base(adapter, other, check_hash=False)
        return
    out = tmp_path / "adapter.gguf"
    with pytest.raises(UserError, match="pass the base GGUF it was made for"):
        write_lora_gguf(adapter_dir, models / "llama", out, base_gguf=other)
    assert not out.exists()


@pytest.mark.parametrize("arch, targets, settings, expected", [
    ("llama", ["embed_tokens", "q_proj"], {}, "adapts an embedding"),
    ("gpt2", ["c_attn", "lm_head"], {}, "tied to the embeddings"),
    ("llama", ["q_proj"], {"use_dora": True}, "DoRA"),
    ("llama", ["q_proj"], {"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ("llama", ["q_proj"], {"bias": "lora_only"}, "trains biases"),
])
def test_what_llama_cpp_cannot_apply_is_refused(tmp_path, models, arch, targets, settings, expected):
    adapter_dir = save_lora(models / arch, tmp_path / "adapter", targets, **settings)
    out = tmp_path / "adapter.gguf"
    with pytest.raises(UserError, match=expected) as refused:
        write_lora_gguf(adapter_dir, models / arch, out)
    assert "\n" not in str(refused.value) and not out.exists()
