"""URLs of the OpenAI-compatible API (/v1/) and of the API key pages."""

from __future__ import annotations

from django.urls import path

from webapp.api import views

app_name = "api"
urlpatterns = [
    path("v1/models", views.models, name="models"),
    path("v1/chat/completions", views.chat_completions, name="chat_completions"),
    path("v1/completions", views.completions, name="completions"),
    path("v1/models/<path:model>", views.model, name="model"),
    path("v1/<path:rest>", views.unknown, name="unknown"),
    path("api-keys/", views.key_list, name="keys"),
    path("api-keys/new", views.key_create, name="key_create"),
    path("api-keys/<int:key_id>/revoke", views.key_revoke, name="key_revoke"),
]
