"""Shared pytest setup: the tests import their helpers (``tb_read``, ...) from this directory."""
