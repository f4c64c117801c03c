"""Device profiles and fit / speed estimates: profiles validate, the speed model predicts
every published reference point it did not see within a factor of 2, memory behaves, and model
facts are read exactly."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from slm_align.cli import main
from slm_align.errors import UserError
from slm_align.ondevice.devices import (
    BITS_PER_WEIGHT,
    ModelFacts,
    estimate_fit,
    leave_one_out,
    list_profiles,
    load_profile,
    model_facts,
)
from slm_align.ondevice.devices.estimate import FIXED_OVERHEAD_BYTES, efficiency_for, reference_pool
from slm_align.ondevice.devices.facts import params_from_config
from slm_align.ondevice.devices.profiles import ReferencePoint
from tests.helpers import ARCHITECTURES

REQUIRED = ["rpi4", "rpi5", "rpi-zero2w", "jetson-orin-nano", "android-mid", "android-flagship", "iphone-15-pro",
            "x86-laptop"]
GIB = 2**30


@pytest.fixture(autouse=True)
def no_user_profiles(monkeypatch, tmp_path):
    """Profiles come from the package only, unless a test adds a user directory."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SLM_ALIGN_DEVICES", raising=False)


def facts(parameters=1e9, layers=16, kv_heads=4, head_dim=64, context_length=32768, **extra) -> ModelFacts:
    return ModelFacts(source="synthetic", format="reference", parameters=int(parameters), layers=layers,
                      kv_heads=kv_heads, head_dim=head_dim, hidden_size=1024, vocab_size=32000,
                      context_length=context_length, **extra)


def run_cli(capsys, *args):
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


# --- profiles -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", REQUIRED)
def test_every_bundled_profile_loads_with_its_required_fields(name):
    profile = load_profile(name)
    assert profile.name == name and profile.display_name
    assert profile.ram_gb > 0 and 0 < profile.app_memory_share <= 1 and 1 <= profile.threads <= 2 * profile.cores
    assert profile.isa and profile.bandwidth_gbs > 0 and len(profile.bandwidth_source) > 10
    assert profile.runtime in ("gguf", "onnx") and profile.gguf_quant in BITS_PER_WEIGHT
    assert profile.onnx_preset in ("arm64", "avx2", "avx512", "avx512_vnni")
    assert ("neon" in profile.isa) == (profile.onnx_preset == "arm64")
    for point in profile.reference:
        assert point.tokens_per_second > 0 and point.parameters > 0 and len(point.source) > 10


def test_profiles_hold_enough_reference_points():
    counts = {name: len(load_profile(name).reference) for name in list_profiles()}
    assert set(REQUIRED) <= set(counts)
    assert sum(counts.values()) >= 12 and sum(n >= 2 for n in counts.values()) >= 3


def test_leave_one_out_predicts_every_reference_point_within_the_promised_1_3x():
    rows = leave_one_out()
    assert len(rows) == len(reference_pool())
    worst = max(rows, key=lambda row: abs(math.log(row.ratio)))
    assert all(1 / 1.3 <= row.ratio <= 1.3 for row in rows), worst  # docs/reference/runtime.md promises 1.3x


def test_efficiency_is_the_geometric_mean_of_measured_over_the_bandwidth_bound():
    points = [ReferencePoint(model=f"m{i}", parameters=10**9, quant="Q8_0", tokens_per_second=tps, context=1,
                             size_gb=1.0, source="hand-made point") for i, tps in enumerate((8.0, 5.0))]
    board = load_profile("rpi5").model_copy(update={"bandwidth_gbs": 10.0, "reference": points})
    efficiency = efficiency_for(board, [])
    assert efficiency.basis == "device" and efficiency.value == pytest.approx(math.sqrt(0.8 * 0.5))
    model = facts(layers=None, kv_heads=None, head_dim=None, quant="Q8_0", weight_bytes=10**9)
    report = estimate_fit(model, board, quant="Q8_0", pool=[])
    assert report.tokens_per_second == pytest.approx(math.sqrt(0.4) * 10)  # 10 GB/s over 1 GB per token
    assert any("KV cache not counted" in note for note in report.notes)


def test_a_device_without_enough_points_uses_every_devices_points():
    report = estimate_fit(facts(), load_profile("rpi-zero2w"))
    assert report.efficiency.basis == "all devices" and report.efficiency.points == len(reference_pool())


