"""Bundles of an adapter export (issue 35, item 4): the base once and each adapter as its own file, loading in
llama.cpp as the export folder does; an update bundle for a device that has an older chain of the same base
holds only the new adapter; what cannot be an update is refused in one line with nothing written."""

import json
import shutil
import zipfile

import numpy as np
import pytest

from slm_align.errors import UserError
from slm_align.export.packaging.adapter_bundle import apply_update
from slm_align.export.packaging.bundle import BundleRequest, make_bundle
from slm_align.export.publishing.parity import HELDOUT_TEXT
from slm_align.export.publishing.stage import ExportRequest, run_export
from slm_align.ondevice.agent.llama_backend import LlamaCppBackend
from slm_align.ondevice.agent.runtime import Agent
from slm_align.ondevice.agent.settings import SamplingParams
from slm_align.ondevice.gguf.adapter_check import chain_digest
from slm_align.runs import sha256_file
from tests.export.test_adapter_export import dpo_run, sft_run  # noqa: F401  (the module fixtures)
from tests.export.test_bundle import FILES, bundled_files
from tests.helpers import run_cli, tree_digest

pytest.importorskip("llama_cpp")

SFT, DPO, BASE = "adapter-sft-F16.gguf", "adapter-dpo-F16.gguf", "base-F16.gguf"
UPDATE_FILES = {f"adapters/{DPO}", "bundle.json", "export-manifest.json", "verification.json", "README.md"}


@pytest.fixture(scope="module")
def sft_export(sft_run, tmp_path_factory):  # noqa: F811
    """The SFT run's adapter export (SFT adapter only): what the device got first."""
    folder = tmp_path_factory.mktemp("sft-export")
    run_export(ExportRequest(str(sft_run[0]), "gguf-adapter", out=folder))
    return folder


@pytest.fixture(scope="module")
def chain_export(dpo_run, tmp_path_factory):  # noqa: F811
    """The DPO round's adapter export (SFT + DPO adapters on the same base): the next round."""
    folder = tmp_path_factory.mktemp("chain-export")
    run_export(ExportRequest(str(dpo_run), "gguf-adapter", out=folder))
    return folder


@pytest.fixture(scope="module")
def old_bundle(sft_export, tmp_path_factory):
    """The full bundle of the first round, as installed on the device."""
    out = tmp_path_factory.mktemp("device") / "v1"
    make_bundle(BundleRequest(str(sft_export / SFT), out=out))
    return out


@pytest.fixture(scope="module")
def full_bundle(chain_export, tmp_path_factory):
    """The full bundle of the DPO round, made from the export's manifest path."""
    out = tmp_path_factory.mktemp("full") / "v2"
    make_bundle(BundleRequest(str(chain_export / f"{DPO}.json"), out=out))
    return out


def described(bundle):
    return json.loads((bundle / "bundle.json").read_text())


def assert_digests_hold(bundle):
    """Every file bundle.json lists has the sha256 it records, and nothing else is there."""
    files = described(bundle)["files"]
    assert set(files) == bundled_files(bundle) - {"bundle.json"}
    assert all(sha256_file(bundle / name) == digest for name, digest in files.items())


def test_a_full_adapter_bundle_ships_the_base_once_and_each_adapter(chain_export, full_bundle):
    manifest = json.loads((chain_export / f"{DPO}.json").read_text())
    base_sha, sft_sha, dpo_sha = (sha256_file(chain_export / name) for name in (BASE, SFT, DPO))
    assert bundled_files(full_bundle) == FILES | {f"model/{BASE}", f"adapters/{SFT}", f"adapters/{DPO}"}
    for name in (f"model/{BASE}", f"adapters/{SFT}", f"adapters/{DPO}"):
        assert (full_bundle / name).read_bytes() == (chain_export / name.split("/")[1]).read_bytes()
    info = described(full_bundle)
    assert {key: info[key] for key in ("format", "kind", "target", "runtime", "artifact", "base", "base_sha256")} == {
        "format": 2, "kind": "full", "target": "gguf-adapter", "runtime": "llama.cpp", "artifact": f"model/{BASE}",
        "base": f"model/{BASE}", "base_sha256": base_sha}
    assert info["adapters"] == [
        {"path": f"adapters/{SFT}", "stage": "sft", "sha256": sft_sha, "scale": 1.0},
        {"path": f"adapters/{DPO}", "stage": "dpo", "sha256": dpo_sha, "scale": 1.0}]
    assert info["model_id"] == manifest["metrics"]["sha256"] == chain_digest(base_sha, [sft_sha, dpo_sha])
    assert info["verification_passed"] is True
    assert json.loads((full_bundle / "export-manifest.json").read_text()) == manifest
    assert_digests_hold(full_bundle)
    with zipfile.ZipFile(full_bundle.with_name("v2.zip")) as archive:
        zipped = {name: archive.read(name) for name in archive.namelist()}
    assert set(zipped) == {f"v2/{name}" for name in bundled_files(full_bundle)}
    base_bytes = (chain_export / BASE).read_bytes()
    assert [name for name, data in zipped.items() if data == base_bytes] == [f"v2/model/{BASE}"]  # once
    readme = (full_bundle / "README.md").read_text()
    assert f'llama_model_load_from_file("model/{BASE}"' in readme
    assert f'`llama_adapter_lora_init(model, path)` for each of "adapters/{SFT}", "adapters/{DPO}", in this order' \
        in readme
    assert "`llama_set_adapters_lora(ctx, adapters, 2, scales)`" in readme
    assert f'Agent.load("model/{BASE}", adapters=["adapters/{SFT}", "adapters/{DPO}"])' in readme
    assert info["model_id"] in readme


