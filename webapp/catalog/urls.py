"""Catalog URLs: the models page, registration and a model's replica count."""

from __future__ import annotations

from django.urls import path

from webapp.catalog import views

app_name = "catalog"
urlpatterns = [
    path("models/", views.index, name="index"),
    path("models/register", views.register, name="register"),
    path("models/<int:artifact_id>/replicas", views.set_replicas, name="replicas"),
]
