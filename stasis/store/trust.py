"""What the store believes of a manifest: parsed, its signature verified against the node's
keyring (signing.py), or refused; the signing of what is published; the signed verdicts of
`stasis verify` kept beside a checkpoint; and the rule that images only xxh3 checks are never
restored. A manifest without a signature, with one that does not verify, or signed by a key
the keyring does not trust is never listed, never restored, never counted by retention.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping

from pydantic import ValidationError

from stasis.errors import UntrustedCheckpointError
from stasis.store._place import Place, reason
from stasis.store.manifest import FORMATS, Manifest
from stasis.store.signing import Signature, Signer, Verdict

log = logging.getLogger(__name__)

# What a manifest's signature is for (signing.py): it verifies nothing else.
MANIFEST_PURPOSE = "manifest"
# Beside a checkpoint's images: the newest verdict of `stasis verify` on it, signed
# (`Trust.record_verdict`); what its signature is for, so that it verifies nothing else.
VERDICT_NOTE = "verdict.json"
VERDICT_PURPOSE = "verify-verdict"
_VERDICT_MAX = 1 << 16  # a verdict is a few hundred bytes; what lies past this is not read


class UnreadableManifest(Exception):
    """Not a manifest this stasis can read: garbage, or (`known_format` False) one of a format
    it does not know, which a newer stasis sharing the store may have written."""

    def __init__(self, why: str, known_format: bool = True) -> None:
        super().__init__(why)
        self.known_format = known_format


class UntrustedManifest(Exception):
    """A well-formed manifest whose signature is missing, wrong or made with a key not trusted."""

    def __init__(
        self, verdict: Verdict | None, key_id: str | None, claims: Manifest | None = None
    ) -> None:
        super().__init__(verdict.value if verdict else "not signed")
        self.verdict = verdict
        self.key_id = key_id
        # What the manifest says of itself, unverified: a hint for an error message only.
        self.claims = claims


class Trust:
    """`keys` signs what is published and says which signatures are trusted."""

    def __init__(self, place: Place, keys: Signer) -> None:
        self._place = place
        self.keys = keys
        # Checkpoints already warned about: a store with many bad ones must not flood the log.
        self._warned: set[str] = set()

    def load(self, checkpoint_id: str) -> Manifest:
        """The manifest of `checkpoint_id`, once it parsed and its signature verified;
        FileNotFoundError, UnreadableManifest or UntrustedManifest otherwise."""
        data = self._place.tree.read_manifest(checkpoint_id)
        try:
            document = json.loads(data)
        except ValueError as e:  # not JSON, not UTF-8
            raise UnreadableManifest(reason(e)) from e
        if not isinstance(document, dict):
            raise UnreadableManifest("not a JSON object")
        if document.get("format", 1) not in FORMATS:
            raise UnreadableManifest(
                f"format {document.get('format')!r}, which this stasis does not know "
                "(written by a newer one?)",
                known_format=False,
            )
        try:
            manifest = Manifest.model_validate(document)
        except (ValidationError, ValueError) as e:
            raise UnreadableManifest(_first_problem(e)) from e
        if manifest.id != checkpoint_id:
            raise UnreadableManifest(f"it names checkpoint {manifest.id}")
        if manifest.signature is None:
            raise UntrustedManifest(None, None, manifest)
        # Exactly what was read, not the model's view of it: a field this version ignores is
        # signed too, and a change to it is a change.
        del document["signature"]
        verdict = self.keys.verify(MANIFEST_PURPOSE, document, manifest.signature)
        if verdict is not Verdict.VALID:
            raise UntrustedManifest(verdict, manifest.signature.key_id, manifest)
        return manifest

    def seal(self, manifest: Manifest) -> Manifest:
        """`manifest` signed with this node's key, as it is written."""
        signature = self.keys.sign(MANIFEST_PURPOSE, _signed_part(manifest))
        return manifest.model_copy(update={"signature": signature})

    def warn_once(self, checkpoint_id: str, why: str) -> None:
        if checkpoint_id not in self._warned:
            self._warned.add(checkpoint_id)
            log.warning("skipping checkpoint %s in %s: %s", checkpoint_id, self._place.url, why)

    def skip(self, checkpoint_id: str, e: Exception) -> None:
        """Warn, once, of a checkpoint a listing passes over (untrusted, garbage, unreadable)."""
        self.warn_once(
            checkpoint_id, untrusted_why(e) if isinstance(e, UntrustedManifest) else str(e)
        )

    def untrusted(self, checkpoint_id: str, e: UntrustedManifest) -> UntrustedCheckpointError:
        rm = f"root can delete it with `stasis checkpoints rm {checkpoint_id}`"
        if e.verdict is Verdict.UNKNOWN_KEY:
            return UntrustedCheckpointError(
                f"checkpoint {checkpoint_id} is not trusted: its manifest is signed by key "
                f"{e.key_id}, which this node does not trust; if another node of your site made "
                f"it, add that node's key to trusted_keys (or give both one site_key) and restart "
                f"the daemon, else {rm}"
            )
        if e.verdict is None:
            what = (
                "is not signed: it was written by a stasis that did not sign manifests, or "
                "by someone else who can write the store"
            )
        else:
            what = (
                "does not match its signature: it was changed after it was signed "
                "(tampering or damage)"
            )
        return UntrustedCheckpointError(
            f"checkpoint {checkpoint_id} is not trusted and is not restored: its manifest {what}; "
            f"{rm}"
        )

    # -- verdicts of `stasis verify` ----------------------------------------------------------

    def record_verdict(self, manifest: Manifest, verdict: Mapping[str, object]) -> None:
        """Write `verdict` (stasis.wire.VerifyVerdict) beside `manifest`'s images, replacing
        the one before: signed with this node's signing key (the site key where there is one)
        over the verdict and the manifest's own MAC, so that it neither stands for another
        checkpoint nor can be written by whoever can merely write the store."""
        document = {"verdict": dict(verdict), "manifest": _manifest_mac(manifest)}
        signature = self.keys.sign(VERDICT_PURPOSE, document)
        data = json.dumps({**document, "signature": signature.model_dump()}).encode()
        try:
            self._place.tree.put_note(manifest.id, VERDICT_NOTE, data)
        except FileNotFoundError:
            raise self._place.not_found(manifest.id) from None
        except Exception as e:
            raise self._place.write_error(manifest.id, e) from e

    def verdict(self, manifest: Manifest) -> dict[str, object] | None:
        """The newest verdict recorded on `manifest` (`record_verdict`), or None: none, or one
        that is not signed by a key this node trusts, or not for this very manifest (a forged
        or copied one is logged once and never shown)."""
        try:
            data = self._place.tree.read_stored_range(manifest.id, VERDICT_NOTE, 0, _VERDICT_MAX)
        except FileNotFoundError:
            return None
        except Exception as e:
            log.warning("cannot read the verdict of checkpoint %s: %s", manifest.id, reason(e))
            return None
        try:
            raw = json.loads(data)
            signature = Signature.model_validate(raw["signature"])
            document = {"verdict": raw["verdict"], "manifest": raw["manifest"]}
            good = (
                isinstance(raw["verdict"], dict)
                and raw["verdict"].get("checkpoint") == manifest.id
                and raw["manifest"] == _manifest_mac(manifest)
                and self.keys.verify(VERDICT_PURPOSE, document, signature) is Verdict.VALID
            )
        except (ValueError, TypeError, KeyError, ValidationError):
            good = False
        if not good:
            key = f"verdict:{manifest.id}"
            if key not in self._warned:
                self._warned.add(key)
                log.warning(
                    "ignoring the verdict of checkpoint %s in %s: it is not signed by a key "
                    "this node trusts for this checkpoint",
                    manifest.id,
                    self._place.url,
                )
            return None
        return dict(raw["verdict"])


