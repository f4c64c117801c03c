"""What an update bundle may hold and claim (export/packaging/update_checks.py), checked on bundle.json
dicts and folders made here."""

from __future__ import annotations

import copy
import os

import pytest

from slm_align.errors import UserError
from slm_align.export.packaging.update_checks import (
    UPDATE_ROLE,
    check_bundle_fields,
    check_claims,
    check_update_files,
    plain_name,
)
from slm_align.ondevice.gguf.adapter_check import chain_digest

BASE = "b" * 64
SFT = "1" * 64
DPO = "2" * 64
RECORD = "3" * 64


def installed() -> dict:
    adapters = [{"path": "adapters/sft.gguf", "sha256": SFT, "scale": 1.0}]
    return {"base": "model/base.gguf", "base_sha256": BASE, "artifact": "a", "chat_template": "t",
            "tokenizer": "tok", "adapters": adapters, "model_id": chain_digest(BASE, [SFT]),
            "files": {"model/base.gguf": BASE}}


def update() -> dict:
    adapters = [{"path": "adapters/sft.gguf", "sha256": SFT, "shipped": False},
                {"path": "adapters/dpo.gguf", "sha256": DPO, "shipped": True, "scale": 0.5}]
    return {**installed(), "adapters": adapters, "requires_base_sha256": BASE,
            "replaces_model_id": chain_digest(BASE, [SFT]), "model_id": chain_digest(BASE, [SFT, DPO]),
            "files": {"adapters/dpo.gguf": DPO, "export-manifest.json": RECORD, "verification.json": RECORD}}


def refused(fn, *args) -> str:
    with pytest.raises(UserError) as caught:
        fn(*args)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_valid_update_passes_every_check(tmp_path):
    """The well-formed pair passes (mutation: a check that refuses everything)."""
    check_bundle_fields(installed(), "the installed bundle", update=False)
    check_bundle_fields(update(), UPDATE_ROLE, update=True)
    check_claims(installed(), update(), UPDATE_ROLE)


@pytest.mark.parametrize("path", ["adapters/../x.gguf", "adapters/sub/x.gguf", "/adapters/x.gguf",
                                  "adapters/.hidden", "adapters/a\\b", "other/x.gguf", "adapters/", "adapters",
                                  "adapters//x.gguf", "./adapters/x.gguf"])
def test_plain_name_refuses_anything_but_folder_slash_name(path):
    """'..', subfolders, absolute paths, dotfiles, backslashes, another folder, normalised spellings
    (mutation: a path check dropped, or PurePosixPath's normalisation trusted)."""
    assert "only plain names under adapters/" in refused(plain_name, path, "adapters", UPDATE_ROLE)


def test_plain_name_returns_the_name():
    """Mutation: the whole path returned."""
    assert plain_name("adapters/dpo.gguf", "adapters", UPDATE_ROLE) == "dpo.gguf"
    assert "a path is int, not text" in refused(plain_name, 3, "adapters", UPDATE_ROLE)


def set_field(key, value):
    """A change setting one top-level field of bundle.json."""
    def change(described):
        described[key] = value
    return change


def set_entry(key, value):
    """A change setting one field of the shipped adapter's entry."""
    def change(described):
        described["adapters"][1][key] = value
    return change


def drop_replaces(described):
    del described["replaces_model_id"]


def append_text_entry(described):
    described["adapters"].append("x")


@pytest.mark.parametrize("breaking, words", [
    (set_field("model_id", "xyz"), "model_id is 'xyz', not a sha256"),
    (drop_replaces, "replaces_model_id is 'None'"),
    (set_field("adapters", []), "it lists no adapters"),
    (set_entry("shipped", "yes"), "does not say whether it is shipped"),
    (set_entry("scale", True), "has a scale that is not a number"),
    (set_entry("sha256", "ABC"), "has no sha256"),
    (set_entry("path", "adapters/sft.gguf"), "names one adapter file twice"),
    (set_field("files", ["x"]), "files is not a map"),
    (append_text_entry, "an adapter entry is str"),
])
def test_malformed_update_fields_are_refused_with_the_fix(breaking, words):
    """Each malformed field is one line naming it and how to remake the update (mutation: a KeyError or
    TypeError, or the check dropped)."""
    described = update()
    breaking(described)
    message = refused(check_bundle_fields, described, UPDATE_ROLE, True)
    assert words in message
    assert message.startswith("the update is malformed") or "only plain names" in message


