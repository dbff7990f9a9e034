"""Tenants of port 4000: which client key belongs to whom (TENANT_KEYS_FILE; read by the front door).

    tenants = TenantKeys(path)            # the file is read again whenever it changes
    tenants.tenant_of("sk-...")           # -> "alice", or None for a key nobody holds
    add_tenant(path, "alice")             # -> a new key for alice (the file created 0600)

The file is JSON: ``{"alice": "sk-...", "bob": ["sk-1", "sk-2"]}`` (a tenant may hold several
keys). The master key (LITELLM_MASTER_KEY) is the default tenant. A tenant's requests reach the
MLX server with the backend key and the tenant's name on ``x-mlxstack-tenant`` (the front door
sets it and drops any a client sent), and the MLX server keeps each tenant's cache, sessions,
healing and diagnoses apart from every other's (docs/security.md#tenants).

The file must be private to its owner (mode 0600, like .env): a readable one is refused with a
message naming the fix -- never a key. Keys are compared in constant time.
"""
from __future__ import annotations

import hmac
import json
import os
import re
import secrets
import stat
import threading
from pathlib import Path

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")
MIN_KEY_CHARS = 16


class TenantsError(ValueError):
    """TENANT_KEYS_FILE cannot be used (the message says why and how to fix it; never a key)."""


def parse_tenants(text: str, where: str = "TENANT_KEYS_FILE") -> dict[str, str]:
    """key -> tenant name, from the file's JSON text."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise TenantsError(f"{where} is not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise TenantsError(f'{where} must be a JSON object {{"tenant": "key", ...}}')
    keys: dict[str, str] = {}
    for name, value in data.items():
        if not NAME.match(str(name)):
            raise TenantsError(f"{where}: tenant name {str(name)[:64]!r} must be 1-64 letters, digits, '.', '_', '@' "
                               "or '-'")
        held = value if isinstance(value, list) else [value]
        for key in held:
            if not isinstance(key, str) or len(key.strip()) < MIN_KEY_CHARS:
                raise TenantsError(f"{where}: every key of tenant {name!r} must be a string of at least "
                                   f"{MIN_KEY_CHARS} characters")
            key = key.strip()
            if key in keys and keys[key] != name:
                raise TenantsError(f"{where}: tenants {keys[key]!r} and {name!r} hold the same key")
            keys[key] = str(name)
    return keys


def check_private(path: Path) -> None:
    info = path.stat()
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise TenantsError(f"{path} can be read by other users: run 'chmod 600 {path}'")
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise TenantsError(f"{path} belongs to another user")


def read_tenants(path: Path) -> dict[str, str]:
    try:
        check_private(path)
        return parse_tenants(path.read_text(encoding="utf-8"), str(path))
    except FileNotFoundError:
        raise TenantsError(f"TENANT_KEYS_FILE {path} does not exist (create it with 'mlxstack tenant add NAME')") from None


class TenantKeys:
    """The tenants of one file, read again when it changes (mtime and size); a file that became
    unusable keeps the last good table and says why once."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path).expanduser() if path else None
        self._keys: dict[str, str] = {}
        self._stamp: tuple | None = None
        self._lock = threading.Lock()
        self.error: str | None = None
        if self.path is not None:
            self._keys = read_tenants(self.path)       # at start: an unusable file is an error now
            self._stamp = self._stat()

    def _stat(self) -> tuple | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_mode)

    def _refresh(self) -> None:
        stamp = self._stat()
        if stamp == self._stamp:
            return
        with self._lock:
            try:
                self._keys, self.error = read_tenants(self.path), None
            except (TenantsError, OSError) as exc:
                self.error = str(exc)
            self._stamp = stamp

    def tenant_of(self, key: str) -> str | None:
        """The tenant holding ``key`` (constant time over every key), else None."""
        if self.path is None:
            return None
        self._refresh()
        found = None
        given = key.encode()
        for held, name in self._keys.items():
            if hmac.compare_digest(given, held.encode()):
                found = name
        return found

    def __len__(self) -> int:
        return len(set(self._keys.values()))


def add_tenant(path: str | Path, name: str) -> str:
    """Give ``name`` a new key in the file (created private when absent); returns the key."""
    path = Path(path).expanduser()
    if not NAME.match(name):
        raise TenantsError(f"tenant name {name[:64]!r} must be 1-64 letters, digits, '.', '_', '@' or '-'")
    data: dict = {}
    if path.exists():
        check_private(path)
        data = json.loads(path.read_text(encoding="utf-8") or "{}")
        parse_tenants(json.dumps(data), str(path))
    key = "sk-" + secrets.token_urlsafe(32)
    held = data.get(name)
    data[name] = ([*held] if isinstance(held, list) else [held] if held else []) + [key]
    if len(data[name]) == 1:
        data[name] = key
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    return key


__all__ = ["TenantKeys", "TenantsError", "add_tenant", "parse_tenants", "read_tenants"]
