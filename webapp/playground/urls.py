"""Playground URLs."""

from __future__ import annotations

from django.urls import path

from webapp.playground import views

app_name = "playground"
urlpatterns = [path("playground/", views.index, name="index")]
