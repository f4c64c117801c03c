"""The quickstart on the bundled model: SFT lowers perplexity, the reward model ranks well, the gate passes."""

import json

import pytest

from slm_align.cli import main


def test_quickstart_trains_the_bundled_model_and_passes_the_gate(capsys, tmp_path):
    out = tmp_path / "qs"
    with pytest.raises(SystemExit) as done:
        main(["quickstart", "--out", str(out), "--sft-steps", "40", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert done.value.code == 0
    headroom = json.loads((out / "headroom.json").read_text())
    assert headroom == result["headroom"] and headroom["verdict"] == "PASS"
    sft_ppl = headroom["figures"][0]["value"]
    assert sft_ppl < headroom["info"]["base_ppl"] and sft_ppl < 20
    assert (out / "sft" / "adapter" / "adapter_model.safetensors").is_file()
    reward = json.loads((out / "reward" / "manifest.json").read_text())["metrics"]
    assert reward["accuracy"] >= 0.8 and reward["pairs"] >= 100  # held-out pairs from stories it never saw
    assert reward["accuracy_by_kind"]["shuffle"] >= 0.9  # a true continuation beats its shuffled self
    figures = {f["name"]: f for f in headroom["figures"]}
    assert figures["reward accuracy (held-out pairs)"]["passed"]
    assert figures["reward spread (std over policy samples)"]["passed"]
    with pytest.raises(SystemExit):  # a second run reuses the finished stage
        main(["quickstart", "--out", str(out), "--sft-steps", "40", "--json"])
    assert json.loads(capsys.readouterr().out)["sft"]["skipped"] is True
