"""Applying an update bundle (issue 45, items 1 and 2): nothing is written outside ``out``, an update adds adapters
only, its chain ids are recomputed, it must be signed by a trusted key, and every refusal is one line with nothing
written. The bundles are written here by hand (bytes standing for GGUF files: applying reads no GGUF), as
``slm-align bundle`` lays them out; tests/export/test_bundle_adapters.py applies real ones."""

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest

from slm_align.errors import UserError
from slm_align.export.packaging import adapter_bundle
from slm_align.export.packaging.adapter_bundle import apply_update
from slm_align.export.packaging.bundle_signing import generate_keys, load_private_key, sign_bundle
from slm_align.ondevice.gguf.adapter_check import chain_digest
from slm_align.runs import sha256_file
from tests.helpers import run_cli

BASE, SFT, DPO = "model/base-F16.gguf", "adapters/adapter-sft-F16.gguf", "adapters/adapter-dpo-F16.gguf"
RECORDS = {"export-manifest.json": b'{"metrics": {}}\n', "verification.json": b'{"passed": true}\n'}
INSTALLED_FILES = {BASE: b"base weights " * 64, SFT: b"sft adapter " * 16, "chat_template.jinja": b"{{ x }}",
                   "sampling.json": b"{}\n", "tools.json": b"[]\n", "README.md": b"v1\n", **RECORDS}
UPDATE_FILES = {DPO: b"dpo adapter " * 16, "README.md": b"update\n", **RECORDS}
VICTIM = b"precious, not to be overwritten\n"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_bundle(folder, described, files):
    """``files`` ({path: bytes}) in ``folder`` and bundle.json = ``described`` + every file's sha256."""
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    described = dict(described, files={name: sha(data) for name, data in files.items()})
    (folder / "bundle.json").write_text(json.dumps(described, indent=2, sort_keys=True))
    return described


def common(base):
    return {"format": 2, "runtime": "llama.cpp", "target": "gguf-adapter", "quant": "F16", "device": None,
            "artifact": BASE, "base": BASE, "base_sha256": sha(base), "verification_passed": True,
            "chat_template": "chat_template.jinja", "tokenizer": "embedded in the base"}


def installed_description():
    base, sft = INSTALLED_FILES[BASE], INSTALLED_FILES[SFT]
    return dict(common(base), kind="full", model_id=chain_digest(sha(base), [sha(sft)]),
                adapters=[{"path": SFT, "stage": "sft", "sha256": sha(sft), "scale": 1.0}])


def update_description(files=UPDATE_FILES):
    base, sft, dpo = INSTALLED_FILES[BASE], INSTALLED_FILES[SFT], files[DPO]
    return dict(common(base), kind="update", model_id=chain_digest(sha(base), [sha(sft), sha(dpo)]),
                requires_base_sha256=sha(base), replaces_model_id=installed_description()["model_id"],
                adapters=[{"path": SFT, "stage": "sft", "sha256": sha(sft), "scale": 1.0, "shipped": False},
                          {"path": DPO, "stage": "dpo", "sha256": sha(dpo), "scale": 1.0, "shipped": True}])


@pytest.fixture
def keys(tmp_path):
    """(private key, public key path) of the publisher."""
    private, public = generate_keys(tmp_path / "keys")
    return load_private_key(private), public


@pytest.fixture
def device(tmp_path):
    """The installed bundle, and a file outside every bundle that an attacker would like to overwrite."""
    installed = tmp_path / "device" / "v1"
    installed.mkdir(parents=True)
    write_bundle(installed, installed_description(), INSTALLED_FILES)
    victim = tmp_path / "victim" / "precious.txt"
    victim.parent.mkdir()
    victim.write_bytes(VICTIM)
    return installed, victim


def make_update(tmp_path, key, described=None, files=UPDATE_FILES, name="update"):
    """An update bundle (signed by ``key`` unless None) of ``described`` (default: the honest one)."""
    folder = tmp_path / name
    folder.mkdir()
    write_bundle(folder, update_description(files) if described is None else described, files)
    if key is not None:
        sign_bundle(folder, key)
    return folder


def snapshot(root):
    """Every file and link below ``root`` with its bytes or target: equal snapshots, nothing written."""
    found = {}
    for folder, folders, files in os.walk(root):
        for name in folders + files:
            path = Path(folder) / name
            found[path] = os.readlink(path) if path.is_symlink() else None if path.is_dir() else path.read_bytes()
    return found


