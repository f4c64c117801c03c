"""Launching on several processes: the launch files shipped with the package (accelerate configs for
one machine and for several, read by accelerate's own config loader, which rejects unknown keys, and
the DeepSpeed ZeRO-2 config of the Trainer stages); the Trainer stages under a two-process launch
(rank 0 alone prepares, logs and publishes); and a data-parallel RL launch refusing to train its
missing prerequisites on rank 0 alone."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from slm_align.modeling.accelerator import DEEPSPEED_PRESETS, LAUNCH_DIR

ACCELERATE = {"accelerate_multi_gpu.yaml": {"num_machines": 1, "num_processes": 4},
              "accelerate_multi_node.yaml": {"num_machines": 2, "num_processes": 8, "main_process_port": 29500}}


@pytest.mark.parametrize("name", sorted(ACCELERATE))
def test_accelerate_configs_parse_and_name_a_multi_gpu_launch_that_leaves_precision_to_the_recipe(name):
    from accelerate.commands.config.config_args import ClusterConfig

    path = LAUNCH_DIR / name
    fields = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert fields["distributed_type"] == "MULTI_GPU" and fields["compute_environment"] == "LOCAL_MACHINE"
    assert fields["mixed_precision"] == "no"  # --precision decides, the envelope's math stays fp32
    assert fields["machine_rank"] == 0 and fields["use_cpu"] is False
    for key, value in ACCELERATE[name].items():
        assert fields[key] == value, key
    config = ClusterConfig.from_yaml_file(str(path))  # raises on a key accelerate does not know
    assert config.distributed_type.value == "MULTI_GPU" and config.num_processes == fields["num_processes"]
    if fields["num_machines"] > 1:
        assert config.main_process_ip and config.main_process_port == 29500
        assert fields["num_processes"] % fields["num_machines"] == 0  # the same GPUs on every machine


def test_the_zero2_config_shards_with_stage_2_and_takes_its_sizes_from_the_trainer():
    config = json.loads(DEEPSPEED_PRESETS["zero2"].read_text(encoding="utf-8"))
    assert config["zero_optimization"]["stage"] == 2
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "gradient_clipping"):
        assert config[key] == "auto", key  # filled in from the recipe's batch size, accumulation and clip
    assert config["bf16"]["enabled"] == "auto" and config["fp16"]["enabled"] == "auto"  # --precision decides
    assert "optimizer" not in config and "scheduler" not in config  # the Trainer's AdamW and cosine schedule
    assert "offload_optimizer" not in config["zero_optimization"]  # offload would need DeepSpeed's own optimizer


def test_the_launch_files_are_package_data():
    from slm_align.config.tomlcompat import tomllib

    root = LAUNCH_DIR.parent.parent
    pyproject = tomllib.loads((root.parent / "pyproject.toml").read_text(encoding="utf-8"))
    packaged = {path for pattern in pyproject["tool"]["setuptools"]["package-data"]["slm_align"]
                for path in root.glob(pattern)}
    shipped = sorted(path.name for path in LAUNCH_DIR.iterdir())
    assert shipped == sorted([*ACCELERATE, "deepspeed_zero2.json"])
    assert all(LAUNCH_DIR / name in packaged for name in shipped)  # the wheel carries them


def launch(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``slm-align ARGS`` on two CPU processes under accelerate launch (gloo),
    importing this checkout."""
    repo = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "slm_align", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=cwd,
                          env=dict(os.environ, PYTHONPATH=str(repo), OMP_NUM_THREADS="1"))


def test_the_trainer_stages_train_data_parallel_and_rank_0_alone_writes(tmp_path):
    out = tmp_path / "run"
    done = launch("sft", "--data", "demo", "--set", "data.demo_documents=50", "--max-steps", "3", "--batch-size",
                  "4", "--device", "cpu", "--out", str(out), "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["stage"] == "sft"  # one summary: rank 0's
    manifest = json.loads((out / "sft" / "manifest.json").read_text())["metrics"]
    logged = [json.loads(line) for line in (out / "sft" / "log.jsonl").read_text().splitlines()]
    assert [line["step"] for line in logged if "train_loss" in line] == [3]  # one log, not one per rank
    per_epoch = manifest["train_documents"] / (4 * 2)  # two ranks, four documents each per step
    assert logged[-1]["epoch"] == pytest.approx(3 / per_epoch, abs=0.01)  # each rank took its own share
    assert manifest["world_size"] == 2 and manifest["replicas_identical"]  # averaged gradients kept them equal
    done = launch("train", "--stage", "reward", "--reward-steps", "2", "--device", "cpu", "--out", str(out),
                  "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    metrics = json.loads(done.stdout)["metrics"]
    assert metrics["steps"] == 2 and metrics["world_size"] == 2 and metrics["replicas_identical"]
    assert len(set(metrics["replica_digests"])) == 1 and len(metrics["replica_digests"]) == 2
    assert sorted(path.name for path in out.iterdir()) == ["reward", "sft"]  # no partial dir left behind
    assert (out / "reward" / "model" / "model.safetensors").is_file()


def test_a_data_parallel_rl_launch_refuses_to_train_its_prerequisites_on_rank_0_alone(tmp_path):
    from slm_align.config import load_recipe
    from slm_align.envelope.world import World
    from slm_align.errors import UserError
    from slm_align.pipeline import RLRequest, rl_prior

    recipe = load_recipe(overrides={"data.path": "demo", "rl.algo": "grpo"})
    world = World(rank=0, size=2)
    with pytest.raises(UserError, match="a data-parallel RL launch needs the sft and reward stage "
                                        "of .* finished first: run `slm-align train --stage sft"):
        rl_prior(recipe, tmp_path / "run", RLRequest(), world, print)
    with pytest.raises(UserError, match="needs the sft stage .* finished first"):
        rl_prior(recipe, tmp_path / "run", RLRequest(rewards=("length_window",)), world, print)
    assert not (tmp_path / "run").exists()
