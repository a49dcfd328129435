"""The API keys: `--api-key` guards inference, `--admin-api-key` the adapter routes.

- The API key (LEDGERSERVE_API_KEY): every path under `/v1`, `/tokenize`, `/detokenize` and
  `/metrics` needs `Authorization: Bearer <key>`; `/health`, `/ping` and `/version` stay open.
- The admin key (LEDGERSERVE_ADMIN_API_KEY): `/v1/load_lora_adapter` and
  `/v1/unload_lora_adapter` (loading, reloading, pinning and unloading adapters) need it, and
  the API key no longer opens them (403). The admin key also opens every route the API key
  opens, so an operator needs one key; without an admin key the API key opens every route.
- `/v1/models` shows an adapter's server path (`root`) only to a request holding the admin key.

Both keys reach this process only through its environment, and are compared in constant time.
Paths are judged as the routes see them (without `--root-path`).
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from ledgerserve.shared import env
from ledgerserve.shared.config import EngineConfig
from ledgerserve.tokenizer_proc.security import (
    ASGIApp,
    Receive,
    Scope,
    Send,
    StartupRefused,
    header,
    route_path,
    send_error,
)

PROTECTED_PREFIX = "/v1"
PROTECTED_PATHS = ("/tokenize", "/detokenize", "/metrics")  # the tokenizer and template run there, as in /v1
ADMIN_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
ADMIN_STATE = "holds_admin_key"  # request.state's flag: the request carries the admin key


@dataclass(frozen=True)
class Keys:
    api: bytes | None  # None: inference is open
    admin: bytes | None  # None: the adapter routes take the API key, as inference does


def keys_from_env(config: EngineConfig) -> Keys:
    """The keys to enforce; refuses a required-but-empty key and an admin key equal to the API key."""
    api, admin = env.api_key(), env.admin_api_key()
    for required, key, flag, name in (
        (config.api_key_required, api, "--api-key", env.API_KEY),
        (config.admin_api_key_required, admin, "--admin-api-key", env.ADMIN_API_KEY),
    ):
        if required and not key:
            raise StartupRefused(
                f"an API key is required ({flag}) but {name} is empty in the "
                "HTTP process; refusing to start without authentication"
            )
    if admin and admin == api:
        raise StartupRefused("the admin API key must differ from the API key")
    return Keys(api.encode() or None, admin.encode() or None)


def key_matches(authorization: bytes | None, key: bytes) -> bool:
    """`Authorization: Bearer <key>`, compared in constant time."""
    if authorization is None:
        return False
    scheme, _, given = authorization.partition(b" ")
    if scheme.lower() != b"bearer":
        return False
    return hmac.compare_digest(given.strip(), key)


class AuthMiddleware:
    """401 without the key a path needs (403 when the request holds only the API key where the
    admin key is needed); marks requests holding the admin key in `request.state`."""

    def __init__(self, app: ASGIApp, keys: Keys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        authorization = header(scope, b"authorization")
        is_admin = self.keys.admin is not None and key_matches(authorization, self.keys.admin)
        is_user = self.keys.api is not None and key_matches(authorization, self.keys.api)
        path = route_path(scope)
        if is_admin_path(path) and self.keys.admin is not None and not is_admin:
            if is_user:
                await send_error(send, 403, "This route needs the admin API key (--admin-api-key).")
            else:
                await _unauthorized(send, "Invalid or missing admin API key; send `Authorization: Bearer <key>`.")
            return
        if is_protected(path) and self.keys.api is not None and not (is_user or is_admin):
            await _unauthorized(send, "Invalid or missing API key; send `Authorization: Bearer <key>`.")
            return
        scope.setdefault("state", {})[ADMIN_STATE] = is_admin
        await self.app(scope, receive, send)


async def _unauthorized(send: Send, message: str) -> None:
    await send_error(send, 401, message, {"www-authenticate": "Bearer"})


def is_protected(path: str) -> bool:
    return path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/") or path.rstrip("/") in PROTECTED_PATHS


def is_admin_path(path: str) -> bool:
    return path.rstrip("/") in ADMIN_PATHS