# --- memory ---------------------------------------------------------------------------------------

def test_kv_cache_and_weights_follow_the_documented_formulas():
    model, board = facts(), load_profile("x86-laptop")
    report = estimate_fit(model, board, quant="Q8_0", context=1000)
    assert report.memory.kv_cache == 2 * 16 * 4 * 64 * 1000 * 2
    assert report.memory.weights == pytest.approx(1e9 * 8.5 / 8)
    assert report.memory.fixed == FIXED_OVERHEAD_BYTES
    assert report.memory.compute == 4 * board.ubatch * (32000 + 8 * 1024)
    q4 = estimate_fit(model, board, quant="Q4_0", context=1000).memory.weights  # output head stays at Q6_K
    assert q4 == pytest.approx(((1e9 - 32000 * 1024) * 4.5 + 32000 * 1024 * 6.56) / 8)


def test_an_artifact_of_the_asked_type_counts_its_own_bytes():
    model = facts(quant="Q4_K_M", weight_bytes=700_000_000)
    assert estimate_fit(model, load_profile("rpi5"), quant="Q4_K_M").memory.weights == 700_000_000
    assert estimate_fit(model, load_profile("rpi5"), quant="Q8_0").memory.weights == pytest.approx(1e9 * 8.5 / 8)


def test_memory_grows_with_context_and_with_bits_per_weight():
    model, board = facts(), load_profile("rpi5")
    by_context = [estimate_fit(model, board, quant="Q4_0", context=n).memory.total for n in (256, 1024, 4096, 16384)]
    assert by_context == sorted(by_context) and len(set(by_context)) == 4
    quants = sorted(("Q2_K", "Q3_K_M", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "F16", "F32"),
                    key=BITS_PER_WEIGHT.get)
    by_bits = [estimate_fit(model, board, quant=q, context=2048).memory.total for q in quants]
    assert by_bits == sorted(by_bits) and len(set(by_bits)) == len(quants)


def test_decode_slows_with_context_and_with_bits_per_weight():
    model, board = facts(), load_profile("rpi5")
    assert (estimate_fit(model, board, quant="Q4_0", context=256).tokens_per_second >
            estimate_fit(model, board, quant="Q4_0", context=16384).tokens_per_second >
            estimate_fit(model, board, quant="Q8_0", context=16384).tokens_per_second)


def test_a_model_too_large_does_not_fit_and_gets_a_smaller_quantization_that_does():
    board = load_profile("rpi4")  # 4 GiB x 0.75; prefers Q4_K_M
    big = facts(parameters=4.5e9, layers=32, kv_heads=8, head_dim=128, context_length=4096)
    report = estimate_fit(big, board, quant="F16", context=1024)
    assert report.verdict == "does not fit" and report.share_of_budget > 1
    assert BITS_PER_WEIGHT[report.recommended_quant] < BITS_PER_WEIGHT[board.gguf_quant]
    assert estimate_fit(big, board, quant=report.recommended_quant, context=1024).verdict == "fits"
    default = estimate_fit(big, board, context=1024)
    assert default.quant == report.recommended_quant and default.verdict == "fits"
    huge = estimate_fit(facts(parameters=40e9), board, context=1024)
    assert huge.recommended_quant is None and huge.verdict == "does not fit" and huge.max_context == 0


def test_a_model_that_fits_keeps_the_devices_preference_and_verdict_thresholds_hold():
    board = load_profile("x86-laptop")
    report = estimate_fit(facts(parameters=135e6), board)
    assert report.quant == report.recommended_quant == "Q8_0" and report.verdict == "fits"
    assert report.share_of_budget <= 0.7 and report.context == 4096


def test_largest_context_is_the_last_one_within_the_budget():
    board, model = load_profile("rpi4"), facts(parameters=2e9, layers=32, kv_heads=32, head_dim=128,
                                               context_length=10**6)
    report = estimate_fit(model, board, quant="Q4_0", context=512)
    assert 0 < report.max_context < 10**6
    assert estimate_fit(model, board, quant="Q4_0", context=report.max_context).share_of_budget <= 1
    assert estimate_fit(model, board, quant="Q4_0", context=report.max_context + 1).share_of_budget > 1
    capped = estimate_fit(facts(parameters=1e8, context_length=2048), board, quant="Q4_0")
    assert capped.max_context == 2048 and capped.context == 2048


