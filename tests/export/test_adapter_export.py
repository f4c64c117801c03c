"""``export --target gguf-adapter``: a run's adapters beside one base, bound to it by hash, verified as
base + adapters against the merged PyTorch policy; a DPO round's chain (SFT adapter + DPO adapter on the
original base) matches RUN/merged; what this target cannot export is refused in one line."""

import json
import shutil

import numpy as np
import pytest

from slm_align.export.publishing.parity import HELDOUT_TEXT
from slm_align.ondevice.agent.llama_backend import LlamaCppBackend
from slm_align.ondevice.agent.runtime import Agent
from slm_align.ondevice.agent.settings import SamplingParams
from slm_align.ondevice.agent.store import PreferenceStore
from slm_align.ondevice.gguf.adapter_check import BASE_SHA256_KEY, chain_digest
from slm_align.ondevice.gguf.fields import read_fields
from slm_align.pipeline import run_preference
from slm_align.preference.data import check_feedback_models
from slm_align.runs import sha256_file
from tests.helpers import finished_sft_run, run_cli

pytest.importorskip("llama_cpp")


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, tiny_models, stories):
    return finished_sft_run(tmp_path_factory.mktemp("adapter-run") / "run", tiny_models["llama"], stories, steps=2)


@pytest.fixture(scope="module")
def dpo_run(sft_run, tmp_path_factory):
    """The SFT run with a short DPO round on pairs whose chosen side opens with "Yes, indeed." (lr high
    enough that the DPO adapter moves the logits)."""
    base, recipe = sft_run
    out = tmp_path_factory.mktemp("adapter-dpo") / "run"
    shutil.copytree(base / "sft", out / "sft")
    prefs = out.parent / "prefs.jsonl"
    prefs.write_text("".join(json.dumps({"prompt": f"Story {i}: the fox went to the river.",
                                         "chosen": f" Yes, indeed. It saw {i % 7} birds.",
                                         "rejected": f" It saw {i % 7} birds."}) + "\n" for i in range(24)))
    recipe = recipe.model_copy(update={
        "rl": recipe.rl.model_copy(update={"algo": "dpo"}),
        "preference": recipe.preference.model_copy(update=dict(steps=8, learning_rate=2e-2, batch_size=8,
                                                               eval_every=8, save_steps=8)),
        "reward": recipe.reward.model_copy(update={"preferences": [str(prefs)]})})
    run_preference(recipe, out, force=True)
    return out


def manifest_of(summary: dict) -> dict:
    return json.loads(open(summary["dir"], encoding="utf-8").read())


def test_a_runs_sft_adapter_exports_beside_one_base_bound_by_hash(sft_run, capsys):
    run = sft_run[0]
    code, out, _ = run_cli(capsys, "export", run, "--target", "gguf-adapter", "--quant", "F32", "--json")
    assert code == 0
    summary = json.loads(out)
    folder = run / "export"
    base, adapter = folder / "base-F32.gguf", folder / "adapter-sft-F32.gguf"
    assert summary["dir"] == str(folder / "adapter-sft-F32.gguf.json")
    metrics = manifest_of(summary)["metrics"]
    assert metrics["base"] | {"source": None} == {"path": base.name, "sha256": sha256_file(base), "exported": True,
                                                  "bytes": base.stat().st_size, "quant": "F32", "source": None}
    assert metrics["adapters"] == [{"path": adapter.name, "stage": "sft", "trained_on": "base", "scale": 1.0,
                                    "sha256": sha256_file(adapter), "bytes": adapter.stat().st_size}]
    assert metrics["sha256"] == chain_digest(sha256_file(base), [sha256_file(adapter)])
    assert read_fields(adapter, prefix=BASE_SHA256_KEY)[BASE_SHA256_KEY].value == sha256_file(base)
    verification = metrics["verification"]
    assert verification["passed"] and verification["agreement"] == 1.0 and not verification["divergences"]
    assert sorted(p.name for p in folder.iterdir()) == [adapter.name, adapter.name + ".json", base.name]
    code, out, err = run_cli(capsys, "export", run, "--target", "gguf-adapter", "--quant", "F32")
    assert code == 2 and out == "" and err.count("\n") == 1 and "--overwrite" in err
    before = base.stat().st_mtime_ns
    code, _, _ = run_cli(capsys, "export", run, "--target", "gguf-adapter", "--quant", "F32", "--overwrite",
                         "--no-verify")
    assert code == 0 and base.stat().st_mtime_ns == before  # the identical base is reused, not rewritten


