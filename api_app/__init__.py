"""The OpenAI-compatible API: members' tools use the team's models with a personal key (docs/api.md)."""
