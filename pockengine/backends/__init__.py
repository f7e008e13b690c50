"""Backends: kernel tables that execute a training graph."""
