"""Signing bundles: an Ed25519 signature over bundle.json, beside it as ``bundle.json.sig``.

bundle.json lists every other file's sha256 (``files``), the adapters' and the chain's id, so a
signature over it covers every byte the bundle ships. A sha256 proves integrity (the bytes are those
the manifest names, against accidental change); it proves nothing about origin, since whoever
changes a file can rewrite its hash. The signature adds origin: only the holder of the private key
can make one that a trusted public key accepts.

What is signed is the canonical form of bundle.json's content (:func:`signed_bytes`: a domain tag,
then JSON with sorted keys and no spaces), so a reader checks exactly the content it parsed and acts
on. Written with the ``cryptography`` library (OpenSSL's Ed25519, as TUF and Sigstore clients use),
not by hand.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Union

from slm_align.atomic import write_bytes_atomic, write_json_atomic
from slm_align.errors import UserError

try:
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
except ImportError:  # the export and agent extras install it; only signing and checking need it
    InvalidSignature = serialization = Ed25519PrivateKey = Ed25519PublicKey = None

SIGNATURE = "bundle.json.sig"
ALGORITHM = "ed25519"
DOMAIN = b"slm-align bundle.json v1\n"
"""Prefixed to what is signed, so that a signature made for something else never passes as a
bundle's."""
PRIVATE_KEY = "bundle-signing-key.pem"
PUBLIC_KEY = "bundle-signing-key.pub.pem"
TrustedKey = Union[str, Path, bytes, "Ed25519PublicKey"]


def _require_cryptography() -> None:
    if Ed25519PrivateKey is None:
        raise UserError("signing and checking bundles needs the cryptography package: "
                        "pip install 'slm-align[export]' (or [agent])")


def signed_bytes(described: dict) -> bytes:
    """What the signature covers: the domain tag, then bundle.json's content as canonical JSON."""
    canonical = json.dumps(described, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                           allow_nan=False)
    return DOMAIN + canonical.encode("ascii")


def _raw_public(key: "Ed25519PublicKey") -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(key: "Ed25519PublicKey") -> str:
    """A public key's id: the sha256 of its 32 raw bytes, in hex (named in messages and in the
    signature)."""
    return hashlib.sha256(_raw_public(key)).hexdigest()


def generate_keys(folder: Path) -> tuple[Path, Path]:
    """A new key pair in ``folder``: the private key (PEM, PKCS#8, readable by its owner only: 0600)
    and the public key to give to devices (PEM); an existing key is never overwritten. Returns
    (private, public)."""
    _require_cryptography()
    folder = Path(folder).expanduser()
    private_path, public_path = folder / PRIVATE_KEY, folder / PUBLIC_KEY
    for path in (private_path, public_path):
        if path.exists() or path.is_symlink():
            raise UserError(f"{path} exists; a key is never "
                            "overwritten: choose another --out folder")
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
    public_pem = key.public_key().public_bytes(serialization.Encoding.PEM,
                                               serialization.PublicFormat.SubjectPublicKeyInfo)
    write_bytes_atomic(private_path, private_pem, mode=0o600)
    write_bytes_atomic(public_path, public_pem, mode=0o644)
    return private_path, public_path


def _pem(path: Path, what: str) -> bytes:
    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"{what} {path} not found; make a key pair "
                        "with `slm-align bundle-keygen --out DIR`")
    return path.read_bytes()


def load_private_key(path: Path) -> "Ed25519PrivateKey":
    """The Ed25519 private key in the PEM file ``path`` (unencrypted); one line for anything
    else."""
    _require_cryptography()
    try:
        key = serialization.load_pem_private_key(_pem(path, "the signing key"), password=None)
    except (ValueError, TypeError):
        raise UserError(f"{path} is not an unencrypted PEM private key; pass the {PRIVATE_KEY} "
                        "`slm-align bundle-keygen` wrote") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise UserError(f"{path} is a {type(key).__name__}, not an Ed25519 key; make one with "
                        "`slm-align bundle-keygen --out DIR`")
    return key


