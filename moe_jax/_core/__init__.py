"""Shared helpers: argument checks, backend selection, hardware queries."""
