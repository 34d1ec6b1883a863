"""Test support shared across the suites: fake runs, the worker fleet harness."""
