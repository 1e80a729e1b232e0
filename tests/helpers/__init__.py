"""Builders shared by the tests: paths, subprocess runners, CLI helpers.

`tests/` is on `sys.path` in every test (pytest puts the root conftest's folder there), so a
test file anywhere below writes `from helpers.paths import SRC`. Import only what a test file
uses; the modules here import nothing from the tests.
"""
