"""llama.cpp's own converter (convert_hf_to_gguf.py, MIT licence), the reference our GGUF
writer is tested against.

It ships in the sdist of the llama-cpp-python we have installed (vendor/llama.cpp, with its own
gguf-py), so the reference always matches the llama.cpp that loads our files. The sdist is
downloaded once with pip into ``~/.cache/slm-align-tests`` (``SLM_ALIGN_TEST_CACHE`` overrides),
and only the converter, its ``conversion`` package and ``gguf-py`` are kept. Each conversion runs
in a subprocess: the converter imports its own gguf-py, which must not replace the ``gguf``
package the tests have imported.

Two things the converter cannot do on our tiny models, each bridged here and nowhere else:

- it recognises a BPE pre-tokenizer only by the hash of a test string's ids, and our small
  test tokenizer is not in its table: an unknown hash is given the name our own writer
  derives from tokenizer.json;
- its GPT-2 class reads ``n_ctx`` from config.json, which transformers 4.x no longer saves (it saves
  ``n_positions``): the input copy gets ``n_ctx`` added.

Run as a script (``python tests/llama_cpp_reference.py CONVERTER_DIR PRE_TOKENIZER -- converter
args``) it is the patched converter itself; ``python tests/llama_cpp_reference.py --fetch`` is the set-up
step of the README's test command, which fetches the converter into the cache before the tests run (so the
test run itself downloads nothing).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import runpy
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

CACHE = Path(os.environ.get("SLM_ALIGN_TEST_CACHE", "~/.cache/slm-align-tests")).expanduser()
_KEPT = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "LICENSE")


class ReferenceUnavailable(RuntimeError):
    """The converter could not be fetched or cannot run with the installed packages."""


def installed_version() -> str:
    return importlib.metadata.version("llama_cpp_python")


def _download_sdist(version: str) -> Path:
    sdist = CACHE / f"llama_cpp_python-{version}.tar.gz"
    if sdist.is_file():
        return sdist
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                           f"llama-cpp-python=={version}", "-d", str(CACHE)],
                          capture_output=True, text=True, check=False, timeout=600)
    if done.returncode != 0 or not sdist.is_file():
        raise ReferenceUnavailable(f"pip could not download the llama-cpp-python {version} sdist: "
                                   f"{done.stderr.strip()[-300:]}")
    return sdist


def _kept_members(tar: tarfile.TarFile, prefix: str) -> list[tarfile.TarInfo]:
    members = []
    for member in tar.getmembers():
        relative = member.name[len(prefix):]
        if member.name.startswith(prefix) and relative.startswith(_KEPT):
            member.name = relative
            members.append(member)
    return members


def converter_dir() -> Path:
    """The directory holding convert_hf_to_gguf.py for the installed
    llama-cpp-python, fetched on first use."""
    version = installed_version()
    target = CACHE / f"llama.cpp-{version}"
    if (target / "convert_hf_to_gguf.py").is_file():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    sdist = _download_sdist(version)
    partial = CACHE / f".llama.cpp-{version}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(partial, members=_kept_members(tar, f"llama_cpp_python-{version}/vendor/llama.cpp/"),
                       filter="data")
    os.replace(partial, target)
    return target


def _converter_input(model_dir: Path, scratch: Path) -> Path:
    """``model_dir`` itself, or for GPT-2 a copy whose config.json also says
    ``n_ctx`` (see the module doc)."""
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    if config.get("model_type") != "gpt2" or "n_ctx" in config:
        return model_dir
    copy = scratch / f"{model_dir.name}-input"
    shutil.copytree(model_dir, copy, dirs_exist_ok=True)
    (copy / "config.json").write_text(json.dumps(dict(config, n_ctx=config["n_positions"])), encoding="utf-8")
    return copy


def convert(model_dir: Path, out_path: Path, outtype: str = "f32") -> Path:
    """``model_dir`` converted by llama.cpp's converter into ``out_path``;
    ReferenceUnavailable when it fails."""
    from slm_align.ondevice.gguf.writer import pre_tokenizer_name

    model_dir, out_path = Path(model_dir), Path(out_path)
    tokenizer_json = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    source = _converter_input(model_dir, out_path.parent)
    command = [sys.executable, __file__, str(converter_dir()), pre_tokenizer_name(tokenizer_json), "--",
               str(source), "--outfile", str(out_path), "--outtype", outtype]
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=600)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ReferenceUnavailable(f"llama.cpp's converter failed on {model_dir.name}: {last}")
    return out_path


def _run_patched(converter: Path, pre_tokenizer: str, args: list[str]) -> None:
    """Run convert_hf_to_gguf.py with ``args``, naming an unknown BPE
    pre-tokenizer ``pre_tokenizer``."""
    sys.path[:0] = [str(converter), str(converter / "gguf-py")]
    from conversion.base import TextModel

    recognise = TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return recognise(self, tokenizer)
        except NotImplementedError:
            return pre_tokenizer

    TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = [str(converter / "convert_hf_to_gguf.py"), *args]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    if sys.argv[1:] == ["--fetch"]:
        print(f"llama.cpp's converter: {converter_dir()}")
    else:
        _run_patched(Path(sys.argv[1]), sys.argv[2], sys.argv[sys.argv.index("--") + 1:])
