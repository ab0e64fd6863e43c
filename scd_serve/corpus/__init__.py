"""The built-in synthetic QA language (lexicon, seeded documents and splits): the embedded pair
is trained on it, and `calibrate` and `eval` read its splits when no --data file is given."""
