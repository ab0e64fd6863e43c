"""`scd-serve eval`: quality of a transfer method against the consumer's own prefill."""
