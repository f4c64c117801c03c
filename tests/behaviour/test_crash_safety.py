"""Crash safety: long stages killed with SIGKILL at several points resume to the same step
count, and no artifact ever appears half-written under its final name. Manifests carry checksums
that loading verifies."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from slm_align.errors import UserError
from slm_align.runs import read_manifest
from tests.helpers import finished_sft_run, tree_digest
from tests.preference.test_dpo_kto import learnable_rows, write_rows

TIMEOUT = 600


def start(*args, pause: str = "", marker=None) -> subprocess.Popen:
    """The CLI in a child process; with ``pause``, one that stops at that point (see tests/paused_cli.py)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    launcher = ["-m", "tests.paused_cli", str(marker), pause] if pause else ["-m", "slm_align"]
    return subprocess.Popen([sys.executable, *launcher, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def killed_at(tmp_path, pause: str, *args) -> None:
    """Run the CLI until it reaches ``pause``, then SIGKILL it there; fail if it ends without reaching it."""
    marker = tmp_path / f"reached-{time.monotonic_ns()}"
    process = start(*args, pause=pause, marker=marker)
    deadline = time.time() + TIMEOUT
    while not marker.exists():
        if process.poll() is not None:
            pytest.fail(f"ended (exit {process.returncode}) without reaching {pause}: {process.stderr.read()[-1500:]}")
        if time.time() > deadline:
            process.kill()
            pytest.fail(f"{pause} not reached in time")
        time.sleep(0.05)  # the child waits at the point: polling here cannot miss it
    process.send_signal(signal.SIGKILL)
    process.communicate()


def finish(*args) -> None:
    process = start(*args)
    _, err = process.communicate(timeout=TIMEOUT)
    assert process.returncode == 0, err[-2000:]


def test_sft_killed_twice_resumes_to_the_full_step_count(tmp_path, tiny_models, stories):
    out = tmp_path / "run"
    args = ["sft", "--model", tiny_models["llama"], "--data", stories, "--out", out, "--max-steps", 60,
            "--save-steps", 4, "--batch-size", 4, "--max-length", 48]
    killed_at(tmp_path, "trainer-start", *args)  # the work dir exists, no checkpoint yet
    assert (out / "sft.partial").is_dir() and not (out / "sft").exists()
    killed_at(tmp_path, "trainer-checkpoint:8", *args, "--resume")
    assert not (out / "sft").exists()  # the final name appears only complete
    left = tree_digest(out / "sft.partial")
    changed = start(*args, "--resume", "--lr", "5e-4")  # another learning rate: not the run that was interrupted
    _, err = changed.communicate(timeout=TIMEOUT)
    assert changed.returncode == 2 and "other inputs or settings" in err and err.count("\n") == 1, err[-2000:]
    assert tree_digest(out / "sft.partial") == left  # refused before touching the interrupted run
    killed_at(tmp_path, "trainer-checkpoint:24", *args, "--resume")
    assert not (out / "sft").exists()
    finish(*args, "--resume")
    manifest = read_manifest(out / "sft")
    assert manifest["metrics"]["steps"] == 60 and not (out / "sft.partial").exists()
    assert "adapter/adapter_model.safetensors" in manifest["files"]


def test_reward_and_rl_killed_mid_training_resume_to_the_full_step_count(tmp_path, tiny_models, stories):
    run, _ = finished_sft_run(tmp_path / "run", tiny_models["llama"], stories, steps=2)
    recipe = tmp_path / "recipe.toml"
    recipe.write_text('[model]\nsource = "%s"\n[data]\npath = "%s"\nmax_length = '
                      '64\n[reward]\nsave_steps = 3\nmax_steps = 30\nbatch_size = '
                      '4\n[rl]\nsave_steps = 2\nsteps = 12\nprompts_per_step = 2\ngroup_size = '
                      '2\nmax_new_tokens = 8\neval_prompts = 4\n' % (tiny_models["llama"], stories))
    reward = ["train", "--stage", "reward", "--out", run, "--config", recipe]
    killed_at(tmp_path, "trainer-checkpoint:6", *reward)
    assert (run / "reward.partial" / "checkpoints" / "checkpoint-6").is_dir()
    assert not (run / "reward").exists()
    finish(*reward, "--resume")
    assert read_manifest(run / "reward")["metrics"]["steps"] == 30

    rl = ["train", "--algo", "grpo", "--out", run, "--config", recipe, "--force", "--json"]
    killed_at(tmp_path, "metrics-line:3", *rl)  # past the checkpoint at step 2
    assert torch.load(run / "rl.partial" / "checkpoint.pt", weights_only=True)["step"] == 2
    assert not (run / "rl").exists()
    killed_at(tmp_path, "metrics-line:7", *rl, "--resume")
    assert not (run / "rl").exists()
    finish(*rl, "--resume")
    steps = [json.loads(line)["step"] for line in (run / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert read_manifest(run / "rl")["metrics"]["steps"] == 12 and steps == list(range(1, 13))


def test_grpo_on_the_llama_cpp_sampler_killed_resumes_to_the_unbroken_runs_adapter(tmp_path, tiny_models, stories):
    """The sampler's base GGUF is made anew on resume and the adapter rewritten from the checkpoint's LoRA:
    the resumed run draws the same rollouts and ends with the same adapter, bit for bit."""
    import shutil

    from safetensors.torch import load_file

    run, _ = finished_sft_run(tmp_path / "a", tiny_models["llama"], stories, steps=2)
    shutil.copytree(run / "sft", tmp_path / "b" / "sft")
    recipe = tmp_path / "recipe.toml"
    recipe.write_text('[model]\nsource = "%s"\n[data]\npath = "%s"\nmax_length = 64\n[rl]\nsave_steps = 2\n'
                      'steps = 4\nprompts_per_step = 2\ngroup_size = 2\nmax_new_tokens = 8\neval_prompts = 2\n'
                      'sampler = "llama_cpp"\n' % (tiny_models["llama"], stories))
    args = ["train", "--algo", "grpo", "--reward", "length_window", "--config", recipe, "--force", "--json"]
    finish(*args, "--out", tmp_path / "a")
    killed_at(tmp_path, "metrics-line:3", *args, "--out", tmp_path / "b")  # past the checkpoint at step 2
    assert torch.load(tmp_path / "b" / "rl.partial" / "checkpoint.pt", weights_only=True)["step"] == 2
    finish(*args, "--out", tmp_path / "b", "--resume")
    unbroken = load_file(tmp_path / "a" / "rl" / "adapter" / "adapter_model.safetensors")
    resumed = load_file(tmp_path / "b" / "rl" / "adapter" / "adapter_model.safetensors")
    assert unbroken.keys() == resumed.keys() and all(torch.equal(unbroken[k], resumed[k]) for k in unbroken)
    assert any(bool(tensor.abs().sum() > 0) for name, tensor in unbroken.items() if "lora_B" in name)  # it trained
    assert read_manifest(tmp_path / "b" / "rl")["inputs"]["rl"]["sampler"] == "llama_cpp"


def test_kto_killed_between_checkpoints_resumes_bit_identical(tmp_path, tiny_models, stories):
    """KTO scores each training answer under the reference on first use and keeps the scores in
    its checkpoints: a run SIGKILLed after a checkpoint resumes with that partial cache and ends
    where an unbroken run ends."""
    prefs = write_rows(tmp_path / "prefs.jsonl", learnable_rows(60))
    recipe = tmp_path / "recipe.toml"
    recipe.write_text('[model]\nsource = "%s"\n[data]\npath = "%s"\nmax_length = '
                      '96\n[reward]\npreferences = ["%s"]\n[preference]\nsteps = 16\nsave_steps = '
                      '4\nbatch_size = 8\nlearning_rate = '
                      '5e-3\neval_every = 5\n' % (tiny_models["llama"], stories, prefs))
    runs = {}
    for name in ("whole", "killed"):
        runs[name], _ = finished_sft_run(tmp_path / name, tiny_models["llama"], stories, steps=2)
    kto = ["train", "--algo", "kto", "--config", recipe, "--force", "--json", "--out"]
    finish(*kto, runs["whole"])
    checkpoint = runs["killed"] / "kto.partial" / "checkpoint.pt"
    killed_at(tmp_path, "metrics-line:6", *kto, runs["killed"])  # past the checkpoint at step 4
    assert not (runs["killed"] / "kto").exists()
    saved = torch.load(checkpoint, weights_only=True)
    assert saved["step"] == 4
    cache = saved["references"]["completions"]
    assert torch.isnan(cache).any() and not torch.isnan(cache).all()  # some answers scored, the rest not yet
    finish(*kto, runs["killed"], "--resume")
    for name in ("adapter/adapter_model.safetensors", "metrics.jsonl"):
        assert (runs["killed"] / "kto" / name).read_bytes() == (runs["whole"] / "kto" / name).read_bytes()
    resumed = read_manifest(runs["killed"] / "kto")["metrics"]
    whole = read_manifest(runs["whole"] / "kto")["metrics"]
    assert resumed["steps"] == 16 and not (runs["killed"] / "kto.partial").exists()
    for key in ("heldout_before", "heldout_after", "heldout_accuracy"):
        assert resumed[key] == whole[key]


def test_killed_export_leaves_no_artifact_and_a_rerun_completes(tmp_path, tiny_models):
    out = tmp_path / "export"
    args = ["export", tiny_models["llama"], "--target", "gguf", "--quant", "F16", "--out", out]
    killed_at(tmp_path, "gguf-written", *args)  # written in scratch, not yet verified or published
    assert out.is_dir() and any(out.iterdir())
    assert not (out / "model-F16.gguf").exists() and not (out / "model-F16.gguf.json").exists()
    finish(*args)
    assert (out / "model-F16.gguf").is_file() and sorted(p.name for p in out.iterdir()) == [
        "README.md", "model-F16.Modelfile", "model-F16.gguf", "model-F16.gguf.json"]


def test_a_damaged_stage_output_is_refused_with_one_line(tmp_path, tiny_models, stories):
    run, _ = finished_sft_run(tmp_path / "run", tiny_models["llama"], stories, steps=2)
    weights = run / "sft" / "adapter" / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(UserError, match="does not match the checksum"):
        read_manifest(run / "sft")
    weights.unlink()
    with pytest.raises(UserError, match="is missing"):
        read_manifest(run / "sft")


def test_a_changed_export_artifact_is_refused_by_the_agent(tmp_path, tiny_models):
    from slm_align.export.publishing.stage import ExportRequest, run_export
    from slm_align.ondevice.agent.runtime import Agent

    artifact = run_export(ExportRequest(str(tiny_models["llama"]), "gguf", "F16", out=tmp_path, verify=False)).stage_dir
    Agent.load(artifact)
    with open(artifact, "ab") as handle:
        handle.write(b"\0")
    with pytest.raises(UserError, match="does not match the checksum"):
        Agent.load(artifact)
