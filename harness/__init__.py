"""Factories and helpers the tests share (one module per subsystem); fixtures built on them live in tests/conftest.py."""
