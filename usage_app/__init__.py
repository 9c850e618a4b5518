"""What each member used, where and of what: tokens in and out, cached tokens and time on
the machine, per finished completion, as llama-server reported them (docs/usage.md)."""
