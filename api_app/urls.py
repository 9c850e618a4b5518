from django.urls import path

from . import views

urlpatterns = [
    path("v1/models", views.model_list, name="api_models"),
    path("v1/models/<path:model>", views.model_detail, name="api_model"),
    path("v1/chat/completions", views.chat_completions, name="api_chat_completions"),
    path("v1/<path:rest>", views.not_served),
    path("settings/api-keys/", views.api_keys, name="api_keys"),
    path("settings/api-keys/<int:key_id>/revoke/", views.revoke_key, name="api_key_revoke"),
]
