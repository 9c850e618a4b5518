"""A request body Django will not read, and a click from a browser whose login has ended,
each answered with a sentence instead of a blank 400 or the login page."""

from __future__ import annotations

from collections.abc import Callable

from django.conf import settings
from django.contrib.auth.middleware import LoginRequiredMiddleware
from django.core.exceptions import PermissionDenied, RequestDataTooBig, TooManyFieldsSent, TooManyFilesSent
from django.http import HttpRequest, HttpResponse

from sessions_app.images import megabytes
from sessions_app.rules import MAX_MESSAGE_CHARS
from sessions_app.views import permission_denied


def too_large_message() -> str:
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE / (1024 * 1024)
    return (f"This is too large to send: the server takes at most {limit:g} MB in one request, "
            f"and a message can be at most {MAX_MESSAGE_CHARS:,} characters "
            f"with at most {settings.CORRAL_IMAGE_MAX_COUNT} images of {megabytes(settings.CORRAL_IMAGE_MAX_BYTES)}.")


def largest_request() -> int:
    """The most a POST may carry in bytes: the form data Django reads into memory plus the
    images a message may attach (Django spools files to disk without a limit of its own),
    with 1 MB for the multipart framing."""
    images = settings.CORRAL_IMAGE_MAX_COUNT * settings.CORRAL_IMAGE_MAX_BYTES
    return settings.DATA_UPLOAD_MAX_MEMORY_SIZE + images + 1_000_000


def request_too_large(get_response: Callable[[HttpRequest], HttpResponse]) -> Callable[[HttpRequest], HttpResponse]:
    """Answer a POST whose form data exceeds ``DATA_UPLOAD_MAX_MEMORY_SIZE`` with 413 and a
    plain-text sentence (the session page shows it where the person typed).

    Without this, Django's CSRF check is the first to read the body, and its
    ``RequestDataTooBig`` becomes a bare "Bad Request (400)" that htmx never shows: a
    pasted log of several megabytes would seem to vanish without a word.
    """

    def middleware(request: HttpRequest) -> HttpResponse:
        if request.method == "POST":
            try:
                length = int(request.META.get("CONTENT_LENGTH") or 0)
            except ValueError:
                length = 0
            if length > largest_request():
                return HttpResponse(too_large_message(), status=413, content_type="text/plain; charset=utf-8")
            try:
                request.POST  # noqa: B018  (read here, so the size check speaks first)
            except RequestDataTooBig:
                return HttpResponse(too_large_message(), status=413, content_type="text/plain; charset=utf-8")
            except (TooManyFieldsSent, TooManyFilesSent) as exc:
                # No page of Corral's sends this many fields: a script's mistake, told plainly.
                return HttpResponse(f"This request has too many fields: {exc}", status=400,
                                    content_type="text/plain; charset=utf-8")
        return get_response(request)

    return middleware


#: What a click says once its browser's login has ended (docs/access.md).
LOGGED_OUT_SENTENCE = ("You are logged out (you logged out elsewhere, your password was changed or your account "
                       "was turned off), so this was not done: reload the page to log in again.")


class LoginRequired(LoginRequiredMiddleware):
    """Django's ``LoginRequiredMiddleware``, but an htmx request (a click or a poll from an
    open page) whose login has ended is refused with 403 and :data:`LOGGED_OUT_SENTENCE` beside the
    control, where the page shows refusals; redirected to the login page, htmx would
    have swapped the login form into the page. Other requests go to the login page."""

    def handle_no_permission(self, request: HttpRequest, view_func) -> HttpResponse:
        if getattr(request, "htmx", False):
            return permission_denied(request, PermissionDenied(LOGGED_OUT_SENTENCE))
        return super().handle_no_permission(request, view_func)
