"""Callbacks in real runs."""
