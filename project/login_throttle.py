"""What a person sees when django-axes has locked their login out (docs/deployment.md).

Axes counts wrong passwords per username and client address (settings
``AXES_LOCKOUT_PARAMETERS``) and, past ``AXES_FAILURE_LIMIT``, refuses even the right
password until ``AXES_COOLOFF_TIME`` has passed since the last wrong one. Its own page
says "try again later"; this one says how long, for whom, and who can lift it.
"""

from __future__ import annotations

import math

from axes.helpers import get_client_username, get_cool_off
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
