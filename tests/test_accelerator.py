"""Devices, precision and memory savers: what the CPU can prove (device resolution and refusals, bf16 autocast
keeping the envelope's math in fp32, gradient checkpointing that recomputes without changing a bit); the tests
marked ``gpu`` run the same paths on CUDA and skip without it."""

import pytest
import torch

from slm_align.accelerator import Compute, forward_autocast, resolve_device
from slm_align.config import ComputeSettings
from slm_align.errors import UserError
from slm_align.rl.distributed import rank_device
from slm_align.rl.policy import ValueHead
from tests.helpers import run_cli
from tests.test_rl import make_loop, prepared, sft_run  # noqa: F401  (the module fixture)

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
    from slm_align.accelerator import resolve_compute

    settings = ComputeSettings(device="cpu", load_in_4bit=True)
    with pytest.raises(UserError, match="applies to SFT only"):
        resolve_compute(settings, quantizable=False)


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
    """Patch the shared step's ratio_of to record the dtype of every tensor entering it and of the ratio."""
    import slm_align.rl.step as step

    seen = []
    original = step.ratio_of

    def ratio_of(new, old, clamp):
        ratio = original(new, old, clamp)
        seen.append((new.dtype, old.dtype, ratio.dtype))
        return ratio

    monkeypatch.setattr(step, "ratio_of", ratio_of)
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
        batch = loop.rollout(0)[0] if algo == "grpo" else loop.rollout(0)
        if algo == "grpo":
            loss_fn = loop.loss(batch, loop.advantages(batch))
        else:
            advantages, returns = loop.advantages(batch)
            assert advantages.dtype == returns.dtype == torch.float32
            loss_fn = loop.loss(batch, advantages, returns)
        result = loop.minibatch(batch, torch.arange(8), loss_fn)
    assert torch.bfloat16 in logits  # the forward passes did run in bf16
    assert batch.old_logprobs.dtype == batch.ref_logprobs.dtype == batch.scores.dtype == torch.float32
    assert seen == [(torch.float32, torch.float32, torch.float32)]
    assert result["ratio/mean"] == 1.0 and result["ratio/max"] == 1.0


def test_a_bf16_learner_autocasts_its_own_forward_passes(sft_run, monkeypatch):  # noqa: F811
    loop = make_loop(sft_run)
    loop.precision = "bf16"
    seen = recording_ratio(monkeypatch)
    logits = logits_dtypes(loop)
    batch, loss_fn, rows = prepared(loop)
    result = loop.minibatch(batch, rows, loss_fn)
    assert set(logits) == {torch.bfloat16}
    assert seen == [(torch.float32, torch.float32, torch.float32)] and result["ratio/mean"] == 1.0


def layer_calls(loop, monkeypatch) -> list:
    """Count the forward calls of the decoder layers (forward hooks do not fire when checkpointing recomputes)."""
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
    from slm_align.rl.policy import enable_checkpointing

    enable_checkpointing(checkpointed.policy)
    counts = []
    for loop in (plain, checkpointed):
        batch, loss_fn, rows = prepared(loop)
        with monkeypatch.context() as patch:
            calls = layer_calls(loop, patch)
            loop.minibatch(batch, rows, loss_fn)
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


