"""The Celery app: spawn, health and turn loops run here (docs/behaviour.md §5, §6)."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

app = Celery("corral")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
