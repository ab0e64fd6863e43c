"""The method vocabulary: besides the codec registry's transfer methods (scd_serve.codec.METHODS),
what a request's `scd_method` and a worker's default may name. Plain strings, as on the wire."""

LOCAL = "local"  # no transfer: the decode worker prefills the prompt itself
AUTO = "auto"  # per request, the fastest method the quality budget allows (decode/auto.py)
