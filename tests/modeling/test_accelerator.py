"""Devices, precision and memory savers: what the CPU can prove (device resolution and refusals,
bf16 autocast keeping the envelope's math in fp32, gradient checkpointing that recomputes without
changing a bit); the tests marked ``gpu`` run the same paths on CUDA and skip without it."""

import pytest
import torch

from slm_align.config import ComputeSettings
from slm_align.envelope.value_head import ValueHead
from slm_align.envelope.world import rank_device
from slm_align.errors import UserError
from slm_align.modeling.accelerator import Compute, forward_autocast, resolve_device
from tests.helpers import run_cli
from tests.rl.test_guards import make_loop, prepared, sft_run  # noqa: F401  (the module fixture)

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_no_cuda
def test_auto_resolves_to_the_cpu_on_a_machine_without_an_accelerator():
    assert resolve_device("auto") == "cpu"
    assert resolve_device("cpu") == "cpu"


@needs_no_cuda
@pytest.mark.parametrize("command", [["sft"], ["train"], ["train", "--algo", "dpo"]])
def test_cuda_requested_without_cuda_is_exit_2_with_one_line_and_writes_nothing(capsys, tmp_path, command):
    code, out, err = run_cli(capsys, *command, "--data", "demo", "--device", "cuda", "--out", tmp_path / "run")
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "--device cuda: no CUDA GPU here" in err
    assert not (tmp_path / "run").exists()


@needs_no_cuda
def test_evaluate_and_merge_refuse_a_missing_device_too(capsys, tmp_path):
    for command in (["evaluate", "--run", tmp_path], ["merge", "--run", tmp_path]):
        code, _, err = run_cli(capsys, *command, "--device", "cuda:0")
        assert code == 2 and len(err.strip().splitlines()) == 1 and "no CUDA GPU" in err


@pytest.mark.parametrize("flags, message", [
    (["--device", "gpu"], "choose auto, cpu, cuda, cuda:N or mps"),
    (["--device", "cpu", "--load-in-4bit"], "4-bit base weights (bitsandbytes) need a CUDA GPU"),
    (["--device", "cpu", "--precision", "fp16"], "fp16 needs a CUDA GPU"),
])
def test_unavailable_compute_settings_are_refused_in_one_line(capsys, tmp_path, flags, message):
    code, _, err = run_cli(capsys, "sft", "--data", "demo", "--out", tmp_path / "run", *flags)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err
    assert not (tmp_path / "run").exists()


def test_4bit_weights_are_refused_by_the_stages_that_train_full_precision_weights():
    from slm_align.modeling.accelerator import resolve_compute

    settings = ComputeSettings(device="cpu", load_in_4bit=True)
    with pytest.raises(UserError, match="applies to SFT only"):
        resolve_compute(settings, quantizable=False)


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has Apple's GPU")
def test_mps_requested_without_apples_gpu_is_exit_2_with_one_line(capsys, tmp_path):
    code, _, err = run_cli(capsys, "sft", "--data", "demo", "--device", "mps", "--out", tmp_path / "run")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--device mps: no Apple GPU (MPS) here" in err and not (tmp_path / "run").exists()


@needs_no_cuda
def test_check_headroom_refuses_a_missing_device(capsys, tmp_path):
    code, _, err = run_cli(capsys, "check-headroom", "--run", tmp_path / "run", "--device", "cuda")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--device cuda: no CUDA GPU here" in err


@pytest.fixture
def on_a_cuda_machine(monkeypatch):
    """Resolve every device to cuda:0 (as on a machine with a GPU), so the checks after
    the device's are reached."""
    import slm_align.modeling.accelerator as accelerator

    def first_gpu(spec="auto"):
        return "cuda:0"

    monkeypatch.setattr(accelerator, "resolve_device", first_gpu)


def test_fp16_is_refused_by_the_envelopes_loops_and_taken_by_the_trainer_stages(on_a_cuda_machine):
    from slm_align.modeling.accelerator import resolve_compute

    settings = ComputeSettings(precision="fp16")
    assert resolve_compute(settings).trainer_arguments()["fp16"] is True  # SFT, reward: the Trainer scales losses
    with pytest.raises(UserError, match="RL, DPO and KTO take the envelope's guarded "
                                        "step without loss scaling"):
        resolve_compute(settings, trainer=False)


def test_4bit_weights_are_refused_by_the_reward_stage_in_one_line_on_the_cpu(capsys, tmp_path):
    code, _, err = run_cli(capsys, "train", "--stage", "reward", "--load-in-4bit", "--device", "cpu", "--out",
                           tmp_path / "run")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--load-in-4bit applies to SFT only (QLoRA): the reward model is published as a merged full-precision " \
           "classifier" in err
    assert not (tmp_path / "run").exists()


@pytest.fixture
def deepspeed_installed(monkeypatch):
    """A stand-in deepspeed package: ``import deepspeed`` succeeds (nothing
    here trains under it)."""
    import sys
    import types

    monkeypatch.setitem(sys.modules, "deepspeed", types.ModuleType("deepspeed"))