def test_installed_bundle_needs_no_update_fields():
    """An installed bundle has no shipped flags or replaces_model_id (mutation: update rules applied)."""
    check_bundle_fields(installed(), "the installed bundle", update=False)
    message = refused(check_bundle_fields, {**installed(), "base_sha256": "x"}, "the installed bundle", False)
    assert message.endswith("bundle the export in full again")


@pytest.mark.parametrize("change, words", [
    (set_field("tokenizer", "other"), "changes tokenizer"),
    (set_field("requires_base_sha256", "c" * 64), "needs base sha256 cccccccccccc"),
    (set_field("replaces_model_id", "d" * 64), "apply the updates in order"),
    (set_field("model_id", "e" * 64), "claims model_id eeeeeeeeeeee"),
])
def test_claims_are_recomputed_never_trusted(change, words):
    """Kept fields, base, installed chain and claimed chain (mutation: a written id taken as is)."""
    new = update()
    change(new)
    assert words in refused(check_claims, installed(), new, UPDATE_ROLE)


def test_installed_model_id_must_match_its_chain():
    """A tampered installed bundle is refused (mutation: old model_id trusted)."""
    old = {**installed(), "model_id": "f" * 64}
    assert "is not the id of its chain" in refused(check_claims, old, update(), UPDATE_ROLE)


def write_update(folder, described):
    folder.mkdir()
    for name in described["files"]:
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_bytes(b"x")
    (folder / "bundle.json").write_text("{}")


def test_update_folder_holding_exactly_what_it_lists_passes(tmp_path):
    """Mutation: bundle.json itself counted as unlisted."""
    described = update()
    write_update(tmp_path / "u", described)
    check_update_files(tmp_path / "u", described, UPDATE_ROLE)


def test_update_shipping_a_base_is_refused(tmp_path):
    """An update listing model/... is refused (mutation: any listed file accepted)."""
    described = update()
    described["files"]["model/base.gguf"] = BASE
    write_update(tmp_path / "u", described)
    assert "ships model/base.gguf: an update adds adapters only" in refused(
        check_update_files, tmp_path / "u", described, UPDATE_ROLE)


def test_unlisted_and_missing_files_are_refused(tmp_path):
    """A file on disk not listed, or listed but absent (mutation: one direction of the set difference)."""
    described = update()
    write_update(tmp_path / "u", described)
    (tmp_path / "u" / "adapters" / "extra.gguf").write_bytes(b"x")
    assert "holds adapters/extra.gguf, which its bundle.json does not list" in refused(
        check_update_files, tmp_path / "u", described, UPDATE_ROLE)
    described = update()
    write_update(tmp_path / "v", described)
    os.remove(tmp_path / "v" / "verification.json")
    assert "lacks verification.json" in refused(check_update_files, tmp_path / "v", described, UPDATE_ROLE)


def test_shipped_adapter_needs_its_digest_in_files(tmp_path):
    """Mutation: shipped adapters not cross-checked with files."""
    described = update()
    described["files"]["adapters/dpo.gguf"] = RECORD
    write_update(tmp_path / "u", described)
    assert "adapters/dpo.gguf is shipped but files does not list it" in refused(
        check_update_files, tmp_path / "u", described, UPDATE_ROLE)


def test_records_must_be_listed(tmp_path):
    """Mutation: the export records optional."""
    described = copy.deepcopy(update())
    del described["files"]["export-manifest.json"]
    write_update(tmp_path / "u", described)
    assert "files does not list export-manifest.json" in refused(
        check_update_files, tmp_path / "u", described, UPDATE_ROLE)


def test_symlink_is_refused(tmp_path):
    """Mutation: lstat replaced by stat (a link to a file passes as a plain file)."""
    described = update()
    write_update(tmp_path / "u", described)
    target = tmp_path / "secret"
    target.write_text("s")
    (tmp_path / "u" / "adapters" / "link.gguf").symlink_to(target)
    assert "adapters/link.gguf is a symlink" in refused(check_update_files, tmp_path / "u", described, UPDATE_ROLE)
