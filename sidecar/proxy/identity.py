"""Who is billed for a request: API keys mapped to principals, and the rules for trusting a claim.

Owns: the keys file (SHA-256 of each key with its user, team, project and tags, re-read on
SIGHUP), the mode (keys file, trusted gateway header, or the key's hash), the 401 an unknown key
gets, the upstream credential that replaces the client's, and `tollbooth keys add`.
Never: keeps, logs or exports a key. Only its SHA-256 is held; only 12 hex digits of it leave here.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..config import Config, ConfigError, load_yaml
from ..credentials import ConflictingKeys, bearer, digest, key_id
from ..text import USER_CHARS, clean

log = logging.getLogger("tollbooth.identity")

ANONYMOUS = "anonymous"
TAG_CHARS = 64  # a project or tag from a trusted header, after clean(): as long as a key's name
_HEX64 = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[A-Za-z0-9._:@+-]{1,64}")  # what a principal may be called (it is a label)
MAX_TAGS = 16  # tags on one key or one trusted header: bounded (each one is a budget scope)
_FIELDS = {"sha256", "user", "team", "project", "tags"}


@dataclass(frozen=True, slots=True)
class Principal:
    """The billed identity of a request."""

    user: str
    team: str | None = None
    key_id: str | None = None  # "key-" + 12 hex of the key's sha256, when a key was presented
    project: str | None = None  # chargeback: the project (cost centre) the key belongs to
    tags: tuple[str, ...] = ()  # chargeback tags, sorted and unique


class Unauthorized(Exception):
    """No valid key where one is required; the proxy answers 401 without reaching the upstream."""


class KeyBook:
    """sha256 -> Principal, from the keys file. `reload()` swaps the table atomically."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._by_hash = read_keys(path)

    def __len__(self) -> int:
        return len(self._by_hash)

    def lookup(self, key: str) -> Principal | None:
        return self._by_hash.get(digest(key))

    def users(self) -> list[str]:
        """Every user the file names, once each, in file order (their series are published
        ahead)."""
        return list(dict.fromkeys(p.user for p in self._by_hash.values()))

    def reload(self) -> None:
        self._by_hash = read_keys(self.path)


def read_keys(path: str) -> dict[str, Principal]:
    data = load_yaml(path) if Path(path).exists() else {}
    entries = data.get("keys") or []
    if not isinstance(entries, list):
        raise ConfigError(f"keys file '{path}': 'keys' must be a list")
    table: dict[str, Principal] = {}
    for i, entry in enumerate(entries):
        where = f"keys file '{path}' entry {i}"
        if not isinstance(entry, dict) or set(entry) - _FIELDS:
            raise ConfigError(f"{where}: expected {{sha256, user, team?, project?, tags?}}")
        sha, user, team = entry.get("sha256"), entry.get("user"), entry.get("team")
        if not isinstance(sha, str) or not _HEX64.fullmatch(sha):
            raise ConfigError(f"{where}: 'sha256' must be 64 lowercase hex digits")
        if not isinstance(user, str) or not _NAME.fullmatch(user):
            raise ConfigError(f"{where}: 'user' must match {_NAME.pattern}")
        if team is not None and (not isinstance(team, str) or not _NAME.fullmatch(team)):
            raise ConfigError(f"{where}: 'team' must match {_NAME.pattern}")
        project, tags = entry.get("project"), entry.get("tags") or []
        if project is not None and (not isinstance(project, str) or not _NAME.fullmatch(project)):
            raise ConfigError(f"{where}: 'project' must match {_NAME.pattern}")
        if not isinstance(tags, list) or len(tags) > MAX_TAGS:
            raise ConfigError(f"{where}: 'tags' must be a list of at most {MAX_TAGS}")
        for tag in tags:
            if not isinstance(tag, str) or not _NAME.fullmatch(tag):
                raise ConfigError(f"{where}: each tag must match {_NAME.pattern}")
        table[sha] = Principal(
            user=user,
            team=team,
            key_id="key-" + sha[:12],
            project=project,
            tags=tuple(sorted(set(tags))),
        )
    return table


def header_tags(value: str) -> tuple[str, ...]:
    """A trusted gateway's comma-separated tags, each cleaned: sorted, unique, at most MAX_TAGS."""
    tags = {clean(t.strip(), TAG_CHARS) for t in value.split(",")[: MAX_TAGS * 4] if t.strip()}
    return tuple(sorted(tags)[:MAX_TAGS])


