from django.apps import AppConfig


class SessionsAppConfig(AppConfig):
    name = "sessions_app"
    verbose_name = "Agent sessions"

    def ready(self) -> None:
        from . import access_changes, signals  # noqa: F401  (connects the receivers)
