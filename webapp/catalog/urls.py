"""Catalog URLs: the models page and registration."""

from __future__ import annotations

from django.urls import path

from webapp.catalog import views

app_name = "catalog"
urlpatterns = [
    path("models/", views.index, name="index"),
    path("models/register", views.register, name="register"),
]