class Identity:
    """Resolves the billed principal of a request under the configured mode."""

    def __init__(self, config: Config) -> None:
        ident = config.identity
        self.keys = KeyBook(ident.keys_file) if ident.keys_file else None
        unknown = ident.unknown_key or ("reject" if self.keys else "anonymous")
        self.reject_unknown = unknown == "reject"
        trust = ident.trust_user_header
        self.trust_header = (self.keys is None) if trust is None else trust
        self.user_header = config.metering.user_header
        self.project_header = ident.project_header
        self.tags_header = ident.tags_header

    @property
    def needs_body(self) -> bool:
        """Only without a keys file can the body (its `user`) decide who is billed."""
        return self.keys is None

    def resolve(self, headers: Mapping[str, str], body_user: str | None) -> Principal:
        """Keys file: the key's principal (an unknown key: 401, or the one shared "anonymous", so
        inventing keys never buys a fresh budget). Without one, first that applies: the trusted
        header, the body's `user`, the key's hash, "anonymous". Raises Unauthorized."""
        try:
            key = bearer(headers)
        except ConflictingKeys as exc:
            raise Unauthorized(f"conflicting API keys: {exc}") from None
        known = self.keys.lookup(key) if self.keys is not None and key else None
        if self.keys is not None and known is None and self.reject_unknown:
            raise Unauthorized("invalid API key" if key else "missing API key")
        claimed = (headers.get(self.user_header) or "").strip() if self.trust_header else ""
        if claimed:  # a header's text (undecodable bytes arrive as surrogates): made safe here
            return self._claimed(headers, claimed, key_id(key))
        if known is not None:
            return known
        if self.keys is not None:
            return Principal(user=ANONYMOUS)
        if body_user and body_user.strip():
            return Principal(user=body_user.strip(), key_id=key_id(key))
        kid = key_id(key)
        return Principal(user=kid or ANONYMOUS, key_id=kid)

    def _claimed(self, headers: Mapping[str, str], user: str, kid: str | None) -> Principal:
        """The trusted gateway's principal: user, and project and tags from their configured
        headers (each cleaned and bounded here, at the boundary)."""
        project = (headers.get(self.project_header) or "").strip() if self.project_header else ""
        tags = headers.get(self.tags_header) or "" if self.tags_header else ""
        return Principal(
            user=clean(user, USER_CHARS),
            key_id=kid,
            project=clean(project, TAG_CHARS) if project else None,
            tags=header_tags(tags) if tags else (),
        )

    def reload(self) -> None:
        if self.keys is not None:
            self.keys.reload()


def upstream_authorization(config: Config) -> str | None:
    """`Bearer <key>` from the variable named by upstream.api_key_env, read once at start."""
    name = config.upstream.api_key_env
    if not name:
        return None
    value = os.environ.get(name, "").strip()
    if not value:
        raise ConfigError(f"config 'upstream.api_key_env' names '{name}', which is unset or empty")
    return "Bearer " + value


# --- tollbooth keys add ---------------------------------------------------------------------------


def add_key(
    path: str,
    user: str,
    team: str | None,
    project: str | None = None,
    tags: tuple[str, ...] | list[str] = (),
) -> str:
    """Create a random key, append its hash and principal to the keys file, return the key."""
    named = [("user", user), ("team", team), ("project", project), *(("tag", t) for t in tags)]
    for what, value in named:
        if value is not None and not _NAME.fullmatch(value):
            raise ConfigError(f"--{what} '{value}' must match {_NAME.pattern}")
    if len(set(tags)) > MAX_TAGS:
        raise ConfigError(f"at most {MAX_TAGS} tags")
    existing: dict[str, Any] = load_yaml(path) if Path(path).exists() else {}
    read_keys(path)  # refuse to append to a file we could not load afterwards
    key = "tb-" + secrets.token_urlsafe(32)
    entry: dict[str, Any] = {"sha256": digest(key), "user": user}
    if team:
        entry["team"] = team
    if project:
        entry["project"] = project
    if tags:
        entry["tags"] = sorted(set(tags))
    entries = list(existing.get("keys") or [])
    entries.append(entry)
    _write_atomic(Path(path), yaml.safe_dump({**existing, "keys": entries}, sort_keys=False))
    return key


def _write_atomic(path: Path, text: str) -> None:
    """Readable by the owner only; a crash leaves the old file or the new one, never half."""
    fd, tmp = tempfile.mkstemp(dir=path.parent or Path("."), prefix=".keys-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
