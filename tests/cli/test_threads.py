"""--threads on every command that computes (issue 44, item 4): the default that does not
oversubscribe a busy host, the flag reaching PyTorch and llama.cpp, bad values refused in one line."""

import json

import pytest
import torch

import slm_align.cli.options
from slm_align.ondevice.devices import host
from slm_align.ondevice.devices.host import MAX_DEFAULT_THREADS, free_threads
from tests.helpers import run_cli


class Reached(BaseException):
    """Raised by a stand-in once the command has set up and is about to do its work (a BaseException:
    evaluate-agent reports an artifact that raises any Exception as one that does not load)."""


@pytest.mark.parametrize("cores, load, omp, expected", [
    (2, 1.0, None, 1),        # the host: 2 cores, another job running -> 1 thread, not 2
    (2, 0.2, None, 2),        # an idle host: every core
    (2, 0.6, None, 1),        # load rounds to the nearest whole core
    (8, 3.4, None, 5),
    (4, 9.0, None, 1),        # a host busier than its cores: still 1
    (64, 0.0, None, MAX_DEFAULT_THREADS),  # capped
    (2, 1.0, "3", 3),         # the user's OMP_NUM_THREADS wins, load or not
    (64, 0.0, "32", 32),      # ... and is not capped
    (2, 1.0, "4,2", 4),       # a nested list: its first level
    (2, 0.0, "0", 2),         # not a whole number >= 1: ignored, as OpenMP ignores it
    (2, 1.0, "abc", 1),
    (2, 0.0, "", 2),
])
def test_the_default_is_the_free_cores_unless_omp_num_threads_says(cores, load, omp, expected):
    assert free_threads(cores, load, omp) == expected


def test_the_process_default_reads_this_host_once(monkeypatch):
    readings = []

    def busy_load():
        readings.append(1)
        return 3.0

    monkeypatch.setattr(host, "usable_cores", lambda: 4)
    monkeypatch.setattr(host, "load_average", busy_load)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    host.default_threads.cache_clear()
    try:
        assert host.default_threads() == 1 and host.default_threads() == 1 and len(readings) == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        host.default_threads.cache_clear()
        assert host.default_threads() == 2
    finally:
        host.default_threads.cache_clear()


@pytest.fixture
def torch_threads():
    """Put PyTorch's thread count back after a command changed it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _stand_in(monkeypatch, module, name, seen):
    """Replace ``module.name`` with a function that records PyTorch's threads and stops the command."""

    def record(*args, **kwargs):
        seen.append(torch.get_num_threads())
        raise Reached

    monkeypatch.setattr(module, name, record)


def _commands(tmp_path):
    """(command line, module, the function it calls to do its work) of each torch command."""
    import slm_align.evaluate.stage
    import slm_align.export.converters.merge
    import slm_align.export.publishing.stage
    import slm_align.headroom.stage
    import slm_align.pipeline
    import slm_align.quickstart
    import slm_align.sft.stage

    run = tmp_path / "run"
    return [
        (["sft", "--data", "demo", "--out", run], slm_align.sft.stage, "run_sft"),
        (["train", "--data", "demo", "--out", run], slm_align.pipeline, "train"),
        (["check-headroom", "--run", run], slm_align.headroom.stage, "check_headroom"),
        (["evaluate", "--run", run], slm_align.evaluate.stage, "evaluate"),
        (["merge", "--run", run], slm_align.export.converters.merge, "merge_run"),
        (["export", run], slm_align.export.publishing.stage, "run_export"),
        (["quickstart", "--out", run], slm_align.quickstart, "run_quickstart"),
    ]


def test_threads_reach_pytorch_before_each_command_works(capsys, monkeypatch, tmp_path, torch_threads):
    monkeypatch.setattr(slm_align.cli.options, "default_threads", lambda: 1)
    for args, module, name in _commands(tmp_path):
        seen = []
        _stand_in(monkeypatch, module, name, seen)
        torch.set_num_threads(1)
        with pytest.raises(Reached):
            run_cli(capsys, *args, "--threads", "2")
        torch.set_num_threads(2)
        with pytest.raises(Reached):
            run_cli(capsys, *args)  # no flag: the host's default (1 here), not what torch had
        assert seen == [2, 1], args[0]


