"""Compilation: tracing user hooks into XLA programs and caching them process-wide."""
