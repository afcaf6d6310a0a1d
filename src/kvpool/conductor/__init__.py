"""The conductor: the KVCache-aware global scheduler behind an OpenAI-compatible API."""
