"""kvpool's pool under the APIs of tools people already run (Mooncake Store's Python API)."""
