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


def start(*args) -> subprocess.Popen:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.Popen([sys.executable, "-m", "slm_align", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def kill_when(process: subprocess.Popen, ready) -> None:
    """SIGKILL ``process`` as soon as ``ready()`` holds; fail if it finished first."""
    deadline = time.time() + TIMEOUT
    while not ready():
        if process.poll() is not None:
            pytest.fail(f"finished (exit {process.returncode}) before the kill point: "
                        f"{process.stderr.read()[-1500:]}")
        if time.time() > deadline:
            process.kill()
            pytest.fail("kill point not reached in time")
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()


def finish(*args) -> None:
    process = start(*args)
    _, err = process.communicate(timeout=TIMEOUT)
    assert process.returncode == 0, err[-2000:]


def checkpoint_at_least(checkpoints, step):
    def ready():
        return checkpoints.is_dir() and any(d.name.startswith("checkpoint-") and int(d.name.split("-")[1]) >= step
                                            for d in checkpoints.iterdir())
    return ready


def test_sft_killed_twice_resumes_to_the_full_step_count(tmp_path, tiny_models, stories):
    out = tmp_path / "run"
    args = ["sft", "--model", tiny_models["llama"], "--data", stories, "--out", out, "--max-steps", 60,
            "--save-steps", 4, "--batch-size", 4, "--max-length", 48]
    kill_when(start(*args), lambda: (out / "sft.partial").is_dir())  # before any checkpoint
    assert not (out / "sft").exists()
    kill_when(start(*args, "--resume"), checkpoint_at_least(out / "sft.partial" / "checkpoints", 8))
    assert not (out / "sft").exists()  # the final name appears only complete
    left = tree_digest(out / "sft.partial")
    changed = start(*args, "--resume", "--lr", "5e-4")  # another learning rate: not the run that was interrupted
    _, err = changed.communicate(timeout=TIMEOUT)
    assert changed.returncode == 2 and "other inputs or settings" in err and err.count("\n") == 1, err[-2000:]
    assert tree_digest(out / "sft.partial") == left  # refused before touching the interrupted run
    kill_when(start(*args, "--resume"), checkpoint_at_least(out / "sft.partial" / "checkpoints", 24))
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
    kill_when(start(*reward), checkpoint_at_least(run / "reward.partial" / "checkpoints", 6))
    assert not (run / "reward").exists()
    finish(*reward, "--resume")
    assert read_manifest(run / "reward")["metrics"]["steps"] == 30

    rl = ["train", "--algo", "grpo", "--out", run, "--config", recipe, "--force", "--json"]
    log = run / "rl.partial" / "metrics.jsonl"
    checkpoint = run / "rl.partial" / "checkpoint.pt"
    logged = lambda n: lambda: log.is_file() and log.read_text().count("\n") >= n  # noqa: E731
    kill_when(start(*rl), lambda: checkpoint.is_file() and logged(3)())  # past the checkpoint at step 2
    assert not (run / "rl").exists()
    kill_when(start(*rl, "--resume"), logged(7))
    assert not (run / "rl").exists()
    finish(*rl, "--resume")
    steps = [json.loads(line)["step"] for line in (run / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert read_manifest(run / "rl")["metrics"]["steps"] == 12 and steps == list(range(1, 13))


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
    log = runs["killed"] / "kto.partial" / "metrics.jsonl"
    checkpoint = runs["killed"] / "kto.partial" / "checkpoint.pt"
    kill_when(start(*kto, runs["killed"]), lambda: checkpoint.is_file() and log.read_text().count("\n") >= 6)
    assert not (runs["killed"] / "kto").exists()
    saved = torch.load(checkpoint, weights_only=True)
    assert saved["step"] in (4, 8, 12)
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
    kill_when(start(*args), lambda: out.is_dir() and any(out.iterdir()))  # scratch exists: mid-export
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
    from slm_align.agent.runtime import Agent
    from slm_align.export.stage import ExportRequest, run_export

    artifact = run_export(ExportRequest(str(tiny_models["llama"]), "gguf", "F16", out=tmp_path, verify=False)).stage_dir
    Agent.load(artifact)
    with open(artifact, "ab") as handle:
        handle.write(b"\0")
    with pytest.raises(UserError, match="does not match the checksum"):
        Agent.load(artifact)
