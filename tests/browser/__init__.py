"""Browser tests: the notebooks' widget panels in a real JupyterLab, driven through Chromium.

A package, so that its conftest is imported as ``browser.conftest`` and the suite's own
``conftest`` (tests/conftest.py, imported by other test files as ``conftest``) stays the one
under that name.
"""