def refused(tmp_path, installed, update, public, match, **kwargs):
    """apply_update refuses in one line matching ``match``; nothing below tmp_path written or changed."""
    before = snapshot(tmp_path)
    kwargs.setdefault("trusted_keys", [public])
    with pytest.raises(UserError, match=match) as refusal:
        apply_update(installed, update, tmp_path / "applied" / "v2", **kwargs)
    assert "\n" not in str(refusal.value)
    assert snapshot(tmp_path) == before  # no out, no scratch, no victim touched
    return str(refusal.value)


def test_a_signed_update_applies_and_makes_the_chain_it_names(tmp_path, device, keys):
    installed, _ = device
    update = make_update(tmp_path, keys[0])
    out = tmp_path / "applied" / "v2"
    applied = apply_update(installed, update, out, trusted_keys=[keys[1]])
    assert applied["kind"] == "full" and applied["model_id"] == update_description()["model_id"]
    assert [entry["path"] for entry in applied["adapters"]] == [SFT, DPO]
    assert "shipped" not in applied["adapters"][1] and "replaces_model_id" not in applied
    for name, data in {**INSTALLED_FILES, **UPDATE_FILES}.items():
        if name != "README.md":
            assert (out / name).read_bytes() == data, name
    assert json.loads((out / "bundle.json").read_text()) == applied
    assert all(sha256_file(out / name) == digest for name, digest in applied["files"].items())
    assert sorted(p.name for p in out.parent.iterdir()) == ["v2"]  # the scratch folder is gone


TRAVERSALS = {
    "dot-dot to an absolute file": "adapters/" + "../" * 40 + "VICTIM",
    "absolute": "VICTIM",
    "dot-dot inside": "adapters/../adapters/adapter-dpo-F16.gguf",
    "a sub-folder": "adapters/sub/adapter-dpo-F16.gguf",
    "the folder itself": "adapters/..",
    "a hidden name": "adapters/.adapter-dpo-F16.gguf",
    "a backslash": "adapters/..\\..\\x.gguf",
    "the base's folder": BASE,
    "no folder": "adapter-dpo-F16.gguf",
}


@pytest.mark.parametrize("shipped", [False, True], ids=["installed bytes", "the update's bytes"])
@pytest.mark.parametrize("case", sorted(TRAVERSALS))
def test_an_entry_path_that_is_not_a_plain_name_under_adapters_is_refused(tmp_path, device, keys, case, shipped):
    """The issue's probe: today's code wrote the installed adapter (or the attacker's file) over the victim. Signed
    by the trusted key: a publisher's key does not license writes outside ``out`` either."""
    installed, victim = device
    path = TRAVERSALS[case].replace("VICTIM", str(victim)[int(case != "absolute"):])
    described = update_description()
    described["adapters"][int(shipped)]["path"] = path
    update = make_update(tmp_path, keys[0], described)
    refused(tmp_path, installed, update, keys[1], "only plain names under adapters/")
    assert victim.read_bytes() == VICTIM


def test_symlinked_adapters_folder_in_the_update_is_refused(tmp_path, device, keys):
    """The issue's second probe: update/adapters a symlink into a deep folder of the update."""
    installed, victim = device
    update = make_update(tmp_path, keys[0])
    deep = update / "a" / "b" / "c"
    deep.mkdir(parents=True)
    (update / "adapters").rename(deep / "adapters")
    (update / "adapters").symlink_to(deep / "adapters", target_is_directory=True)
    message = refused(tmp_path, installed, update, keys[1], "symlink")
    assert "adapters is a symlink" in message and victim.read_bytes() == VICTIM


@pytest.mark.parametrize("name", [DPO, "export-manifest.json", "bundle.json"])
def test_a_shipped_file_that_is_a_symlink_to_a_local_file_is_refused(tmp_path, device, keys, name):
    """A symlink to a local file would copy that file into the bundle (bundle.json: be read as the update's)."""
    installed, victim = device
    update = make_update(tmp_path, keys[0])
    local = tmp_path / "local-secret"
    local.write_bytes((update / name).read_bytes())  # the same bytes: the hash alone would let it through
    (update / name).unlink()
    (update / name).symlink_to(local)
    refused(tmp_path, installed, update, keys[1], "symlink")


def test_an_existing_or_linked_out_is_refused(tmp_path, device, keys):
    installed, victim = device
    update = make_update(tmp_path, keys[0])
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "victim" / "new-folder")  # dangling: out.exists() is False
    before = snapshot(tmp_path)
    with pytest.raises(UserError, match="exists; choose another folder"):
        apply_update(installed, update, link, trusted_keys=[keys[1]])
    assert snapshot(tmp_path) == before and not (tmp_path / "victim" / "new-folder").exists()


