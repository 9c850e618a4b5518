"""Telling people that a question waits for them: the inbox, the live count every page shows,
system notifications, Web Push to their devices, and the installable app (docs/attention.md)."""
