"""Catalog URLs."""

from __future__ import annotations

from django.urls import path

from webapp.catalog import views

app_name = "catalog"
urlpatterns = [
    path("models/", views.index, name="index"),
    path("models/register", views.register, name="register"),
    path("models/<int:artifact_id>/place", views.place, name="place"),
    path("models/<int:artifact_id>/unplace", views.unplace, name="unplace"),
    path("artifacts/<str:sha256>/manifest", views.artifact_manifest, name="manifest"),
    path("artifacts/<str:sha256>/file", views.artifact_file, name="file"),
    path("artifacts/<str:sha256>/torrent", views.artifact_torrent, name="torrent"),
]