@pytest.mark.parametrize("name", [BASE, "chat_template.jinja", "tokenizer.json"])
def test_an_update_cannot_replace_the_base_template_or_tokenizer(tmp_path, device, keys, name):
    """Signed and listed in ``files``: still refused, an update adds adapters only."""
    installed, _ = device
    files = dict(UPDATE_FILES, **{name: b"the attacker's " + name.encode()})
    update = make_update(tmp_path, keys[0], update_description(files), files)
    refused(tmp_path, installed, update, keys[1], f"ships {name}: an update adds adapters only")
    assert (installed / BASE).read_bytes() == INSTALLED_FILES[BASE]


@pytest.mark.parametrize("key, value", [("chat_template", "other.jinja"), ("base", "model/other.gguf"),
                                        ("tokenizer", "tokenizer.json")])
def test_an_update_that_names_another_base_template_or_tokenizer_is_refused(tmp_path, device, keys, key, value):
    installed, _ = device
    update = make_update(tmp_path, keys[0], dict(update_description(), **{key: value}))
    refused(tmp_path, installed, update, keys[1], f"changes {key} .*an update adds adapters only")


def test_an_unlisted_file_in_the_update_is_refused(tmp_path, device, keys):
    installed, _ = device
    update = make_update(tmp_path, keys[0])
    (update / "adapters" / "extra.gguf").write_bytes(b"not listed")
    refused(tmp_path, installed, update, keys[1], "holds adapters/extra.gguf, which its bundle.json does not list")


@pytest.mark.parametrize("key, message", [("model_id", "claims model_id"), ("replaces_model_id", "replaces model_id"),
                                          ("requires_base_sha256", "needs base sha256")])
def test_chain_ids_are_recomputed_not_taken_as_written(tmp_path, device, keys, key, message):
    """Signed by the trusted key, but naming a chain its adapters do not make, or a chain the device lacks."""
    installed, _ = device
    update = make_update(tmp_path, keys[0], dict(update_description(), **{key: "ab" * 32}))
    refused(tmp_path, installed, update, keys[1], message)


def rewritten(tmp_path, keys, signature):
    """The issue's probe: the adapter's bytes changed and bundle.json's sha256s (entry, files, model_id) rewritten
    to match; with the publisher's signature of the original (``old``), signed by another key (``attacker``), or
    unsigned (None)."""
    files = dict(UPDATE_FILES, **{DPO: b"a backdoored adapter " * 16})
    update = make_update(tmp_path, None, update_description(files), files)
    if signature == "old":
        original = make_update(tmp_path, keys[0], name="original")
        (update / "bundle.json.sig").write_bytes((original / "bundle.json.sig").read_bytes())
    elif signature == "attacker":
        sign_bundle(update, load_private_key(generate_keys(tmp_path / "attacker")[0]))
    return update


@pytest.mark.parametrize("signature, message", [
    ("old", "is not signed by a trusted key"),
    ("attacker", "is not signed by a trusted key"),
    (None, "is not signed \\(no bundle.json.sig\\)"),
])
def test_changed_bytes_with_rewritten_hashes_are_refused_unless_a_trusted_key_signed(tmp_path, device, keys,
                                                                                    signature, message):
    installed, _ = device
    update = rewritten(tmp_path, keys, signature)
    text = refused(tmp_path, installed, update, keys[1], message)
    assert signature != "attacker" or "its signature names key" in text


def test_without_trusted_keys_an_update_is_refused_unless_the_caller_opts_out(tmp_path, device, keys):
    """The secure default: no keys, no update; allow_unsigned=True trusts the hashes alone, which is exactly what
    they cannot carry: rewritten bytes and hashes pass (integrity, not origin)."""
    installed, _ = device
    update = rewritten(tmp_path, keys, None)
    refused(tmp_path, installed, update, keys[1], "no trusted key to check the update against", trusted_keys=[])
    applied = apply_update(installed, update, tmp_path / "opted-out", allow_unsigned=True)
    assert (tmp_path / "opted-out" / DPO).read_bytes() == b"a backdoored adapter " * 16
    assert applied["model_id"] != update_description()["model_id"]


def test_a_damaged_signature_file_is_one_line(tmp_path, device, keys):
    installed, _ = device
    update = make_update(tmp_path, keys[0])
    (update / "bundle.json.sig").write_text('{"algorithm": "ed25519", "signature": "not base64!"}')
    refused(tmp_path, installed, update, keys[1], "bundle.json.sig is malformed")


def drop(key):
    def mutate(described):
        del described[key]
    return mutate


def set_to(key, value):
    def mutate(described):
        described[key] = value
    return mutate


def entry_set(index, key, value):
    def mutate(described):
        if value is None:
            del described["adapters"][index][key]
        else:
            described["adapters"][index][key] = value
    return mutate


