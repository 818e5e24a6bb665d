"""Session snapshots on disk: where ``POST /v1/sessions/{id}/snapshot`` writes and
``POST /v1/sessions/restore`` reads (docs/server.md, "Snapshots").

Clients never name a path. The server picks the place: ``settings.snapshot_dir`` (default
``<cothink cache dir>/snapshots``), one folder per API key (a hash of the key's fingerprint, so a key
only ever reaches its own snapshots), one folder per snapshot::

    <snapshot_dir>/<owner hash>/<snapshot id>/blocks.safetensors   # engine.save: tokens, KV, GDN state
    <snapshot_dir>/<owner hash>/<snapshot id>/session.json         # session name, block ids and labels

A snapshot id is unguessable (``snap_`` + secrets.token_urlsafe) and is checked twice before it
touches the file system: against its pattern, then that the resolved folder lies inside the owner's
folder. `session.json` is written last (atomically): a folder without it is an unfinished snapshot.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from cothink.errors import SnapshotError
from cothink.server.errors import APIError

BLOCKS_FILE = "blocks.safetensors"
MANIFEST_FILE = "session.json"
SNAPSHOT_ID_PATTERN = r"^snap_[A-Za-z0-9_-]{16,48}$"
_SNAPSHOT_ID = re.compile(SNAPSHOT_ID_PATTERN)


@dataclass(frozen=True)
class SnapshotBlock:
    """A saved block as the session knew it: its id (also its engine name in the file) and label."""

    id: str
    name: str | None
    length: int


@dataclass(frozen=True)
class SnapshotManifest:
    id: str
    source_session: str
    session_name: str | None
    created: int
    model: str  # the server's model name when saved (the file itself records the model identity)
    blocks: list[SnapshotBlock]

    @property
    def tokens(self) -> int:
        return sum(b.length for b in self.blocks)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> SnapshotManifest:
        raw = json.loads(text)
        return SnapshotManifest(
            raw["id"], raw["source_session"], raw["session_name"], int(raw["created"]), raw["model"],
            [SnapshotBlock(b["id"], b["name"], int(b["length"])) for b in raw["blocks"]],
        )


class SnapshotStore:
    """The snapshot folders of every API key, under one root; at most `max_per_owner` per key."""

    def __init__(self, root: Path, max_per_owner: int):
        self.root = root
        self.max_per_owner = max_per_owner

    def owner_dir(self, owner: str) -> Path:
        # a hash, not the fingerprint itself: a fixed-width name that cannot hold path characters
        return self.root / hashlib.sha256(owner.encode()).hexdigest()[:32]

    def folder(self, owner: str, snapshot_id: str) -> Path:
        """The folder of `owner`'s snapshot `snapshot_id`; 400 for an id that is not one, 404 if absent."""
        if not _SNAPSHOT_ID.fullmatch(snapshot_id):
            raise APIError(
                400, "not a snapshot id", "invalid_request_error", "invalid_snapshot_id", "snapshot"
            )
        base = self.owner_dir(owner).resolve()
        folder = (base / snapshot_id).resolve()
        if folder.parent != base:  # belt and braces: the pattern already excludes separators and dots
            raise APIError(
                400, "not a snapshot id", "invalid_request_error", "invalid_snapshot_id", "snapshot"
            )
        if not (folder / MANIFEST_FILE).is_file():
            raise APIError(404, f"no snapshot {snapshot_id!r}", "not_found_error", "snapshot_not_found")
        return folder

    def create(self, owner: str) -> tuple[str, Path]:
        """A new, empty snapshot folder (429 when the key holds its maximum). Synchronous: folders being
        written count against the quota, so concurrent requests cannot all pass the check."""
        base = self.owner_dir(owner)
        base.mkdir(parents=True, exist_ok=True)
        held = sum(1 for p in base.iterdir() if p.is_dir())
        if held >= self.max_per_owner:
            raise APIError(
                429,
                f"this API key holds its maximum of {self.max_per_owner} snapshots; delete some",
                "quota_error",
                "snapshot_quota",
            )
        snapshot_id = f"snap_{secrets.token_urlsafe(18)}"
        folder = base / snapshot_id
        folder.mkdir()
        return snapshot_id, folder

    def write_manifest(self, folder: Path, manifest: SnapshotManifest) -> None:
        tmp = folder / (MANIFEST_FILE + ".tmp")
        tmp.write_text(manifest.to_json())
        os.replace(tmp, folder / MANIFEST_FILE)  # the snapshot exists once this is in place

    def read_manifest(self, folder: Path) -> SnapshotManifest:
        try:
            manifest = SnapshotManifest.from_json((folder / MANIFEST_FILE).read_text())
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SnapshotError(f"the snapshot's session record is unreadable: {exc}") from None
        if manifest.id != folder.name:
            raise SnapshotError("the snapshot's session record names another snapshot")
        return manifest

    def discard(self, folder: Path) -> None:
        shutil.rmtree(folder, ignore_errors=True)

    def delete(self, owner: str, snapshot_id: str) -> None:
        self.discard(self.folder(owner, snapshot_id))

    def file_bytes(self, folder: Path) -> int:
        try:
            return (folder / BLOCKS_FILE).stat().st_size
        except OSError:
            return 0
