"""The machines page's URLs (:mod:`.views`); their names are the ones the templates use."""

from django.urls import path

from . import views

urlpatterns = [
    path("machines/", views.machine_list, name="machine_list"),
    path("machines/servers/<int:session_id>/stop/", views.machine_server_stop, name="machine_server_stop"),
]
