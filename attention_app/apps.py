from django.apps import AppConfig


class AttentionAppConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "attention_app"
    verbose_name = "Attention (inbox, notifications, Web Push)"
