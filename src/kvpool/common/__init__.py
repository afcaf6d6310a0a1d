"""Shared contracts: block hashing, errors, logging, metrics."""