def load_public_key(key: TrustedKey) -> "Ed25519PublicKey":
    """A trusted key: an Ed25519 public key object, its PEM bytes, or the path of its PEM file."""
    _require_cryptography()
    if isinstance(key, Ed25519PublicKey):
        return key
    data = key if isinstance(key, bytes) else _pem(Path(key), "the trusted key")
    try:
        loaded = serialization.load_pem_public_key(data)
    except (ValueError, TypeError):
        raise UserError(f"the trusted key {str(key)[:60]} is not a PEM public key; pass the "
                        f"{PUBLIC_KEY} `slm-align bundle-keygen` wrote") from None
    if not isinstance(loaded, Ed25519PublicKey):
        raise UserError(f"the trusted key {str(key)[:60]} is a "
                        f"{type(loaded).__name__}, not an Ed25519 key")
    return loaded


def sign_bundle(folder: Path, key: "Ed25519PrivateKey") -> str:
    """Write ``folder``/bundle.json.sig, the signature by ``key`` of bundle.json's content as
    written there (parsed back: what a reader checks); returns the signing key's id."""
    described = json.loads((Path(folder) / "bundle.json").read_text(encoding="utf-8"))
    signature = key.sign(signed_bytes(described))
    signer = key_id(key.public_key())
    write_json_atomic(Path(folder) / SIGNATURE, {"algorithm": ALGORITHM, "key_id": signer,
                                                 "signature": base64.b64encode(signature).decode("ascii")})
    return signer


def _read_signature(folder: Path, role: str) -> tuple[str, bytes]:
    """(key id, signature) of the bundle at ``folder``; one line when there is none or it is
    malformed."""
    path = Path(folder) / SIGNATURE
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise UserError(f"{role} {folder} is not signed (no {SIGNATURE}); ask its publisher for an "
                        "update made with `slm-align bundle ... --sign KEY.pem`") from None
    if not stat.S_ISREG(mode):
        raise UserError(f"{role}'s {SIGNATURE} is not a regular file (a symlink?); refusing it")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        signature = base64.b64decode(record["signature"], validate=True)
        signer = str(record.get("key_id", "?"))
    except (ValueError, KeyError, TypeError, binascii.Error):
        raise UserError(f"{role}'s {SIGNATURE} is malformed; ask its "
                        "publisher to sign the bundle again") from None
    if record.get("algorithm") != ALGORITHM:
        raise UserError(f"{role}'s {SIGNATURE} uses {record.get('algorithm')!r}; "
                        f"only {ALGORITHM} is accepted")
    return signer, signature


def check_signature(folder: Path, described: dict,
                    trusted_keys: Union[TrustedKey, Sequence[TrustedKey]], role: str) -> str:
    """The id of the trusted key whose signature of ``described`` (the bundle.json read at
    ``folder``) is beside it; one line when the bundle is unsigned or no trusted key signed this
    content."""
    if isinstance(trusted_keys, (str, bytes, os.PathLike)):  # one key passed bare, not in a list
        trusted_keys = [trusted_keys]
    keys = [load_public_key(key) for key in trusted_keys]
    signer, signature = _read_signature(folder, role)
    try:
        message = signed_bytes(described)
    except ValueError:  # NaN or Infinity: no bundle we write holds one
        raise UserError(f"{role}'s bundle.json holds a number "
                        "JSON cannot carry; refusing it") from None
    for key in keys:
        try:
            key.verify(signature, message)
        except InvalidSignature:
            continue
        return key_id(key)
    raise UserError(f"{role} {folder} is not signed by a trusted key (its signature names key "
                    f"{signer[:12]}, the trusted keys are "
                    f"{', '.join(key_id(key)[:12] for key in keys)}) or was changed after signing; "
                    "refusing it")
