from django.urls import path

from . import views

urlpatterns = [
    path("usage/", views.usage, name="usage"),
    path("usage/usage.csv", views.usage_csv, name="usage_csv"),
]
