"""`slm-align bench`: on-host measurement of GGUF and ONNX artifacts, saved host
profiles, and no torch."""

import json
import math
import subprocess
import sys

import pytest

from slm_align.errors import UserError
from slm_align.ondevice.agent.bench import BenchPlan, bench, run_bench
from slm_align.ondevice.devices.host import cpu_flags, profile_isa
from slm_align.ondevice.devices.measured import BenchResult, save_profile, to_toml
from slm_align.ondevice.devices.profiles import load_profile, tomllib
from tests.helpers import export_bundled, run_cli

pytest.importorskip("llama_cpp")
pytest.importorskip("onnxruntime")
SMALL = dict(prompt_tokens=16, decode_tokens=8, repeats=2)
SMALL_FLAGS = ["--prompt-tokens", "16", "--decode-tokens", "8", "--repeats", "1"]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """The bundled model exported once to GGUF Q8_0 and ONNX int8."""
    return export_bundled(tmp_path_factory.mktemp("bench-artifacts"), ("gguf", "Q8_0"), ("onnx", "int8"))


@pytest.fixture(scope="module")
def measured(artifacts):
    """Each artifact benched once (small sizes: the figures, not their speed, are under test)."""
    return {kind: bench(path, threads=1, **SMALL) for kind, path in artifacts.items()}


@pytest.fixture
def profile_dir(tmp_path, monkeypatch):
    directory = tmp_path / "devices"
    monkeypatch.setenv("SLM_ALIGN_DEVICES", str(directory))
    return directory


@pytest.mark.parametrize("kind", ["gguf", "onnx"])
def test_bench_measures_every_figure(measured, artifacts, kind):
    result = measured[kind]
    assert result.kind == kind and result.artifact == str(artifacts[kind])
    assert (result.prompt_tokens, result.decode_tokens, result.repeats, result.threads) == (16, 8, 2, 1)
    assert result.generated_tokens == 8 + 1  # the first token (from the prompt's logits) plus the decoded ones
    assert len(result.decode_runs) == 2
    for figure in (result.load_seconds, result.time_to_first_token_seconds, result.prompt_tokens_per_second,
                   result.decode_tokens_per_second, *result.decode_runs):
        assert math.isfinite(figure) and figure > 0
    assert min(result.decode_runs) <= result.decode_tokens_per_second <= max(result.decode_runs)
    assert 0 < result.rss_before_load_bytes < result.peak_rss_bytes
    assert result.model_rss_bytes == result.peak_rss_bytes - result.rss_before_load_bytes
    assert result.n_ctx >= 16 + 8 and result.model and result.runtime
    host = result.host
    assert host.cores >= 1 and host.logical_cpus >= 1 and host.ram_gb > 0 and host.cpu
    assert BenchResult.from_dict(json.loads(json.dumps(result.to_dict()))) == result


def test_peak_memory_is_the_measuring_process_not_the_caller(measured):
    """The parent holds torch (the export fixture) and pytest; the child's peak
    must be far below that."""
    import resource

    parent_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert measured["gguf"].peak_rss_bytes < parent_peak


def test_isa_flags_map_to_profile_words():
    x86 = "flags\t\t: fpu sse4_2 avx avx2 fma avx512f avx512bw avx512_vnni\n"
    arm = "Features\t: fp asimd evtstrm asimdhp asimddp i8mm bf16\n"
    assert cpu_flags(x86, "x86_64") == ["sse4_2", "avx", "avx2", "avx512f", "avx512_vnni"]
    assert profile_isa(cpu_flags(x86, "x86_64")) == ["sse4", "avx", "avx2", "avx512", "avx512_vnni"]
    assert profile_isa(cpu_flags(arm, "aarch64")) == ["neon", "dotprod", "i8mm", "fp16", "bf16"]


def test_toml_writer_round_trips():
    data = {"display_name": 'this host: "Xeon" \\ 2', "ram_gb": 7.5, "cores": 4, "isa": ["avx2"],
            "reference": [{"model": "m", "parameters": 3, "size_gb": None}]}
    assert tomllib.loads(to_toml(data)) == {"display_name": 'this host: "Xeon" \\ 2',
                                            "ram_gb": 7.5, "cores": 4,
                                            "isa": ["avx2"], "reference": [{"model": "m", "parameters": 3}]}