def test_bad_quantization_and_context_are_user_errors():
    with pytest.raises(UserError, match="unknown quantization 'Q9_X'"):
        estimate_fit(facts(), load_profile("rpi5"), quant="Q9_X")
    with pytest.raises(UserError, match="--ctx 0"):
        estimate_fit(facts(), load_profile("rpi5"), context=0)
    assert estimate_fit(facts(), load_profile("rpi5"), quant="q4_k_m").quant == "Q4_K_M"


# --- user profiles and errors ---------------------------------------------------------------------

def _write_profile(path, **changes):
    text = load_profile("rpi5").model_dump(exclude={"name", "reference"}) | changes
    lines = [f"{key} = {json.dumps(value)}" for key, value in text.items()]
    path.write_text("\n".join(lines) + "\n")


def test_a_user_directory_adds_and_overrides_profiles(monkeypatch, tmp_path):
    user = tmp_path / "mine"
    user.mkdir()
    _write_profile(user / "rpi5.toml", ram_gb=16)
    _write_profile(user / "my-board.toml", display_name="My board", ram_gb=2, runtime="onnx")
    monkeypatch.setenv("SLM_ALIGN_DEVICES", str(user))
    assert "my-board" in list_profiles() and set(REQUIRED) <= set(list_profiles())
    assert load_profile("rpi5").ram_gb == 16 and load_profile("rpi5").reference == []
    board = load_profile("my-board")
    assert board.display_name == "My board" and estimate_fit(facts(parameters=1e8), board).quant == "w8"


def test_the_config_directory_is_searched_and_the_environment_wins(monkeypatch, tmp_path):
    config = tmp_path / "home" / ".config" / "slm-align" / "devices"
    config.mkdir(parents=True)
    _write_profile(config / "rpi4.toml", ram_gb=8)
    assert load_profile("rpi4").ram_gb == 8
    env = tmp_path / "env"
    env.mkdir()
    _write_profile(env / "rpi4.toml", ram_gb=2)
    monkeypatch.setenv("SLM_ALIGN_DEVICES", str(env))
    assert load_profile("rpi4").ram_gb == 2


@pytest.mark.parametrize("content, problem", [("ram_gb = [", "not valid TOML"),
                                              (None, "ram_gb"),
                                              ("display_name = 'x'", "Field required")])
def test_a_malformed_profile_is_one_line_naming_the_file(monkeypatch, tmp_path, content, problem):
    monkeypatch.setenv("SLM_ALIGN_DEVICES", str(tmp_path))
    path = tmp_path / "broken.toml"
    if content is None:
        _write_profile(path, ram_gb="lots")
    else:
        path.write_text(content)
    with pytest.raises(UserError) as error:
        load_profile("broken")
    message = str(error.value)
    assert str(path) in message and problem in message and "\n" not in message


def test_an_unknown_isa_feature_or_quant_in_a_profile_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("SLM_ALIGN_DEVICES", str(tmp_path))
    _write_profile(tmp_path / "odd.toml", isa=["neon", "warp-drive"])
    with pytest.raises(UserError, match="warp-drive"):
        load_profile("odd")
    _write_profile(tmp_path / "odd.toml", gguf_quant="int8")
    with pytest.raises(UserError, match="not a GGUF type"):
        load_profile("odd")


def test_an_unknown_device_lists_the_known_ones():
    with pytest.raises(UserError, match="unknown device 'toaster'.*rpi-zero2w, rpi4, rpi5"):
        load_profile("toaster")


