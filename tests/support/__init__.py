"""Helpers the tests share (importable as `support`: tests/ is on the import path)."""