def test_a_recipe_sets_the_threads_and_the_flag_wins(capsys, monkeypatch, tmp_path, torch_threads):
    recipe = tmp_path / "recipe.toml"
    recipe.write_text("[compute]\nthreads = 2\n")
    seen = []
    import slm_align.sft.stage

    _stand_in(monkeypatch, slm_align.sft.stage, "run_sft", seen)
    torch.set_num_threads(1)
    for extra in ([], ["--threads", "1"]):
        with pytest.raises(Reached):
            run_cli(capsys, "sft", "--data", "demo", "--out", tmp_path / "run", "--config", recipe, *extra)
    assert seen == [2, 1]
    recipe.write_text("[compute]\nthreads = 0\n")
    code, out, err = run_cli(capsys, "sft", "--data", "demo", "--out", tmp_path / "run", "--config", recipe)
    assert code == 2 and out == "" and err.count("\n") == 1 and "compute.threads" in err


class FakeLlama:
    """Records the keyword arguments llama.cpp's constructor got, then stops the command."""

    seen: list = []

    def __init__(self, **kwargs):
        FakeLlama.seen.append(kwargs)
        raise Reached


@pytest.fixture
def fake_llama(monkeypatch, tmp_path):
    from slm_align.ondevice.agent.llama_open import template_free_llama

    llama_cpp = pytest.importorskip("llama_cpp")
    monkeypatch.setattr(llama_cpp, "Llama", FakeLlama)
    template_free_llama.cache_clear()  # the opener subclasses llama_cpp.Llama once: subclass the fake
    FakeLlama.seen = []
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    yield gguf
    template_free_llama.cache_clear()  # and the real one again after


def test_threads_reach_llama_cpp_in_every_runtime_command(capsys, monkeypatch, tmp_path, fake_llama):
    import slm_align.ondevice.agent.llama_backend

    monkeypatch.setattr(slm_align.ondevice.agent.llama_backend, "default_threads", lambda: 1)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"prompt": "What is 2 + 3?", "answer": "5"}) + "\n")
    commands = [["chat", fake_llama], ["serve", fake_llama], ["evaluate-agent", tasks, "--artifact", fake_llama]]
    for args in commands:
        for extra, expected in ((["--threads", "2"], 2), ([], 1)):
            FakeLlama.seen = []
            with pytest.raises(Reached):
                run_cli(capsys, *args, *extra)
            kwargs = FakeLlama.seen[0]
            assert (kwargs["n_threads"], kwargs["n_threads_batch"]) == (expected, expected), (args[0], extra)


def test_exports_quantize_and_verify_with_the_default_threads(monkeypatch, tmp_path):
    from slm_align.export.publishing import model_export
    from slm_align.export.publishing.stage import ExportRequest
    from slm_align.export.targets import target_named

    gguf = target_named("gguf")
    monkeypatch.setattr(model_export, "default_threads", lambda: 3)
    assert model_export._device_settings(ExportRequest(str(tmp_path), target="gguf"), gguf)[2] == 3
    request = ExportRequest(str(tmp_path), target="gguf", threads=2)
    assert model_export._device_settings(request, gguf)[2] == 2


THREADS_COMMANDS = [["sft"], ["train"], ["check-headroom"], ["evaluate", "--run", "r"], ["merge", "--run", "r"],
                    ["export", "r"], ["quickstart"], ["chat", "m.gguf"], ["serve", "m.gguf"], ["bench", "m.gguf"],
                    ["evaluate-agent", "t.jsonl", "--artifact", "m.gguf"]]


@pytest.mark.parametrize("value", ["0", "-1", "1.5", "two"])
@pytest.mark.parametrize("args", THREADS_COMMANDS, ids=lambda args: args[0])
def test_bad_threads_are_one_line_and_exit_2(capsys, tmp_path, monkeypatch, args, value):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(capsys, *args, "--threads", value)
    assert (code, out) == (2, ""), err
    assert err.startswith("error: ") and err.count("\n") == 1 and "--threads" in err, err
    assert list(tmp_path.iterdir()) == []  # refused before any work