def test_the_bundle_loads_in_llama_cpp_as_the_export_folder_does(chain_export, full_bundle):
    sampling = SamplingParams(temperature=0, max_tokens=12)
    bundled = Agent.load(full_bundle / "model" / BASE, sampling=sampling,
                         adapters=[full_bundle / "adapters" / SFT, full_bundle / "adapters" / DPO])
    exported = Agent.load(chain_export / BASE, sampling=sampling, adapters=[chain_export / SFT, chain_export / DPO])
    answer = bundled.chat("Tell me a story.")
    assert answer.tokens > 0 and answer.text == exported.chat("Tell me a story.").text
    assert bundled.model_id == exported.model_id == described(full_bundle)["model_id"]
    backend = LlamaCppBackend(full_bundle / "model" / BASE, n_ctx=256, all_logits=True, threads=1,
                              adapters=[full_bundle / "adapters" / SFT, full_bundle / "adapters" / DPO])
    ids = backend.tokenize(HELDOUT_TEXT)[:48]
    chain = backend.feed_all(ids)
    backend.set_adapters([])
    backend.reset()
    assert np.abs(chain - backend.feed_all(ids)).max() > 1e-3  # the adapters are applied, not just shipped


def folder_bytes(folder):
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def test_an_update_holds_only_the_new_adapter_and_applies_to_the_installed_bundle(
        chain_export, old_bundle, full_bundle, tmp_path, capsys):
    """Signed with `--sign` (issue 45): apply_update now refuses an update no trusted key signed."""
    code, stdout, stderr = run_cli(capsys, "bundle-keygen", "--out", tmp_path / "keys")
    assert code == 0, stderr
    code, stdout, stderr = run_cli(capsys, "bundle", chain_export / DPO, "--update-from", old_bundle,
                                   "--out", tmp_path / "v2-update", "--json",
                                   "--sign", tmp_path / "keys" / "bundle-signing-key.pem")
    assert code == 0, stderr
    update = tmp_path / "v2-update"
    assert bundled_files(update) == UPDATE_FILES | {"bundle.json.sig"}  # no base, no SFT adapter: the device has both
    assert len(json.loads(stdout)["signed_by"]) == 64
    assert (update / "adapters" / DPO).read_bytes() == (chain_export / DPO).read_bytes()
    info, old = described(update), described(old_bundle)
    assert json.loads(stdout)["path"] == str(update) and info["kind"] == "update"
    assert info["requires_base_sha256"] == old["base_sha256"] == sha256_file(chain_export / BASE)
    assert info["replaces_model_id"] == old["model_id"] != info["model_id"] == described(full_bundle)["model_id"]
    assert [(entry["path"], entry["shipped"]) for entry in info["adapters"]] == [
        (f"adapters/{SFT}", False), (f"adapters/{DPO}", True)]
    assert old["adapters"][0]["sha256"] == info["adapters"][0]["sha256"]  # the same SFT adapter, already there
    files = described(update)["files"]
    assert set(files) == bundled_files(update) - {"bundle.json", "bundle.json.sig"}  # all but the two it signs
    assert all(sha256_file(update / name) == digest for name, digest in files.items())
    assert "Copy `adapters/*` beside the installed bundle's adapters" in (update / "README.md").read_text()
    sizes = {"full": folder_bytes(full_bundle), "update": folder_bytes(update),
             "full zip": full_bundle.with_name("v2.zip").stat().st_size,
             "update zip": (tmp_path / "v2-update.zip").stat().st_size}
    print("bundle bytes:", sizes)
    assert sizes["update"] * 5 < sizes["full"] and sizes["update zip"] * 5 < sizes["full zip"]
    applied = apply_update(old_bundle, update, tmp_path / "v2-applied",
                           trusted_keys=[tmp_path / "keys" / "bundle-signing-key.pub.pem"])
    assert applied == described(full_bundle)  # the installed bundle + the update = the full bundle of the round
    assert tree_digest(tmp_path / "v2-applied") == tree_digest(full_bundle)


