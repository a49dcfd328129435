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
later unregister it while idle. One directory is registered once, whatever names reach it: a
directory already registered (under any name, by any route) serves under that name, and
concurrent first requests for one directory share one load (one asyncio task per real path;
the others await it, and a client leaving does not cancel it). If the core already registered
the name from the same directory (a racing load), that one serves. Without any
`--lora-allowed-dir` nothing is loaded on demand: the 404s stay as they were.

A request resolved to an adapter registered on demand carries that adapter's load
(`RequestArrived.on_demand`): should another on-demand load unregister it before the request
reaches the core, the core registers it again rather than refuse the request
(scheduler_proc/core/on_demand.py).
"""

from __future__ import annotations

import asyncio
import os
from collections import OrderedDict
from dataclasses import dataclass

from ledgerserve.shared.adapter_format import AdapterManifest, BaseShapes
from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.events import AdapterInfo, OnDemandLoad
from ledgerserve.tokenizer_proc import adapters
from ledgerserve.tokenizer_proc.adapter_routes import load_event
from ledgerserve.tokenizer_proc.engine_client import EngineClientBase
from ledgerserve.tokenizer_proc.errors import ApiError


@dataclass(frozen=True)
class ResolvedAdapter:
    info: AdapterInfo  # the adapter as registered when the request named it
    on_demand: OnDemandLoad | None  # registered on demand: its load, for the core to register it again


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
        self._loads: dict[str, asyncio.Task[AdapterInfo]] = {}  # real path -> its on-demand load in flight
        # real path -> the load that registered it on demand, least recently used first; bounded
        # (a dropped one is kept again at its directory's next on-demand load; until then its
        # requests carry none, and one unregistered before it arrives gets the core's 404)
        self._on_demand: OrderedDict[str, OnDemandLoad] = OrderedDict()
        self._max_on_demand = 2 * config.max_on_demand_loras + 64

    @property
    def loads_on_demand(self) -> bool:
        return self.config.enable_lora and bool(self.config.lora_allowed_dirs)

    async def resolve(self, model: str, lora_path: str | None) -> ResolvedAdapter | None:
        """The adapter a request asks for, as registered when resolved (None: the base model), or
        an ApiError."""
        info = await self._by_model(model)
        if lora_path is not None:
            adapters.require_lora(self.config)
            by_path = await self._by_path(lora_path)
            if info is not None and info.name != by_path.name:
                raise ApiError(
                    400, f"model `{model}` and lora_path `{lora_path}` name different adapters.", "lora_path"
                )
            info = by_path
        if info is None:
            return None
        load = self._on_demand.get(info.path) if info.on_demand else None
        if load is not None:
            self._on_demand.move_to_end(info.path)
        return ResolvedAdapter(info, load)

    async def _by_model(self, model: str) -> AdapterInfo | None:
        if model in self.config.served_model_names:
            return None
        info = self.registry.get(model) if self.config.enable_lora else None
        if info is not None:
            return info
        directory = self._resolvable(model)
        if directory is None:
            raise ApiError(404, f"The model `{model}` does not exist.", "model")
        try:
            real = adapters.allowed_real_path(directory, self.config.lora_allowed_dirs)
        except ApiError:
            raise ApiError(
                400, f"The adapter `{model}` of --lora-resolve-dir leads outside every --lora-allowed-dir.", "model"
            ) from None
        return await self._load_once(model, real, "model")

    async def _by_path(self, lora_path: str) -> AdapterInfo:
        info = self.registry.get(lora_path) or self.registry.by_path(lora_path)
        if info is not None:
            return info
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
        return await self._load_once(real, real, "lora_path")

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

    async def _load_once(self, name: str, real: str, param: str) -> AdapterInfo:
        """The adapter registered from `real`: the one there is (under any name), else `real`
        loaded on demand under `name`; concurrent callers for one directory share one load."""
        registered = self.registry.by_path(real)
        if registered is not None:
            return registered
        task = self._loads.get(real)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._load(name, real, param))
            self._loads[real] = task
            task.add_done_callback(lambda done: self._forget(real, done))
        return await asyncio.shield(task)

    def _forget(self, real: str, task: asyncio.Task[AdapterInfo]) -> None:
        if self._loads.get(real) is task:
            del self._loads[real]
        if not task.cancelled():
            task.exception()  # retrieved: every caller may have left

    async def _load(self, name: str, real: str, param: str) -> AdapterInfo:
        """The adapter as the core registered it, taken from its reply (the mirror may have lost it
        again by the time a caller looks: another on-demand load's reply)."""
        if self.base is None:  # enable_lora implies base shapes; kept for the type checker
            raise RuntimeError("LoRA is enabled but the base shapes are unknown")
        try:
            manifest = await asyncio.to_thread(adapters.validate, real, self.base, self.config)
        except ApiError as e:
            raise ApiError(e.status_code, e.message, param) from None
        reply = await self.engine.adapter_op(load_event(self.engine.next_op_id(), name, manifest, on_demand=True))
        info = self.registry.get(name)
        if reply.code == 200:
            info = AdapterInfo(name, reply.version_id, manifest.path, on_demand=True)
        elif info is None or info.path != manifest.path:
            raise ApiError(reply.code, reply.message, param)
        self._keep_load(manifest)
        return info

    def _keep_load(self, manifest: AdapterManifest) -> None:
        load = OnDemandLoad(manifest.path, manifest.max_rank, manifest.num_bytes, manifest.content_sha256)
        self._on_demand[manifest.path] = load
        self._on_demand.move_to_end(manifest.path)
        while len(self._on_demand) > self._max_on_demand:
            self._on_demand.popitem(last=False)


def is_component(name: str) -> bool:
    """A single path component: no separator, no `..`, no NUL, not `.`."""
    return name not in ("", ".") and not any(bad in name for bad in ("/", "\\", "..", "\x00"))
