"""The built-in synthetic QA language: its lexicon and its seeded documents and splits.

The embedded pair is trained on it (pair/), and `calibrate` and `eval` read its splits when
no --data file is given, so it sits below both.
"""
