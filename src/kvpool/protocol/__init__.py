"""Typed formats of what crosses a process boundary (see DESIGN.md §2)."""
