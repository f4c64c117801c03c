"""Flag names (issue 21, item 5): one spelling per concept across commands, TRL's and llama.cpp's
spellings as aliases, and old spellings that keep working with a one-line deprecation note."""

import pytest
import typer

from slm_align.cli.aliases import DEPRECATED, current_spellings
from tests.helpers import run_cli


class Reached(Exception):
    """Raised by a stand-in stage once the command has parsed its flags."""


def _options() -> dict[str, set[str]]:
    """Every command path ("devices fit") -> the option names it accepts."""
    from slm_align.cli import app

    found = {}

    def walk(command, path):
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, path + [name])
        if not hasattr(command, "commands"):
            found[" ".join(path)] = {opt for param in command.params for opt in param.opts if opt.startswith("-")}

    walk(typer.main.get_command(app), [])
    return found


def test_deprecated_spellings_are_rewritten_with_one_note_each():
    notes = []
    argv = ["chat", "m.gguf", "--max-tokens", "12", "--system", "--max-tokens=9"]
    assert current_spellings(argv, notes.append) == ["chat", "m.gguf", "--max-new-tokens", "12", "--system",
                                                     "--max-new-tokens=9"]
    assert notes == ["note: --max-tokens is deprecated; use --max-new-tokens\n"]
    notes.clear()
    assert current_spellings(["evaluate", "--run", "r", "-m", "a", "--model", "b"], notes.append) == [
        "evaluate", "--run", "r", "--baseline", "a", "--baseline", "b"]
    assert len(notes) == 2 and all(line.count("\n") == 1 for line in notes)
    assert current_spellings(["devices", "fit", "m", "--", "--context"], notes.append)[-1] == "--context"


def test_other_commands_keep_their_flags_untouched():
    notes = []
    argv = ["sft", "--model", "base", "--max-tokens", "3"]  # --model is sft's base model; --max-tokens is no sft flag
    assert current_spellings(argv, notes.append) == argv and notes == []


def test_no_command_offers_a_deprecated_spelling_or_a_second_spelling_of_a_concept():
    options = _options()
    for command, renames in DEPRECATED.items():
        assert not set(renames) & options[command], command
        assert set(renames.values()) <= options[command], command
    for command, names in options.items():
        assert not {"--max-tokens", "--context"} & names, command
        assert ("--ctx" in names) == ("--ctx-size" in names), command
        if command != "evaluate" and "--model" in names:
            assert "--data" in names, command  # --model is the base model a stage trains or measures
    assert "--model" not in options["evaluate"] and "--baseline" in options["evaluate"]


def test_an_old_spelling_works_on_the_command_line_with_a_note(capsys, tmp_path):
    code, _, err = run_cli(capsys, "evaluate", "--run", tmp_path, "--model", "base")
    lines = err.splitlines()
    assert lines[0] == "note: --model is deprecated; use --baseline"
    assert code == 2 and len(lines) == 2 and "no finished SFT stage" in lines[1]  # parsed as --baseline, then checked


def test_trl_spellings_set_the_same_recipe_settings_without_a_note(capsys, tmp_path, monkeypatch):
    import slm_align.pipeline
    import slm_align.sft.stage

    seen = {}

    def fake_run(recipe, out, **kwargs):
        seen["recipe"] = recipe
        seen["out"] = out
        raise Reached

    monkeypatch.setattr(slm_align.pipeline, "run_rl", fake_run)
    monkeypatch.setattr(slm_align.sft.stage, "run_sft", fake_run)
    with pytest.raises(Reached):
        run_cli(capsys, "train", "--data", "demo", "--algo", "grpo", "--num-generations", "4",
                "--max-completion-length", "16", "--mask-truncated-completions", "--output-dir", tmp_path / "g")
    rl = seen["recipe"].rl
    assert (rl.group_size, rl.max_new_tokens, rl.mask_truncated) == (4, 16, True) and seen["out"] == tmp_path / "g"
    with pytest.raises(Reached):
        run_cli(capsys, "sft", "--data", "demo", "--learning-rate", "1e-4", "--num-train-epochs", "2",
                "--per-device-train-batch-size", "3", "--gradient-accumulation-steps", "2",
                "--lora-target-modules", "q_proj,v_proj", "--neftune-noise-alpha", "3", "--output-dir", tmp_path / "s")
    sft = seen["recipe"].sft
    assert (sft.learning_rate, sft.epochs, sft.batch_size, sft.grad_accum) == (1e-4, 2.0, 3, 2)
    assert sft.lora.target_modules == ["q_proj", "v_proj"] and sft.neftune_alpha == 3.0
    assert seen["out"] == tmp_path / "s"
    assert capsys.readouterr().err == ""  # aliases are not deprecated


def test_ctx_size_and_the_old_context_reach_devices_fit(capsys, tiny_models):
    import json

    code, out, err = run_cli(capsys, "devices", "fit", tiny_models["llama"], "--device", "rpi5", "--ctx-size", "64",
                             "--json")
    assert code == 0 and err == "" and json.loads(out)["context"] == 64
    code, out, err = run_cli(capsys, "devices", "fit", tiny_models["llama"], "--device", "rpi5", "--context", "32",
                             "--json")
    assert code == 0 and json.loads(out)["context"] == 32
    assert err == "note: --context is deprecated; use --ctx\n"


def test_imatrix_is_llama_cpp_s_name_for_calibrate(capsys, monkeypatch, tmp_path):
    import slm_align.export.publishing.stage

    seen = {}

    def fake_export(request):
        seen["request"] = request
        raise Reached

    monkeypatch.setattr(slm_align.export.publishing.stage, "run_export", fake_export)
    with pytest.raises(Reached):
        run_cli(capsys, "export", tmp_path, "--target", "gguf", "--quant", "Q4_K_M", "--imatrix")
    assert seen["request"].calibrate is True
    assert capsys.readouterr().err == ""