def test_deepspeed_zero2_reaches_the_trainers_arguments(on_a_cuda_machine, deepspeed_installed, monkeypatch,
                                                        tmp_path):
    import transformers

    from slm_align.config import TrainSettings
    from slm_align.envelope.trainer import training_arguments
    from slm_align.modeling.accelerator import DEEPSPEED_PRESETS, resolve_compute

    compute = resolve_compute(ComputeSettings(deepspeed="zero2", precision="fp16"), quantizable=True)
    passed = {}

    def recorded(**arguments):
        passed.update(arguments)
        return arguments

    monkeypatch.setattr(transformers, "TrainingArguments", recorded)
    training_arguments(TrainSettings(), 0, tmp_path, compute)
    assert passed["deepspeed"] == str(DEEPSPEED_PRESETS["zero2"]) and DEEPSPEED_PRESETS["zero2"].is_file()
    assert passed["use_cpu"] is False and passed["fp16"] is True
    assert compute.record()["deepspeed"] == str(DEEPSPEED_PRESETS["zero2"])
    own = tmp_path / "ds.json"
    own.write_text('{"zero_optimization": {"stage": 1}}')
    assert resolve_compute(ComputeSettings(deepspeed=str(own))).trainer_arguments()["deepspeed"] == str(own)
    assert "deepspeed" not in resolve_compute(ComputeSettings()).trainer_arguments()


@pytest.mark.parametrize("command", [["sft", "--data", "demo"], ["train", "--stage", "sft", "--data", "demo"],
                                     ["train", "--stage", "reward"]])
def test_deepspeed_without_the_package_is_one_line_naming_the_install(capsys, tmp_path, monkeypatch, command):
    import sys

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed raises ImportError
    code, _, err = run_cli(capsys, *command, "--deepspeed", "zero2", "--out", tmp_path / "run")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--deepspeed needs DeepSpeed: pip install deepspeed" in err and not (tmp_path / "run").exists()


@pytest.mark.parametrize("algo", ["ppo", "grpo", "dpo", "kto"])
def test_deepspeed_is_refused_by_rl_dpo_and_kto_in_one_line(capsys, tmp_path, deepspeed_installed, algo):
    code, _, err = run_cli(capsys, "train", "--algo", algo, "--data", "demo", "--device", "cpu", "--deepspeed",
                           "zero2", "--out", tmp_path / "run")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--deepspeed applies to the Trainer stages" in err and "RL, DPO and KTO" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("spec, message", [
    ("zero9", "no such file; pass zero2"),
    ("list.json", "a DeepSpeed config is a JSON object, not a list"),
    ("broken.json", "not a JSON file"),
])
def test_a_bad_deepspeed_config_is_refused_in_one_line(capsys, tmp_path, monkeypatch, deepspeed_installed, spec,
                                                       message):
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "broken.json").write_text("{stage: 2")
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(capsys, "sft", "--data", "demo", "--deepspeed", spec, "--out", tmp_path / "run")
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err
    assert not (tmp_path / "run").exists()


@needs_no_cuda
def test_deepspeed_off_cuda_is_refused_in_one_line(capsys, tmp_path, deepspeed_installed):
    code, _, err = run_cli(capsys, "sft", "--data", "demo", "--deepspeed", "zero2", "--out", tmp_path / "run")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "DeepSpeed's ZeRO shards training state across CUDA GPUs, not cpu" in err
    assert not (tmp_path / "run").exists()


def test_dpo_and_kto_refuse_a_data_parallel_launch_in_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    for algo in ("dpo", "kto"):
        code, _, err = run_cli(capsys, "train", "--algo", algo, "--data", "demo", "--out", tmp_path / "run")
        assert code == 2 and len(err.strip().splitlines()) == 1
        assert f"--algo {algo} trains in one process, and this one was launched as 1 of 2 (WORLD_SIZE)" in err
        assert not (tmp_path / "run").exists()
    import torch.distributed as dist

    assert not dist.is_initialized()  # refused before any process group was set up


def test_trainer_arguments_follow_the_resolved_device():
    assert Compute("cpu").trainer_arguments() == {"use_cpu": True, "bf16": False, "fp16": False,
                                                  "gradient_checkpointing": False}
    gpu = Compute("cuda:0", "bf16", gradient_checkpointing=True).trainer_arguments()
    assert gpu["use_cpu"] is False and gpu["bf16"] is True and gpu["gradient_checkpointing"] is True
    assert gpu["gradient_checkpointing_kwargs"] == {"use_reentrant": False}


