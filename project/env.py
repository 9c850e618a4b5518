"""Strict readers of Corral's environment variables, for settings and the launcher.

Each helper returns the default when the variable is unset (or set to the empty
string, which is what ``FOO= ./corral run`` gives) and raises
:class:`~django.core.exceptions.ImproperlyConfigured` naming the variable, the value and
what would be accepted when it is set to something it cannot mean. A typo such as
``DEBUG=ture`` or ``CORRAL_STOP_GRACE=5s`` stops the process at start with that message
instead of silently meaning something else (django-environ reads ``ture`` as false).

Reads ``os.environ`` at call time; imports nothing from Django but the exception, so
the launcher can use it before settings exist.
"""

from __future__ import annotations

import math
import os
import re
from urllib.parse import urlsplit, urlunsplit

from django.core.exceptions import ImproperlyConfigured

__all__ = ["env_bool", "env_choice", "env_db", "env_float", "env_int", "env_list", "env_redis_url", "env_str", "env_url"]

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def _raw(name: str) -> str | None:
    """The variable's value stripped of surrounding blanks; None when unset or blank."""
    value = os.environ.get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def _bad(name: str, value: str, wanted: str) -> ImproperlyConfigured:
    return ImproperlyConfigured(f"{name}={value!r} is not valid: {wanted}.")


def env_str(name: str, default: str) -> str:
    """A free-form string (paths, commands); blank or unset gives ``default``."""
    value = _raw(name)
    return default if value is None else value


def env_bool(name: str, default: bool) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off`` in any case; anything else raises."""
    value = _raw(name)
    if value is None:
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise _bad(name, value, "use 1/true/yes/on or 0/false/no/off")


def env_int(name: str, default: int, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """A base-10 integer within ``[minimum, maximum]`` (either bound optional)."""
    value = _raw(name)
    if value is None:
        return default
    try:
        number = int(value, 10)
    except ValueError:
        raise _bad(name, value, "expected a whole number") from None
    if minimum is not None and number < minimum:
        raise _bad(name, value, f"expected a whole number of at least {minimum}")
    if maximum is not None and number > maximum:
        raise _bad(name, value, f"expected a whole number of at most {maximum}")
    return number


def env_float(name: str, default: float, *, minimum: float | None = None) -> float:
    """A finite decimal number (seconds, usually) not below ``minimum``."""
    value = _raw(name)
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError:
        raise _bad(name, value, "expected a number") from None
    if not math.isfinite(number):
        raise _bad(name, value, "expected a finite number")
    if minimum is not None and number < minimum:
        raise _bad(name, value, f"expected a number of at least {minimum}")
    return number


def env_list(name: str, default: list[str]) -> list[str]:
    """Comma-separated items, blanks around each removed; an empty item raises (``a,,b``)."""
    value = _raw(name)
    if value is None:
        return list(default)
    items = [item.strip() for item in value.split(",")]
    if any(not item for item in items):
        raise _bad(name, value, "expected comma-separated items with none empty")
    return items


def env_choice(name: str, default: str, choices: frozenset[str] | set[str]) -> str:
    """One of ``choices`` (compared as given, after stripping)."""
    value = _raw(name)
    if value is None:
        return default
    if value not in choices:
        raise _bad(name, value, f"expected one of {', '.join(sorted(choices))}")
    return value


def env_url(name: str, default: str, schemes: frozenset[str] | set[str]) -> str:
    """A URL whose scheme is one of ``schemes``; a password in it never reaches the message."""
    value = _raw(name)
    if value is None:
        return default
    if urlsplit(value).scheme not in schemes or "://" not in value:
        raise _bad(name, _without_password(value), f"expected a URL starting with {' or '.join(sorted(schemes))}://")
    return value


def env_redis_url(name: str, default: str) -> str:
    """A Redis URL (``redis://``, ``rediss://``, ``unix://``) that redis-py can read and
    Celery's broker can take (project/broker.py): a database that is not a number
    (``/abc``, ``?db=x``), or a query option the broker has no word for (``?protocol=3``),
    is refused here, naming the variable, rather than at the first connection."""
    value = env_url(name, default, {"redis", "rediss", "unix"})
    from project.broker import celery_broker

    try:
        celery_broker(value)
    except ValueError as exc:
        raise _bad(name, _without_password(value), str(exc).rstrip(".")) from None
    return value


def env_db(name: str, default: str) -> dict:
    """A database URL (``sqlite:///path``, ``postgres://user@host:port/name``) → a
    ``DATABASES`` entry, parsed by django-environ; an unknown scheme or a URL it cannot
    read raises (without echoing a password it holds)."""
    import environ

    value = _raw(name) or default
    shown = _without_password(value)
    if "://" not in value or urlsplit(value).scheme not in environ.Env.DB_SCHEMES:
        raise _bad(name, shown, "expected a database URL such as postgres://user@host:5432/name or sqlite:///path")
    try:
        config = environ.Env.db_url_config(value)
    except (ValueError, KeyError, TypeError) as exc:
        raise _bad(name, shown, f"could not read it as a database URL ({type(exc).__name__})") from None
    if not config.get("NAME"):
        raise _bad(name, shown, "the URL names no database")
    return config


def _without_password(url: str) -> str:
    """``url`` with the password part of its user info replaced by ``***``."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # e.g. a port that is not a number
        return re.sub(r"://([^:/@]*):[^@/]*@", r"://\1:***@", url)
    if not password:
        return url
    netloc = parts.netloc.replace(f":{password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))