def same_path_twice(described):
    described["adapters"][0]["path"] = DPO


MALFORMED = {
    "no requires_base_sha256": (drop("requires_base_sha256"), "requires_base_sha256 is 'None', not a sha256"),
    "no replaces_model_id": (drop("replaces_model_id"), "replaces_model_id is 'None'"),
    "no model_id": (drop("model_id"), "model_id is 'None'"),
    "a number for a digest": (set_to("replaces_model_id", 5), "replaces_model_id is '5'"),
    "base a list": (set_to("base", ["model", "x"]), "a path is list, not text"),
    "adapters a string": (set_to("adapters", "adapters/x"), "not of base \\+ adapters"),
    "an entry a string": (set_to("adapters", ["adapters/x"]), "an adapter entry is str"),
    "an entry without sha256": (entry_set(1, "sha256", None), "has no sha256"),
    "an entry without path": (entry_set(1, "path", None), "a path is NoneType"),
    "an entry without shipped": (entry_set(1, "shipped", None), "does not say whether it is shipped"),
    "a scale as text": (entry_set(1, "scale", "1.0"), "scale that is not a number"),
    "files a list": (set_to("files", ["adapters/x"]), "files is not a map"),
    "one file twice": (same_path_twice, "names one adapter file twice"),
    "a full bundle": (set_to("kind", "full"), "is a full bundle, not an update"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_update_is_one_line_not_a_traceback(tmp_path, device, keys, case):
    installed, _ = device
    mutate, message = MALFORMED[case]
    update = make_update(tmp_path, None)
    described = json.loads((update / "bundle.json").read_text())
    mutate(described)
    (update / "bundle.json").write_text(json.dumps(described))
    sign_bundle(update, keys[0])  # signed: the shape is checked, not just the signature
    refused(tmp_path, installed, update, keys[1], message)


def test_the_installed_bundle_as_its_own_update_is_one_line(tmp_path, device, keys):
    installed, _ = device
    refused(tmp_path, installed, installed, keys[1], "is a full bundle, not an update")


def test_keygen_writes_a_private_key_only_its_owner_reads_and_never_overwrites(tmp_path, capsys):
    code, out, err = run_cli(capsys, "bundle-keygen", "--out", tmp_path / "keys", "--json")
    assert code == 0, err
    result = json.loads(out)
    private, public = tmp_path / "keys" / "bundle-signing-key.pem", tmp_path / "keys" / "bundle-signing-key.pub.pem"
    assert result["private_key"] == str(private) and result["public_key"] == str(public)
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert private.read_text().startswith("-----BEGIN PRIVATE KEY-----")
    assert public.read_text().startswith("-----BEGIN PUBLIC KEY-----") and len(result["key_id"]) == 64
    before = private.read_bytes()
    code, out, err = run_cli(capsys, "bundle-keygen", "--out", tmp_path / "keys")
    assert code == 2 and "never overwritten" in err and err.count("\n") == 1 and private.read_bytes() == before


@pytest.mark.parametrize("key", ["missing", "public", "garbage"])
def test_bundle_sign_with_an_unusable_key_is_refused_before_any_work(tmp_path, capsys, keys, key):
    path = {"missing": tmp_path / "nope.pem", "public": keys[1], "garbage": tmp_path / "garbage.pem"}[key]
    (tmp_path / "garbage.pem").write_text("-----BEGIN PRIVATE KEY-----\nnot a key\n")
    code, out, err = run_cli(capsys, "bundle", tmp_path / "no-such-export.gguf", "--sign", path,
                             "--out", tmp_path / "b")
    assert code == 2 and err.count("\n") == 1 and "no-such-export" not in err, err
    assert not (tmp_path / "b").exists()


def test_an_out_made_meanwhile_by_another_writer_is_left_as_it_is(tmp_path, device, keys, monkeypatch):
    """Two applies to one ``out`` at once: the second finds it made between its check and its rename."""
    installed, _ = device
    update = make_update(tmp_path, keys[0])
    out = tmp_path / "applied" / "v2"
    real_publish = adapter_bundle.publish_directory

    def racing_publish(built, final):
        final.mkdir()
        (final / "theirs.txt").write_text("the other writer's bundle")
        return real_publish(built, final)

    monkeypatch.setattr(adapter_bundle, "publish_directory", racing_publish)
    with pytest.raises(UserError, match="exists; choose another folder"):
        apply_update(installed, update, out, trusted_keys=[keys[1]])
    assert [p.name for p in out.iterdir()] == ["theirs.txt"] and sorted(os.listdir(out.parent)) == ["v2"]
