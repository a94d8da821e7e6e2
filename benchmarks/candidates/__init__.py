"""Candidate kernel data paths, timed against the library's before one replaces it."""
