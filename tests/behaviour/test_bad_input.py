"""Bad input over every command (issue #10): one line on stderr naming the problem and the fix,
exit code 2, nothing on stdout, and every output that existed before left byte-identical (no
partial file, no new entry).

The matrix adds to the cases that live beside their feature; those are not repeated here:
tests/cli/test_commands.py (21 `sft` data/model/flag/recipe cases; `train` --algo, --group-size,
--loss-type, --stage; `check-headroom --run` without SFT), tests/export/test_gguf_and_onnx.py (gpt2
for GGUF, unknown GGUF/ONNX quantization, target and preset, --min-agreement 1.5, no tokenizer, a
missing source, an existing artifact), tests/export/test_merge.py (an existing --out),
tests/ondevice/agent/test_runtime.py (`chat` on a missing artifact, `feedback export` of a missing DB),
tests/ondevice/agent/test_store.py (not-SQLite and newer-schema stores, no consented feedback, existing or
non-.jsonl outputs, through the Python API), tests/ondevice/devices/test_profiles_and_estimates.py (`devices
fit` with an unknown device or quantization, --ctx 0, a missing model; `devices show` of an unknown
name; malformed profiles and corrupt GGUF/safetensors headers through the API),
tests/ondevice/agent/test_bench.py (a missing artifact, an unknown device, prompt + decode beyond the
context, an existing --save-profile; bad profile names and --repeats 0 through the API),
tests/ondevice/agent/server/test_serve.py (the network without a key, a taken port),
tests/reward_model/test_reward_model.py (a bad --preferences file), tests/ondevice/agent/test_task_eval.py
(`evaluate-agent` on a missing task file, a row without 'answer' or with an empty one, a missing
or broken artifact; the matrix repeats the row without 'answer' with --out, to show nothing is
written), and the module tests
tests/data/test_corpus.py, tests/modeling/test_models.py, tests/data/test_preferences.py,
tests/ondevice/rewards/test_reward_functions.py.

A full disk is simulated by making one write (os.fsync, gguf's tensor writer) raise ENOSPC.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers import finished_sft_run, run_cli, tree_digest


def tree_listing(path: Path) -> list[str]:
    """Every entry under ``path`` (empty directories and temporary files too)."""
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def snapshot(paths) -> dict:
    return {str(p): (tree_digest(p), tree_listing(p)) if p.is_dir() else (p.read_bytes() if p.exists() else None)
            for p in paths}


def _corrupt_copy(source: Path, target: Path, keep_bytes: int) -> Path:
    """A copy of an HF directory whose model.safetensors is cut after ``keep_bytes`` bytes."""
    shutil.copytree(source, target)
    weights = target / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:keep_bytes])
    return target


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_models, tokenizer, stories):
    """Inputs shared by the cases: bad files, odd model directories, a finished SFT
    run and a GGUF artifact."""
    from slm_align.modeling.models import build_tiny_model
    from slm_align.ondevice.agent.store import PreferenceStore
    from slm_align.ondevice.gguf.writer import write_gguf

    root = tmp_path_factory.mktemp("bad-input")
    (root / "utf16.txt").write_bytes("Once upon a time there "
                                     "was a cat.\n\nThe end.\n".encode("utf-16"))
    (root / "numbers.jsonl").write_text("".join(json.dumps({"text": 7 + i}) + "\n" for i in range(40)))
    (root / "blank.jsonl").write_text("\n\n  \n")
    (root / "header.csv").write_text("text\n")
    (root / "junk.parquet").write_bytes(os.urandom(256))
    locked = unreadable_file(tmp_path_factory.mktemp("locked") / "locked.txt")  # outside root: never snapshot
    (root / "random.gguf").write_bytes(os.urandom(4096))
    (root / "a-file").write_text("not a directory\n")
    (root / "notes.db").write_text("these are my notes, not a database\n" * 10)
    (root / "prefs.jsonl").write_text('{"prompt": "Hi", "chosen": " Hello.", "rejected": " Go."}\n')
    (root / "folder.jsonl").mkdir()
    (root / "empty-onnx").mkdir()
    (root / "empty-onnx" / "config.json").write_text("{}")
    (root / "tasks.jsonl").write_text(json.dumps({"prompt": "What is 2 + 2?", "answer": "4"}) + "\n")
    (root / "no-answer.jsonl").write_text(json.dumps({"prompt": "What is 2 + 2?", "solution": "4"}) + "\n")
    (root / "empty-answer.jsonl").write_text(json.dumps({"prompt": "What is 2 + 2?", "answer": " "}) + "\n")
    (root / "bad-profiles").mkdir()
    (root / "bad-profiles" / "board.toml").write_text("name = 'board'\nram_gb = [\n")

    models = root / "models"
    mamba = models / "mamba"
    shutil.copytree(tiny_models["llama"], mamba)
    config = json.loads((mamba / "config.json").read_text())
    (mamba / "config.json").write_text(json.dumps(dict(config, model_type="mamba")))
    badjson = models / "badjson"
    shutil.copytree(tiny_models["llama"], badjson)
    (badjson / "config.json").write_text('{"model_type": "llama",')
    small_vocab = models / "small-vocab"  # a tokenizer whose ids run past the model's embedding rows
    build_tiny_model("llama", vocab_size=len(tokenizer) // 2).save_pretrained(small_vocab, safe_serialization=True)
    tokenizer.save_pretrained(small_vocab)
    truncated = _corrupt_copy(tiny_models["llama"], models / "truncated",
                              (tiny_models["llama"] / "model.safetensors").stat().st_size // 2)

    base = shutil.copytree(tiny_models["llama"], models / "run-base")
    run, _ = finished_sft_run(root / "run", base, stories, steps=1)
    broken_base = shutil.copytree(tiny_models["llama"], models / "broken-base")
    broken_run, _ = finished_sft_run(root / "broken-run", broken_base, stories, steps=1)
    weights = broken_base / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])

    gguf = write_gguf(tiny_models["llama"], root / "tiny-F16.gguf", "F16")
    with PreferenceStore(root / "private.db") as store:
        turn = store.record_turn("c1", [{"role": "user", "content": "Tell me a story."}], "Once upon a time.",
                                 "ab" * 32, {"temperature": 0.7}, False)
        store.thumbs(turn, up=True)
    with PreferenceStore(root / "consented.db") as store:
        turn = store.record_turn("c1", [{"role": "user", "content": "Tell me a story."}], "Once upon a time.",
                                 "ab" * 32, {"temperature": 0.7}, True)
        store.thumbs(turn, up=True)
        store.edit(turn, "Once upon a time, a cat.")
    shutil.copyfile(root / "consented.db", root / "round3.unpaired.jsonl")  # a DB named like an export's sibling
    (root / "empty.db").write_bytes(b"")
    return SimpleNamespace(root=root, locked=locked, run=run, broken_run=broken_run, gguf=gguf, stories=stories,
                           llama=tiny_models["llama"], mamba=mamba, badjson=badjson,
                           small_vocab=small_vocab, truncated=truncated)


@pytest.fixture(autouse=True)
def no_user_profiles(monkeypatch, tmp_path):
    """Device profiles come from the package only; nothing is written to the real home directory."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SLM_ALIGN_DEVICES", raising=False)