def test_a_dpo_round_exports_the_chain_that_loads_as_the_merged_policy(dpo_run, capsys, tmp_path):
    code, out, _ = run_cli(capsys, "export", dpo_run, "--target", "gguf-adapter", "--json")
    assert code == 0
    metrics = manifest_of(json.loads(out))["metrics"]
    folder = dpo_run / "export"
    assert [(a["path"], a["stage"], a["trained_on"]) for a in metrics["adapters"]] == [
        ("adapter-sft-F16.gguf", "sft", "base"), ("adapter-dpo-F16.gguf", "dpo", "merged sft")]
    assert json.loads((dpo_run / "merged" / "manifest.json").read_text())["inputs"]["aligned_stage"] == "dpo"
    assert metrics["verification"]["passed"] and metrics["verification"]["greedy_exact"] == 4
    # The chain is what PyTorch's merged policy computes, and each adapter matters.
    base = folder / "base-F16.gguf"
    chain = [folder / a["path"] for a in metrics["adapters"]]
    backend = LlamaCppBackend(base, n_ctx=512, all_logits=True, threads=1, adapters=chain)
    ids = backend.tokenize(HELDOUT_TEXT)[:64]
    both = backend.feed_all(ids)
    merged = torch_logits(dpo_run / "merged", ids)
    backend.set_adapters(chain[:1])
    backend.reset()
    sft_only = backend.feed_all(ids)
    assert np.abs(both - merged).max() < np.abs(sft_only - merged).max() / 5
    # What the runtime records for answers of this chain is what the run exported: the next round trains on it.
    store = PreferenceStore(tmp_path / "prefs.db")
    agent = Agent.load(base, adapters=chain, store=store, sampling=SamplingParams(temperature=0, max_tokens=4))
    agent.chat("Tell me a story.")
    [turn] = store.turns()
    assert turn.model_id == metrics["sha256"] and [a["file"] for a in turn.sampling["adapters"]] == [
        "adapter-sft-F16.gguf", "adapter-dpo-F16.gguf"]
    assert check_feedback_models({turn.model_id}, dpo_run, any_model=False)["matched"] == [turn.model_id]


def torch_logits(model_dir, ids):
    import torch

    from slm_align.modeling.models import load_model, resolve_source

    with torch.no_grad():
        return load_model(resolve_source(str(model_dir)))(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("args, expected", [
    (["{model}"], "is not a run directory"),
    (["{run}", "--calibrate"], "--calibrate does not apply"),
    (["{run}", "--quant", "Q3_X"], "unknown GGUF quantization 'Q3_X'"),
])
def test_what_this_target_cannot_export_is_one_line(capsys, tmp_path, tiny_models, sft_run, args, expected):
    paths = {"{model}": tiny_models["llama"], "{run}": sft_run[0]}
    out_dir = tmp_path / "out"
    code, out, err = run_cli(capsys, "export", *[paths.get(a, a) for a in args], "--target", "gguf-adapter",
                             "--out", out_dir)
    assert code == 2 and out == "" and err.count("\n") == 1 and expected in err, err
    assert not out_dir.exists()


def test_a_run_from_the_users_gguf_binds_the_adapter_to_that_file_untouched(llama_cpp_reference, stories, tmp_path,
                                                                            capsys):
    """The user's own GGUF (made by llama.cpp's converter) is the base: referenced, never copied nor changed."""
    users = shutil.copy(llama_cpp_reference["llama"], tmp_path / "users-model.gguf")
    before = sha256_file(users)
    run, _ = finished_sft_run(tmp_path / "run", users, stories, steps=2)
    code, out, _ = run_cli(capsys, "export", run, "--target", "gguf-adapter", "--json")
    assert code == 0
    metrics = manifest_of(json.loads(out))["metrics"]
    assert metrics["base"]["path"] == str(users.resolve()) and not metrics["base"]["exported"]
    assert metrics["base"]["sha256"] == before == sha256_file(users)
    assert metrics["verification"]["passed"] and metrics["verification"]["greedy_exact"] == 4  # an F32 file
    assert sorted(p.name for p in (run / "export").iterdir()) == ["adapter-sft-F16.gguf", "adapter-sft-F16.gguf.json"]
    code, _, err = run_cli(capsys, "export", run, "--target", "gguf-adapter", "--chat-template", "chatml",
                           "--overwrite")
    assert code == 2 and "left untouched" in err
