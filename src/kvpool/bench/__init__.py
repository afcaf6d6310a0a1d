"""Trace replay: measure any OpenAI-compatible endpoint on Mooncake-format request traces."""