WRITE_ONLY = ("/proc/sys/vm/compact_memory", "/proc/sys/vm/drop_caches", "/proc/sys/net/ipv4/route/flush")
"""Write-only kernel settings: procfs checks their mode bits for root too, so not even root may read them."""


def unreadable_file(path: Path) -> Path:
    """A file at ``path`` that this user cannot read: chmod 000, or for root (who reads through chmod 000) a link
    to a write-only kernel setting. Returned as it is when neither works: the case then fails on it."""
    path.write_text("Once upon a time.\n")
    path.chmod(0)
    if not can_read(path):
        return path
    for target in WRITE_ONLY:
        if Path(target).exists() and not can_read(Path(target)):
            path.unlink()
            path.symlink_to(target)
            return path
    return path


def can_read(path: Path) -> bool:
    try:
        with open(path, "rb") as handle:
            handle.read(1)
    except PermissionError:
        return False
    return True


def fail_nth(monkeypatch, module, name: str, n: int) -> None:
    """``module.name`` raises ENOSPC (a full disk) on its ``n``-th call and works otherwise."""
    real, calls = getattr(module, name), []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, failing)


def full_disk_on_fsync(n: int):
    def arrange(e, monkeypatch):
        fail_nth(monkeypatch, os, "fsync", n)
    return arrange