def test_each_launched_process_computes_on_the_gpu_of_its_local_rank(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert rank_device("cuda:0") == "cuda:1"
    assert rank_device("cpu") == "cpu"
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert rank_device("cuda:0") == "cuda:0"


def test_the_value_head_stays_fp32_under_bf16_autocast():
    head = ValueHead(8)
    with forward_autocast("cpu", "bf16"):
        assert torch.nn.Linear(8, 1)(torch.randn(2, 8)).dtype == torch.bfloat16  # autocast is on ...
        assert head(torch.randn(2, 3, 8)).dtype == torch.float32  # ... and the values stay fp32


def recording_ratio(monkeypatch):
    """Patch the shared minibatch forward's ratio_of to record the dtype of every tensor
    entering it and of the ratio."""
    import slm_align.rl.learner as learner

    seen = []
    original = learner.ratio_of

    def ratio_of(new, old, clamp):
        ratio = original(new, old, clamp)
        seen.append((new.dtype, old.dtype, ratio.dtype))
        return ratio

    monkeypatch.setattr(learner, "ratio_of", ratio_of)
    return seen


def logits_dtypes(loop):
    """Record the dtype of the output projection's logits (what autocast changes)."""
    seen = []

    def hook(module, inputs, output):
        seen.append(output.dtype)

    loop.policy.get_output_embeddings().register_forward_hook(hook)
    return seen


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_bf16_autocast_keeps_the_envelope_math_fp32_and_the_first_ratio_exactly_one(sft_run, monkeypatch,  # noqa: F811
                                                                                   algo):
    loop = make_loop(sft_run, algo=algo)
    seen = recording_ratio(monkeypatch)
    logits = logits_dtypes(loop)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        batch = loop.rollout(0)
        adv = loop.advantages(batch)
        if algo == "ppo":
            assert adv.tokens.dtype == adv.returns.dtype == torch.float32
        result = loop.minibatch(batch, torch.arange(8), adv)
    assert torch.bfloat16 in logits  # the forward passes did run in bf16
    assert batch.old_logprobs.dtype == batch.ref_logprobs.dtype == batch.scores.dtype == torch.float32
    assert seen == [(torch.float32, torch.float32, torch.float32)]
    assert result["ratio/mean"] == 1.0 and result["ratio/max"] == 1.0


def test_a_bf16_learner_autocasts_its_own_forward_passes(sft_run, monkeypatch):  # noqa: F811
    loop = make_loop(sft_run)
    loop.precision = "bf16"
    seen = recording_ratio(monkeypatch)
    logits = logits_dtypes(loop)
    batch, adv, rows = prepared(loop)
    result = loop.minibatch(batch, rows, adv)
    assert set(logits) == {torch.bfloat16}
    assert seen == [(torch.float32, torch.float32, torch.float32)] and result["ratio/mean"] == 1.0


def layer_calls(loop, monkeypatch) -> list:
    """Count the forward calls of the decoder layers (forward hooks do not fire when
    checkpointing recomputes)."""
    layer_class = type(loop.policy.get_base_model().model.layers[0])
    forward = layer_class.forward
    calls = []

    def counted(self, *args, **kwargs):
        calls.append(1)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(layer_class, "forward", counted)
    return calls


def test_rl_gradient_checkpointing_recomputes_the_layers_and_changes_no_bit(sft_run, monkeypatch):  # noqa: F811
    plain = make_loop(sft_run)
    checkpointed = make_loop(sft_run)
    checkpointed.checkpointing = True
    from slm_align.envelope.policy import enable_checkpointing

    enable_checkpointing(checkpointed.policy)
    counts = []
    for loop in (plain, checkpointed):
        batch, adv, rows = prepared(loop)
        with monkeypatch.context() as patch:
            calls = layer_calls(loop, patch)
            loop.minibatch(batch, rows, adv)
        counts.append(len(calls))
    layers = plain.policy.config.num_hidden_layers
    assert counts == [layers, 2 * layers]  # each checkpointed layer ran again in the backward pass
    assert not any(module.training for name, module in checkpointed.policy.named_modules()
                   if "dropout" in name.lower())  # and dropout stayed off
    for (_, a), (_, b) in zip(plain.named_params, checkpointed.named_params):
        assert torch.equal(a, b)


@pytest.mark.gpu
@needs_cuda
def test_gpu_a_grpo_iteration_on_cuda_in_bf16_keeps_the_ratio_math_fp32(sft_run, monkeypatch):  # noqa: F811
    loop = make_loop(sft_run)
    loop.policy.to("cuda")
    loop.device = torch.device("cuda:0")
    loop.precision = "bf16"
    seen = recording_ratio(monkeypatch)
    metrics = loop.run_step(0)
    assert all(p.device.type == "cuda" for p in loop.params)
    assert set(seen) == {(torch.float32, torch.float32, torch.float32)}
    assert metrics["guard/rollbacks"] == 0


@pytest.mark.gpu
@needs_cuda
def test_gpu_auto_resolves_to_the_first_cuda_device_and_a_missing_index_is_refused():
    assert resolve_device("auto") == "cuda:0"
    with pytest.raises(UserError, match="CUDA GPU"):
        resolve_device(f"cuda:{torch.cuda.device_count()}")


@pytest.mark.gpu
@needs_cuda
def test_gpu_sft_trains_on_cuda(tmp_path, tiny_models, stories):
    from tests.helpers import finished_sft_run

    out, _ = finished_sft_run(tmp_path / "run", tiny_models["llama"], stories, steps=2)
    import json

    manifest = json.loads((out / "sft" / "manifest.json").read_text())
    assert manifest["metrics"]["compute"]["device"] == "cuda:0"


