"""Accounts: single sign-on with the team's OpenID Connect provider, and password login
that can be kept for administrators only (docs/access.md, "Single sign-on")."""
