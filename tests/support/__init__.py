"""Code the tests share, one module per thing it provides (importable as `support`: tests/ is on
the import path). tests/conftest.py registers the modules that define fixtures as plugins."""
