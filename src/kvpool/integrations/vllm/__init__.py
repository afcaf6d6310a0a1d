"""kvpool's pool inside vLLM: ``KVPoolConnector``, a ``KVConnectorBase_V1`` (``connector.py``;
``layout.py`` converts between vLLM's KV tensors and kvpool's objects, without vLLM).

``KVPoolConnector`` is imported on first use (it needs vLLM): vLLM's
``kv_connector_module_path="kvpool.integrations.vllm"`` finds it here.
"""

from __future__ import annotations

__all__ = ["KVPoolConnector", "KVPoolConnectorMetadata"]


def __getattr__(name: str):
    if name in __all__:
        from kvpool.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
