"""Which adapter a generation request asks for, loading it on its first request.

A request picks an adapter with `model` (a registered name) or `lora_path` (a registered name,
or the path of a registered adapter). When neither names a registered adapter:

- `lora_path` = an absolute path of a directory inside a `--lora-allowed-dir` loads it on
  demand, under its real path as its name (one name per directory, whatever spelling or link
  reached it; at most 256 characters, else 400). An absolute path outside every allowed dir
  gets 400 before anything under it is read. A relative `lora_path` is a name (a relative
  path would depend on the server's working directory): unknown, it gets 404.
- `model` = N, with `--lora-resolve-dir DIR`, loads DIR/N under the name N when N is a single
  path component that passes the adapter name rules (no `/`, `\\`, `..` or NUL) and DIR/N is
  a directory; otherwise, and without `--lora-resolve-dir`, the model does not exist (404).

An on-demand load is validated as /v1/load_lora_adapter validates (allowed_real_path, then
read_manifest off the event loop with the content digest) and sent to the core marked
`on_demand`; the core may refuse it (503 when every adapter loaded on demand is in use), or
later unregister it while idle. Concurrent first requests for one name share one load (one
asyncio task per name; the others await it, and a client leaving does not cancel it). If the
core already registered the name from the same directory (a racing load), that one serves.
Without any `--lora-allowed-dir` nothing is loaded on demand: the 404s stay as they were.
"""

from __future__ import annotations

import asyncio
import os

from ledgerserve.shared.adapter_format import BaseShapes
from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.events import AdapterInfo
from ledgerserve.tokenizer_proc import adapters
from ledgerserve.tokenizer_proc.adapter_routes import load_event
from ledgerserve.tokenizer_proc.engine_client import EngineClientBase
from ledgerserve.tokenizer_proc.errors import ApiError


class LoraResolver:
    def __init__(
        self,
        engine: EngineClientBase,
        config: EngineConfig,
        registry: adapters.AdapterRegistry,
        base: BaseShapes | None,
    ) -> None:
        self.engine = engine
        self.config = config
        self.registry = registry
        self.base = base
        self._loads: dict[str, asyncio.Task[None]] = {}  # adapter name -> its on-demand load in flight

    @property
    def loads_on_demand(self) -> bool:
        return self.config.enable_lora and bool(self.config.lora_allowed_dirs)

    async def resolve(self, model: str, lora_path: str | None) -> AdapterInfo | None:
        """The adapter a request asks for, as registered now (None: the base model), or an ApiError."""
        name = await self._by_model(model)
        if lora_path is not None:
            adapters.require_lora(self.config)
            by_path = await self._by_path(lora_path)
            if name is not None and name != by_path:
                raise ApiError(
                    400, f"model `{model}` and lora_path `{lora_path}` name different adapters.", "lora_path"
                )
            name = by_path
        info = self.registry.get(name) if name is not None else None
        if name is not None and info is None:  # unloaded again before this request could use it
            raise ApiError(404, f"The model `{name}` does not exist.", "model")
        return info

    async def _by_model(self, model: str) -> str | None:
        if model in self.config.served_model_names:
            return None
        info = self.registry.get(model) if self.config.enable_lora else None
        if info is not None:
            return info.name
        directory = self._resolvable(model)
        if directory is None:
            raise ApiError(404, f"The model `{model}` does not exist.", "model")
        try:
            real = adapters.allowed_real_path(directory, self.config.lora_allowed_dirs)
        except ApiError:
            raise ApiError(
                400, f"The adapter `{model}` of --lora-resolve-dir leads outside every --lora-allowed-dir.", "model"
            ) from None
        await self._load_once(model, real, "model")
        return model

    async def _by_path(self, lora_path: str) -> str:
        info = self.registry.get(lora_path) or self.registry.by_path(lora_path)
        if info is not None:
            return info.name
        if not self.loads_on_demand or not os.path.isabs(lora_path):
            raise ApiError(404, f"The LoRA adapter `{lora_path}` is not loaded.", "lora_path")
        real = adapters.allowed_real_path(lora_path, self.config.lora_allowed_dirs)
        if len(real) > adapters.MAX_NAME_CHARS:
            raise ApiError(
                400,
                f"lora_path `{lora_path}` resolves to a path longer than {adapters.MAX_NAME_CHARS} "
                "characters, the longest adapter name.",
                "lora_path",
            )
        try:
            adapters.check_name(real, self.config)
        except ApiError as e:
            raise ApiError(400, f"lora_path `{lora_path}` cannot name an adapter: {e.message}", "lora_path") from None
        await self._load_once(real, real, "lora_path")
        return real

    def _resolvable(self, name: str) -> str | None:
        """DIR/name if a request's unknown model name may be loaded from --lora-resolve-dir."""
        if not self.loads_on_demand or not self.config.lora_resolve_dir or not is_component(name):
            return None
        try:
            adapters.check_name(name, self.config)
        except ApiError:
            return None
        directory = os.path.join(self.config.lora_resolve_dir, name)
        return directory if os.path.isdir(directory) else None

    async def _load_once(self, name: str, real: str, param: str) -> None:
        """Load `real` under `name` on demand; concurrent callers for one name share one load."""
        task = self._loads.get(name)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._load(name, real, param))
            self._loads[name] = task
            task.add_done_callback(lambda done: self._forget(name, done))
        await asyncio.shield(task)

    def _forget(self, name: str, task: asyncio.Task[None]) -> None:
        if self._loads.get(name) is task:
            del self._loads[name]
        if not task.cancelled():
            task.exception()  # retrieved: every caller may have left

    async def _load(self, name: str, real: str, param: str) -> None:
        if self.base is None:  # enable_lora implies base shapes; kept for the type checker
            raise RuntimeError("LoRA is enabled but the base shapes are unknown")
        try:
            manifest = await asyncio.to_thread(adapters.validate, real, self.base, self.config)
        except ApiError as e:
            raise ApiError(e.status_code, e.message, param) from None
        reply = await self.engine.adapter_op(load_event(self.engine.next_op_id(), name, manifest, on_demand=True))
        info = self.registry.get(name)
        if reply.code == 200 or (info is not None and info.path == manifest.path):
            return
        raise ApiError(reply.code, reply.message, param)


def is_component(name: str) -> bool:
    """A single path component: no separator, no `..`, no NUL, not `.`."""
    return name not in ("", ".") and not any(bad in name for bad in ("/", "\\", "..", "\x00"))
