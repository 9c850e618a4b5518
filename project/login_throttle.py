"""What a person sees when django-axes has locked their login out (docs/deployment.md).

Axes counts wrong passwords per username and client address (settings
``AXES_LOCKOUT_PARAMETERS``) and, past ``AXES_FAILURE_LIMIT``, refuses even the right
password until ``AXES_COOLOFF_TIME`` has passed since the last wrong one. Its own page
says "try again later"; this one says how long, for whom, and who can lift it.
"""

from __future__ import annotations

import math

from axes.helpers import get_client_username, get_cool_off
from axes.models import AccessAttempt
from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

#: "Too Many Requests": the client may retry once the cool-off has passed.
LOCKED_OUT_STATUS = 429


def locked_out(
    request: HttpRequest, original_response: HttpResponse | None = None, credentials: dict | None = None
) -> HttpResponse:
    """``AXES_LOCKOUT_CALLABLE``: the login page's lockout notice, status 429.

    Context: ``username`` (as typed; escaped by the template) and ``minutes``, the
    cool-off rounded up to whole minutes.
    """
    cool_off = get_cool_off(request)
    minutes = math.ceil(cool_off.total_seconds() / 60) if cool_off else None
    context = {"username": get_client_username(request, credentials) or "", "minutes": minutes}
    return render(request, "registration/locked_out.html", context, status=LOCKED_OUT_STATUS)


def client_username(request: HttpRequest, credentials: dict | None = None) -> str | None:
    """``AXES_USERNAME_CALLABLE``: the username as typed, cut to what axes can store.

    Django's login form does not limit the username's length before it authenticates,
    and axes records it in ``AccessAttempt.username``, a varchar(255): a longer name
    would fail that insert on PostgreSQL and turn a wrong password into a server error.
    Cutting it keeps the count (two names alike in their first 255 characters count
    together, which only matters to someone typing such names). ``None`` when no
    username was given. Source: axes' own ``get_client_username``, which this replaces.
    """
    field = settings.AXES_USERNAME_FORM_FIELD
    data = credentials if credentials else getattr(request, "data", request.POST)
    username = data.get(field)
    if username is None:
        return None
    return str(username)[: AccessAttempt._meta.get_field("username").max_length]
