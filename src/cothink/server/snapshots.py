"""Session snapshots on disk: where ``POST /v1/sessions/{id}/snapshot`` writes and
``POST /v1/sessions/restore`` reads (docs/server.md, "Snapshots").

Clients never name a path. The server picks the place: ``settings.snapshot_dir`` (default
``<cothink cache dir>/snapshots``), one folder per API key (a hash of the key's fingerprint, so a key
only ever reaches its own snapshots), one folder per snapshot::

    <snapshot_dir>/<owner hash>/<snapshot id>/blocks.safetensors   # engine.save: tokens, KV, GDN state
    <snapshot_dir>/<owner hash>/<snapshot id>/session.json         # session name, block ids and labels

A snapshot id is unguessable (``snap_`` + secrets.token_urlsafe) and is checked twice before it
touches the file system: against its pattern, then that the resolved folder lies inside the owner's
folder. `session.json` is written last (atomically): a folder without it is an unfinished snapshot
(one being written, or one a crash cut short); its owner sees it in the list and may delete it.

Each key holds at most `max_per_owner` snapshot folders and `max_bytes_per_owner` bytes in them:
the count is checked when a folder is made (synchronously, so concurrent saves cannot all pass),
the bytes both then and when the snapshot is complete (`commit`, one at a time under a lock: a
snapshot that would take the key past its bytes is deleted and refused). Snapshots older than
`ttl_s` are deleted whenever their key saves, lists or restores. Everything that reads or writes
files here runs in a worker thread (the routes call it through asyncio.to_thread), except `create`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import threading
import time
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


@dataclass(frozen=True)
class StoredSnapshot:
    """One folder of a key, as the list shows it."""

    id: str
    status: str  # "complete" | "writing" (being saved now) | "unfinished" (cut short; delete it)
    bytes: int  # on disk, all its files
    created: int  # unix time (unfinished: when its folder was last written)
    manifest: SnapshotManifest | None  # complete snapshots only


def _folder_bytes(folder: Path) -> int:
    total = 0
    try:
        for p in folder.iterdir():
            try:
                total += p.stat().st_size
            except OSError:  # deleted meanwhile
                pass
    except OSError:
        pass
    return total


class SnapshotStore:
    """The snapshot folders of every API key, under one root, with each key's count and bytes bounded."""

    def __init__(self, root: Path, max_per_owner: int, max_bytes_per_owner: int, ttl_s: float | None = None):
        self.root = root
        self.max_per_owner = max_per_owner
        self.max_bytes_per_owner = max_bytes_per_owner
        self.ttl_s = ttl_s
        self.writing: set[Path] = set()  # folders a save is writing now
        self._lock = threading.Lock()  # commits, deletes and expiry, one at a time

    def owner_dir(self, owner: str) -> Path:
        # a hash, not the fingerprint itself: a fixed-width name that cannot hold path characters
        return self.root / hashlib.sha256(owner.encode()).hexdigest()[:32]

    def _resolve(self, owner: str, snapshot_id: str) -> Path:
        """The folder `snapshot_id` names for `owner` (400 for an id that is not one); may not exist."""
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
        return folder

    def folder(self, owner: str, snapshot_id: str) -> Path:
        """The folder of `owner`'s complete snapshot `snapshot_id`; 400 for an id that is not one, 404
        if absent (or unfinished)."""
        folder = self._resolve(owner, snapshot_id)
        if not (folder / MANIFEST_FILE).is_file():
            raise APIError(404, f"no snapshot {snapshot_id!r}", "not_found_error", "snapshot_not_found")
        return folder

    def held(self, owner: str) -> tuple[int, int]:
        """(folders, bytes) `owner` holds, unfinished ones included."""
        base = self.owner_dir(owner)
        if not base.is_dir():
            return 0, 0
        folders = [p for p in base.iterdir() if p.is_dir()]
        return len(folders), sum(_folder_bytes(p) for p in folders)

    def create(self, owner: str, at_least: int = 0) -> tuple[str, Path]:
        """A new, empty snapshot folder for a snapshot of `at_least` bytes (429 when the key holds its
        maximum count, or would exceed its bytes). Synchronous: folders being written count against the
        quota, so concurrent requests cannot all pass the count check."""
        base = self.owner_dir(owner)
        base.mkdir(parents=True, exist_ok=True)
        base = base.resolve()
        count, size = self.held(owner)
        if count >= self.max_per_owner:
            raise APIError(
                429,
                f"this API key holds its maximum of {self.max_per_owner} snapshots; delete some",
                "quota_error",
                "snapshot_quota",
            )
        if size >= self.max_bytes_per_owner or size + at_least > self.max_bytes_per_owner:
            raise self._bytes_refusal(size + at_least)
        snapshot_id = f"snap_{secrets.token_urlsafe(18)}"
        folder = base / snapshot_id
        folder.mkdir()
        with self._lock:
            self.writing.add(folder)
        return snapshot_id, folder

    def _bytes_refusal(self, size: int) -> APIError:
        return APIError(
            429,
            f"this API key's snapshots would take {size} bytes on disk; it may keep "
            f"{self.max_bytes_per_owner}: delete some",
            "quota_error",
            "snapshot_bytes_quota",
        )

    def commit(self, owner: str, folder: Path, manifest: SnapshotManifest) -> None:
        """Complete a snapshot whose blocks file is written: within the key's bytes it gets its manifest
        (and exists from then on); beyond them it is deleted and refused (429 snapshot_bytes_quota)."""
        with self._lock:
            self.writing.discard(folder)
            _, size = self.held(owner)
            if size > self.max_bytes_per_owner:
                shutil.rmtree(folder, ignore_errors=True)
                raise self._bytes_refusal(size)
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
        with self._lock:
            self.writing.discard(folder)
        shutil.rmtree(folder, ignore_errors=True)

    def delete(self, owner: str, snapshot_id: str) -> None:
        """Delete `owner`'s snapshot, complete or unfinished (404 if absent, 409 while being written)."""
        folder = self._resolve(owner, snapshot_id)
        with self._lock:
            if folder in self.writing:
                raise APIError(
                    409,
                    f"snapshot {snapshot_id!r} is being written; delete it once it is saved",
                    "conflict_error",
                    "snapshot_busy",
                )
            if not folder.is_dir():
                raise APIError(404, f"no snapshot {snapshot_id!r}", "not_found_error", "snapshot_not_found")
            shutil.rmtree(folder, ignore_errors=True)

    def entries(self, owner: str) -> list[StoredSnapshot]:
        """`owner`'s snapshots, newest first: complete ones with their manifest, unfinished ones too."""
        base = self.owner_dir(owner).resolve()
        if not base.is_dir():
            return []
        out = []
        for folder in base.iterdir():
            if not folder.is_dir() or not _SNAPSHOT_ID.fullmatch(folder.name):
                continue
            size = _folder_bytes(folder)
            try:
                manifest = self.read_manifest(folder) if (folder / MANIFEST_FILE).is_file() else None
            except SnapshotError:
                manifest = None
            if manifest is not None:
                out.append(StoredSnapshot(folder.name, "complete", size, manifest.created, manifest))
                continue
            status = "writing" if folder in self.writing else "unfinished"
            out.append(StoredSnapshot(folder.name, status, size, _mtime(folder), None))
        return sorted(out, key=lambda s: (-s.created, s.id))

    def expire(self, owner: str, now: float | None = None) -> int:
        """Delete `owner`'s snapshots older than `ttl_s` (none while one is being written); returns how
        many went."""
        if self.ttl_s is None:
            return 0
        cutoff = (time.time() if now is None else now) - self.ttl_s
        gone = 0
        for snap in self.entries(owner):
            if snap.status != "writing" and snap.created < cutoff:
                with self._lock:
                    folder = self.owner_dir(owner).resolve() / snap.id
                    if folder not in self.writing:
                        shutil.rmtree(folder, ignore_errors=True)
                        gone += 1
        return gone

    def file_bytes(self, folder: Path) -> int:
        return _folder_bytes(folder)


def _mtime(folder: Path) -> int:
    try:
        return int(folder.stat().st_mtime)
    except OSError:
        return 0
