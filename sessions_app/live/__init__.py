"""The live session page, server side (docs/live-page.md)."""
