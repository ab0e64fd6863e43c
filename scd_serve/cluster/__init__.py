"""`scd-serve up`: a local cluster of real processes (prefill + decode + gateway)."""