def test_an_update_with_a_changed_adapter_is_not_applied(chain_export, old_bundle, tmp_path):
    """The hashes alone (allow_unsigned: no trusted key) still catch an accidental change."""
    update = tmp_path / "update"
    make_bundle(BundleRequest(str(chain_export / DPO), out=update, update_from=old_bundle))
    damaged = update / "adapters" / DPO
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"\0")
    with pytest.raises(UserError, match="has sha256"):
        apply_update(old_bundle, update, tmp_path / "applied", allow_unsigned=True)
    assert not (tmp_path / "applied").exists() and not list(tmp_path.glob(".*.partial"))


def another_base(bundle, tmp_path):
    """A copy of ``bundle`` whose bundle.json names another base."""
    other = tmp_path / "other-base"
    shutil.copytree(bundle, other)
    info = dict(described(other), base_sha256="0" * 64)
    (other / "bundle.json").write_text(json.dumps(info))
    return other


def single_artifact_bundle(tmp_path):
    """A bundle.json as a plain GGUF bundle (format 1) has it."""
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "bundle.json").write_text(json.dumps({"format": 1, "artifact": "model/model-Q8_0.gguf",
                                                                "model_id": "ab" * 32}))
    return tmp_path / "plain"


def plain_export(tmp_path):
    """A GGUF export's artifact and manifest (not an adapter export)."""
    artifact = tmp_path / "model-Q8_0.gguf"
    artifact.write_bytes(b"GGUF")
    (tmp_path / "model-Q8_0.gguf.json").write_text(json.dumps({"metrics": {"target": "gguf", "sha256": "ab"}}))
    return artifact


@pytest.mark.parametrize("case, message", [
    ("another base", "an update keeps the device's base"),
    ("not a bundle", "is not a bundle (no bundle.json)"),
    ("single artifact", "not of base + adapters"),
    ("same chain", "already shipped"),
    ("plain export", "--update-from ships adapters"),
])
def test_what_cannot_be_an_update_is_refused_in_one_line(chain_export, old_bundle, full_bundle, tmp_path, capsys,
                                                         case, message):
    source, old = chain_export / DPO, old_bundle
    if case == "another base":
        old = another_base(old_bundle, tmp_path)
    elif case == "not a bundle":
        old = tmp_path / "empty"
        old.mkdir()
    elif case == "single artifact":
        old = single_artifact_bundle(tmp_path)
    elif case == "same chain":
        old = full_bundle
    else:
        source = plain_export(tmp_path)
    code, stdout, stderr = run_cli(capsys, "bundle", source, "--update-from", old, "--out", tmp_path / "update")
    assert code == 2 and stdout == "" and message in stderr and len(stderr.strip().splitlines()) == 1, stderr
    if case == "another base":
        assert "0" * 12 in stderr and described(old_bundle)["base_sha256"][:12] in stderr  # both hashes named
    assert not (tmp_path / "update").exists() and not list(tmp_path.glob("*.zip"))
    assert not list(tmp_path.glob(".*.partial"))


def test_a_run_from_a_gguf_ships_to_a_phone_as_that_file_and_its_adapter(llama_cpp_reference, stories, tmp_path,
                                                                           capsys):
    """`bundle RUN --device` for a run trained from the user's GGUF: the adapter export (made first), the user's
    file as the base byte for byte, no merged re-quantization."""
    from tests.helpers import finished_sft_run

    users = shutil.copy(llama_cpp_reference["llama"], tmp_path / "users-model.gguf")
    run, _ = finished_sft_run(tmp_path / "run", users, stories, steps=2)
    code, out, err = run_cli(capsys, "bundle", run, "--device", "iphone-15-pro", "--json")
    assert code == 0, err
    described = json.loads(out)
    bundle = run / "export" / "bundle-iphone-15-pro"
    assert described["path"] == str(bundle) and described["kind"] == "full"
    assert (bundle / "model" / "users-model.gguf").read_bytes() == users.read_bytes()
    assert described["base_sha256"] == sha256_file(users)
    assert [entry["stage"] for entry in described["adapters"]] == ["sft"]
    assert sorted(p.name for p in (run / "export").glob("*.gguf*")) == [SFT, f"{SFT}.json"]  # nothing merged
