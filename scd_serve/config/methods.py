"""The method vocabulary, one place for every module that names a method: what a request's
`scd_method` and a worker's default may name. Plain strings, as on the wire; the codec registry
(scd_serve.codec) builds exactly TRANSFER_METHODS and ABLATIONS."""

LOCAL = "local"  # no transfer: the decode worker prefills the prompt itself
AUTO = "auto"  # per request, the fastest method the quality budget allows (decode/auto.py)
# how a prompt's K/V can travel from the producer (codec/): what serving offers
TRANSFER_METHODS = ("identity", "raw", "quant4", "quant2", "droidspeak", "reuse", "scd", "scd-int8")
ABLATIONS = ("prior-only",)  # the eval table's zero-payload control; never served
REQUEST_METHODS = (LOCAL, *TRANSFER_METHODS, AUTO)  # what a request may ask for (a worker may offer fewer)
