from django.urls import path

from . import views

urlpatterns = [
    path("inbox/", views.inbox, name="inbox"),
    path("inbox/entries/", views.inbox_entries, name="inbox_entries"),
    path("notifications/", views.notifications, name="notifications"),
    path("notifications/subscribe/", views.subscribe, name="push_subscribe"),
    path("notifications/<int:subscription_id>/remove/", views.remove_subscription, name="push_remove"),
    path("manifest.webmanifest", views.manifest, name="manifest"),
    path("sw.js", views.service_worker, name="service_worker"),
]
