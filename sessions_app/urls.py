from django.urls import path

from . import views

urlpatterns = [
    path("", views.session_list, name="session_list"),
    path("sessions/new/", views.session_new, name="session_new"),
    path("sessions/models/", views.model_options, name="model_options"),
    path("sessions/models/defaults/", views.model_defaults, name="model_defaults"),
    path("machines/<int:machine_id>/refresh/", views.refresh_models, name="refresh_models"),
    path("machines/<int:machine_id>/refresh/status/", views.refresh_status, name="refresh_status"),
    path("sessions/<int:session_id>/", views.session_detail, name="session_detail"),
    path("sessions/<int:session_id>/earlier/", views.session_earlier, name="session_earlier"),
    path("sessions/<int:session_id>/waiting/", views.session_waiting, name="session_waiting"),
    path("sessions/<int:session_id>/export.<str:fmt>", views.session_export, name="session_export"),
    path("sessions/<int:session_id>/send/", views.session_send, name="session_send"),
    path("sessions/<int:session_id>/images/<str:sha256>.<str:ext>", views.session_image, name="session_image"),
    path("sessions/<int:session_id>/interrupt/", views.session_interrupt, name="session_interrupt"),
    path("sessions/<int:session_id>/regenerate/", views.session_regenerate, name="session_regenerate"),
    path("sessions/<int:session_id>/version/", views.session_choose_version, name="session_choose_version"),
    path("sessions/<int:session_id>/clear/", views.session_clear, name="session_clear"),
    path("sessions/<int:session_id>/stop/", views.session_stop, name="session_stop"),
    path("sessions/<int:session_id>/rename/", views.session_rename, name="session_rename"),
    path("sessions/<int:session_id>/restart/", views.session_restart, name="session_restart"),
    path("sessions/<int:session_id>/calls/<str:call_id>/answer/", views.session_answer, name="session_answer"),
    path("sessions/<int:session_id>/allowances/<int:seq>/revoke/", views.session_revoke_allowance,
         name="session_revoke_allowance"),
    path("sessions/<int:session_id>/model/", views.session_model, name="session_model"),
    path("sessions/<int:session_id>/settings/", views.session_settings, name="session_settings"),
    path("sessions/<int:session_id>/delete/", views.session_delete, name="session_delete"),
    path("sessions/<int:session_id>/sharing/", views.session_sharing, name="session_sharing"),
    path("sessions/<int:session_id>/mode/", views.session_mode, name="session_mode"),
    path("sessions/<int:session_id>/queue/<str:queued_id>/drop/", views.session_drop, name="session_drop"),
]