# --- model facts ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def numpy_hf_dir(tmp_path_factory):
    """A tiny Llama-shaped HF directory written with numpy only: exact parameter count
    known by construction."""
    from safetensors.numpy import save_file

    root = tmp_path_factory.mktemp("hf")
    config = {"model_type": "llama", "hidden_size": 16, "num_hidden_layers": 3, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 32, "vocab_size": 50, "max_position_embeddings": 256}
    (root / "config.json").write_text(json.dumps(config))
    tensors = {"model.embed_tokens.weight": np.zeros((50, 16), np.float32),
               "model.norm.weight": np.ones(16, np.float32)}
    for layer in range(3):
        tensors[f"model.layers.{layer}.self_attn.q_proj.weight"] = np.zeros((16, 16), np.float32)
        tensors[f"model.layers.{layer}.self_attn.k_proj.weight"] = np.zeros((8, 16), np.float32)
        tensors[f"model.layers.{layer}.mlp.up_proj.weight"] = np.zeros((32, 16), np.float32)
    save_file(dict(list(tensors.items())[:4]), str(root / "model-00001-of-00002.safetensors"))
    save_file(dict(list(tensors.items())[4:]), str(root / "model-00002-of-00002.safetensors"))
    return root, sum(t.size for t in tensors.values())


def test_model_facts_counts_hf_parameters_exactly_from_the_safetensors_headers(numpy_hf_dir):
    root, expected = numpy_hf_dir
    found = model_facts(root)
    assert found.parameters == expected == 50 * 16 + 16 + 3 * (256 + 128 + 512)
    assert found.weight_bytes == 4 * expected and found.quant == "F32" and found.bits_per_weight == 32
    assert (found.layers, found.hidden_size, found.kv_heads, found.head_dim) == (3, 16, 2, 4)
    assert (found.vocab_size, found.context_length, found.format) == (50, 256, "hf")
    assert found.kv_bytes_per_token == 2 * 3 * 2 * 4 * 2


def test_model_facts_reads_a_gguf_file(tmp_path, tiny_models):
    from slm_align.ondevice.gguf.writer import write_gguf

    path = write_gguf(tiny_models["llama"], tmp_path / "tiny.gguf", "F16")
    hf, found = model_facts(tiny_models["llama"]), model_facts(path)
    assert found.format == "gguf" and found.architecture == "llama" and found.quant == "F16"
    assert found.parameters == hf.parameters and found.layers == hf.layers == 2
    assert (found.hidden_size, found.kv_heads, found.head_dim, found.context_length) == (32, 2, 8, 512)
    assert found.vocab_size == hf.vocab_size
    assert hf.parameters * 2 < found.weight_bytes < hf.parameters * 4  # F16 matrices, F32 norms
    report = estimate_fit(found, load_profile("rpi5"), quant="F16")
    assert report.memory.weights == found.weight_bytes


def test_model_facts_sizes_an_onnx_export_from_its_files(tmp_path, numpy_hf_dir):
    root, _ = numpy_hf_dir
    onnx = tmp_path / "onnx"
    onnx.mkdir()
    (onnx / "config.json").write_text((root / "config.json").read_text())
    (onnx / "model.onnx").write_bytes(b"\0" * 1000)
    (onnx / "model.onnx_data").write_bytes(b"\0" * 3000)
    found = model_facts(onnx)
    assert found.format == "onnx" and found.weight_bytes == 4000 and not found.parameters_exact
    assert found.layers == 3 and found.parameters > 0 and found.quant in ("F32", "F16", "int8", "int4")


@pytest.mark.parametrize("make, problem", [(lambda p: p / "missing", "not found"),
                                           (lambda p: p, "not a model this can size"),
                                           (lambda p: (p / "notes.txt").write_text("hi") and p / "notes.txt",
                                            "not a model this can size")])
def test_unsupported_model_inputs_are_user_errors(tmp_path, make, problem):
    with pytest.raises(UserError, match=problem):
        model_facts(make(tmp_path))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_config_formula_counts_every_architectures_parameters_exactly(tiny_models, arch):
    """ONNX exports are sized from config.json alone: Qwen2's qkv biases, Qwen3's and Gemma's q/k
    norms, Gemma's extra norms, GPT-2's learned positions and every GPT-style bias are counted."""
    config = json.loads((tiny_models[arch] / "config.json").read_text())
    assert params_from_config(config) == model_facts(tiny_models[arch]).parameters


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text"])
def test_gguf_facts_take_head_dim_from_the_key_length(tmp_path, tiny_models, arch):
    """Qwen3 and Gemma 3 heads are wider than hidden / heads (16, not 8, in the tiny
    models): the KV cache too."""
    from slm_align.ondevice.gguf.writer import write_gguf

    hf = model_facts(tiny_models[arch])
    found = model_facts(write_gguf(tiny_models[arch], tmp_path / "m.gguf", "F16"))
    assert found.head_dim == hf.head_dim == 16 and found.parameters == hf.parameters
    assert found.kv_bytes_per_token == hf.kv_bytes_per_token == 2 * found.layers * found.kv_heads * 16 * 2