def require_cryptographic_sums(manifest: Manifest) -> None:
    """UntrustedCheckpointError (one line) for a checkpoint whose images nothing but xxh3
    checks (formats 1 and 2, not encrypted): a store writer can rewrite its images keeping
    every xxh3 sum, and a restore runs as root. Re-dumping makes a format 3 checkpoint."""
    if manifest.has_cryptographic_sums:
        return
    raise UntrustedCheckpointError(
        f"checkpoint {manifest.id} is not restored: it predates cryptographic image hashes "
        f"(format {manifest.format}, stored in the clear, checked by xxh3 only, which "
        "whoever can write the store can forge); restore it with the stasis that made it "
        "and dump the job again with this one, or delete it with "
        f"`stasis checkpoints rm {manifest.id}`"
    )


def untrusted_why(e: UntrustedManifest) -> str:
    if e.verdict is None:
        return "its manifest is not signed"
    if e.verdict is Verdict.UNKNOWN_KEY:
        return f"its manifest is signed by key {e.key_id}, which this node does not trust"
    return "its manifest does not match its signature (changed after it was signed)"


def _signed_part(manifest: Manifest) -> dict[str, object]:
    """The manifest as the JSON values written to manifest.json, less the signature: what a
    reader gets back from the file and verifies."""
    signed: dict[str, object] = json.loads(manifest.model_dump_json(exclude={"signature"}))
    return signed


def _manifest_mac(manifest: Manifest) -> str:
    return manifest.signature.hmac_sha256 if manifest.signature is not None else ""


def _first_problem(e: ValueError) -> str:
    if isinstance(e, ValidationError):
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return f"{where}: {first['msg']}" if where else str(first["msg"])
    return reason(e)
