"""Seeing where the time goes: events, summaries, the doctor and the benchmark."""
