"""Runnable benchmarks (see step.py); a package so tests can `from benchmarks.step import main`."""