def test_a_corrupt_gguf_or_safetensors_is_a_user_error(tmp_path):
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\xff" * 40)
    with pytest.raises(UserError, match="not a readable GGUF file"):
        model_facts(tmp_path / "bad.gguf")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(UserError, match="not a safetensors file"):
        model_facts(tmp_path)


def test_devices_import_neither_torch_nor_transformers(tmp_path, numpy_hf_dir, tiny_models):
    from slm_align.ondevice.gguf.writer import write_gguf

    gguf_path = write_gguf(tiny_models["qwen2"], tmp_path / "q.gguf", "F16")
    code = ("import sys; import slm_align.ondevice.devices as d\n"
            f"for path in ({str(numpy_hf_dir[0])!r}, {str(gguf_path)!r}):\n"
            "    d.estimate_fit(d.model_facts(path), d.load_profile('rpi5'))\n"
            "d.leave_one_out()\nprint(sorted(m for m in ('torch', "
            "'transformers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# --- command line ---------------------------------------------------------------------------------

@pytest.mark.parametrize("command", [["devices"], ["devices", "list"], ["devices", "show"], ["devices", "fit"]])
def test_devices_commands_have_help_with_examples(capsys, command):
    code, out, _ = run_cli(capsys, *command, "--help")
    assert code == 0 and "Examples:" in out and "--json" in out


def test_devices_list_and_show_on_the_command_line(capsys):
    code, out, _ = run_cli(capsys, "devices", "list", "--json")
    names = [row["name"] for row in json.loads(out)["devices"]]
    assert code == 0 and set(REQUIRED) <= set(names)
    code, out, _ = run_cli(capsys, "devices", "show", "rpi5", "--json")
    shown = json.loads(out)
    assert code == 0 and shown["name"] == "rpi5" and len(shown["reference"]) >= 2
    code, out, _ = run_cli(capsys, "devices", "show", "rpi5")
    assert code == 0 and "Raspberry Pi 5" in out and "Reference decode measurements" in out


def test_devices_fit_on_the_command_line(capsys, numpy_hf_dir):
    root, expected = numpy_hf_dir
    code, out, err = run_cli(capsys, "devices", "fit", root, "--device", "rpi5", "--quant", "Q8_0", "--ctx",
                             "128", "--json")
    report = json.loads(out)
    assert code == 0, err
    assert report["device"] == "rpi5" and report["quant"] == "Q8_0" and report["context"] == 128
    assert report["verdict"] == "fits" and report["tokens_per_second"] > 0
    assert report["memory"]["weights"] == pytest.approx(expected * 8.5 / 8)
    code, out, _ = run_cli(capsys, "devices", "fit", root, "--device", "rpi-zero2w")
    assert code == 0 and "verdict" in out and "fits" in out and "tokens/s" in out


@pytest.mark.parametrize("args, problem", [(["--device", "toaster"], "unknown device 'toaster'"),
                                           (["--device", "rpi5", "--quant", "Q9"], "unknown quantization"),
                                           (["--device", "rpi5", "--ctx", "0"], "--ctx 0")])
def test_devices_fit_bad_input_is_one_line_exit_2(capsys, numpy_hf_dir, args, problem):
    code, out, err = run_cli(capsys, "devices", "fit", numpy_hf_dir[0], *args)
    assert code == 2 and out == "" and err.count("\n") == 1 and problem in err


def test_devices_fit_on_a_missing_model_is_one_line_exit_2(capsys, tmp_path):
    code, out, err = run_cli(capsys, "devices", "fit", tmp_path / "nope", "--device", "rpi5")
    assert code == 2 and out == "" and err.count("\n") == 1 and "not found" in err


def test_devices_show_unknown_is_one_line_exit_2(capsys):
    code, out, err = run_cli(capsys, "devices", "show", "toaster", "--json")
    assert code == 2 and out == "" and err.count("\n") == 1 and "known devices" in err
