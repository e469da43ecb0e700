"""kiln's tests, laid out as the package: ``tests/<subpackage>/test_<what>.py`` tests
``kiln/<subpackage>/``; tests of kiln's top-level modules, the import graph and packaging sit here at
the top; ``tests/e2e/`` drives the whole system through a public entry point. What several test files
share lives in ``tests/helpers/`` (fixtures in a ``conftest.py``); a test file never imports another.
``tests/test_import_graph.py`` checks the layout.
"""