@pytest.mark.parametrize("kind", ["gguf", "onnx"])
def test_saved_profile_loads_and_is_not_overwritten(measured, profile_dir, kind):
    path = save_profile(measured[kind], "host-test", bandwidth_gbs=12.5)
    assert path == profile_dir / "host-test.toml" and not list(profile_dir.glob(".*.tmp"))
    profile = load_profile("host-test")
    host = measured[kind].host
    assert profile.display_name == f"this host: {host.cpu}" and profile.runtime == kind
    assert (profile.cores, profile.threads, profile.ram_gb, profile.bandwidth_gbs) == (host.cores, 1, host.ram_gb, 12.5)
    assert "numpy copy" in profile.bandwidth_source and profile.isa == host.isa
    (point,) = profile.reference
    assert point.tokens_per_second == pytest.approx(measured[kind].decode_tokens_per_second, rel=1e-3)
    assert point.parameters > 1_000_000 and point.source.startswith("slm-align bench on this host, ")
    before = path.read_text()
    with pytest.raises(UserError, match="already exists; pass --overwrite"):
        save_profile(measured[kind], "host-test", bandwidth_gbs=99.0)
    assert path.read_text() == before
    save_profile(measured[kind], "host-test", overwrite=True, bandwidth_gbs=99.0)
    assert load_profile("host-test").bandwidth_gbs == 99.0


def test_bad_profile_names_and_threads_are_user_errors(measured, profile_dir):
    with pytest.raises(UserError, match="--save-profile '../x'"):
        save_profile(measured["gguf"], "../x", bandwidth_gbs=1.0)
    too_many = BenchResult.from_dict(dict(measured["gguf"].to_dict(), threads=10_000))
    with pytest.raises(UserError, match="threads"):
        save_profile(too_many, "host-test", bandwidth_gbs=1.0)
    assert not profile_dir.exists() or not list(profile_dir.iterdir())


def test_cli_saves_profile_then_predicts_with_it(artifacts, profile_dir, capsys):
    gguf = artifacts["gguf"]
    code, out, err = run_cli(capsys, "bench", gguf, "--threads", "1", *SMALL_FLAGS, "--save-profile", "host-test",
                             "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["saved_profile"]["name"] == "host-test" and summary["saved_profile"]["bandwidth_gbs"] > 0
    assert load_profile("host-test").reference

    code, out, err = run_cli(capsys, "bench", gguf, "--threads", "1", *SMALL_FLAGS, "--save-profile", "host-test")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "--overwrite" in err

    code, out, err = run_cli(capsys, "bench", gguf, "--threads", "1", *SMALL_FLAGS, "--device", "host-test",
                             "--json")
    assert code == 0, err
    prediction = json.loads(out)["prediction"]
    assert prediction["device"] == "host-test" and prediction["quant"] == "Q8_0"
    assert math.isfinite(prediction["ratio"]) and prediction["ratio"] > 0
    assert prediction["ratio"] == pytest.approx(prediction["measured_tokens_per_second"]
                                                / prediction["predicted_tokens_per_second"])

    code, out, err = run_cli(capsys, "bench", artifacts["onnx"], "--threads", "1", *SMALL_FLAGS,
                             "--device", "host-test")
    assert code == 0, err
    text = " ".join(out.split())  # rich wraps lines at the terminal width
    assert "decode" in text and "tokens/s" in text and "peak memory" in text
    ratio = float(text.split("measured / predicted = ")[1].split()[0])
    assert math.isfinite(ratio) and ratio > 0


def test_unknown_artifact_and_device_are_one_line_errors(artifacts, tmp_path, profile_dir, capsys):
    for args, needle in ((["bench", tmp_path / "missing.gguf"], "not an exported model"),
                         (["bench", artifacts["gguf"], "--device", "no-such-board"], "unknown device 'no-such-board'"),
                         (["bench", artifacts["gguf"], "--prompt-tokens", "400", "--decode-tokens", "400"],
                          "exceed the context window")):
        code, out, err = run_cli(capsys, *args)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and needle in err, err
    with pytest.raises(UserError, match="--repeats 0"):
        run_bench(artifacts["gguf"], BenchPlan(repeats=0))


def test_bench_has_help_with_examples(capsys):
    code, out, _ = run_cli(capsys, "bench", "--help")
    assert code == 0 and "Examples:" in out and "--save-profile" in out and "--json" in out


def test_bench_imports_neither_torch_nor_transformers(artifacts, tmp_path):
    out = tmp_path / "child.json"
    code = ("import sys\nfrom slm_align.ondevice.agent.bench import bench, main\n"
            f"bench({str(artifacts['onnx'])!r}, threads=1, prompt_tokens=8, decode_tokens=4, repeats=1)\n"
            f"assert main([{str(artifacts['gguf'])!r}, '--threads', '1', '--prompt-tokens', '8', "
            f"'--decode-tokens', '4', '--repeats', '1', '--out', {str(out)!r}]) == 0\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
    assert json.loads(out.read_text())["generated_tokens"] == 5