def full_disk_writing_gguf(e, monkeypatch):
    import gguf

    fail_nth(monkeypatch, gguf.GGUFWriter, "write_tensors_to_file", 1)


def devices_dir(e, monkeypatch):
    monkeypatch.setenv("SLM_ALIGN_DEVICES", str(e.root / "bad-profiles"))


SFT = ["--max-steps", "1", "--batch-size", "4", "--max-length", "64"]


def sft(*args, model="{llama}", data="{stories}"):
    return ["sft", "--out", "{out}", "--model", model, "--data", data, *SFT, *args]


def train(stage, *args):
    return ["train", "--stage", stage, *args]


def agent_eval(*args, tasks="{root}/tasks.jsonl"):
    return ["evaluate-agent", tasks, "--artifact", "{gguf}", "--out", "{out}/agent-report.json", *args]


def case(command, args, keyword, arrange=None, marks=(), id=None):
    return pytest.param(args, keyword, arrange, marks=marks, id=f"{command}: {id or ' '.join(args)}"[:90])


CASES = [
    # sft: data
    case("sft", sft(data="{root}/utf16.txt"), "UTF-8", id="UTF-16 corpus"),
    case("sft", sft(data="{root}/numbers.jsonl"), "text", id="jsonl with numbers in the text column"),
    case("sft", sft(data="{root}/blank.jsonl"), "no documents", id="jsonl of blank lines"),
    case("sft", sft(data="{root}/header.csv"), "no documents", id="csv with a header only"),
    case("sft", sft(data="{root}/junk.parquet"), "not a readable parquet file", id="parquet of random bytes"),
    case("sft", sft(data="{locked}"), "permission", id="unreadable corpus (chmod 000)"),
    case("sft", sft(data="{root}"), "directory", id="a directory that is no dataset"),
    # sft: model
    case("sft", sft(model="{mamba}"), "unsupported architecture 'mamba'", id="model_type mamba"),
    case("sft", sft(model="{badjson}"), "config.json", id="config.json cut short"),
    case("sft", sft(model="{small_vocab}"), "but the model's vocab_size is",
         id="tokenizer ids beyond the embedding rows"),
    case("sft", sft(model="{truncated}"), "cannot be loaded", id="truncated safetensors"),
    case("sft", sft(model="{root}/random.gguf"), "not a GGUF model", id="random bytes named .gguf"),
    # sft: flags and the run directory
    case("sft", sft("--batch-size", "0"), "batch_size", id="--batch-size 0"),
    case("sft", sft("--lora-dropout", "1.5"), "should be less than 1", id="--lora-dropout 1.5"),
    case("sft", sft("--max-length", "0"), "max_length", id="--max-length 0"),
    case("sft", sft("--warmup-ratio", "2"), "warmup_ratio", id="--warmup-ratio 2"),
    case("sft", sft("--epochs", "-1"), "should be greater than 0", id="--epochs -1"),
    case("sft", ["sft", "--out", "{run}", "--model", "{run_base}", "--data", "{stories}", "--max-steps", "1",
                 "--batch-size", "4", "--max-length", "96", "--lr", "1e-4"], "other inputs",
         id="finished run, another --lr"),
    case("sft", sft("--lora-alpha", "0"), "should be greater than 0", id="--lora-alpha 0"),
    case("sft", ["sft", "--out", "{root}/a-file", "--model", "{llama}", "--data", "{stories}", *SFT],
         "is a file, not a directory",
         id="--out is a file"),
    # check-headroom (exit 1 is its FAIL verdict; bad input is 2)
    case("check-headroom", ["check-headroom", "--run", "{run}", "--model", "{llama}"], "not both",
         id="--run and --model"),
    case("check-headroom", ["check-headroom", "--run", "{run}", "--max-ppl", "-1"], "max_ppl", id="--max-ppl -1"),
    case("check-headroom", ["check-headroom", "--model", "{llama}", "--data", "{root}/tasks.jsonl"],
         "pass this file with --tasks", id="task rows (prompt + answer) given as --data"),
    case("check-headroom", ["check-headroom", "--run", "{run}", "--min-reward-acc", "2"], "reward_acc",
         id="--min-reward-acc 2"),
    case("check-headroom", ["check-headroom", "--model", "{mamba}", "--data", "{stories}"], "unsupported architecture",
         id="--model of architecture mamba"),
    case("check-headroom", ["check-headroom", "--model", "{llama}", "--adapter", "{root}/no-adapter",
                            "--data", "{stories}"], "not found (no adapter_config.json)", id="--adapter missing"),
    case("check-headroom", ["check-headroom", "--run", "{run}", "--reward-model", "{root}/no-rm"],
         "not found (no config.json)",
         id="--reward-model missing"),
    case("check-headroom", ["check-headroom", "--run", "{root}/no-run"], "has no finished SFT stage",
         id="--run missing"),
    # train --stage sft / reward / rl
    case("train", train("sft", "--out", "{out}", "--model", "{llama}", "--data", "{root}/utf16.txt"), "UTF-8",
         id="--stage sft on a UTF-16 corpus"),
    case("train", train("reward", "--out", "{out}"), "SFT", id="--stage reward without an SFT stage"),
    case("train", train("reward", "--out", "{run}", "--pair-mix", "warp=1"), "use positive weights for truncate",
         id="--stage reward --pair-mix of an unknown kind"),
    case("train", train("reward", "--out", "{run}", "--preferences", "{root}/missing.jsonl"), "not found",
         id="--stage reward --preferences missing"),
    case("train", train("reward", "--out", "{run}", "--no-synthetic-pairs"), "--no-synthetic-pairs is set",
         id="--stage reward --no-synthetic-pairs without --preferences"),
    case("train", train("reward", "--out", "{run}", "--reward-lr", "-1"), "learning_rate",
         id="--stage reward --reward-lr -1"),
    case("train", train("rl", "--out", "{out}", "--sft", "{root}"), "has no finished SFT stage",
         id="--sft of a dir without SFT"),
    case("train", train("rl", "--out", "{out}", "--kl-mode", "both"), "kl_mode", id="--kl-mode both"),
    case("train", train("rl", "--out", "{out}", "--scale-rewards", "max"), "scale_rewards",
         id="--scale-rewards max"),
    case("train", train("rl", "--out", "{out}", "--steps", "0"), "greater than or equal to 1", id="--steps 0"),
    case("train", train("rl", "--out", "{out}", "--report-prompts", "1"), "report_prompts",
         id="--report-prompts 1"),
    case("train", train("rl", "--out", "{out}", "--beta", "-1"), "greater than or equal to 0", id="--beta -1"),
    case("train", train("rl", "--out", "{out}", "--prompts-per-step", "0"), "prompts_per_step",
         id="--prompts-per-step 0"),
    case("train", train("rl", "--out", "{out}", "--sft", "{run}", "--reward", "no_such_builtin"), "use module:function",
         id="--reward unknown"),
    case("train", train("rl", "--out", "{out}", "--sft", "{run}", "--reward-model", "{root}/no-rm"),
         "not found (no config.json)",
         id="--reward-model missing"),
    case("train", train("rl", "--out", "{out}", "--sft", "{run}", "--reward", "task_success", "--episodes", "on"),
         "agent episodes need task rows", id="--episodes on without --tasks"),
    case("train", train("rl", "--out", "{out}", "--sft", "{run}", "--tasks", "{root}/tasks.jsonl", "--environment",
                        "no_such_module:Env"), "cannot import module", id="--environment that does not import"),
    case("train", train("rl", "--out", "{out}", "--sft", "{run}", "--tasks", "{root}/tasks.jsonl", "--reward",
                        "call_format", "--episodes", "off"), "scores agent episodes",
         id="--reward call_format on single completions"),
    case("train", train("rl", "--out", "{out}", "--sft", "{run}", "--episodes", "sometimes"),
         "should be 'auto', 'on' or 'off'",
         id="--episodes sometimes"),
    case("train", train("rl", "--out", "{out}", "--sft", "{run}", "--max-tool-rounds", "17"), "max_tool_rounds",
         id="--max-tool-rounds 17"),
    # evaluate
    case("evaluate", ["evaluate", "--run", "{root}"], "SFT", id="--run without SFT"),
    case("evaluate", ["evaluate", "--run", "{run}", "--prompts", "1"], "greater than or equal to 2", id="--prompts 1"),
    case("evaluate", ["evaluate", "--run", "{run}", "--reward", "length_window", "--temperature", "-1"],
         "should be greater than 0",
         id="--temperature -1"),
    case("evaluate", ["evaluate", "--run", "{run}", "--reward", "length_window", "--max-new-tokens", "0"],
         "max_new_tokens", id="--max-new-tokens 0"),
    case("evaluate", ["evaluate", "--run", "{run}", "--reward", "length_window", "--baseline", "{root}/no-model"],
         "not found", id="--baseline missing"),
    case("evaluate", ["evaluate", "--run", "{run}", "--reward-model", "{llama}", "--prompts", "2"], "one",
         id="--reward-model is a language model"),
    case("evaluate", ["evaluate", "--run", "{broken_run}", "--reward", "length_window", "--prompts", "4"],
         "cannot be loaded", id="run whose base weights are truncated"),
    # merge
    case("merge", ["merge", "--run", "{root}", "--out", "{out}/merged"], "SFT", id="--run without SFT"),
    case("merge", ["merge", "--run", "{run}", "--out", "{root}/a-file"], "is a file, not a directory",
         id="--out is a file"),
    case("merge", ["merge", "--run", "{run}", "--out", "{root}/a-file", "--overwrite"], "not a directory",
         id="--out is a file, --overwrite"),
    case("merge", ["merge", "--run", "{broken_run}", "--out", "{out}/merged"], "cannot be loaded",
         id="run whose base weights are truncated"),
    # export
    case("export", ["export", "{llama}", "--device", "toaster", "--out", "{out}"], "unknown device 'toaster'",
         id="--device unknown"),
    case("export", ["export", "{truncated}", "--target", "gguf", "--out", "{out}"], "model.safetensors",
         id="truncated safetensors"),
    case("export", ["export", "{mamba}", "--target", "onnx", "--out", "{out}"], "unsupported architecture",
         id="ONNX of architecture mamba"),
    case("export", ["export", "{small_vocab}", "--target", "gguf", "--out", "{out}"], "but the model's vocab_size is",
         id="tokenizer ids beyond the embedding rows"),
    case("export", ["export", "{llama}", "--out", "{root}/a-file"], "is a file, not a directory", id="--out is a file"),
    case("export", ["export", "{llama}", "--threads", "0", "--out", "{out}"], "greater than or equal to 1",
         id="--threads 0"),
    case("export", ["export", "{llama}", "--min-agreement", "-0.1", "--out", "{out}"], "must be between 0 and 1",
         id="--min-agreement -0.1"),
    case("export", ["export", "{root}/random.gguf", "--out", "{out}"], "not a GGUF model (no GGUF magic)",
         id="random bytes named .gguf"),
    case("export", ["export", "{llama}", "--target", "gguf", "--quant", "F16", "--no-verify", "--out", "{out}"],
         "space", arrange=full_disk_writing_gguf, id="full disk while writing the GGUF"),
    # chat
    case("chat", ["chat", "{root}/random.gguf"], "the file is corrupt", id="random bytes named .gguf"),
    case("chat", ["chat", "{root}/empty-onnx"], "not an exported model",
         id="ONNX dir without model.onnx"),
    case("chat", ["chat", "{gguf}", "--temperature", "-1"], "must be a number from 0 to 2", id="--temperature -1"),
    case("chat", ["chat", "{gguf}", "--top-p", "1.5"], "must be a number from 0 to 1", id="--top-p 1.5"),
    case("chat", ["chat", "{gguf}", "--threads", "0"], "greater than or equal to 1", id="--threads 0"),
    case("chat", ["chat", "{gguf}", "--threads", "100000"], "cores can run", id="--threads beyond the cores"),
    case("bench", ["bench", "{gguf}", "--threads", "5000"], "cores can run", id="--threads beyond the cores"),
    case("chat", ["chat", "{gguf}", "--max-new-tokens", "0"], "must be an integer >= 1", id="--max-new-tokens 0"),
    case("chat", ["chat", "{gguf}", "--device", "toaster"], "unknown device 'toaster'",
         id="--device unknown"),
    case("chat", ["chat", "{gguf}", "--store", "{root}/no-folder/prefs.db"], "does not exist",
         id="--store in a missing folder"),
    case("chat", ["chat", "{gguf}", "--tools", "--notes", "{root}/a-file"], "not a directory",
         id="--notes is a file"),
    case("chat", ["chat", "{gguf}", "--store", "{root}/notes.db"], "not a SQLite database",
         id="--store that is not SQLite"),
    # feedback export
    case("feedback export",
         ["feedback", "export", "{root}/private.db", "--out", "{out}/round2.jsonl"],
         "no consented feedback", id="only turns without consent"),
    case("feedback export",
         ["feedback", "export", "{root}/notes.db", "--out", "{out}/round2.jsonl"],
         "not a SQLite database", id="DB that is not SQLite"),
    case("feedback export",
         ["feedback", "export", "{root}", "--out", "{out}/round2.jsonl"], "directory",
         id="DB is a directory"),
    case("feedback export",
         ["feedback", "export", "{root}/consented.db", "--out", "{root}/folder.jsonl"],
         "is a directory", id="--out is an existing directory"),
    case("feedback export", ["feedback", "export", "{root}/consented.db", "--out", "{root}/a-file/round2.jsonl"],
         "a-file is a file", id="--out inside a file"),
    case("feedback export", ["feedback", "export", "{root}/consented.db", "--out", "{out}/round2.jsonl"], "space",
         arrange=full_disk_on_fsync(1), id="full disk on the pairs file"),
    case("feedback export", ["feedback", "export", "{root}/consented.db", "--out", "{out}/round2.jsonl"], "space",
         arrange=full_disk_on_fsync(2), id="full disk on the unpaired file"),
    case("feedback export", ["feedback", "export", "{root}/round3.unpaired.jsonl", "--out", "{root}/round3.jsonl",
                             "--overwrite"], "is the preference DB itself", id="the DB is the unpaired output"),
    case("feedback export", ["feedback", "export", "{root}/empty.db", "--out", "{out}/round2.jsonl"],
         "is empty (0 bytes)", id="a 0-byte DB"),
    case("feedback export", ["feedback", "export", "{root}/consented.db", "--out", "/proc/round2.jsonl"],
         "cannot write", id="--out where nothing can be written"),
    # devices
    case("devices list", ["devices", "list"], "board.toml", arrange=devices_dir, id="a malformed user profile"),
    case("devices show", ["devices", "show", "../rpi5"], "unknown device", id="a path as the name"),
    case("devices fit", ["devices", "fit", "{root}/random.gguf", "--device", "rpi5"], "not a readable GGUF file",
         id="random bytes named .gguf"),
    case("devices fit", ["devices", "fit", "{truncated}", "--device", "rpi5"], "safetensors",
         id="truncated safetensors"),
    case("devices fit",
         ["devices", "fit", "{llama}", "--device", "rpi5", "--ctx", "-5"], "must be at least 1 token",
         id="--ctx -5"),
    case("devices fit", ["devices", "fit", "{root}/empty-onnx", "--device", "rpi5"], "not a model this can size",
         id="ONNX dir without model.onnx"),
    # bench
    case("bench", ["bench", "{root}/random.gguf", "--repeats", "1"], "the file is corrupt",
         id="random bytes named .gguf"),
    case("bench", ["bench", "{gguf}", "--threads", "0"], "greater than or equal to 1", id="--threads 0"),
    case("bench", ["bench", "{gguf}", "--repeats", "0"], "greater than or equal to 1", id="--repeats 0"),
    case("bench", ["bench", "{gguf}", "--ctx", "8"], "greater than or equal to 16", id="--ctx 8"),
    case("bench", ["bench", "{gguf}", "--save-profile", "../x"], "use letters, digits", id="--save-profile ../x"),
    # serve (refused before it listens)
    case("serve", ["serve", "{root}/random.gguf", "--port", "0"], "the file is corrupt", id="random bytes named .gguf"),
    case("serve", ["serve", "{gguf}", "--port", "70000"], "less than or equal to 65535", id="--port 70000"),
    case("serve", ["serve", "{gguf}", "--port", "0", "--store", "{root}/notes.db"], "not a SQLite database",
         id="--store that is not SQLite"),
    case("serve", ["serve", "{gguf}", "--port", "0", "--device", "toaster"], "unknown device 'toaster'",
         id="--device unknown"),
    # evaluate-agent (refused before any artifact loads; --out is never written)
    case("evaluate-agent", agent_eval("--samples", "0"), "--samples must be an integer >= 1", id="--samples 0"),
    case("evaluate-agent", agent_eval("--samples", "-2"), "--samples must be an integer >= 1", id="--samples -2"),
    case("evaluate-agent", agent_eval("--temperature", "2.5"), "--temperature must be a number from 0 to 2",
         id="--temperature 2.5"),
    case("evaluate-agent", agent_eval("--temperature", "-0.1"), "--temperature must be a number from 0 to 2",
         id="--temperature -0.1"),
    case("evaluate-agent", agent_eval("--max-tool-rounds", "-1"), "--max-tool-rounds must be an integer >= 0",
         id="--max-tool-rounds -1"),
    case("evaluate-agent", agent_eval(tasks="{root}/no-answer.jsonl"), "needs 'prompt' and 'answer' columns",
         id="a task row without an answer column"),
    case("evaluate-agent", agent_eval(tasks="{root}/empty-answer.jsonl"), "'answer' is empty",
         id="a task row with an empty answer"),
    # quickstart
    case("quickstart", ["quickstart", "--out", "{root}/a-file"], "is a file, not a directory", id="--out is a file"),
    case("quickstart", ["quickstart", "--out", "{out}", "--sft-steps", "0"], "greater than or equal to 1",
         id="--sft-steps 0"),
    case("quickstart", ["quickstart", "--out", "{out}", "--rl-steps", "-1"], "greater than or equal to 1",
         id="--rl-steps -1"),
]


