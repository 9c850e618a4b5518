"""A small real OpenID Connect provider (django-oauth-toolkit) for the single sign-on tests:
its own Django project, port and SQLite file, started by tests/test_sso.py as a server.
Not part of Corral."""