@pytest.mark.parametrize("args, keyword, arrange", CASES)
def test_bad_input_is_one_line_exit_2_and_changes_nothing(capsys, monkeypatch, env, tmp_path, args, keyword,
                                                          arrange):
    out = tmp_path / "out"
    (out / "notes").mkdir(parents=True)
    (out / "keep.txt").write_text("earlier result")
    paths = {"{out}": out, "{root}": env.root, "{run}": env.run, "{broken_run}": env.broken_run, "{gguf}": env.gguf,
             "{stories}": env.stories, "{llama}": env.llama, "{mamba}": env.mamba,
             "{badjson}": env.badjson, "{small_vocab}": env.small_vocab, "{truncated}": env.truncated,
             "{run_base}": env.root / "models" / "run-base"}
    if "{locked}" in args:
        paths["{locked}"] = env.locked
        assert not can_read(env.locked), "this user can read every file here: no unreadable corpus to test"
    args = [paths[a] if a in paths else a.format(root=env.root, out=out) for a in args]
    echoed = keyword.lower() in " ".join(map(str, args)).lower()
    assert not echoed, f"{keyword!r} is in the command line: name the problem, not the input the error echoes"
    if arrange is not None:
        arrange(env, monkeypatch)
    if args[0] == "serve":  # bad input must be refused before serving; never block the test run by listening
        uvicorn = pytest.importorskip("uvicorn")
        monkeypatch.setattr(uvicorn.Server, "run", lambda *a, **k: pytest.fail("serve started on bad input"))
    watched = [out, env.root, env.llama]  # root holds the runs, the stores and the model directories
    before = snapshot(watched)
    code, stdout, stderr = run_cli(capsys, *args)
    monkeypatch.undo()
    assert (code, stdout) == (2, ""), stderr
    assert stderr.startswith("error: ") and stderr.count("\n") == 1 and stderr.endswith("\n"), stderr
    assert keyword.lower() in stderr.lower(), stderr
    assert snapshot(watched) == before
